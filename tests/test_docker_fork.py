"""Fork and reset on the Docker backend (issue 30 item 3): ``docker commit`` of the source
to an image, a container per child from it; reset recreates from the fork point. Real
dockerd (``.ci/docker-setup.sh``), containers with ``network_mode="none"``."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid

import docker
import pytest

from tangramd.backends.base import EnvError, ExecRequest
from tangramd.backends.docker import DockerBackend

pytestmark = pytest.mark.docker

IMAGE = os.environ.get("TANGRAM_TEST_IMAGE", "tangram-test:bookworm")
LABEL = f"org.arl-tangram.test-{uuid.uuid4().hex[:8]}"


async def sh(b: DockerBackend, env: str, cmd: str) -> str:
    res = await b.exec(ExecRequest(env, ["sh", "-c", cmd], (min(os.sched_getaffinity(0)),)))
    assert res.outcome == "ok", res
    return res.stdout


def test_docker_fork_and_reset() -> None:
    client = docker.from_env(timeout=60)
    assert client.ping(), "dockerd must be running: run .ci/docker-setup.sh"
    state = tempfile.mkdtemp(prefix="tgf-", dir="/tmp")
    b = DockerBackend(
        client=client, default_image=IMAGE, label=LABEL, state_dir=state, owner_id="tfork"
    )

    async def main() -> None:
        await b.create_env("src", None, 256 << 20)
        await b.put("src", "repo/a.txt", b"prepared\n")
        await sh(b, "src", "echo dep > /opt/dep.txt")
        await b.fork_env("src", ["c1", "c2"])
        for child in ("c1", "c2"):
            assert await sh(b, child, "cat repo/a.txt /opt/dep.txt") == "prepared\ndep\n"
        await sh(b, "c1", "echo c1 > repo/a.txt")
        assert await sh(b, "c2", "cat repo/a.txt") == "prepared\n"
        assert await sh(b, "src", "cat repo/a.txt") == "prepared\n"
        await b.reset_env("c1")
        assert await sh(b, "c1", "cat repo/a.txt") == "prepared\n"
        await b.open_session("c2", "s")
        with pytest.raises(EnvError, match="session"):
            await b.fork_env("c2", ["x"])
        await b.close_session("s")
        await b.create_env("fresh", None, 256 << 20)  # never forked: back to its image
        await sh(b, "fresh", "echo x > /opt/x")
        await b.reset_env("fresh")
        assert await sh(b, "fresh", "ls /opt/x 2>/dev/null; echo end") == "end\n"
        images = {i.id for i in client.images.list(filters={"label": f"{LABEL}=tfork"})}
        assert len(images) == 1
        await b.close_env("src")  # the children keep working
        assert await sh(b, "c2", "cat /opt/dep.txt") == "dep\n"
        for env in ("c1", "c2", "fresh"):
            await b.close_env(env)
        assert not client.images.list(filters={"label": f"{LABEL}=tfork"})

    try:
        asyncio.run(main())
    finally:
        asyncio.run(b.shutdown())
        for info in client.api.containers(all=True, filters={"label": LABEL}):
            client.api.remove_container(info["Id"], force=True)
        for image in client.images.list(filters={"label": LABEL}):
            client.images.remove(image.id, force=True)
        shutil.rmtree(state, ignore_errors=True)

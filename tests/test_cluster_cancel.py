"""``Backend.cancel``: a cluster node kills the execs its coordinator has already ended (see
test_cluster_faults for the node side). Each real backend: the process backend and Docker
(agent and plain `docker exec`; marked `docker`, CI starts dockerd)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import docker
import pytest
from backend_conformance import BOTH_CORES, new_env, req, run

from tangramd.backends.docker import DockerBackend
from tangramd.backends.process import ProcessBackend

IMAGE = "tangram-test:bookworm"
LABEL = f"org.arl-tangram.test-cancel-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def docker_client():
    client = docker.from_env(timeout=30)
    yield client
    for info in client.api.containers(all=True, filters={"label": LABEL}):
        client.api.remove_container(info["Id"], force=True)
    client.close()


@pytest.fixture(
    params=[
        "process",
        pytest.param("agent", marks=pytest.mark.docker),
        pytest.param("docker_exec", marks=pytest.mark.docker),
    ]
)
def backend(request, tmp_path):
    if request.param == "process":
        b = ProcessBackend(tmp_path / "root")
        yield b
        run(b.shutdown())
        return
    client = request.getfixturevalue("docker_client")
    state = Path(tempfile.mkdtemp(prefix="tgcn-", dir="/tmp"))  # short agent socket paths
    b = DockerBackend(
        client=client, default_image=IMAGE, label=LABEL, state_dir=state,
        owner_id=f"t{uuid.uuid4().hex[:8]}", use_agent=request.param == "agent",
    )  # fmt: skip
    yield b
    run(b.shutdown())
    shutil.rmtree(state, ignore_errors=True)


def test_cancel_kills_a_running_exec_and_what_it_started(backend):
    """cancel(action id) ends the exec at once (as SIGKILL would), background children
    included; other actions' execs run on; an unknown or finished action is False."""
    # in environments and on cores of their own, as the scheduler places them; the first
    # with a background child holding the output pipes (the exec ends when it is gone too)
    doomed = req(new_env(backend), "sleep 30 & sleep 30", (BOTH_CORES[0],), action_id="a1f")
    other = req(new_env(backend), "sleep 1; echo done", (BOTH_CORES[-1],), action_id="a20")

    async def scenario():
        tasks = [asyncio.ensure_future(backend.exec(r)) for r in (doomed, other)]
        await asyncio.sleep(0.5)  # both started (the sleeps are long either way)
        started = time.monotonic()
        assert await backend.cancel("a1f") is True
        result = await asyncio.wait_for(tasks[0], 10)
        took = time.monotonic() - started
        assert await backend.cancel("a1") is False  # no prefix match: ids are exact
        second = await tasks[1]
        return result, took, second

    result, took, second = run(scenario())
    assert result.outcome != "ok" and result.exit_code == 137, result
    assert took < 5, took
    assert result.detail != "output pipes held open by an escaped descendant", result
    assert (second.outcome, second.stdout) == ("ok", "done\n"), second
    assert run(backend.cancel("a1f")) is False  # finished

"""stdin, cwd and put/get on each real backend: the process backend and Docker (agent and
plain `docker exec`; marked `docker`, CI starts dockerd)."""

from __future__ import annotations

import io
import shutil
import tarfile
import tempfile
import uuid
from pathlib import Path

import docker
import pytest
from backend_conformance import ex, new_env, run

from tangramd.backends.docker import DockerBackend
from tangramd.backends.process import ProcessBackend

IMAGE = "tangram-test:bookworm"
LABEL = f"org.arl-tangram.test-io-{uuid.uuid4().hex[:8]}"


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
    state = Path(tempfile.mkdtemp(prefix="tgio-", dir="/tmp"))  # short agent socket paths
    b = DockerBackend(
        client=client, default_image=IMAGE, label=LABEL, state_dir=state,
        owner_id=f"t{uuid.uuid4().hex[:8]}", use_agent=request.param == "agent",
    )  # fmt: skip
    yield b
    run(b.shutdown())
    shutil.rmtree(state, ignore_errors=True)


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_stdin_cwd_and_transfers(backend):
    """Input bytes reach the command; cwd is inside the env; files and trees round-trip."""
    env = new_env(backend)
    r = ex(backend, env, ["cat"], stdin=b"in\x00put\n")
    assert (r.outcome, r.stdout) == ("ok", "in\x00put\n")
    assert ex(backend, env, ["cat"]).stdout == ""
    assert ex(backend, env, "wc -c", stdin=b"z" * 300_000).stdout.strip() == "300000"
    assert run(backend.put(env, "d/f.txt", b"hello")) == 5
    r = ex(backend, env, "pwd; cat f.txt", cwd="d")
    assert r.stdout.endswith("/d\nhello"), r
    assert run(backend.get(env, "d/f.txt", max_bytes=100)) == (b"hello", False)
    run(backend.put(env, "t", _tar({"a.txt": b"a", "s/b.txt": b"bb"}), tar=True))
    assert ex(backend, env, "cat t/a.txt t/s/b.txt").stdout == "abb"
    data, is_tar = run(backend.get(env, "t", max_bytes=1 << 20))
    assert is_tar
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        assert {"a.txt", "s/b.txt"} <= set(archive.getnames())
    with pytest.raises(FileNotFoundError):
        run(backend.get(env, "missing", max_bytes=100))
    with pytest.raises(ValueError, match="more than"):
        run(backend.get(env, "d/f.txt", max_bytes=2))

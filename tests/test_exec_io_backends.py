"""stdin, cwd and put/get on each real backend: the process backend and Docker (agent and
plain `docker exec`; marked `docker`, CI starts dockerd)."""

from __future__ import annotations

import asyncio
import io
import tarfile

import pytest
from backend_conformance import (
    BOTH_CORES,
    allowed_list,
    backend_fixtures,
    cpulist,
    ex,
    new_env,
    req,
)

from tangramd.backends.base import EnvError
from tangramd.backends.docker import DockerBackend

docker_client, backend = backend_fixtures("io")


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
    assert asyncio.run(backend.put(env, "d/f.txt", b"hello")) == 5
    r = ex(backend, env, "pwd; cat f.txt", cwd="d")
    assert r.stdout.endswith("/d\nhello"), r
    assert asyncio.run(backend.get(env, "d/f.txt", max_bytes=100)) == (b"hello", False)
    asyncio.run(backend.put(env, "t", _tar({"a.txt": b"a", "s/b.txt": b"bb"}), tar=True))
    assert ex(backend, env, "cat t/a.txt t/s/b.txt").stdout == "abb"
    data, is_tar = asyncio.run(backend.get(env, "t", max_bytes=1 << 20))
    assert is_tar
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        assert {"a.txt", "s/b.txt"} <= set(archive.getnames())
    with pytest.raises(FileNotFoundError):
        asyncio.run(backend.get(env, "missing", max_bytes=100))
    with pytest.raises(ValueError, match="more than"):
        asyncio.run(backend.get(env, "d/f.txt", max_bytes=2))


def test_sessions_keep_state_and_survive_timeouts(backend):
    """A session's shell keeps cd and variables; a timeout interrupts, the shell stays;
    each run is pinned to its own cores. (Docker: through the agent only.)"""
    env = new_env(backend)

    async def scenario() -> None:  # one loop: a session's shell is watched by the daemon's
        def go(cmd, **kw):
            return backend.exec(req(env, cmd, session="s1", **kw))

        if isinstance(backend, DockerBackend) and not backend.use_agent:
            with pytest.raises(EnvError, match="agent"):
                await backend.open_session(env, "s1")
            return
        await backend.open_session(env, "s1")
        assert (await go("mkdir -p w && cd w && X=5")).outcome == "ok"
        r = await go("pwd; echo $X; grep Cpus_allowed_list /proc/self/status", cores=BOTH_CORES)
        lines = r.stdout.splitlines()
        assert lines[0].endswith("/w") and lines[1] == "5", r
        assert allowed_list(r) == cpulist(BOTH_CORES)
        r = await go("echo before; sleep 30", timeout_s=0.5)
        assert (r.outcome, r.stdout) == ("timeout", "before\n"), r
        assert (await go("echo $X; cat", stdin=b"piped")).stdout == "5\npiped"
        await backend.close_session("s1")
        assert (await go("true")).outcome == "infra_error"

    asyncio.run(scenario())

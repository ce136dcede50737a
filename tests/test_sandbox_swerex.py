"""swe-rex's own RemoteRuntime against the default (isolated) backend: absolute paths such
as /tmp and /testbed work, in execute and in sessions, as in a container (issue 30)."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
from swerex.runtime.abstract import (
    BashAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)
from swerex.runtime.remote import RemoteRuntime

KEY = "swe-key"
AUTH = {"X-API-Key": KEY}


@pytest.fixture(scope="module")
def gateway_args(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ...]:
    """Served with an API key: RemoteRuntime sends its auth_token as X-API-Key."""
    key = tmp_path_factory.mktemp("swerex") / "key"
    key.write_text(KEY)
    return ("--api-key-file", str(key))


@pytest.fixture
def runtime(stack):
    """A RemoteRuntime on a fresh environment opened with POST /envs."""
    opened = httpx.post(f"{stack.url}/envs", json={}, headers=AUTH).json()
    yield RemoteRuntime(host=opened["swerex_url"], timeout=30, auth_token=KEY)
    httpx.delete(f"{stack.url}/envs/{opened['id']}", headers=AUTH)


def test_absolute_paths_are_the_environments(runtime):
    """execute with cwd=/tmp; a session that makes /testbed, works there, and an execute
    that finds what it left; the host's /testbed is untouched."""

    async def scenario() -> None:
        r = await runtime.execute(Command(command="pwd; touch here", shell=True, cwd="/tmp"))
        assert (r.exit_code, r.stdout) == (0, "/tmp\n"), r
        await runtime.create_session(CreateBashSessionRequest(session="main"))
        out = await runtime.run_in_session(
            BashAction(command="mkdir -p /testbed && cd /testbed && echo x > f && pwd",
                       session="main")
        )  # fmt: skip
        assert out.output.strip() == "/testbed", out
        out = await runtime.run_in_session(BashAction(command="pwd; ls /tmp", session="main"))
        # (/tmp also holds the way to its home here, the tests' state dir being under /tmp,
        # and a checkout cloned under /tmp: bound back read-only)
        first, *listed = out.output.split()
        assert first == "/testbed" and "here" in listed, out
        await runtime.close_session(CloseBashSessionRequest(session="main"))
        r = await runtime.execute(Command(command=["cat", "f"], cwd="/testbed"))
        assert (r.exit_code, r.stdout) == (0, "x\n"), r

    asyncio.run(scenario())


def test_files_at_absolute_paths(runtime, tmp_path):
    """write_file, read_file and upload (a file, and a directory: a zip) at /testbed and
    /tmp paths are the environment's own, as its commands see them; what they make belongs
    to root inside (the environment's user); the host's /testbed is untouched."""
    (tmp_path / "repo" / "pkg").mkdir(parents=True)
    (tmp_path / "repo" / "pkg" / "mod.py").write_text("X = 1\n")
    (tmp_path / "one.txt").write_text("one\n")
    host_testbed = os.path.exists("/testbed")

    async def scenario() -> None:
        await runtime.write_file(WriteFileRequest(path="/testbed/src/a.py", content="A = 1\n"))
        await runtime.write_file(WriteFileRequest(path="/tmp/notes/n.txt", content="tmp\n"))
        got = await runtime.read_file(ReadFileRequest(path="/testbed/src/a.py"))
        assert got.content == "A = 1\n"
        got = await runtime.read_file(ReadFileRequest(path="/tmp/notes/n.txt"))
        assert got.content == "tmp\n"
        await runtime.upload(
            UploadRequest(source_path=str(tmp_path / "repo"), target_path="/testbed/repo")
        )
        await runtime.upload(
            UploadRequest(source_path=str(tmp_path / "one.txt"), target_path="/tmp/one.txt")
        )
        r = await runtime.execute(
            Command(
                command="cat /testbed/src/a.py /tmp/notes/n.txt /testbed/repo/pkg/mod.py "
                "/tmp/one.txt && stat -c '%u' /testbed/src /testbed/repo/pkg/mod.py | sort -u",
                shell=True,
            )
        )
        assert (r.exit_code, r.stdout) == (0, "A = 1\ntmp\nX = 1\none\n0\n"), r
        got = await runtime.read_file(ReadFileRequest(path="/testbed/repo/pkg/mod.py"))
        assert got.content == "X = 1\n"

    asyncio.run(scenario())
    assert os.path.exists("/testbed") == host_testbed

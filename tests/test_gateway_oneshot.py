"""One-shot sandbox runs: ``exec`` carrying ``files`` in and ``fetch`` back, in one action.

This is what makes SandboxFusion's ``/run_code`` a single round trip to the daemon (throwaway
environment, files, command, fetched files, removal); tested on the process backend and on
Docker (marked ``docker``; CI starts dockerd), then through the gateway.
"""

from __future__ import annotations

import base64

import httpx
import pytest
from harness import running_stack

from tangram.model import TangramError

IMAGE = "tangram-test:bookworm"
BINARY = bytes(range(256)) * 3  # every byte value, NUL included


@pytest.fixture(
    scope="module", params=["process", pytest.param("docker", marks=pytest.mark.docker)]
)
def backend(request: pytest.FixtureRequest) -> str:
    """Each test runs on the process backend and on Docker."""
    return str(request.param)


@pytest.fixture(scope="module")
def daemon_args(backend: str) -> tuple[str, ...]:
    return ("--cpu-backend", "docker") if backend == "docker" else ()


@pytest.fixture(scope="module")
def image(backend: str) -> str | None:
    """The image an exec names: none on the process backend."""
    return IMAGE if backend == "docker" else None


def _exec_count(c) -> int:
    return int(c.status()["recent"].get("exec", {}).get("count", 0))


def test_files_in_fetch_out_one_throwaway_action(daemon, image):
    """The files are there before the command runs, the fetched ones come back byte for byte
    (directories and missing paths left out), the whole run is one action and the
    environment is gone when the answer arrives."""
    with daemon.client() as c:
        before = _exec_count(c)
        r = c.exec(
            ["sh", "-c", "cat in/a.txt; wc -c < blob; mkdir -p out/d; cp blob out/copy; "
             "echo made > out/new.txt; pwd > where"],
            image=image,
            files={"in/a.txt": "hello\n", "blob": BINARY},
            fetch=["out/copy", "out/new.txt", "out/d", "missing", "where"],
        )  # fmt: skip
        assert r.outcome == "ok", r
        assert r.stdout.split() == ["hello", str(len(BINARY))]
        assert set(r.files) == {"out/copy", "out/new.txt", "where"}
        assert r.files["out/copy"] == BINARY and r.files["out/new.txt"] == b"made\n"
        assert _exec_count(c) == before + 1
        assert c.env_list() == []  # throwaway: nothing left open
        # the next run is a fresh environment: none of these files
        fresh = c.exec(["sh", "-c", "ls -A"], image=image, fetch=["blob"])
        assert fresh.stdout == "" and fresh.files == {}


def test_files_persist_in_an_open_environment_and_fetch_after_a_failure(daemon, image):
    """With ``env``, the files stay for later execs; fetch works after a non-zero exit."""
    with daemon.client() as c:
        env = c.env_open(image=image)
        try:
            r = c.exec(["sh", "-c", "echo partial > log; exit 3"], env=env,
                       files={"conf/x": b"1"}, fetch=["log"])  # fmt: skip
            assert (r.outcome, r.exit_code, r.files) == ("failed", 3, {"log": b"partial\n"})
            assert c.exec(["cat", "conf/x"], env=env).stdout == "1"
        finally:
            c.env_close(env)


def test_bad_paths_are_refused_and_a_blocked_file_is_an_infra_error(daemon, image):
    """'..' in files or fetch is a bad_request before anything runs; a file that cannot be
    written (its parent is a file) ends the action as infra_error without running it."""
    with daemon.client() as c:
        for kw in ({"files": {"../escape": b"x"}}, {"fetch": ["a/../../etc/passwd"]}):
            with pytest.raises(TangramError) as info:
                c.exec(["true"], image=image, **kw)
            assert info.value.code == "bad_request"
        r = c.exec(["sh", "-c", "echo ran"], image=image,
                   files={"a": b"file", "a/b": b"under a file"})  # fmt: skip
        assert r.outcome == "infra_error" and "files: a/b" in r.detail and r.stdout == ""
        assert c.env_list() == []
        assert c.ping()  # the daemon is fine


def test_run_code_is_one_action_without_a_wrapper_shell(tmp_path):
    """Through the gateway: /run_code with files and fetch_files is one exec action, the
    interpreter runs the source file directly (argv[0] is main.py, no shell in between)."""
    with running_stack(tmp_path) as stack, stack.daemon.client() as c:
        before = _exec_count(c)
        code = (
            "import os, sys\nprint(sys.argv[0], open('data.txt').read())\n"
            # (in an isolated environment the spawner, outside it, shows as parent 0)
            "ppid = os.getppid()\n"
            "print(ppid == 0 or open(f'/proc/{ppid}/comm').read().strip() != 'sh')\n"
            "open('result.txt', 'w').write('42')"
        )
        body = {
            "code": code,
            "language": "python",
            "files": {"data.txt": base64.b64encode(b"in").decode()},
            "fetch_files": ["result.txt"],
        }
        resp = httpx.post(f"{stack.url}/run_code", json=body, timeout=60).json()
        assert resp["status"] == "Success", resp
        assert resp["run_result"]["stdout"] == "main.py in\nTrue\n"
        assert resp["files"] == {"result.txt": base64.b64encode(b"42").decode()}
        assert _exec_count(c) == before + 1
        assert c.env_list() == []

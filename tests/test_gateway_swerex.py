"""`tangramd http` as a SWE-ReX remote runtime: swerex's own RemoteRuntime against it."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import time
from typing import Any

import httpx
import psutil
import pytest
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)
from swerex.runtime.remote import RemoteRuntime

from tangram.testing import free_port, wait_for, wait_for_async

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
    assert opened["swerex_url"] == f"{stack.url}/swerex/{opened['id']}"
    yield RemoteRuntime(host=opened["swerex_url"], timeout=30, auth_token=KEY)
    closed = httpx.delete(f"{stack.url}/envs/{opened['id']}", headers=AUTH)
    # (404: the test closed the runtime, and with it the environment the gateway opened)
    assert closed.status_code == 404 or closed.json()["closed"] is True, closed.text


def test_is_alive_answers_within_the_clients_budget(runtime, stack):
    """is_alive is answered at once (RemoteRuntime gives it 0.15 s); unknown envs are not."""

    async def check() -> None:
        started = time.monotonic()
        assert (await runtime.is_alive(timeout=0.15)).is_alive
        assert time.monotonic() - started < 0.15
        other = RemoteRuntime(host=f"{stack.url}/swerex/e999", timeout=5, auth_token=KEY)
        assert not (await other.is_alive()).is_alive

    asyncio.run(check())


def test_session_state_persists_and_survives_timeout_and_interrupt(runtime):
    """cd and exports persist across run_in_session; a timeout raises and the shell lives."""

    async def scenario() -> None:
        await runtime.create_session(CreateBashSessionRequest(session="main"))
        with pytest.raises(SessionExistsError):
            await runtime.create_session(CreateBashSessionRequest(session="main"))
        await runtime.run_in_session(BashAction(command="mkdir -p w && cd w", session="main"))
        await runtime.run_in_session(BashAction(command="export X=7", session="main"))
        obs = await runtime.run_in_session(
            BashAction(command="pwd; echo x=$X; echo err >&2", session="main")
        )
        assert obs.exit_code == 0
        assert obs.output.endswith("/w\nx=7\nerr\n"), obs.output
        with pytest.raises(CommandTimeoutError):
            await runtime.run_in_session(
                BashAction(command="sleep 30", session="main", timeout=0.5)
            )
        await runtime.run_in_session(BashInterruptAction(session="main"))
        obs = await runtime.run_in_session(BashAction(command="echo still $X", session="main"))
        assert obs.output == "still 7\n"
        with pytest.raises(NonZeroExitCodeError):
            await runtime.run_in_session(BashAction(command="false", session="main"))
        obs = await runtime.run_in_session(
            BashAction(command="exit_code_is() { return 3; }; exit_code_is", session="main",
                       check="silent")
        )  # fmt: skip
        assert obs.exit_code == 3
        with pytest.raises(BashIncorrectSyntaxError):
            await runtime.run_in_session(BashAction(command="if then fi (", session="main"))
        with pytest.raises(SessionDoesNotExistError):
            await runtime.run_in_session(BashAction(command="true", session="nope"))
        await runtime.close_session(CloseBashSessionRequest(session="main"))
        with pytest.raises(SessionDoesNotExistError):
            await runtime.close_session(CloseBashSessionRequest(session="main"))

    asyncio.run(scenario())


def test_execute_files_and_upload(runtime, tmp_path):
    """execute, write_file/read_file, upload of a file and of a (zipped) directory."""

    async def scenario() -> None:
        r = await runtime.execute(Command(command="echo $GREET; pwd", shell=True,
                                          env={"GREET": "hello"}))  # fmt: skip
        assert r.exit_code == 0 and r.stdout.startswith("hello\n")
        r = await runtime.execute(Command(command=["sh", "-c", "echo out; echo err >&2; exit 4"]))
        assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 4)
        with pytest.raises(NonZeroExitCodeError):
            await runtime.execute(Command(command="exit 1", shell=True, check=True))
        with pytest.raises(CommandTimeoutError):
            await runtime.execute(Command(command="sleep 30", shell=True, timeout=0.5))
        merged = await runtime.execute(
            Command(command="echo a; echo b >&2", shell=True, merge_output_streams=True)
        )
        assert merged.stdout == "a\nb\n"
        await runtime.write_file(WriteFileRequest(path="notes/a.txt", content="über\n"))
        assert (await runtime.read_file(ReadFileRequest(path="notes/a.txt"))).content == "über\n"
        with pytest.raises(FileNotFoundError):
            await runtime.read_file(ReadFileRequest(path="notes/none.txt"))
        with pytest.raises(ValueError, match="ermission denied"):  # a host file root reads
            await runtime.read_file(ReadFileRequest(path="/etc/shadow"))
        passwd = await runtime.read_file(ReadFileRequest(path="/etc/passwd"))  # its own /etc
        r = await runtime.execute(Command(command=["cat", "/etc/passwd"]))
        assert passwd.content == r.stdout
        (tmp_path / "one.txt").write_text("one")
        tree = tmp_path / "tree"
        (tree / "sub").mkdir(parents=True)
        (tree / "sub" / "two.txt").write_text("two")
        await runtime.upload(UploadRequest(source_path=str(tmp_path / "one.txt"),
                                           target_path="up/one.txt"))  # fmt: skip
        await runtime.upload(UploadRequest(source_path=str(tree), target_path="up/tree"))
        r = await runtime.execute(Command(command="cat up/one.txt up/tree/sub/two.txt", shell=True))
        assert r.stdout == "onetwo"
        await runtime.close()

    asyncio.run(scenario())


def test_concurrent_calls_to_one_runtime_run_concurrently(runtime):
    """Two execute calls on one runtime overlap on the two free cores (serial: >= 3 s)."""

    async def scenario() -> float:
        started = time.monotonic()
        results = await asyncio.gather(
            *(runtime.execute(Command(command="sleep 1.5", shell=True)) for _ in range(2))
        )
        assert all(r.exit_code == 0 for r in results)
        return time.monotonic() - started

    assert asyncio.run(scenario()) < 2.9


def test_bad_requests_are_4xx_and_the_runtime_stays_up(runtime, stack):
    """Malformed SWE-ReX bodies are 422; unknown environments answer as SWE-ReX errors."""
    base = runtime._config.host
    assert httpx.post(f"{base}/execute", content=b"{", headers=AUTH).status_code == 422
    for route, body in (
        ("run_in_session", [1]),
        ("create_session", {"session": 5}),
        ("write_file", {"path": "x"}),
        ("upload", {"target_path": "x"}),
    ):
        r = httpx.post(f"{base}/{route}", json=body, headers=AUTH)
        assert r.status_code == 422, (route, r.text)
    assert httpx.post(f"{base}/execute", json={"command": "true"}).status_code == 401
    r = httpx.post(f"{stack.url}/swerex/e999/execute", json={"command": "true"}, headers=AUTH)
    assert r.status_code == 511 and "swerexception" in r.json()
    assert asyncio.run(runtime.execute(Command(command="true", shell=True))).exit_code == 0


# --------------------------------------------------------------------- side by side

FIDELITY_COMMANDS = [
    "echo 42",
    "printf '  a\\n\\nb\\n\\n'",  # leading spaces, blank lines, trailing newlines
    "",
    "# only a comment",
    "echo err >&2; echo out",
    "false",
]


def _terminal_free(output: str) -> str:
    """SWE-ReX's server reads its shell through a pseudo-terminal: its observation starts
    with the line the command was typed on and ends with the prompt's line breaks, both as
    "\r\n"; the command's own output is what lies between them."""
    if output.startswith("\r\n"):
        output = output[2:]
    while output.endswith("\r\n"):
        output = output[:-2]
    return output.replace("\r\n", "\n")


async def _observations(rt: RemoteRuntime) -> list[tuple[str, int | None]]:
    await rt.create_session(CreateBashSessionRequest(session="side"))
    seen = []
    for command in FIDELITY_COMMANDS:
        obs = await rt.run_in_session(BashAction(command=command, session="side", check="silent"))
        seen.append((_terminal_free(obs.output), obs.exit_code))
    empty = await rt.execute(Command(command="", shell=True))
    seen.append((empty.stdout + empty.stderr, empty.exit_code))
    await rt.close_session(CloseBashSessionRequest(session="side"))
    return seen


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """SWE-ReX's own server, ``swerex-remote``, on a loopback port: the reference."""
    port = free_port()
    proc = subprocess.Popen(
        ["swerex-remote", "--host", "127.0.0.1", "--port", str(port), "--auth-token", "ref"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=tmp_path_factory.mktemp("swerex-remote"),
    )
    try:
        ref = RemoteRuntime(host="http://127.0.0.1", port=port, auth_token="ref", timeout=30)

        async def alive() -> bool:
            try:
                return bool((await ref.is_alive()).is_alive)
            except Exception:
                return False

        asyncio.run(wait_for_async(alive, 60, "swerex-remote answers"))
        yield ref
    finally:
        proc.terminate()
        proc.wait(10)


def test_sessions_answer_as_swerex_remote_does(runtime, reference) -> None:
    """The same commands through the gateway and through SWE-ReX's own server
    (``swerex-remote`` on a loopback port) give the same observations: output unstripped,
    empty and comment-only commands run, an empty ``execute`` runs."""

    async def both() -> tuple[list[tuple[str, int | None]], list[tuple[str, int | None]]]:
        return await _observations(reference), await _observations(runtime)

    theirs, ours = asyncio.run(both())
    assert ours == theirs
    assert ours[0] == ("42\n", 0) and ours[2] == ("", 0) and ours[5] == ("", 1)


# The REPL by absolute path: swerex-remote's shell inherits the test's PATH (a venv's
# python3 first) and an environment's shell the host's, so `python3` could be two Pythons
# with two banners. A path under /usr is the same file inside an environment's overlay root.
REPL = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3"

INTERACTIVE = [
    # a REPL: its banner up to the prompt, each line's answer, a block, then quit
    BashAction(command=REPL, is_interactive_command=True, expect=[">>> "], timeout=20),
    BashAction(command="print(6 * 7)", is_interactive_command=True, expect=[">>> "]),
    BashAction(command="for i in range(2):", is_interactive_command=True, expect=[r"\.\.\. "]),
    BashAction(command="  print(i)", is_interactive_command=True, expect=[r"\.\.\. "]),
    BashAction(command="", is_interactive_command=True, expect=[">>> "]),
    BashAction(command="exit()", is_interactive_quit=True, timeout=20),
    BashAction(command="echo after", check="silent"),
    # a prompt, answered by the quitting line
    BashAction(
        command="read -p 'name? ' x && echo hi $x",
        is_interactive_command=True,
        expect=[r"name\? "],
        timeout=20,
    ),
    BashAction(command="bob", is_interactive_quit=True, timeout=20),
    # a program that never prints what is expected: the timeout, then ^C, the shell lives
    BashAction(command="cat", is_interactive_command=True, expect=["never"], timeout=1),
    BashInterruptAction(),
    BashAction(command="echo alive", check="silent"),
]


async def _interactive(rt: RemoteRuntime) -> list[tuple[str, int | None, str] | str]:
    await rt.create_session(CreateBashSessionRequest(session="i"))
    seen: list[tuple[str, int | None, str] | str] = []
    for action in INTERACTIVE:
        action = action.model_copy(update={"session": "i"})
        try:
            obs = await rt.run_in_session(action)
        except CommandTimeoutError as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
            continue
        output = obs.output
        if isinstance(action, BashAction) and not (
            action.is_interactive_command or action.is_interactive_quit
        ):
            output = _terminal_free(output)
        seen.append((output, obs.exit_code, obs.expect_string))
    await rt.close_session(CloseBashSessionRequest(session="i"))
    return seen


def test_interactive_commands_answer_as_swerex_remote_does(runtime, reference) -> None:
    """Interactive actions (``is_interactive_command``/``is_interactive_quit`` with
    ``expect`` patterns) through the gateway and through ``swerex-remote``: the same
    outputs, exit codes, matched patterns and timeout errors, and a ^C that leaves the
    session usable."""

    async def both() -> tuple[list[Any], list[Any]]:
        return await _interactive(reference), await _interactive(runtime)

    theirs, ours = asyncio.run(both())
    assert ours == theirs
    assert ours[1] == ("42", 0, ">>> ") and ours[4] == ("0\n1", 0, ">>> ")
    assert ours[8] == ("hi bob\n", 0, "SHELLPS1PREFIX"), ours
    assert ours[9].startswith("CommandTimeoutError: timeout after 1.0 seconds")
    assert ours[11] == ("alive\n", 0, "SHELLPS1PREFIX")


def test_close_closes_the_environment_the_gateway_opened(stack):
    """RemoteRuntime.close ends an environment opened with POST /envs: its memory is free
    at once (not after the idle TTL); twice is fine. One opened by a client stays open
    (its opener closes it), only its sessions end."""
    with stack.daemon.client() as c:
        opened = httpx.post(f"{stack.url}/envs", json={}, headers=AUTH).json()
        rt = RemoteRuntime(host=opened["swerex_url"], timeout=30, auth_token=KEY)
        mine = c.env_open()
        theirs = RemoteRuntime(host=f"{stack.url}/swerex/{mine}", timeout=30, auth_token=KEY)

        async def scenario() -> None:
            await rt.create_session(CreateBashSessionRequest(session="main"))
            assert (await rt.is_alive()).is_alive
            await rt.close()
            await rt.close()
            await theirs.create_session(CreateBashSessionRequest(session="main"))
            await theirs.close()

        asyncio.run(scenario())
        ids = {row["id"] for row in c.env_list()}
        assert opened["id"] not in ids and mine in ids, ids
        story = c.story(opened["id"])
        assert story["state"] == "closed", story
        c.env_close(mine)


def test_an_interactive_program_is_held_to_the_session(runtime) -> None:
    """The program of an interactive command runs under the session's shell: each command
    re-pins it to that command's cores, and closing the session ends it."""
    marker = f"sleep {random.randint(10_000, 99_999)}"

    def pids() -> list[int]:
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            if proc.info["cmdline"] == marker.split():
                found.append(proc.pid)
        return found

    async def scenario() -> None:
        await runtime.create_session(CreateBashSessionRequest(session="held"))
        with pytest.raises(CommandTimeoutError):
            await runtime.run_in_session(
                BashAction(command=marker, session="held", is_interactive_command=True,
                           expect=["never"], timeout=0.5)
            )  # fmt: skip
        assert len(pids()) == 1
        # the next command (to the program) pins the session's processes to its core
        with pytest.raises(CommandTimeoutError):
            await runtime.run_in_session(
                BashAction(command="", session="held", is_interactive_command=True,
                           expect=["never"], timeout=0.3)
            )  # fmt: skip
        allowed = psutil.Process(pids()[0]).cpu_affinity()
        assert len(allowed) == 1, allowed
        await runtime.close_session(CloseBashSessionRequest(session="held"))
        await wait_for_async(lambda: _none(pids), 10, "the program ended with its session")

    asyncio.run(scenario())


async def _none(pids: Any) -> bool:
    return not pids()


def test_an_execute_whose_client_hangs_up_is_cancelled(runtime, stack) -> None:
    """An ``execute`` without a timeout whose HTTP client disconnects is cancelled: its
    command is killed and its cores are free, not held by a result nobody will read."""
    marker = f"sleep {random.randint(10_000, 99_999)}"

    def pids() -> list[int]:
        return [
            proc.pid
            for proc in psutil.process_iter(["cmdline"])
            if proc.info["cmdline"] == marker.split()
        ]

    url = httpx.URL(f"{runtime._api_url}/execute")
    body = json.dumps({"command": marker, "shell": True}).encode()
    head = (
        f"POST {url.raw_path.decode()} HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
        f"X-API-Key: {KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    with stack.daemon.client() as c:
        with socket.create_connection((url.host, url.port), timeout=30) as sock:
            sock.sendall(head.encode() + body)
            wait_for(lambda: pids(), 30, "the command running")
            running = c.queue()["running"]
            assert len(running) == 1, running
        # the client is gone: the command goes, and the daemon runs nothing for it
        wait_for(lambda: not pids(), 30, "the command killed")
        wait_for(lambda: not c.queue()["running"], 30, "its cores free")
        story = c.story(running[0]["action_id"])
        assert story["outcome"] == "cancelled", story

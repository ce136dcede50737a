"""`tangramctl` against a real `tangramd up`: the command contracts of docs/design.md §6."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tangram.testing import SpawnedDaemon, wait_for
from tangramctl.main import cli

SUITE = Path(__file__).parent / "data" / "cpu_suite"


@pytest.fixture(scope="module")
def sock(daemon: SpawnedDaemon) -> str:
    """The socket of the module's daemon, which `tangramctl --socket` takes."""
    return daemon.socket


def ctl(sock: str, *args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(cli, ["--socket", sock, *args], env=env, catch_exceptions=False)


def test_status_json_succeeds(sock):
    """`status --json` succeeds once the daemon serves and reports the CPU pool."""
    r = ctl(sock, "status", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["pools"]["cpu:local"]["capacity"] == 2


def test_exec_json_contract_and_pinning(sock):
    """`exec --json` prints one object with the contract fields; cores match the pinning."""
    r = ctl(
        sock,
        "exec",
        "--cpus",
        "2",
        "--json",
        "--",
        "grep",
        "Cpus_allowed_list",
        "/proc/self/status",
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert set(out) >= {
        "outcome",
        "exit_code",
        "stdout",
        "stderr",
        "queue_s",
        "exec_s",
        "act_s",
        "cores",
    }
    assert sorted(out["cores"]) == [0, 1]
    assert out["stdout"].split()[-1] in ("0-1", "0,1")


def test_exec_exit_codes(sock):
    """exec exits with the command's exit code, 124 on timeout."""
    assert ctl(sock, "exec", "--", "sh", "-c", "exit 3").exit_code == 3
    r = ctl(sock, "exec", "--timeout", "0.3", "--", "sleep", "5")
    assert r.exit_code == 124


def test_env_open_exec_close(sock):
    """`env open --json` gives an id whose state persists across `exec --env`."""
    r = ctl(sock, "env", "open", "--json")
    env_id = json.loads(r.output)["id"]
    assert ctl(sock, "exec", "--env", env_id, "--", "sh", "-c", "echo x > f").exit_code == 0
    r = ctl(sock, "exec", "--env", env_id, "--", "cat", "f")
    assert r.exit_code == 0 and r.output.strip() == "x"
    assert ctl(sock, "env", "close", env_id).exit_code == 0
    assert env_id not in ctl(sock, "env", "list", "--json").output


def test_profile_save_and_use(sock):
    """`profile --save` stores T1/E(m) from real pinned runs; `exec --profile` uses it."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(SUITE)]
    r = ctl(
        sock,
        "profile",
        "--dop",
        "1,2",
        "--repeat",
        "1",
        "--save",
        "suite",
        "--json",
        "--",
        *cmd,
        env={"CPU_SUITE_SCALE": "0.2"},
    )
    assert r.exit_code == 0, r.output
    prof = json.loads(r.output[r.output.index("{") :])
    assert set(prof["dop"]) == {"1", "2"} and prof["t1_s"] > 0
    assert prof["speedup"]["1"] == pytest.approx(1.0)
    r = ctl(sock, "exec", "--profile", "suite", "--json", "--", "true")
    assert r.exit_code == 0, r.output


def test_queue_and_story(sock):
    """`queue --json` has waiting/running lists; `story` tells an action's events."""
    q = json.loads(ctl(sock, "queue", "--json").output)
    assert set(q) == {"waiting", "running", "envs", "others"}  # envs: waiting for memory
    aid = json.loads(ctl(sock, "exec", "--json", "--", "true").output)["action_id"]
    r = ctl(sock, "story", aid, "--json")
    assert [e["event"] for e in json.loads(r.output)["events"]][-1] == "finished"


def test_unreachable_daemon_is_a_clear_error(tmp_path):
    """No daemon at the socket: a one-line error naming the path, exit status 2."""
    r = CliRunner().invoke(cli, ["--socket", str(tmp_path / "none.sock"), "status"])
    assert r.exit_code == 2
    assert "none.sock" in r.output and "Traceback" not in r.output


def test_top_shows_pools_recent_act_and_running_actions(sock):
    """`top` frames show the CPU pool, recent ACT per kind and the running actions; --json
    prints one {status, queue} object per frame."""
    import threading

    from tangram import Client

    with Client(sock) as c:
        assert c.exec("true").outcome == "ok"
    done = threading.Event()

    def busy() -> None:
        with Client(sock) as c2:
            c2.exec("sleep 2")
        done.set()

    t = threading.Thread(target=busy)
    t.start()
    try:
        with Client(sock) as c:
            wait_for(lambda: c.queue()["running"], 10, "the exec running")
        r = ctl(sock, "top", "--iterations", "2", "--interval", "0.1")
        assert r.exit_code == 0, r.output
        assert r.output.count("recent ACT per kind") == 2
        assert "cpu:local" in r.output and "exec" in r.output and "running (1):" in r.output
        j = ctl(sock, "top", "--iterations", "2", "--interval", "0.1", "--json")
        frames = [json.loads(line) for line in j.output.splitlines()]
        assert len(frames) == 2 and frames[0]["status"]["pools"]["cpu:local"]["capacity"] == 2
    finally:
        t.join(10)
    assert done.is_set()


def test_top_quits_on_q_in_a_terminal(sock):
    """On a terminal, `top` redraws until `q` is typed, then exits 0 and restores the tty."""
    import os
    import pty
    import subprocess
    import time

    main, child = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tangramctl.main", "--socket", sock, "top", "--interval", "0.2"],
        stdin=child,
        stdout=child,
        stderr=child,
        env={**os.environ, "TERM": "xterm"},
    )
    os.close(child)
    seen = b""
    deadline = time.monotonic() + 20
    while b"(q quits)" not in seen:
        assert time.monotonic() < deadline, seen[-500:]
        seen += os.read(main, 4096)
    os.write(main, b"q")
    assert proc.wait(10) == 0
    os.close(main)


def test_session_run_takes_json_and_says_why_it_did_not_complete(sock):
    """``session run --json ID -- CMD`` gives the exec's JSON (``--json`` is an option, not
    the session id); a timeout exits 124 with a line saying so, as ``exec`` does."""
    env = ctl(sock, "env", "open").output.strip()
    sid = ctl(sock, "session", "open", env).output.strip()
    r = ctl(sock, "session", "run", "--json", sid, "--", "echo", "hi")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["stdout"] == "hi\n"
    r = ctl(sock, "session", "run", "--timeout", "0.5", sid, "--", "sleep", "5")
    assert r.exit_code == 124 and "timed out after" in r.stderr, (r.exit_code, r.stderr)
    ctl(sock, "env", "close", env)


def test_session_shell_lines_and_a_shell_that_ended(sock):
    """``exec --session ID -- 'CMD LINE'`` (the form ``session --help`` shows) runs the line in
    the session's shell, whose state it shares with ``session run``; once the shell has
    exited, ``session run`` exits 125 with a line saying the session ended."""
    env = ctl(sock, "env", "open").output.strip()
    sid = ctl(sock, "session", "open", env).output.strip()
    assert ctl(sock, "session", "run", sid, "--", "Z=zed; cd /tmp").exit_code == 0
    r = ctl(sock, "exec", "--session", sid, "--", "echo $Z $PWD")
    assert (r.exit_code, r.stdout) == (0, "zed /tmp\n"), r.output
    assert ctl(sock, "session", "run", sid, "--", "exit 3").exit_code == 3
    r = ctl(sock, "session", "run", sid, "--", "echo", "hi")
    assert r.exit_code == 125, r.output
    assert f"tangramctl: infra_error: session {sid} has ended" in r.stderr
    ctl(sock, "env", "close", env)

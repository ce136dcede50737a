"""Environments belong to trajectories, not to the daemon process: a restarted `tangramd up`
(SIGKILL or SIGTERM) re-adopts them from its state dir; what was running is ended."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
from pathlib import Path

import psutil
import pytest
from harness import running_daemon

from tangram import Client
from tangram.protocol.errors import ConnectionFailed, NotFound
from tangram.testing import wait_for


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_persistent_environment_survives_a_restart(tmp_path, sig) -> None:
    """Files, trajectory and id of a persistent environment survive the daemon's death;
    throwaway environments do not; new ids never collide with adopted ones."""
    with running_daemon(tmp_path) as d:
        with d.client() as c:
            env = c.env_open(trajectory="traj-7")
            assert c.exec("echo state > f", env=env).outcome == "ok"
        d.stop(sig)
    with running_daemon(tmp_path) as d2, d2.client() as c:
        (row,) = c.env_list()
        assert (row["id"], row["trajectory"], row["state"]) == (env, "traj-7", "ready")
        r = c.exec("cat f", env=env)
        assert (r.outcome, r.stdout) == ("ok", "state\n")
        assert c.env_open() != env
        c.env_close(env)
        with pytest.raises(NotFound):
            c.exec("true", env=env)
    assert "envs_readopted" in d2.log()


def test_command_running_at_the_crash_is_ended_not_left_running(tmp_path) -> None:
    """A command that was running when the daemon was SIGKILLed is killed by the next
    daemon (its cgroup is reconciled); its client saw the connection fail, not a result."""
    box: dict[str, object] = {}
    with running_daemon(tmp_path) as d:
        with d.client() as c:
            env = c.env_open()

        token = f"60.{os.getpid()}"  # its sleep, found by command line from the host

        def long_exec() -> None:
            try:
                with d.client() as c2:
                    box["result"] = c2.exec(f"echo $$ > pid; exec sleep {token}", env=env)
            except ConnectionFailed as exc:
                box["error"] = exc

        t = threading.Thread(target=long_exec)
        t.start()
        pid_file = Path(d.state_dir, "process", "envs", env, "pid")
        inside = int(
            wait_for(lambda: pid_file.read_text().strip(), 10, "the pid file", ignore=(OSError,))
        )
        # (the pid it sees is its namespace's in an isolated environment: the host's here)
        pid = wait_for(lambda: _host_pid(token), 10, "the command on the host")
        d.stop(signal.SIGKILL)
        t.join(10)
        assert isinstance(box.get("error"), ConnectionFailed)  # never a silent success
        os.kill(pid, 0)  # still running: the dead daemon could not end it
    with running_daemon(tmp_path) as d2:
        wait_for(
            lambda: not os.path.exists(f"/proc/{pid}") or _state(pid) == "Z",
            5,
            "the orphaned command ended",
        )
        assert "actions that were running when the previous daemon died" in d2.log()
        with d2.client() as c:
            assert c.exec("cat pid", env=env).stdout.strip() == str(inside)


def _host_pid(token: str) -> int | None:
    """The host pid of the process whose command line ends with ``token``."""
    for proc in psutil.process_iter(["cmdline"]):
        if (proc.info["cmdline"] or [""])[-1] == token:
            return int(proc.pid)
    return None


def test_another_users_environment_does_not_exist_for_them() -> None:
    """An exec or close on an environment owned by another uid is not_found (root excepted)."""
    from hostile_user import local_user

    from tangram.testing import spawn_daemon

    with local_user() as user, tempfile.TemporaryDirectory(prefix="tgo-", dir="/tmp") as tmp:
        os.chmod(tmp, 0o755)
        d = spawn_daemon(tmp, "")
        try:
            with d.client() as c:
                env = c.env_open()  # owned by root
            os.chown(d.socket, 0, user.gid)  # the operator lets the user's group connect
            assert _calls_as(d.socket, user.uid, user.gid, env) == ["not_found", "not_found"]
            with d.client() as c:  # root still can
                assert c.exec("true", env=env).outcome == "ok"
        finally:
            d.stop()


def _calls_as(path: str, uid: int, gid: int, env: str) -> list[str]:
    """exec and env.close on ``env`` from a forked child running as uid/gid."""
    from hostile_user import in_child_as

    def calls() -> bytes:
        answers = []
        with Client(path) as c:
            for call in (lambda: c.exec("true", env=env), lambda: c.env_close(env)):
                try:
                    call()
                    answers.append("served")
                except NotFound:
                    answers.append("not_found")
        return " ".join(answers).encode()

    return in_child_as(uid, gid, calls).decode().split()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_environment_records_are_a_journal_replayed_on_restart(tmp_path) -> None:
    """Each persistent open and close appends one line to ``envs.journal`` (the records are
    not rewritten whole); after a SIGKILL the journal is replayed over ``envs.json`` (a
    torn last line skipped, with a warning); a graceful stop compacts it into envs.json."""
    state = tmp_path / "state"
    with running_daemon(tmp_path) as d:
        with d.client() as c:
            a, b, gone = (c.env_open(trajectory=f"t{i}") for i in range(3))
            c.env_close(gone)
        journal = (state / "envs.journal").read_text().splitlines()
        d.stop(signal.SIGKILL)
    assert len(journal) == 4  # three opens and a close, one line each
    with open(state / "envs.journal", "a") as f:
        f.write('{"id": "torn-by-a-cra')  # a crash in the middle of an append
    with running_daemon(tmp_path) as d2:
        with d2.client() as c:
            assert sorted(e["id"] for e in c.env_list()) == sorted([a, b])
        d2.stop(signal.SIGTERM)
    assert "env_records_unreadable" in d2.log() and "1 line(s) skipped" in d2.log()
    assert not (state / "envs.journal").exists()
    records = json.loads((state / "envs.json").read_text())
    assert sorted(r["id"] for r in records) == sorted([a, b])
    assert {r["trajectory"] for r in records} == {"t0", "t1"}


def test_environment_journal_is_compacted_when_it_outgrows_the_records(tmp_path) -> None:
    """A long run of opens and closes keeps the journal under max(min_lines, twice the
    records): it is folded into envs.json, and a fresh reader gets the same records."""
    from tangramd.records import JOURNAL_MIN_LINES, RecordJournal

    def journal() -> RecordJournal:
        return RecordJournal(tmp_path / "envs.json", valid=lambda r: "mem" in r, problem="bad")

    book = journal()
    assert book.load() == {}
    keep = {f"keep{i}": {"id": f"keep{i}", "mem": 1} for i in range(10)}
    for env_id, record in keep.items():
        book.put(env_id, record)
    most = 0
    for i in range(JOURNAL_MIN_LINES):
        book.put(f"e{i}", {"id": f"e{i}", "mem": 1})
        book.put(f"e{i}", None)
        lines = tmp_path / "envs.journal"  # gone right after a compaction
        most = max(most, len(lines.read_bytes().splitlines()) if lines.exists() else 0)
    assert most <= JOURNAL_MIN_LINES
    assert (tmp_path / "envs.json").exists()  # compacted at least once
    book.close()
    assert journal().load() == keep

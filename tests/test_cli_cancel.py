"""`tangramctl cancel ID` against a real `tangramd up` with one core, and what a cancelled
`tangramctl exec` does: exit 130 with a line saying so (docs/design.md §6.4)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import psutil
import pytest
from click.testing import CliRunner
from harness import running_daemon

from tangram.testing import wait_for
from tangramctl.main import cli

CORE = min(os.sched_getaffinity(0))
CTL = [sys.executable, "-m", "tangramctl.main"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """One core: a second exec waits for the first."""
    config = f"\n[cpu]\ncores = [{CORE}]\n"
    with running_daemon(tmp_path_factory.mktemp("cli-cancel"), config=config) as d:
        yield d


def ctl(sock: str, *args: str):
    return CliRunner().invoke(cli, ["--socket", sock, *args], catch_exceptions=False)


def marked(mark: str) -> list[psutil.Process]:
    """The exec's processes (not the `tangramctl exec` that sent the command line)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or ())
        if mark in line and "tangramctl" not in line:
            found.append(proc)
    return found


def test_cancel_a_running_and_a_queued_tangramctl_exec(daemon):
    """Both `tangramctl exec`s exit 130 saying they were cancelled; the running one's
    processes are gone when `cancel` returns; `--json` says outcome cancelled."""
    mark = str(uuid.uuid4().int % 10**9)
    sock = daemon.socket
    running = subprocess.Popen(
        [*CTL, "--socket", sock, "exec", "--shell", "--", f"sleep 300.{mark} & sleep 301.{mark}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with daemon.client() as c:
            rows = wait_for(lambda: c.queue()["running"], 30, "the exec running")
            running_id = rows[0]["action_id"]
            wait_for(lambda: len(marked(mark)) >= 2, 20, "both sleeps started")
            queued = subprocess.Popen(
                [*CTL, "--socket", sock, "exec", "--json", "--", "sleep", f"302.{mark}"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            rows = wait_for(lambda: c.queue()["waiting"], 30, "the second exec waiting")
            queued_id = rows[0]["action_id"]

        r = ctl(sock, "cancel", queued_id, "--json")
        assert r.exit_code == 0, r.output
        assert json.loads(r.output) == {
            "action_id": queued_id,
            "cancelled": True,
            "state": "done",
            "outcome": "cancelled",
        }
        out, _ = queued.communicate(timeout=20)
        assert queued.returncode == 130, out
        assert json.loads(out)["outcome"] == "cancelled"

        r = ctl(sock, "cancel", running_id)
        assert r.exit_code == 0, r.output
        assert r.output.strip() == f"{running_id}: cancelled"
        assert marked(mark) == []  # killed, background child and all, before the answer
        _, err = running.communicate(timeout=20)
        assert running.returncode == 130, err
        assert f"tangramctl: cancelled: action {running_id}" in err

        r = ctl(sock, "cancel", running_id)
        assert (r.exit_code, r.output.strip()) == (0, f"{running_id}: cancelled")
        r = ctl(sock, "cancel", "a999999")
        assert r.exit_code == 1
        assert "not_found" in r.output and "a999999" in r.output
    finally:
        for proc in (running,):
            if proc.poll() is None:
                proc.kill()


def test_cancel_a_jobs_queued_and_running_execs_with_all(daemon):
    """`cancel --job NAME --all` ends the job's running exec (killed, nothing of it left
    when it returns) and its queued one in one step; another job's queued exec is not
    touched; --json lists both with their outcomes; each `tangramctl exec` exits 130."""
    mark = str(uuid.uuid4().int % 10**9)
    sock = daemon.socket
    job = f"grpo{mark}"

    def start(*args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [*CTL, "--socket", sock, "exec", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    procs = [start("--job", job, "--shell", "--", f"sleep 310.{mark} & sleep 311.{mark}")]
    try:
        with daemon.client() as c:
            running = wait_for(lambda: c.queue()["running"], 30, "the job's exec running")
            running_id = running[0]["action_id"]
            wait_for(lambda: len(marked(mark)) >= 2, 20, "both sleeps started")
            procs.append(start("--job", job, "--", "sleep", f"312.{mark}"))
            procs.append(start("--job", "other", "--", "true"))
            rows = wait_for(
                lambda: len(w := c.queue()["waiting"]) == 2 and w, 30, "two execs waiting"
            )
            mine = [r["action_id"] for r in rows if r["job"] == job]
            theirs = [r["action_id"] for r in rows if r["job"] == "other"]
            assert len(mine) == 1 and len(theirs) == 1, rows

        r = ctl(sock, "cancel", "--job", job, "--all", "--json")
        assert r.exit_code == 0, r.output
        answer = json.loads(r.output)
        assert answer["job"] == job
        assert sorted(answer["actions"], key=lambda row: row["action_id"]) == sorted(
            [
                {"action_id": aid, "cancelled": True, "state": "done", "outcome": "cancelled"}
                for aid in (running_id, mine[0])
            ],
            key=lambda row: row["action_id"],
        )
        assert marked(mark) == []  # killed, background child and all, before the answer
        for proc in procs[:2]:
            _, err = proc.communicate(timeout=20)
            assert proc.returncode == 130, err
        _, err = procs[2].communicate(timeout=30)  # the other job's ran once cores freed
        assert procs[2].returncode == 0, err
        with daemon.client() as c:
            assert c.story(running_id)["outcome"] == "cancelled"

        r = ctl(sock, "cancel", "--job", job, "--all")
        assert (r.exit_code, r.output.strip()) == (0, f"job {job}: nothing to cancel")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--all"], "--all needs --job NAME"),
        (["a1", "--job", "x", "--all"], "not an ID"),
        (["--job", "x"], "--job x needs --all"),
        ([], "give an action ID, or --job NAME --all"),
    ],
)
def test_cancel_usage_errors_name_the_options(daemon, args, says):
    r = ctl(daemon.socket, "cancel", *args)
    assert r.exit_code == 2 and says in r.output, r.output


def sleeps_in_proc(mark: str) -> list[int]:
    """Pids whose /proc cmdline holds ``mark`` and is not a tangramctl (the exec's own)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                line = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        if mark in line and "tangramctl" not in line:
            pids.append(int(entry))
    return pids


def cgroups_of(pid: int) -> set[str]:
    """The cgroup directories process ``pid`` is in (v2 and each v1 hierarchy)."""
    dirs = set()
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            hierarchy = controllers.split(",")[0].removeprefix("name=")
            base = "/sys/fs/cgroup" + (f"/{hierarchy}" if hierarchy else "")
            dirs.add(os.path.normpath(base + path))
    return dirs


def procs_in(cgroup: str) -> str:
    """The pids in ``cgroup`` ('' when it is gone or empty)."""
    try:
        with open(os.path.join(cgroup, "cgroup.procs")) as f:
            return f.read().strip()
    except OSError:
        return ""


def test_ctrl_c_on_tangramctl_exec_cancels_its_running_and_its_queued_action(daemon):
    """SIGINT to a `tangramctl exec` whose command runs cancels the action (by its ref: the
    client does not know its id): exit 130 with a line saying so, the story says cancelled
    and no process of it is left. SIGINT to one still waiting withdraws it the same way."""
    mark = str(uuid.uuid4().int % 10**9)
    sock = daemon.socket
    running = subprocess.Popen(
        [*CTL, "--socket", sock, "exec", "--", "sleep", f"30.{mark}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    procs = [running]
    try:
        with daemon.client() as c:
            rows = wait_for(lambda: c.queue()["running"], 30, "the exec running")
            running_id = rows[0]["action_id"]
            (pid,) = wait_for(lambda: sleeps_in_proc(mark), 20, "the sleep started")
            # the action's own cgroups (not those it shares with the daemon)
            own = cgroups_of(pid) - cgroups_of(daemon.proc.pid)
            queued = subprocess.Popen(
                [*CTL, "--socket", sock, "exec", "--json", "--", "sleep", f"31.{mark}"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            procs.append(queued)
            rows = wait_for(lambda: c.queue()["waiting"], 30, "the second exec waiting")
            queued_id = rows[0]["action_id"]

            queued.send_signal(signal.SIGINT)
            out, err = queued.communicate(timeout=20)
            assert queued.returncode == 130, err
            answer = json.loads(out)
            assert (answer["action_id"], answer["outcome"]) == (queued_id, "cancelled"), answer
            assert "interrupted (Ctrl-C)" in answer["detail"]
            assert c.story(queued_id)["outcome"] == "cancelled"

            running.send_signal(signal.SIGINT)
            _, err = running.communicate(timeout=20)
            assert running.returncode == 130, err
            assert f"tangramctl: cancelled: action {running_id}: interrupted (Ctrl-C)" in err
            assert sleeps_in_proc(mark) == []  # killed before tangramctl returned
            assert {cg: procs_in(cg) for cg in own} == dict.fromkeys(own, "")
            assert c.story(running_id)["outcome"] == "cancelled"
            assert not c.queue()["running"] and not c.queue()["waiting"]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()

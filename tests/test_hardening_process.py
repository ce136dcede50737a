"""Issue 9 hardening of the process backend, against real processes, cgroups and users."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import psutil
import pytest

from tangramd.backends.base import EXEC_OOM_SCORE_ADJ, ExecResult
from tangramd.backends.process import ProcessBackend

pytest.register_assert_rewrite("backend_conformance")
from backend_conformance import (  # noqa: E402
    BOTH_CORES,
    allowed_list,
    ex,
    lodger_of,
    new_env,
    req,
    until_started,
)
from hostile_user import local_user  # noqa: E402

CGROUP_MODES = ["v1", "v2", "none"]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def user():
    with local_user() as u:
        yield u


@pytest.fixture(params=CGROUP_MODES)
def backend(request, tmp_path):
    b = ProcessBackend(tmp_path / "state", cgroup_version=request.param)
    want = {"v1": "v1-cpuset", "v2": "v2", "none": None}[request.param]
    assert (b.cgroups.kind if b.cgroups else None) == want, "CI runs as root, cgroup v1 + v2"
    yield b
    asyncio.run(b.shutdown())


# --- item 1 and 6: the action ends with its main process; nothing it left survives


@pytest.mark.parametrize(
    "script",
    [
        "setsid sleep 60 >/dev/null 2>&1 < /dev/null & echo $!",
        "(nohup sleep 60 >/dev/null 2>&1 & echo $!) ; sleep 0.1",
        "setsid sh -c 'sleep 60 & echo $!; sleep 60' & sleep 0.2",
    ],
    ids=["setsid", "nohup-double-fork", "setsid-grandchild"],
)
def test_nothing_outlives_its_action(backend, script):
    """setsid children and double-forked nohup daemons die with their action, in every mode."""
    env = new_env(backend)
    result = ex(backend, env, script, timeout_s=10.0)
    assert result.outcome == "ok", result
    pids = [int(p) for p in result.stdout.split()]
    assert pids
    assert all(gone(p) for p in pids), [p for p in pids if not gone(p)]


def test_timeout_counts_to_main_exit_only(backend):
    """A main process that exits at once is ok although its child keeps the pipes for 30 s."""
    env = new_env(backend)
    started = time.monotonic()
    result = ex(backend, env, "setsid sleep 30 & echo started", timeout_s=3.0)
    assert (result.outcome, result.stdout) == ("ok", "started\n")
    assert time.monotonic() - started < 2.5


# --- item 2: no action widens the cores of later actions


def test_cpuset_widened_by_a_root_command_is_reset_before_the_next_exec(tmp_path):
    """A root exec that rewrites its cgroup's cpuset.cpus does not widen the next action,
    whether the daemon checks the cgroup (the fork server's path) or the lodger living in
    it does (the later execs' path): the next one finds ``cpuset.cpus`` back to its core.
    One event loop throughout: a new loop restarts the fork server and its lodgers."""
    b = ProcessBackend(tmp_path, cgroup_version="v1")
    env = new_env(b)
    cg = "/sys/fs/cgroup/cpuset$(grep cpuset /proc/self/cgroup | cut -d: -f3)"
    widen = f'echo 0-1 > "{cg}/cpuset.cpus"'
    probe = (
        f'grep Cpus_allowed_list /proc/self/status; echo "cpus $(cat "{cg}/cpuset.cpus")"; '
        'echo "parent $PPID"'
    )

    async def scenario() -> list[tuple[str, ExecResult]]:
        got = []
        widened = await b.exec(req(env, widen, (0,)))  # the fork server's path
        got.append((widened.outcome, await b.exec(req(env, probe, (0,)))))
        lodger = await lodger_of(b, (0,))
        for _ in range(2):  # through the lodger, twice
            widened = await b.exec(req(env, widen, (0,)))
            got.append((widened.outcome, await b.exec(req(env, probe, (0,)))))
        return [(str(lodger), *g) for g in got]

    try:
        got = asyncio.run(scenario())
    finally:
        asyncio.run(b.shutdown())
    for i, (lodger, widened, after) in enumerate(got):
        assert widened == "ok"
        assert allowed_list(after) == "0" and "cpus 0\n" in after.stdout, after
        if i > 0:  # spawned by the lodger, which lives in the widened cgroup
            assert f"parent {lodger}\n" in after.stdout, after


def test_sandboxed_command_cannot_change_its_cgroup_or_widen_its_cores(tmp_path, user):
    """As an unprivileged user a command can neither rewrite its cpuset nor leave it."""
    b = ProcessBackend(tmp_path, cgroup_version="v1", default_user=user.ids)
    try:
        env = new_env(b)
        cg = "/sys/fs/cgroup/cpuset$(grep cpuset /proc/self/cgroup | cut -d: -f3)"
        script = (
            f'echo 0-1 > "{cg}/cpuset.cpus" || echo no-widen; '
            "echo $$ > /sys/fs/cgroup/cpuset/cgroup.procs || echo no-escape; "
            "taskset -pc 0-1 $$ >/dev/null 2>&1 || echo no-taskset; "
            "grep Cpus_allowed_list /proc/self/status"
        )
        result = ex(b, env, script, (0,))
        assert "no-widen" in result.stdout and "no-escape" in result.stdout, result
        assert allowed_list(result) == "0"
        after = ex(b, env, "grep Cpus_allowed_list /proc/self/status", (0,))
        assert allowed_list(after) == "0"
    finally:
        asyncio.run(b.shutdown())


def test_sandboxed_command_cannot_touch_the_lodger_that_spawned_it(tmp_path, user):
    """A command spawned by a lodger (its parent, root, living in the same cgroup) can
    neither kill it nor stop it; the lodger spawns the next command as before."""
    b = ProcessBackend(tmp_path, cgroup_version="v1", default_user=user.ids)

    async def scenario() -> tuple[str, int, str]:
        env = "e1"
        await b.create_env(env, None, None, owner=user.ids)
        assert (await b.exec(req(env, ["true"], (0,)))).outcome == "ok"
        lodger = await lodger_of(b, (0,))  # it joins after the first exec
        attack = "kill -9 $PPID || echo no-kill; kill -STOP $PPID || echo no-stop; echo $PPID"
        hit = await b.exec(req(env, attack, (0,)))
        after = await b.exec(req(env, "echo $PPID", (0,)))
        return hit.stdout, lodger, after.stdout

    try:
        out, lodger, after = asyncio.run(scenario())
        assert "no-kill" in out and "no-stop" in out, out
        assert out.split()[-1] == str(lodger)
        assert after.strip() == str(lodger)
        assert not gone(lodger)
    finally:
        asyncio.run(b.shutdown())


# --- item 3: commands run as the given user, never silently as root


def test_exec_runs_as_the_requested_user_without_root_groups(backend, user):
    """run_as (the peer's uid/gid) is who the command is; root's groups are dropped."""
    env_id = "env-owned"
    asyncio.run(backend.create_env(env_id, None, None, owner=user.ids))
    result = asyncio.run(
        backend.exec(req(env_id, "id -u; id -g; id -G; cat /etc/shadow", run_as=user.ids))
    )
    lines = result.stdout.split("\n")
    assert lines[:3] == [str(user.uid), str(user.gid), str(user.gid)], result
    assert result.outcome == "failed" and "Permission denied" in result.stderr


def test_sandbox_user_is_the_default(tmp_path, user):
    """With a sandbox user configured, a request without run_as does not run as root."""
    b = ProcessBackend(tmp_path, default_user=user.ids)
    try:
        env = new_env(b)
        assert ex(b, env, "id -u").stdout.strip() == str(user.uid)
    finally:
        asyncio.run(b.shutdown())


def test_a_user_cannot_run_in_another_users_environment(backend, user):
    """An environment owned by root refuses execs as another uid (infra_error, no spawn)."""
    asyncio.run(backend.create_env("root-env", None, None, owner=(0, 0)))
    result = asyncio.run(backend.exec(req("root-env", "id -u", run_as=user.ids)))
    assert result.outcome == "infra_error" and "belongs to uid 0" in result.detail


# --- item 4: environments are private


def test_environment_dirs_and_files_are_private(backend, user):
    """Env dirs are 0700 (the backend's dirs 0711), files 0600: another user reads nothing."""
    env = new_env(backend)
    assert ex(backend, env, "echo secret > data.txt").outcome == "ok"
    path = backend.env_dir(env)
    assert (path.stat().st_mode & 0o777, (path / "data.txt").stat().st_mode & 0o777) == (
        0o700,
        0o600,
    )
    assert backend.envs_dir.stat().st_mode & 0o777 == 0o711
    other = new_env(backend)
    spy = asyncio.run(backend.exec(req(other, f"cat {path}/data.txt; ls {backend.envs_dir}")))
    assert "secret" in spy.stdout  # root may read: the same user
    asyncio.run(backend.create_env("spy", None, None, owner=user.ids))
    spy = asyncio.run(
        backend.exec(req("spy", f"cat {path}/data.txt; ls {backend.envs_dir}", run_as=user.ids))
    )
    assert "secret" not in spy.stdout and spy.outcome == "failed"


# --- item 5: the OOM killer picks commands first


def test_execs_get_a_high_oom_score_adj(backend):
    """A command (and what it forks) runs at EXEC_OOM_SCORE_ADJ, not the daemon's score."""
    env = new_env(backend)
    result = ex(backend, env, "cat /proc/self/oom_score_adj; sh -c 'cat /proc/self/oom_score_adj'")
    assert result.stdout.split() == [str(EXEC_OOM_SCORE_ADJ)] * 2


def test_execs_run_under_sched_batch(backend):
    """Sandboxed commands (and the fork server that spawns them) run SCHED_BATCH: they never
    preempt the daemon when they wake. Field 41 of /proc/PID/stat is the policy."""
    env = new_env(backend)
    result = ex(backend, env, "cat /proc/self/stat; sh -c 'cat /proc/self/stat'")
    assert result.outcome == "ok", result
    policies = [line.rsplit(")", 1)[1].split()[41 - 3] for line in result.stdout.splitlines()]
    assert policies == [str(os.SCHED_BATCH)] * 2
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller (the daemon) is not


# --- item 7: no daemon thread ever sits in an exec's cgroup


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_no_daemon_thread_in_an_exec_cgroup(tmp_path, version):
    """While an exec runs, its cgroup holds its processes only, never a daemon thread."""
    b = ProcessBackend(tmp_path, cgroup_version=version)

    async def scenario() -> tuple[set[int], set[int]]:
        env = "e1"
        await b.create_env(env, None, None)
        task = asyncio.create_task(b.exec(req(env, "touch started; sleep 1", BOTH_CORES)))
        await until_started(b, env)
        assert b.cgroups is not None
        cgroup = b.cgroups.for_cores(BOTH_CORES)
        members = set(b.cgroups.pids(cgroup))
        threads = (cgroup / ("tasks" if version == "v1" else "cgroup.threads")).read_text()
        members |= {int(t) for t in threads.split()}
        ours = {int(t) for t in os.listdir("/proc/self/task")} | {os.getpid()}
        assert (await task).outcome == "ok"
        return members, ours

    try:
        members, ours = asyncio.run(scenario())
        assert members and not members & ours
    finally:
        asyncio.run(b.shutdown())


def test_spawn_leaves_the_daemon_thread_where_it_was(tmp_path):
    """Spawning pins the child by pid: the daemon's affinity and cgroup never change."""
    before = (os.sched_getaffinity(0), Path("/proc/thread-self/cgroup").read_text())
    b = ProcessBackend(tmp_path)
    env = new_env(b)
    ex(b, env, "true", (1,))
    asyncio.run(b.shutdown())
    assert (os.sched_getaffinity(0), Path("/proc/thread-self/cgroup").read_text()) == before

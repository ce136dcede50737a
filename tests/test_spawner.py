"""The process backend's fork server (tangramd/backends/spawner.py) on the real host."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from backend_conformance import BOTH_CORES, new_env, req, run

from tangramd.backends.base import EXEC_OOM_SCORE_ADJ
from tangramd.backends.process import ProcessBackend


def _cgroup_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cgroup").read_text()


def test_spawner_goes_home_after_each_spawn(tmp_path):
    """Between spawns the helper is back in the daemon's cgroup, affinity and OOM score."""
    b = ProcessBackend(tmp_path)
    env = new_env(b)

    async def scenario() -> tuple[str, set[int], str, str]:
        result = await b.exec(req(env, ["true"], (0,)))
        assert result.outcome == "ok", result
        pid = b._spawner.pid
        assert pid is not None
        return (
            _cgroup_of(pid),
            os.sched_getaffinity(pid),
            Path(f"/proc/{pid}/oom_score_adj").read_text().strip(),
            result.stdout,
        )

    try:
        cgroups, affinity, score, _ = run(scenario())
        assert cgroups == _cgroup_of(os.getpid())
        assert affinity == os.sched_getaffinity(0)
        assert score == Path("/proc/self/oom_score_adj").read_text().strip()
        assert score != str(EXEC_OOM_SCORE_ADJ)
    finally:
        run(b.shutdown())


def test_a_dead_spawner_fails_its_exec_and_is_replaced(tmp_path):
    """Killing the helper mid-exec ends that exec with infra_error (its command killed);
    the next exec starts a new helper and succeeds."""
    b = ProcessBackend(tmp_path)
    env = new_env(b)

    async def scenario() -> tuple[str, str, str]:
        running = asyncio.ensure_future(b.exec(req(env, ["sleep", "30"], BOTH_CORES)))
        await asyncio.sleep(0.5)
        pid = b._spawner.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        first = await asyncio.wait_for(running, 10)
        again = await b.exec(req(env, ["echo", "again"], (0,)))
        return first.outcome, first.detail, again.stdout

    try:
        outcome, detail, again = run(scenario())
        assert outcome == "infra_error" and "spawner" in detail
        assert again == "again\n"
        assert b.cgroups is None or not b.cgroups.pids(b.cgroups.for_cores(BOTH_CORES))
    finally:
        run(b.shutdown())


def test_a_command_that_cannot_be_run_is_126_or_127(tmp_path):
    """A missing program is exit 127 and a non-executable file 126, as a shell says."""
    b = ProcessBackend(tmp_path)
    env = new_env(b)
    script = b.env_dir(env) / "script"
    script.write_text("echo hi\n")
    try:
        missing = run(b.exec(req(env, ["no-such-program-xyz"])))
        assert (missing.outcome, missing.exit_code) == ("failed", 127)
        assert "no-such-program-xyz" in missing.stderr
        denied = run(b.exec(req(env, [str(script)])))
        assert (denied.outcome, denied.exit_code) == ("failed", 126)
    finally:
        run(b.shutdown())


def test_a_command_gets_only_its_three_descriptors(tmp_path):
    """Nothing of the daemon or the helper (sockets, pidfds, other execs' pipes) leaks into
    a command: it starts with stdin, stdout and stderr only."""
    b = ProcessBackend(tmp_path)
    env = new_env(b)
    probe = "import os; print(' '.join(sorted(os.listdir('/proc/self/fd'), key=int)))"
    try:
        result = run(b.exec(req(env, ["python3", "-c", probe])))
        assert result.outcome == "ok", result
        assert set(result.stdout.split()) <= {"0", "1", "2", "3"}  # 3: listdir's own
    finally:
        run(b.shutdown())

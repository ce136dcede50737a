"""The process backend against real processes, pinning and cgroups (it runs as root in CI)."""

from __future__ import annotations

import asyncio
import os
import re
import stat
from pathlib import Path

import psutil
import pytest

from tangram.testing import wait_for_async
from tangramd.backends.process import CPUSET_ROOT, SPARE, ProcessBackend

# A helper module with asserts, not a test module: have pytest rewrite them too.
pytest.register_assert_rewrite("backend_conformance")
from backend_conformance import BOTH_CORES, BackendConformance, ex, new_env  # noqa: E402


@pytest.fixture
def backend(tmp_path):
    b = ProcessBackend(tmp_path / "state")
    yield b
    asyncio.run(b.shutdown())


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class TestProcessConformance(BackendConformance):
    """The shared backend contract, for the process backend."""


def test_cwd_and_home_are_the_env_dir(backend):
    """Commands run in their environment's directory, which is also HOME."""
    env = new_env(backend)
    result = ex(backend, env, 'pwd; echo "$HOME"')
    assert result.stdout.split() == [str(backend.env_dir(env))] * 2


def test_timeout_kills_process_group_with_grandchild(backend):
    """A timeout kills the whole group, grandchildren included, and keeps partial output."""
    env = new_env(backend)
    result = ex(backend, env, "sleep 60 & echo $!; sleep 60", timeout_s=1.0)
    assert result.outcome == "timeout"
    grandchild = int(result.stdout.split()[0])
    assert gone(grandchild)


def test_leftover_background_process_is_killed_at_exit(backend):
    """What a finished command left running in its group does not outlive the exec."""
    env = new_env(backend)
    result = ex(backend, env, "sleep 60 >/dev/null 2>&1 & echo $!")
    assert result.outcome == "ok"
    assert gone(int(result.stdout))


def test_escaped_session_is_killed_through_the_cgroup(backend):
    """A descendant that setsid()s out of the group is still swept via the exec cgroup."""
    assert backend.cgroups is not None, "CI runs as root with cgroup v1 cpuset"
    env = new_env(backend)
    result = ex(backend, env, "setsid sleep 60 >/dev/null 2>&1 < /dev/null & echo $!")
    assert result.outcome == "ok"
    assert gone(int(result.stdout))


def test_exec_runs_in_the_cpuset_cgroup_of_its_cores(backend):
    """As root each exec runs in the cpuset cgroup of its core set, left empty afterwards
    (but for the fork server's lodger, which stays there for the next exec)."""
    assert backend.cgroups is not None, "CI runs as root with cgroup v1 cpuset"
    env = new_env(backend)
    result = ex(backend, env, ["cat", "/proc/self/cgroup"], (1,), action_id="act-42")
    line = next(ln for ln in result.stdout.splitlines() if re.match(r"\d+:cpuset:", ln))
    rel = line.split(":", 2)[2].lstrip("/")
    assert f"/{rel}" == f"/{backend.cgroups.base.relative_to(CPUSET_ROOT)}/c1"
    left = {int(p) for p in (CPUSET_ROOT / rel / "cgroup.procs").read_text().split()}
    assert left <= backend.lodger_pids


def test_daemon_thread_returns_home_after_spawn(backend):
    """Spawning borrows the child's cgroup and mask for an instant, then restores both."""
    before = (os.sched_getaffinity(0), Path("/proc/thread-self/cgroup").read_text())
    env = new_env(backend)
    ex(backend, env, "true", (1,))
    assert (os.sched_getaffinity(0), Path("/proc/thread-self/cgroup").read_text()) == before


def test_cgroup_has_the_allocated_cores(backend):
    """The per-exec cgroup's cpuset.cpus is exactly the allocation."""
    env = new_env(backend)
    script = 'cat "/sys/fs/cgroup/cpuset$(grep cpuset /proc/self/cgroup | cut -d: -f3)/cpuset.cpus"'
    assert ex(backend, env, script, BOTH_CORES).stdout.strip() in {"0-1", "0,1"}


def test_reconcile_removes_leftovers_of_a_previous_run(tmp_path):
    """Env dirs and exec cgroups left by a crashed daemon are removed on start."""
    crashed = ProcessBackend(tmp_path)
    asyncio.run(crashed.create_env("old-env", None, None))
    leftover_cg = crashed.cgroups.for_cores((0,)) if crashed.cgroups else None
    fresh = ProcessBackend(tmp_path)
    done = asyncio.run(fresh.reconcile())
    assert not (tmp_path / "envs" / "old-env").exists()
    assert any("old-env" in line for line in done)
    if leftover_cg is not None:
        assert not leftover_cg.exists()
    asyncio.run(fresh.shutdown())


def test_closing_environments_leaves_nothing(backend):
    """A closed environment's directory is gone, the short way (a few files) and the long
    way (subdirectories, many files) alike, and nothing is left where it was moved to."""
    small, big = new_env(backend), new_env(backend)
    asyncio.run(backend.put(small, "main.py", b"print(1)"))
    assert ex(backend, big, "mkdir -p a/b && touch a/b/c $(seq 1 50)").outcome == "ok"
    asyncio.run(backend.close_env(small))
    asyncio.run(backend.close_env(big))
    left = sorted(p.name for p in backend.envs_dir.iterdir() if p.name != SPARE)
    assert left in ([], [".removing"])
    assert not any(backend.envs_dir.glob(".removing/*"))
    for spare in backend.envs_dir.glob(f"{SPARE}/*"):  # empty, private, made ahead
        assert not any(spare.iterdir()) and spare.stat().st_mode & 0o777 == 0o700
    asyncio.run(backend.close_env(small))  # closing twice is harmless
    asyncio.run(backend.shutdown())  # the spares go with the backend
    assert sorted(p.name for p in backend.envs_dir.iterdir()) in ([], [".removing"])


def test_an_environment_opens_by_renaming_a_spare_directory(backend, monkeypatch):
    """Once the spare directories are made (in a thread), opening an environment makes no
    directory on the event loop's thread: a spare one is renamed into place, then owned by
    the environment's owner, 0700 and empty; the spares are made again as they run low."""
    import asyncio
    import threading

    from tangramd.backends import process

    loop_thread = threading.get_ident()
    on_loop: list[str] = []
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kw):
        if threading.get_ident() == loop_thread:
            on_loop.append(os.fspath(path))
        return real_mkdir(path, *args, **kw)

    monkeypatch.setattr(os, "mkdir", mkdir)

    async def scenario() -> list[tuple[str, int, int, int]]:
        await backend.create_env("first", None, None)  # no spare yet: made in a thread
        await wait_for_async(lambda: backend._refill is None, 10, "the spares made")
        spares = {p.stat().st_ino for p in backend.envs_dir.glob(f"{SPARE}/*")}
        assert len(spares) == process.SPARE_DIRS
        seen = []
        for i in range(process.SPARE_DIRS):
            env = f"e{i}"
            await backend.create_env(env, None, None, owner=(4321, 4321))
            st = backend.env_dir(env).stat()
            seen.append((env, st.st_ino in spares, st.st_mode & 0o777, st.st_uid))
            assert not any(backend.env_dir(env).iterdir())
        await wait_for_async(lambda: backend._refill is None, 10, "the spares made again")
        assert len(list(backend.envs_dir.glob(f"{SPARE}/*"))) >= process.SPARE_DIRS // 2
        return seen

    seen = asyncio.run(scenario())
    assert on_loop == []
    assert all(renamed and mode == 0o700 and uid == 4321 for _, renamed, mode, uid in seen)


def test_memory_limit_is_advisory(backend):
    """The process backend accepts a memory size without enforcing it."""
    asyncio.run(backend.create_env("big", None, 1 << 40))
    assert backend.env_exists("big")


def test_env_ids_cannot_escape_the_root(backend):
    """An env id that is not a plain name is refused before touching the filesystem."""
    from tangramd.backends.base import EnvError

    with pytest.raises(EnvError):
        asyncio.run(backend.create_env("../escape", None, None))
    assert not Path(backend.root.parent / "escape").exists()


def test_affinity_without_cgroups(tmp_path):
    """Without cgroups the exec is still pinned by sched_setaffinity alone."""
    before = os.sched_getaffinity(0)
    b = ProcessBackend(tmp_path, use_cgroups=False)
    env = new_env(b)
    out = ex(
        b, env, "grep Cpus_allowed_list /proc/self/status; grep cpuset /proc/self/cgroup", (1,)
    )
    assert "Cpus_allowed_list:\t1\n" in out.stdout
    assert "tangram" not in out.stdout
    asyncio.run(b.shutdown())
    assert os.sched_getaffinity(0) == before  # the daemon itself is never pinned


@pytest.mark.parametrize("use_cgroups", [True, False], ids=["cgroup", "no-cgroup"])
def test_background_process_holding_the_pipes_does_not_stall_the_action(tmp_path, use_cgroups):
    """The action ends when its main process exits, even if a setsid child keeps the pipes."""
    b = ProcessBackend(tmp_path, use_cgroups=use_cgroups)
    try:
        env = new_env(b)
        result = ex(b, env, "setsid sleep 30 & echo started", timeout_s=3.0)
        assert (result.outcome, result.exit_code, result.stdout) == ("ok", 0, "started\n")
        assert result.exec_s < 2.0
    finally:
        asyncio.run(b.shutdown())


def test_a_short_exec_is_read_at_its_end_without_readers(backend, monkeypatch):
    """Output of a command that ends within READ_LATER_S is read once at its end: no
    reader is registered on the loop for its pipes (two registrations and removals per
    exec otherwise); every byte still arrives."""
    import asyncio.selector_events

    from tangramd.backends import process

    monkeypatch.setattr(process, "READ_LATER_S", 5.0)  # nothing here runs that long
    added: list[int] = []
    real = asyncio.selector_events.BaseSelectorEventLoop.add_reader

    def counting(self, fd, *args):
        if stat.S_ISFIFO(os.fstat(fd).st_mode):  # an exec's output pipe, not a socket
            added.append(fd)
        return real(self, fd, *args)

    monkeypatch.setattr(asyncio.selector_events.BaseSelectorEventLoop, "add_reader", counting)
    env = new_env(backend)
    result = ex(backend, env, "printf out; printf err >&2")
    assert (result.outcome, result.stdout, result.stderr) == ("ok", "out", "err")
    result = ex(backend, env, "head -c 50000 /dev/zero | tr '\\0' x")
    assert (result.outcome, len(result.stdout)) == ("ok", 50000)
    assert added == []  # (the tree before registered two readers per exec)


def test_a_long_writer_gets_readers_and_loses_nothing(backend, monkeypatch):
    """A command writing far more than a pipe holds, for longer than READ_LATER_S, is read
    as it writes (it would block otherwise): all of it arrives, in order."""
    from tangramd.backends import process

    monkeypatch.setattr(process, "READ_LATER_S", 0.05)
    env = new_env(backend)
    cmd = "for i in $(seq 1 400); do printf '%04d' $i; head -c 996 /dev/zero | tr '\\0' y; done"
    result = ex(backend, env, cmd, timeout_s=30.0)
    assert result.outcome == "ok" and not result.truncated
    assert len(result.stdout) == 400_000
    assert [int(result.stdout[i * 1000 : i * 1000 + 4]) for i in range(400)] == list(range(1, 401))

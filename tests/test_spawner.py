"""The process backend's fork server (tangramd/backends/forkserver.py, driven by
tangramd/backends/spawner.py) on the real host."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from backend_conformance import BOTH_CORES, lodger_of, new_env, req, until_started
from hostile_user import local_user

from tangram.testing import wait_for_async
from tangramd.backends.base import EXEC_OOM_SCORE_ADJ
from tangramd.backends.forkserver import _load_native
from tangramd.backends.process import ProcessBackend
from tangramd.backends.spawner import NATIVE_ENV, Spawner, SpawnError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True, params=["c", "python"])
def lodger_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs twice: with the lodgers' loop in C (``_lodger.c``, the default
    where it is built) and in Python (the reference it must agree with)."""
    monkeypatch.setenv(NATIVE_ENV, "1" if request.param == "c" else "0")
    return str(request.param)


def test_the_fork_server_imports_the_standard_library_only() -> None:
    """The fork server runs as ``python -I -S forkserver.py`` (no site-packages on its path):
    importing it in a fresh interpreter loads nothing but the standard library and its own
    (empty) packages; nothing of the daemon's end or of the rest of tangramd."""
    code = (
        "import sys, json\n"
        "before = set(sys.modules)\n"
        "import tangramd.backends.forkserver\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    loaded = set(json.loads(out))
    ours = {"tangramd", "tangramd.backends", "tangramd.backends.forkserver"}
    assert ours <= loaded  # the import did happen
    foreign = sorted(m for m in loaded - ours if m.split(".")[0] not in sys.stdlib_module_names)
    assert foreign == []


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
        cgroups, affinity, score, _ = asyncio.run(scenario())
        assert cgroups == _cgroup_of(os.getpid())
        assert affinity == os.sched_getaffinity(0)
        assert score == Path("/proc/self/oom_score_adj").read_text().strip()
        assert score != str(EXEC_OOM_SCORE_ADJ)
    finally:
        asyncio.run(b.shutdown())


def test_a_dead_spawner_fails_its_exec_and_is_replaced(tmp_path):
    """Killing the helper mid-exec ends that exec with infra_error (its command killed);
    the next exec starts a new helper and succeeds."""
    b = ProcessBackend(tmp_path)
    env = new_env(b)

    async def scenario() -> tuple[str, str, str]:
        cmd = ["sh", "-c", "touch started; exec sleep 30"]
        running = asyncio.ensure_future(b.exec(req(env, cmd, BOTH_CORES)))
        await until_started(b, env)
        pid = b._spawner.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        first = await asyncio.wait_for(running, 10)
        again = await b.exec(req(env, ["echo", "again"], (0,)))
        return first.outcome, first.detail, again.stdout

    try:
        outcome, detail, again = asyncio.run(scenario())
        assert outcome == "infra_error" and "spawner" in detail
        assert again == "again\n"
        assert b.cgroups is None or not b.cgroups.pids(b.cgroups.for_cores(BOTH_CORES))
    finally:
        asyncio.run(b.shutdown())


def test_a_command_that_cannot_be_run_is_126_or_127(tmp_path):
    """A missing program is exit 127 and a non-executable file 126, as a shell says."""
    b = ProcessBackend(tmp_path)
    env = new_env(b)
    script = b.env_dir(env) / "script"
    script.write_text("echo hi\n")
    try:
        missing = asyncio.run(b.exec(req(env, ["no-such-program-xyz"])))
        assert (missing.outcome, missing.exit_code) == ("failed", 127)
        assert "no-such-program-xyz" in missing.stderr
        denied = asyncio.run(b.exec(req(env, [str(script)])))
        assert (denied.outcome, denied.exit_code) == ("failed", 126)
    finally:
        asyncio.run(b.shutdown())


def test_a_command_gets_only_its_three_descriptors(tmp_path):
    """Nothing of the daemon or the helper (sockets, pidfds, other execs' pipes) leaks into
    a command: it starts with stdin, stdout and stderr only."""
    b = ProcessBackend(tmp_path)
    env = new_env(b)
    probe = "import os; print(' '.join(sorted(os.listdir('/proc/self/fd'), key=int)))"
    try:
        result = asyncio.run(b.exec(req(env, ["python3", "-c", probe])))
        assert result.outcome == "ok", result
        assert set(result.stdout.split()) <= {"0", "1", "2", "3"}  # 3: listdir's own
    finally:
        asyncio.run(b.shutdown())


# --- lodgers: pre-joined copies of the fork server, one per exec cgroup (cgroup v1)


def test_a_lodger_spawns_later_execs_in_place(tmp_path):
    """After the first exec on a core set, a lodger lives in that cgroup (pinned, at the
    exec OOM score, a child of the fork server) and is the parent of the next command,
    which runs in the cgroup with only its cores; the cgroup keeps nothing else; the fork
    server itself stays home."""
    b = ProcessBackend(tmp_path)
    assert b.cgroups is not None and b.cgroups.lodgers, "CI runs as root with cgroup v1"
    env = new_env(b)

    async def scenario() -> tuple[int, str, str, set[int]]:
        first = await b.exec(req(env, ["true"], (1,)))
        assert first.outcome == "ok", first
        lodger = await lodger_of(b, (1,))
        probe = "echo $PPID; grep Cpus_allowed_list /proc/self/status; cat /proc/self/cgroup"
        second = await b.exec(req(env, ["sh", "-c", probe], (1,)))
        assert second.outcome == "ok", second
        assert b.cgroups is not None
        left = set(b.cgroups.pids(b.cgroups.for_cores((1,))))
        return lodger, second.stdout, _cgroup_of(lodger), left

    try:
        lodger, out, lodger_cgroup, left = asyncio.run(scenario())
        ppid, allowed, *cgroup_lines = out.splitlines()
        assert int(ppid) == lodger
        assert allowed.split()[-1] == "1"
        assert any(ln.endswith("/c1") and ":cpuset:" in ln for ln in cgroup_lines)
        assert any(ln.endswith("/c1") and ":cpuset:" in ln for ln in lodger_cgroup.splitlines())
        assert os.sched_getaffinity(lodger) == {1}
        assert Path(f"/proc/{lodger}/oom_score_adj").read_text().strip() == str(EXEC_OOM_SCORE_ADJ)
        status = Path(f"/proc/{lodger}/status").read_text()
        assert f"PPid:\t{b._spawner.pid}" in status
        assert left == {lodger}
        helper = b._spawner.pid
        assert helper is not None and _cgroup_of(helper) == _cgroup_of(os.getpid())
    finally:
        asyncio.run(b.shutdown())
    assert (
        not Path(f"/proc/{lodger}").exists()
        or "zombie" in Path(f"/proc/{lodger}/status").read_text()
    )


def test_a_dead_lodger_fails_its_exec_and_is_replaced(tmp_path):
    """Killing a lodger mid-exec ends that exec with infra_error (its command killed by
    cgroup); the next exec on those cores succeeds and a new lodger takes the cgroup."""
    b = ProcessBackend(tmp_path)
    env = new_env(b)

    async def scenario() -> tuple[str, str, str, int, int]:
        await b.exec(req(env, ["true"], BOTH_CORES))
        lodger = await lodger_of(b, BOTH_CORES)
        cmd = ["sh", "-c", "touch started; exec sleep 30"]
        running = asyncio.ensure_future(b.exec(req(env, cmd, BOTH_CORES)))
        await until_started(b, env)
        os.kill(lodger, signal.SIGKILL)
        first = await asyncio.wait_for(running, 10)
        again = await b.exec(req(env, ["echo", "again"], BOTH_CORES))
        return first.outcome, first.detail, again.stdout, lodger, await lodger_of(b, BOTH_CORES)

    try:
        outcome, detail, again, old, new = asyncio.run(scenario())
        assert outcome == "infra_error" and "spawner" in detail
        assert again == "again\n"
        assert new != old
        assert b.cgroups is not None
        assert set(b.cgroups.pids(b.cgroups.for_cores(BOTH_CORES))) <= {new}
    finally:
        asyncio.run(b.shutdown())


def test_lodgers_are_capped_and_can_be_turned_off(tmp_path):
    """``lodgers=1``: execs on two core sets leave one lodger; ``lodgers=0``: none, and every
    exec cgroup is empty between execs."""
    capped = ProcessBackend(tmp_path / "capped", lodgers=1)
    off = ProcessBackend(tmp_path / "off", lodgers=0)

    async def scenario(b: ProcessBackend) -> list[int]:
        env = "e1"
        await b.create_env(env, None, None)
        for cores in ((0,), (1,), (0,), (1,)):
            assert (await b.exec(req(env, ["true"], cores))).outcome == "ok"
        spawner = b._spawner
        await wait_for_async(
            lambda: not spawner._asked and all(c.ready for c in spawner._lodgers.values()),
            5,
            "every lodger asked for has joined its cgroup",
        )
        assert b.cgroups is not None
        return [len(b.cgroups.pids(b.cgroups.for_cores(c))) for c in ((0,), (1,))]

    try:
        assert sorted(asyncio.run(scenario(capped))) == [0, 1]
        assert len(capped.lodger_pids) == 1
        assert asyncio.run(scenario(off)) == [0, 0]
        assert not off.lodger_pids
    finally:
        asyncio.run(capped.shutdown())
        asyncio.run(off.shutdown())


def test_a_lodger_that_cannot_join_is_not_asked_for_again(tmp_path):
    """A lodger whose join fails (here: the cgroup does not exist) exits; the spawner
    remembers the cgroup and forks no second lodger for it on the next spawn."""
    bogus = str(tmp_path / "no-such-cgroup")
    request = {
        "argv": ["true"],
        "cwd": "/",
        "env": {},
        "umask": 0o077,
        "user": None,
        "cores": [0],
        "cgroup": bogus,
        "home": None,
        "oom_score_adj": EXEC_OOM_SCORE_ADJ,
    }

    async def scenario() -> tuple[str, str, set[str], int, set[int]]:
        spawner = Spawner(lodgers=4)
        try:
            errors = []
            for attempt in range(2):
                with open(os.devnull, "wb") as out:
                    stdio = {"stdout": out.fileno(), "stderr": out.fileno()}
                    try:
                        await spawner.spawn(request, stdio)
                    except SpawnError as e:
                        errors.append(str(e))
                if attempt == 0:  # the lodger is forked, told to join, and refused
                    await wait_for_async(
                        lambda: bogus in spawner._refused and not spawner.lodger_pids,
                        5,
                        "the lodger refused",
                    )
            await asyncio.sleep(0.2)  # the window a second lodger would appear in: none may
            return (
                errors[0],
                errors[1],
                set(spawner._refused),
                len(spawner._asked),
                set(spawner.lodger_pids),
            )
        finally:
            spawner.close()

    first, second, refused, asked, lodgers = asyncio.run(scenario())
    assert "no-such-cgroup" in first and "no-such-cgroup" in second
    assert refused == {bogus}
    assert asked == 0 and lodgers == set()


def test_a_bare_command_name_is_looked_up_in_the_execs_own_path(tmp_path):
    """``argv[0]`` without a slash is found in the PATH of the exec's environment (not the
    helper's), on the fork server's path and on a lodger's, and one exec's PATH does not
    stay for the next."""
    b = ProcessBackend(tmp_path)
    env = new_env(b)
    bindir = b.env_dir(env) / "bin"
    bindir.mkdir()
    tool = bindir / "tangram-test-tool"
    tool.write_text("#!/bin/sh\necho found me\n")
    tool.chmod(0o755)
    path = {"PATH": f"{bindir}:/usr/bin:/bin"}

    async def scenario() -> list[tuple[str, int | None, str]]:
        got = []
        for _ in range(2):  # the first on the fork server's path, then the lodger's
            found = await b.exec(req(env, ["tangram-test-tool"], (1,), env_vars=path))
            missing = await b.exec(req(env, ["tangram-test-tool"], (1,)))
            got += [(r.outcome, r.exit_code, r.stdout) for r in (found, missing)]
            if b.cgroups is not None and b.cgroups.lodgers:
                await lodger_of(b, (1,))
        return got

    try:
        got = asyncio.run(scenario())
        assert got == [("ok", 0, "found me\n"), ("failed", 127, "")] * 2
    finally:
        asyncio.run(b.shutdown())


def test_a_lodger_is_a_subreaper_and_says_when_nothing_is_left(tmp_path, monkeypatch):
    """A lodger re-parents what its commands leave behind to itself: its exit report says
    ``alone`` when its command left nothing alive (the daemon then skips the sweep of the
    group and cgroup), not when a ``setsid`` grandchild survives (that one is swept, and the
    lodger reaps it: no zombie stays). The next clean exec is ``alone`` again."""
    b = ProcessBackend(tmp_path)
    assert b.cgroups is not None and b.cgroups.lodgers, "CI runs as root with cgroup v1"
    env = new_env(b)
    reports: list[bool] = []
    exited = ProcessBackend._exited

    def spy(self, run_, rc, *alone):  # the real method, its ``alone`` recorded
        reports.append(bool(alone and alone[0]))
        return exited(self, run_, rc, *alone)

    monkeypatch.setattr(ProcessBackend, "_exited", spy)
    escape = "setsid sleep 30 & echo started"

    async def scenario() -> tuple[int, list[str], list[int], list[str]]:
        await b.exec(req(env, ["true"], (1,)))  # the fork server's path
        lodger = await lodger_of(b, (1,))
        clean = await b.exec(req(env, ["true"], (1,)))
        left = await b.exec(req(env, ["sh", "-c", escape], (1,)))
        assert b.cgroups is not None
        members = b.cgroups.pids(b.cgroups.for_cores((1,)))
        children = Path(f"/proc/{lodger}/task/{lodger}/children")
        # the swept grandchild's zombie is the lodger's to reap
        await wait_for_async(lambda: not children.read_text().split(), 2, "the zombie reaped")
        kids = children.read_text().split()
        again = await b.exec(req(env, ["true"], (1,)))
        return lodger, [clean.outcome, left.outcome, left.stdout, again.outcome], members, kids

    try:
        lodger, outcomes, members, kids = asyncio.run(scenario())
        assert outcomes == ["ok", "ok", "started\n", "ok"]
        assert reports == [False, True, False, True]
        assert members == [lodger]  # the grandchild was swept with the cgroup
        assert kids == []
    finally:
        asyncio.run(b.shutdown())


def test_a_lodger_answers_a_quick_command_with_its_exit(tmp_path, monkeypatch):
    """Through a lodger, while other execs are in flight, a command that ends within
    ``QUICK_EXIT_S`` of its spawn has its exit status in the spawn's reply (one message,
    not two); a longer one gets the pid first and its exit later, as does a lone exec (its
    pid is handled while it runs) and everything the fork server spawns. Outcomes, output
    and exit codes are the same on every path."""
    b = ProcessBackend(tmp_path)
    assert b.cgroups is not None and b.cgroups.lodgers, "CI runs as root with cgroup v1"
    env = new_env(b)
    seen: list[tuple[str, ...]] = []
    dispatch = Spawner._dispatch

    def spy(self, chan, msg, fds):  # the real method, each spawn reply or exit recorded
        if "pid" in msg or "exit" in msg:
            seen.append(tuple(k for k in ("pid", "exit") if k in msg))
        return dispatch(self, chan, msg, fds)

    monkeypatch.setattr(Spawner, "_dispatch", spy)
    quick = ["sh", "-c", "echo out; echo err >&2; exit 3"]

    async def scenario() -> tuple[list[tuple[str, int | None, str, str]], list[Any]]:
        first = await b.exec(req(env, quick, (1,)))  # the fork server's path
        await lodger_of(b, (1,))
        seen.clear()
        lone = await b.exec(req(env, quick, (1,)))
        lone_seen = list(seen)
        other = asyncio.ensure_future(b.exec(req(env, ["sleep", "5"], (0,), action_id="other")))
        await wait_for_async(  # in flight, its pid back
            lambda: b._running and next(iter(b._running)).child is not None, 10, "other's pid"
        )
        for _ in range(20):  # a loaded host may take longer than QUICK_EXIT_S to run it
            seen.clear()
            lodged = await b.exec(req(env, quick, (1,)))
            if seen == [("pid", "exit")]:
                break
        quick_seen = list(seen)
        seen.clear()
        slow = await b.exec(req(env, ["sh", "-c", "sleep 0.1; echo late"], (1,)))
        busy_seen = quick_seen + seen
        await b.cancel("other")
        await other
        ends = (first, lone, lodged, slow)
        return [(r.outcome, r.exit_code, r.stdout, r.stderr) for r in ends], [lone_seen, busy_seen]

    try:
        results, (lone_seen, busy_seen) = asyncio.run(scenario())
        assert results[0] == results[1] == results[2] == ("failed", 3, "out\n", "err\n")
        assert results[3] == ("ok", 0, "late\n", "")
        assert lone_seen == [("pid",), ("exit",)]
        assert busy_seen == [("pid", "exit"), ("pid",), ("exit",)]
    finally:
        asyncio.run(b.shutdown())


# --- the lodger loop in C (_lodger.c) and in Python: the same behaviour


def test_lodgers_run_their_loop_in_c_unless_told_not_to(tmp_path, lodger_loop):
    """``pip install -e .`` builds ``_lodger.c`` (CI has a C compiler): a lodger switches to
    the C loop once it has joined; ``TANGRAM_NATIVE_LODGER=0`` keeps the Python loop."""
    assert _load_native() is not None, "the C lodger loop is built by pip install -e ."
    b = ProcessBackend(tmp_path)
    assert b.cgroups is not None and b.cgroups.lodgers, "CI runs as root with cgroup v1"
    env = new_env(b)

    async def scenario() -> tuple[list[str], int]:
        outs = [(await b.exec(req(env, ["echo", "one"], (1,)))).stdout]
        await lodger_of(b, (1,))
        outs.append((await b.exec(req(env, ["echo", "two"], (1,)))).stdout)
        return outs, b._spawner.native_lodgers()

    try:
        outs, native = asyncio.run(scenario())
        assert outs == ["one\n", "two\n"]
        assert native == (1 if lodger_loop == "c" else 0)
    finally:
        asyncio.run(b.shutdown())


def test_a_lodger_spawns_as_the_fork_server_does(tmp_path):
    """Through a lodger (either loop): the command's environment (the base one with the
    exec's own over it), umask, working directory, stdin, signals (none blocked, SIGPIPE
    not ignored), session, exit codes for a signal, a missing command (127), a file that is
    not executable (126), and a switch to another user with root's groups dropped."""
    b = ProcessBackend(tmp_path)
    assert b.cgroups is not None and b.cgroups.lodgers, "CI runs as root with cgroup v1"
    env = new_env(b)
    home = b.env_dir(env)
    (home / "sub").mkdir()
    (home / "noexec").write_text("#!/bin/sh\necho never\n")
    (home / "noexec").chmod(0o644)
    show = (
        'echo "$TANGRAM_CPUS $FOO $(pwd) $(umask)"; '
        "grep -E '^(SigBlk|SigIgn)' /proc/self/status; "
        'ps -o sid= -p $$ | tr -d " "; echo $$'
    )

    path = {"PATH": "/usr/bin:/bin"}  # the base PATH starts in root's pyenv: EACCES for user
    with local_user() as user:
        asyncio.run(b.create_env("owned", None, None, owner=user.ids))

        async def scenario() -> list[tuple[Any, ...]]:
            await b.exec(req(env, ["true"], (1,)))  # the fork server's path
            await lodger_of(b, (1,))
            await b.exec(req("owned", ["true"], (1,), run_as=user.ids))
            got = []
            r = await b.exec(req(env, ["sh", "-c", show], (1,), env_vars={"FOO": "bar"}, cwd="sub"))
            got.append((r.outcome, r.exit_code, r.stdout))
            r = await b.exec(req(env, ["cat"], (1,), stdin=b"from stdin"))
            got.append((r.outcome, r.stdout))
            r = await b.exec(req(env, ["sh", "-c", "kill -TERM $$"], (1,)))
            got.append((r.outcome, r.exit_code))
            for argv in (["no-such-command-here"], [str(home / "noexec")]):
                r = await b.exec(req(env, argv, (1,)))
                got.append((r.outcome, r.exit_code, r.stderr))
            r = await b.exec(
                req("owned", ["sh", "-c", "id -u; id -G; umask"], (1,), run_as=user.ids)
            )
            got.append((r.outcome, r.stdout))
            r = await b.exec(
                req("owned", ["no-such-command-here"], (1,), run_as=user.ids, env_vars=path)
            )
            got.append((r.outcome, r.exit_code))
            return got

        try:
            got = asyncio.run(scenario())
        finally:
            asyncio.run(b.shutdown())
    shown, stdin, killed, missing, noexec, as_user, user_missing = got
    assert shown[:2] == ("ok", 0), shown
    cpus_foo_cwd_umask, blocked, ignored, sid, pid = shown[2].split("\n")[:5]
    assert cpus_foo_cwd_umask == f"1 bar {home / 'sub'} 0077"
    assert blocked.split() == ["SigBlk:", "0000000000000000"]
    assert int(ignored.split()[1], 16) & (1 << (signal.SIGPIPE - 1)) == 0
    assert sid == pid  # its own session
    assert stdin == ("ok", "from stdin")
    assert killed == ("failed", 128 + signal.SIGTERM)
    assert missing == ("failed", 127, "tangram: no-such-command-here: not found\n")
    assert noexec[:2] == ("failed", 126) and "Permission denied" in noexec[2]
    assert as_user == ("ok", f"{user.uid}\n{user.gid}\n0077\n")
    assert user_missing == ("failed", 127)

"""The default backend as a sandbox, attacked from inside (issue 30): root inside an
environment of the process backend, built from the daemon's default config, tries to get
out and must fail; the limits hold. Runs as root on a kernel with namespaces (CI's).

Every test drives real processes in real namespaces; nothing here is faked."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from pathlib import Path

import psutil
import pytest

pytest.register_assert_rewrite("backend_conformance")
from backend_conformance import BOTH_CORES, BackendConformance, cpulist, ex, new_env  # noqa: E402

from tangram.testing import wait_for  # noqa: E402
from tangramd.backends.base import ExecRequest  # noqa: E402
from tangramd.backends.process import SANDBOX_ID_BASE, ProcessBackend  # noqa: E402
from tangramd.config import load_config  # noqa: E402
from tangramd.runtime import make_backend  # noqa: E402

ONE_CORE = (min(os.sched_getaffinity(0)),)
BOTH = BOTH_CORES


def default_backend(state: Path, **cpu: object) -> ProcessBackend:
    """The backend ``tangramd up`` builds from the default config (with ``cpu`` keys)."""
    overrides = {"daemon.state_dir": str(state), **{f"cpu.{k}": v for k, v in cpu.items()}}
    backend = make_backend(load_config(None, overrides))
    assert isinstance(backend, ProcessBackend)
    # auto must not have fallen back here: this host (and CI) allows namespaces
    assert backend.isolated, "cpu.isolation = 'auto' fell back to plain directories"
    return backend


@pytest.fixture
def backend(tmp_path):
    b = default_backend(tmp_path / "state")
    yield b
    asyncio.run(b.shutdown())


def alive_with(token: str) -> list[int]:
    """Host pids whose command line carries ``token``."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if any(token in part for part in cmdline):
            found.append(proc.pid)
    return found


def wait_gone(token: str, timeout: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := alive_with(token)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


class TestIsolatedConformance(BackendConformance):
    """The shared backend contract holds inside isolated environments too."""


def test_root_inside_is_an_unprivileged_uid_outside(backend):
    """Commands run as root inside; what they create belongs to an unprivileged host uid."""
    env = new_env(backend)
    r = ex(backend, env, "id -u; touch ~/mine")
    assert (r.outcome, r.stdout) == ("ok", "0\n"), r
    owner = (backend.env_dir(env) / "mine").stat().st_uid
    assert owner >= SANDBOX_ID_BASE


def test_cannot_leave_the_cpuset(backend):
    """Root inside cannot widen its cores, nor move itself to another cpuset cgroup."""
    env = new_env(backend)
    every = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    r = ex(
        backend, env,
        f"taskset -pc {every} $$ >/dev/null 2>&1; echo $$ > /sys/fs/cgroup/cpuset/tasks "
        "2>/dev/null && echo MOVED; grep Cpus_allowed_list /proc/self/status",
        ONE_CORE,
    )  # fmt: skip
    assert "MOVED" not in r.stdout, r
    assert r.stdout.split()[-1] == str(ONE_CORE[0]), r


def test_cannot_write_cgroup_files(backend):
    """Every cgroup file is read-only inside, its own environment's limits included; those
    it reads by the path /proc/self/cgroup gives (as a JVM sizes its heap), but it cannot
    list the directories on the way, so it sees no other environment's cgroups."""
    env = new_env(backend)
    own_mem = '"/sys/fs/cgroup/memory$(grep :memory: /proc/self/cgroup | cut -d: -f3)'
    script = (
        "for f in /sys/fs/cgroup/cpuset/tasks /sys/fs/cgroup/pids/pids.max "
        "/sys/fs/cgroup/memory/memory.limit_in_bytes "
        f'{own_mem}/memory.limit_in_bytes" '
        '"/sys/fs/cgroup/pids$(grep :pids: /proc/self/cgroup | cut -d: -f3)/pids.max"; do '
        '[ -r "$f" ] && echo "FOUND $f"; echo 1 2>/dev/null > "$f" && echo "WROTE $f"; done; '
        f'ls {own_mem}/.." >/dev/null 2>&1 && echo LISTED; true'
    )
    r = ex(backend, env, script)
    assert r.outcome == "ok", r
    assert "WROTE" not in r.stdout and "LISTED" not in r.stdout, r
    # (its own two, where the host mounts its hierarchy, whatever the daemon's umask)
    found = r.stdout.split()
    assert "/memory.limit_in_bytes" in " ".join(f for f in found if "/e-env-" in f), r
    assert any(f.endswith("/pids.max") and "/e-env-" in f for f in found), r


def test_cannot_mount_or_make_namespaces(backend):
    """Root inside has no capability: mount fails, and so does a nested user namespace."""
    env = new_env(backend)
    r = ex(
        backend, env,
        "mount -t tmpfs none /mnt 2>/dev/null && echo MOUNTED; "
        "unshare -U -r true 2>/dev/null && echo USERNS; "
        "mount --bind /tmp /mnt 2>/dev/null && echo BOUND; grep CapEff /proc/self/status",
    )  # fmt: skip
    assert r.outcome == "ok", r
    assert r.stdout.strip() == "CapEff:\t0000000000000000", r


def test_cannot_see_host_processes(backend):
    """Only the environment's processes are visible: not the daemon, not its spawner."""
    env = new_env(backend)
    r = ex(backend, env, f"kill -0 {os.getpid()} 2>/dev/null && echo SEEN; ls /proc")
    assert r.outcome == "ok", r
    pids = [int(p) for p in r.stdout.split() if p.isdigit()]
    assert "SEEN" not in r.stdout and pids and max(pids) < 100, r
    assert len(psutil.pids()) > len(pids)


def test_cannot_reach_the_network(backend):
    """Loopback only: a server on the host's loopback and the outside are unreachable."""
    env = new_env(backend)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = (
            "import socket\n"
            f"for host in (('127.0.0.1', {port}), ('1.1.1.1', 53)):\n"
            "    try:\n"
            "        socket.create_connection(host, timeout=2).close(); print('REACHED', host)\n"
            "    except OSError as e:\n"
            "        print('refused', e.errno)\n"
            "print(open('/proc/net/dev').read().count(':'))\n"
        )
        r = ex(backend, env, ["python3", "-c", code])
    assert r.outcome == "ok", r
    assert "REACHED" not in r.stdout, r
    assert r.stdout.split()[-1] == "1", r  # one interface: lo


def test_network_host_is_the_hosts(tmp_path):
    """``env_network = "host"`` keeps the host's network (a server on its loopback answers)."""
    b = default_backend(tmp_path / "state", env_network="host")
    try:
        env = new_env(b)
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen()
            port = server.getsockname()[1]
            code = f"import socket; socket.create_connection(('127.0.0.1', {port})); print('ok')"
            r = ex(b, env, ["python3", "-c", code])
        assert r.stdout == "ok\n", r
    finally:
        asyncio.run(b.shutdown())


def test_nothing_outlives_the_action(backend):
    """A setsid'd, double-forked child of an exec dies when the exec ends."""
    env = new_env(backend)
    token = f"30{uuid.uuid4().int % 10**6}.5"
    r = ex(backend, env, f"setsid sh -c 'sleep {token} & exit' ; echo started")
    assert r.stdout == "started\n", r
    assert wait_gone(token) == []


def test_nothing_outlives_the_session_or_the_env(backend):
    """What a session's command starts (setsid, in the background) dies with the session;
    and whatever an environment still runs dies with the environment."""
    env = new_env(backend)
    first, second = (f"31{uuid.uuid4().int % 10**6}.{i}" for i in (1, 2))

    async def scenario() -> None:
        await backend.open_session(env, "s1")
        run = ExecRequest(env, f"setsid sleep {first} & echo ok", ONE_CORE, session="s1")
        r = await backend.exec(run)
        assert r.outcome == "ok", r
        await asyncio.to_thread(wait_for, lambda: alive_with(first), 10, "the setsid sleep")
        await backend.close_session("s1")
        await backend.open_session(env, "s2")
        run = ExecRequest(env, f"setsid sleep {second} & echo ok", ONE_CORE, session="s2")
        assert (await backend.exec(run)).outcome == "ok"
        await asyncio.to_thread(wait_for, lambda: alive_with(second), 10, "the setsid sleep")
        await backend.close_env(env)

    asyncio.run(scenario())
    assert wait_gone(first) == [] and wait_gone(second) == []


def test_session_is_pinned_inside(backend):
    """A session's shell runs root inside, on exactly its run's cores, unable to widen them."""
    env = new_env(backend)
    every = ",".join(map(str, sorted(os.sched_getaffinity(0))))

    async def scenario() -> list[str]:
        await backend.open_session(env, "s")
        cmd = (
            f"taskset -pc {every} $$ >/dev/null 2>&1; id -u; grep Cpus_allowed_list /proc/$$/status"
        )
        r = await backend.exec(ExecRequest(env, cmd, ONE_CORE, session="s"))
        await backend.close_session("s")
        return r.stdout.split()

    out = asyncio.run(scenario())
    assert out[0] == "0" and out[-1] == str(ONE_CORE[0]), out


def test_cannot_read_another_environment_or_the_daemon(backend, tmp_path):
    """Another environment's /tmp and home, and the daemon's state dir, are not visible."""
    (tmp_path / "state" / "daemon.key").write_text("secret")
    a, b = new_env(backend), new_env(backend)
    assert ex(backend, a, "echo a-secret > /tmp/s; echo a-secret > ~/s").outcome == "ok"
    home_a = backend.env_dir(a)
    r = ex(
        backend, b,
        f"cat /tmp/s {home_a}/s {tmp_path}/state/daemon.key 2>/dev/null; "
        f"ls {tmp_path}/state {backend.envs_dir}; cat /etc/shadow >/dev/null 2>&1 && echo SHADOW",
    )  # fmt: skip
    assert "secret" not in r.stdout and "SHADOW" not in r.stdout, r
    assert a not in r.stdout and "daemon.key" not in r.stdout, r


def test_fork_bomb_stops_at_the_pids_limit(tmp_path):
    """A fork bomb gets EAGAIN at ``env_pids_max``; the exec's end kills what it made."""
    b = default_backend(tmp_path / "state", env_pids_max=48)
    try:
        env = new_env(b)
        code = (
            "import os, time\nn = 0\n"
            "try:\n"
            "    while n < 5000:\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(60); os._exit(0)\n"
            "        n += 1\n"
            "except OSError as e:\n"
            "    print('stopped', n, e.errno)\n"
        )
        r = ex(b, env, ["python3", "-c", code], timeout_s=60)
        words = r.stdout.split()
        assert words[0] == "stopped" and 0 < int(words[1]) < 48, r
        left = ex(b, env, "ls /proc | grep -c '^[0-9]'")
        assert int(left.stdout) <= 4, left  # its keeper, the shell, grep, ls
    finally:
        asyncio.run(b.shutdown())


def test_memory_hog_is_killed_at_its_limit(backend):
    """An environment opened with 128 MiB: 32 MiB fit, 512 MiB gets the command killed."""
    env = new_env(backend, mem_bytes=128 << 20)
    fits = ex(backend, env, ["python3", "-c", "b = bytearray(32 << 20); print(len(b))"])
    assert fits.stdout == f"{32 << 20}\n", fits
    hog = ex(backend, env, ["python3", "-c", "b = bytearray(512 << 20); print('ALLOCATED')"])
    assert "ALLOCATED" not in hog.stdout and hog.exit_code == 137, hog


def test_tmp_and_testbed_are_the_environments_own(backend):
    """cwd=/tmp works and is private; /testbed can be made and used as a working directory,
    and it is the environment's, not the host's."""
    env, other = new_env(backend), new_env(backend)
    marker = f"tb-{uuid.uuid4().hex[:8]}"
    r = ex(backend, env, f"pwd; mkdir -p /testbed && echo x > /testbed/{marker}", cwd="/tmp")
    assert r.outcome == "ok" and r.stdout == "/tmp\n", r
    r = ex(backend, env, "pwd; ls", cwd="/testbed")
    assert r.stdout.split() == ["/testbed", marker], r
    assert not os.path.exists(f"/testbed/{marker}")
    assert ex(backend, other, "ls /testbed").exit_code != 0
    r = ex(backend, env, "pwd", cwd="/nowhere")
    assert r.outcome == "failed" and "no such directory" in r.stderr, r


def test_files_survive_a_lost_keeper(backend):
    """If an environment's keeper dies, the next exec builds its namespaces again over the
    same layers: files in /testbed and home stay."""
    env = new_env(backend)
    assert (
        ex(backend, env, "mkdir /testbed && echo kept > /testbed/f && echo h > ~/h").outcome == "ok"
    )
    keeper = backend.boxes.keepers[env]
    os.kill(keeper, 9)
    assert wait_gone_pid(keeper)
    time.sleep(0.1)
    r = ex(backend, env, "cat /testbed/f ~/h")
    assert r.stdout == "kept\nh\n", r


def wait_gone_pid(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                time.sleep(0.02)
                continue
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def test_auto_falls_back_with_one_line(tmp_path, monkeypatch):
    """Where the kernel refuses, "auto" runs plain directories and says why in one log
    line; "namespaces" refuses to start."""
    from structlog.testing import capture_logs

    from tangramd.backends import process
    from tangramd.backends.base import EnvError

    monkeypatch.setattr(process, "probe_isolation", lambda _root: "refused for the test")
    with capture_logs() as logs:
        b = ProcessBackend(tmp_path / "a", isolation="auto")
    assert not b.isolated
    off = [e for e in logs if e["event"] == "env_isolation_off"]
    assert len(off) == 1 and off[0]["reason"] == "refused for the test"
    env = new_env(b)
    assert ex(b, env, "pwd").stdout == f"{b.env_dir(env)}\n"
    asyncio.run(b.shutdown())
    with pytest.raises(EnvError, match="refused for the test"):
        ProcessBackend(tmp_path / "n", isolation="namespaces")


def test_lodger_spawns_are_as_closed(backend):
    """Later execs on the same cores come from a lodger living inside the environment (its
    loop in C, ``_lodger.c``, as on the host): they are as confined as the first (root
    inside, no capability, the env's cgroups, its pid namespace), still nothing they leave
    outlives them, and a working directory missing inside fails the exec, not the lodger."""
    env = new_env(backend)
    token = f"32{uuid.uuid4().int % 10**6}.5"
    check = (
        "id -u; grep CapEff /proc/self/status; grep -c 'e-' /proc/self/cgroup; "
        f"setsid sleep {token} & ls /proc | grep -c '^[0-9]'"
    )

    async def scenario() -> list[str]:
        seen = []
        for _ in range(4):
            r = await backend.exec(ExecRequest(env, check, ONE_CORE, timeout_s=30))
            assert r.outcome == "ok", r
            seen.append(r.stdout)
        assert backend.lodger_pids, "no lodger served the later execs"
        assert backend._spawner.native_lodgers() == 1
        r = await backend.exec(ExecRequest(env, "pwd", ONE_CORE, cwd="/nowhere"))
        assert r.outcome == "failed" and "cwd /nowhere: no such directory" in r.stderr, r
        r = await backend.exec(ExecRequest(env, "pwd", ONE_CORE, cwd="/tmp"))
        assert r.stdout == "/tmp\n", r
        return seen

    seen = asyncio.run(scenario())
    first = seen[0].split()
    assert first[:3] == ["0", "CapEff:", "0000000000000000"] and first[3] == "2", seen
    assert all(s.split()[:4] == first[:4] for s in seen), seen
    assert all(int(s.split()[-1]) < 10 for s in seen), seen
    assert wait_gone(token) == []


def test_exec_memory_limit_is_its_own(backend):
    """An exec's ``mem_limit`` holds below its environment's: 256 MiB is killed under a
    64 MiB exec limit and fits the next exec, which has none, in a 512 MiB environment."""
    env = new_env(backend, mem_bytes=512 << 20)
    grab = ["python3", "-c", "b = bytearray(256 << 20); print('ALLOCATED')"]
    limited = ex(backend, env, grab, mem_limit=64 << 20)
    assert limited.exit_code == 137 and "ALLOCATED" not in limited.stdout, limited
    free = ex(backend, env, grab)
    assert free.stdout == "ALLOCATED\n", free
    left = [p.name for p in backend.boxes.limits.paths(env)[0].iterdir() if p.name.startswith("x-")]
    assert left == []


def test_spawns_never_cross_environments(backend):
    """On one core, execs of two environments, with and without their own memory limit,
    each run in their own environment (its hostname is its id), lodgers or not."""
    a, b = new_env(backend), new_env(backend)

    async def scenario() -> list[tuple[str, str]]:
        seen = []
        for env, limit in [(a, 64 << 20), (a, None), (a, None), (b, 64 << 20), (b, None),
                           (b, None), (a, 64 << 20), (a, None)]:  # fmt: skip
            r = await backend.exec(ExecRequest(env, "hostname", ONE_CORE, mem_limit=limit))
            seen.append((env, r.stdout.strip()))
        return seen

    assert all(env == name for env, name in asyncio.run(scenario()))


def test_cannot_reach_host_unix_sockets(backend, tmp_path):
    """A Unix socket anyone may connect to on the host (in /run) is not reachable from
    inside: /run is the environment's own (a path socket ignores network namespaces)."""
    path = f"/run/tangram-test-{uuid.uuid4().hex[:8]}.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
        os.chmod(path, 0o777)
        server.listen()
        try:
            env = new_env(backend)
            code = (
                "import socket\ns = socket.socket(socket.AF_UNIX)\n"
                f"try:\n    s.connect({path!r}); print('REACHED')\n"
                "except OSError as e:\n    print('refused', e.errno)\n"
            )
            r = ex(backend, env, ["python3", "-c", code])
        finally:
            os.unlink(path)
    assert r.outcome == "ok" and r.stdout.startswith("refused"), r


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("isolation", "docker", "'auto', 'namespaces', 'none'"),
        ("env_network", "bridge", "'none', 'host'"),
        ("env_pids_max", 0, "integers >= 1"),
    ],
)
def test_isolation_keys_are_validated(key, value, allowed):
    """A bad isolation key is refused naming the key and what it allows."""
    from tangramd.config import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config(None, {f"cpu.{key}": value})
    assert f"cpu.{key}" in str(info.value) and allowed in str(info.value)


def test_lodger_follows_each_execs_cores(backend):
    """One environment's execs on changing core sets, in one event loop (so its lodger,
    which moves itself between cpuset cgroups, serves them): each sees exactly its cores
    and sits in the cpuset cgroup of those cores."""
    env = new_env(backend)
    sets = [ONE_CORE, BOTH, (max(BOTH),), BOTH, ONE_CORE] if len(BOTH) > 1 else [ONE_CORE] * 3
    cmd = "grep Cpus_allowed_list /proc/self/status; grep cpuset: /proc/self/cgroup"

    async def scenario() -> list[tuple[tuple[int, ...], str]]:
        seen = []
        for cores in sets:
            r = await backend.exec(ExecRequest(env, cmd, cores))
            assert r.outcome == "ok", r
            seen.append((cores, r.stdout))
        assert backend.lodger_pids
        return seen

    for cores, out in asyncio.run(scenario()):
        allowed, group = out.split()[1], out.split()[2]
        assert allowed == cpulist(cores), (cores, out)
        assert group.endswith("/c" + "_".join(map(str, cores))), (cores, out)


def test_closing_an_environment_ends_its_lodger(backend):
    """An environment's lodger, which lives inside it, ends when the environment closes."""
    env = new_env(backend)

    async def scenario() -> set[int]:
        for _ in range(3):
            assert (await backend.exec(ExecRequest(env, "true", ONE_CORE))).outcome == "ok"
        lodgers = set(backend.lodger_pids)
        assert lodgers
        await backend.close_env(env)
        return lodgers

    assert all(wait_gone_pid(pid) for pid in asyncio.run(scenario()))


def test_the_daemons_own_interpreter_and_code_under_tmp_stay_visible(tmp_path, monkeypatch):
    """A venv or checkout under /tmp (CI clones there) is bound back read-only at its path:
    its files read inside, nothing can be written there, and the rest of the host's /tmp
    stays out of sight."""
    venv = tmp_path / "venv"  # (pytest's tmp_path lies under /tmp)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "marker").write_text("from-the-venv\n")
    (tmp_path / "beside").write_text("not-for-you\n")
    monkeypatch.setattr("sys.prefix", str(venv))
    b = default_backend(tmp_path / "state")
    try:
        assert str(venv.resolve()) in b.boxes.binds  # type: ignore[union-attr]
        env = new_env(b)
        r = ex(
            b, env, f"cat {venv}/bin/marker; cat {tmp_path}/beside 2>/dev/null; echo x > {venv}/w"
        )
        assert r.stdout == "from-the-venv\n", r
        assert r.outcome == "failed" and not (venv / "w").exists(), r
    finally:
        asyncio.run(b.shutdown())

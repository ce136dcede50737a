"""Load on a real `tangramd up`: many short execs from many clients, and nothing left over.

    python bench/load.py [--n 10000] [--clients 256] [--env-cycles 200] [--rounds 4]
                         [--config FILE] [--json]

- ``--n`` execs of ``true`` (1 core) from ``--clients`` concurrent clients, one connection
  each (asyncio), each client in an environment of its own (``--throwaway``: a fresh
  environment per exec);
- meanwhile ``--env-cycles`` environment cycles (open, exec, close) spread over the clients;
- and the same count of bare ``subprocess.run(["true"])`` calls at the same concurrency
  (a thread pool of ``--clients`` workers), in the same run, for the throughput ratio: the
  two alternate in ``--rounds`` parts (default 4; the daemon idles during the bare parts),
  so a host whose speed drifts during the run moves both sides alike (the per-exec CPU of
  one command varied by 30% between runs on the shared VM this was built on);
- reports: answers (each request must get exactly one), outcomes, throughput, p50/p99 of
  the client-observed ACT and of the daemon's ``act_s``, the daemon's RSS and open fds
  before and after, and leftovers (live processes under the daemon, non-empty exec
  cgroups, environment directories);
- and where the CPU went, in ms per exec (``cpu_ms_per_exec``): the daemon, its fork
  server and its lodgers, the commands (``true``, reaped by them), the clients (this process's
  event loop); for the bare run this process (its threads) and the commands. On a shared
  machine the throughputs move with the neighbours' load; these stay comparable.

Goal (issue 9): every request answered once, nothing left over, throughput >= 0.5x bare.
A benchmark, not a test: tests/test_bench_load.py runs a small instance under ``slow``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil

from tangram.client import AsyncClient
from tangram.testing import SpawnedDaemon, spawn_daemon
from tangramd.backends.process import SPARE, TOMB

ENV_MEM = "16MiB"  # per environment: 256 clients' environments fit any host
CGROUP_ROOTS = (Path("/sys/fs/cgroup/cpuset/tangram"), Path("/sys/fs/cgroup/unified/tangram"))


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50_ms": 0.0, "p99_ms": 0.0}
    s = sorted(values)
    return {
        "p50_ms": round(statistics.median(s) * 1000, 3),
        "p99_ms": round(s[min(len(s) - 1, int(0.99 * len(s)))] * 1000, 3),
    }


def daemon_usage(daemon: SpawnedDaemon) -> dict[str, int]:
    """The daemon's RSS and fds, its fork server's lodgers (the daemon holds one socket
    to each), and ``kept_fds``: the descriptors it keeps open on purpose once opened, the
    environments' journal and one cgroup ``tasks`` file per core set it has run on (passed
    to the spawner with each exec), which a leak check leaves out."""
    proc = psutil.Process(daemon.proc.pid)
    helper = spawner_of(daemon)
    lodgers = 0
    with contextlib.suppress(psutil.Error):
        lodgers = sum(_is_spawner(c) for c in helper.children()) if helper else 0
    kept = 0
    with contextlib.suppress(psutil.Error):
        for f in proc.open_files():
            kept += f.path.endswith("/tasks") or f.path.endswith("/envs.journal")
    return {
        "rss_mib": proc.memory_info().rss >> 20,
        "fds": proc.num_fds(),
        "kept_fds": kept,
        "lodgers": lodgers,
    }


def _is_spawner(proc: psutil.Process) -> bool:
    """The process backend's fork server: part of the daemon, not a leftover."""
    with contextlib.suppress(psutil.Error):
        return any(arg.endswith("tangramd/backends/forkserver.py") for arg in proc.cmdline())
    return False


def _cpu_s(times: Any, children: bool = False) -> float:
    own = times.user + times.system
    return own + (times.children_user + times.children_system if children else 0.0)


def spawner_of(daemon: SpawnedDaemon) -> psutil.Process | None:
    with contextlib.suppress(psutil.Error):
        for p in psutil.Process(daemon.proc.pid).children():
            if _is_spawner(p):
                return p
    return None


def fork_server_cpu(daemon: SpawnedDaemon) -> tuple[float, float] | None:
    """CPU seconds of the fork server and its lodgers, and of the commands they reaped."""
    helper = spawner_of(daemon)  # started by the first exec: all its time is the run's
    if helper is None:
        return None
    own = commands = 0.0
    with contextlib.suppress(psutil.Error):
        for p in [helper, *(c for c in helper.children() if _is_spawner(c))]:
            t = p.cpu_times()
            own += _cpu_s(t)
            commands += t.children_user + t.children_system
    return own, commands


def _members(procs: Path) -> list[int]:
    """The pids in a cgroup.procs file that are not the fork server's lodgers."""
    pids = [int(p) for p in procs.read_text().split()]
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if _is_spawner(psutil.Process(pid)):
                continue
        out.append(pid)
    return out


def leftovers(daemon: SpawnedDaemon) -> dict[str, int]:
    """Processes still under the daemon (its fork server and lodgers aside), this daemon's
    exec cgroups with members (lodgers aside), env directories."""
    proc = psutil.Process(daemon.proc.pid)
    alive = [
        p
        for p in proc.children(recursive=True)
        if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and not _is_spawner(p)
    ]
    root_dir = Path(daemon.state_dir, "process").resolve()
    scope = "p-" + hashlib.sha1(str(root_dir).encode()).hexdigest()[:12]  # as ProcessBackend
    busy = 0
    for root in CGROUP_ROOTS:
        if (root / scope).is_dir():
            for procs in (root / scope).glob("*/cgroup.procs"):
                if _members(procs):
                    busy += 1
    envs = Path(daemon.state_dir) / "process" / "envs"
    tomb = envs / TOMB  # the backend's own: closed environments on their way out
    # (SPARE holds empty directories made ahead for the next environments: not leftovers)
    dirs = [p for p in envs.iterdir() if p.name not in (TOMB, SPARE)] if envs.is_dir() else []
    dirs += list(tomb.iterdir()) if tomb.is_dir() else []
    return {"processes": len(alive), "busy_cgroups": busy, "env_dirs": len(dirs)}


async def drive(
    path: str,
    n: int,
    clients: int,
    env_cycles: int,
    *,
    throwaway: bool = False,
    rounds: int = 1,
    between: Callable[[int], dict[str, Any]] | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run the load; returns counts, latencies and wall time, and what ``between`` returned.

    Each client runs its execs in one environment of its own (a trajectory's sandbox), or
    with ``throwaway`` in a fresh environment per exec. The execs go in ``rounds`` parts;
    after each part ``between(execs of that part)`` runs in a thread while the clients
    wait, connected, their environments open (the bare run's part). The wall time counts
    the parts only: the first includes connecting and opening the environments, the last
    closing them."""
    latencies: list[float] = []
    act: list[float] = []
    outcomes: dict[str, int] = {}
    errors: dict[str, int] = {}
    answered = 0
    env_done = 0
    counts, cycle_counts = _split(n, rounds), _split(env_cycles, rounds)
    todo: Iterator[int] = iter(())
    cycles: Iterator[int] = iter(())
    go = [asyncio.Event() for _ in range(rounds)]
    walls: list[float] = []
    done_round: list[int] = [0] * rounds
    round_over = [asyncio.Event() for _ in range(rounds)]
    failure: list[BaseException] = []

    async def one_client() -> None:
        try:
            await client_rounds()
        except BaseException as exc:  # ends the run: no round waits for this client
            failure.append(exc)
            for event in round_over:
                event.set()
            raise

    async def client_rounds() -> None:
        nonlocal answered, env_done
        async with AsyncClient(path) as client:
            home = None if throwaway else await client.env_open(mem=ENV_MEM)
            for r in range(rounds):
                await go[r].wait()
                for _ in todo:
                    started = time.perf_counter()
                    try:
                        result = await client.exec(["true"], cpus=1, env=home)
                    except Exception as exc:  # a typed error is an answer too: count it
                        errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                    else:
                        outcomes[result.outcome] = outcomes.get(result.outcome, 0) + 1
                        act.append(result.act_s)
                    latencies.append(time.perf_counter() - started)
                    answered += 1
                    if next(cycles, None) is not None:
                        env = await client.env_open(mem=ENV_MEM)
                        result = await client.exec("echo x > f && cat f", env=env)
                        await client.env_close(env)
                        env_done += result.stdout == "x\n"
                if r == rounds - 1 and home is not None:
                    await client.env_close(home)
                done_round[r] += 1
                if done_round[r] == clients:
                    round_over[r].set()

    extra: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(one_client()) for _ in range(clients)]
    for r in range(rounds):
        todo, cycles = iter(range(counts[r])), iter(range(cycle_counts[r]))
        started = time.perf_counter()
        go[r].set()
        await round_over[r].wait()
        if failure:
            raise failure[0]
        walls.append(time.perf_counter() - started)
        if between is not None:
            extra.append(await loop.run_in_executor(None, between, counts[r]))
    await asyncio.gather(*tasks)
    wall = sum(walls)
    return {
        "answered": answered,
        "outcomes": outcomes,
        "errors": errors,
        "env_cycles_ok": env_done,
        "wall_s": round(wall, 3),
        "throughput_per_s": round(n / wall, 1),
        "throughput_per_round": [round(c / w, 1) for c, w in zip(counts, walls, strict=True)],
        "client_act": percentiles(latencies),
        "daemon_act": percentiles(act),
    }, extra


def bare(n: int, clients: int) -> dict[str, Any]:
    """The same count of bare subprocess.run(["true"]) at the same concurrency (one round;
    :func:`_merge_bare` pools rounds)."""
    latencies: list[float] = []

    def one(_: int) -> None:
        started = time.perf_counter()
        subprocess.run(["true"], check=True)
        latencies.append(time.perf_counter() - started)

    cpu0 = os.times()
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(one, range(n)))
    wall = time.perf_counter() - started
    cpu1 = os.times()
    return {
        "wall_s": round(wall, 3),
        "throughput_per_s": round(n / wall, 1),
        "act": percentiles(latencies),
        "_latencies": latencies,
        "_n": n,
        "cpu_ms_per_exec": {
            "caller": round((_cpu_s(cpu1) - _cpu_s(cpu0)) * 1e3 / n, 3),
            "commands": round(
                (
                    cpu1.children_user
                    + cpu1.children_system
                    - cpu0.children_user
                    - cpu0.children_system
                )
                * 1e3
                / n,
                3,
            ),
        },
    }


def _merge_bare(parts: list[dict[str, Any]], n: int) -> dict[str, Any]:
    latencies = [x for p in parts for x in p.pop("_latencies")]
    wall = sum(p["wall_s"] for p in parts)

    def cpu(key: str) -> float:  # the rounds' per-exec figures, weighted by their execs
        return round(sum(p["cpu_ms_per_exec"][key] * p["_n"] for p in parts) / n, 3)

    return {
        "wall_s": round(wall, 3),
        "throughput_per_s": round(n / wall, 1),
        "throughput_per_round": [p["throughput_per_s"] for p in parts],
        "act": percentiles(latencies),
        "cpu_ms_per_exec": {"caller": cpu("caller"), "commands": cpu("commands")},
    }


def _split(total: int, rounds: int) -> list[int]:
    return [total // rounds + (i < total % rounds) for i in range(rounds)]


def run(
    n: int,
    clients: int,
    env_cycles: int,
    throwaway: bool = False,
    event_loop: str = "auto",
    rounds: int = 1,
    extra_config: str = "",
) -> dict[str, Any]:
    """The load through one daemon and the bare run, in ``rounds`` alternating parts (a
    host whose speed drifts during the run then moves both sides alike); the daemon idles
    during the bare parts."""
    rounds = max(1, min(rounds, n))
    with tempfile.TemporaryDirectory(prefix="tgload-", dir="/tmp") as work:
        config = "[daemon]\nmax_connections = 4096\n"
        if event_loop != "auto":  # (the default: no key, so an older tree's daemon runs too)
            config += f'event_loop = "{event_loop}"\n'
        config += extra_config
        daemon = spawn_daemon(work, config)
        try:
            before = daemon_usage(daemon)
            proc = psutil.Process(daemon.proc.pid)
            bare_caller_s = [0.0]

            def bare_part(count: int) -> dict[str, Any]:  # in a thread, after each round
                part = bare(count, clients)
                bare_caller_s[0] += part["cpu_ms_per_exec"]["caller"] * count / 1e3
                return part

            daemon0, client0 = _cpu_s(proc.cpu_times()), _cpu_s(os.times())
            load, bares = asyncio.run(
                drive(
                    daemon.socket, n, clients, env_cycles, throwaway=throwaway,
                    rounds=rounds, between=bare_part,
                )
            )  # fmt: skip
            # this process's CPU, less its bare parts' (the bare callers run here too)
            daemon_s = _cpu_s(proc.cpu_times()) - daemon0
            client_s = _cpu_s(os.times()) - client0 - bare_caller_s[0]
            forks = fork_server_cpu(daemon)
            load["cpu_ms_per_exec"] = {
                "daemon": round(daemon_s * 1e3 / n, 3),
                "fork_server": round(forks[0] * 1e3 / n, 3) if forks else None,
                "commands": round(forks[1] * 1e3 / n, 3) if forks else None,
                "clients": round(client_s * 1e3 / n, 3),
            }
            time.sleep(0.5)  # let the last closes settle
            after = daemon_usage(daemon)
            left = leftovers(daemon)
        finally:
            daemon.stop()
        baseline = _merge_bare(bares, n)
    ratio = load["throughput_per_s"] / baseline["throughput_per_s"]
    return {
        "n": n,
        "rounds": rounds,
        "clients": clients,
        "env_cycles": env_cycles,
        "throwaway_envs": throwaway,
        "cpus": len(os.sched_getaffinity(0)),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "tangram": load,
        "bare_subprocess_run": baseline,
        "throughput_ratio": round(ratio, 3),
        "daemon_before": before,
        "daemon_after": after,
        "leftovers": left,
        "goal_met": (
            load["answered"] == n
            and load["env_cycles_ok"] == env_cycles
            and not any(left.values())
            and ratio >= 0.5
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=10_000, help="execs (and bare runs)")
    ap.add_argument("--clients", type=int, default=256, help="concurrent clients")
    ap.add_argument("--env-cycles", type=int, default=200, help="env open/exec/close cycles")
    ap.add_argument(
        "--throwaway",
        action="store_true",
        help="a fresh environment per exec (default: one per client)",
    )
    ap.add_argument(
        "--event-loop",
        choices=["auto", "uvloop", "asyncio"],
        default="auto",
        help="the daemon's [daemon] event_loop (default: auto, uvloop where installed)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="alternate the tangram and bare runs in this many parts (default 4)",
    )
    ap.add_argument(
        "--config",
        type=Path,
        help="TOML appended to the daemon's config (after its [daemon] keys), e.g. a "
        "[sched] table to compare settings",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    extra = args.config.read_text() if args.config else ""
    report = run(
        args.n, args.clients, args.env_cycles, args.throwaway, args.event_loop, args.rounds,
        extra,
    )  # fmt: skip
    report["event_loop"] = args.event_loop
    if args.json:
        print(json.dumps(report, indent=2))
        return
    t, b = report["tangram"], report["bare_subprocess_run"]
    print(f"tangram: {t['throughput_per_s']}/s  ACT {t['client_act']}  answered {t['answered']}")
    print(f"bare:    {b['throughput_per_s']}/s  ACT {b['act']}")
    print(f"ratio {report['throughput_ratio']}  leftovers {report['leftovers']}")
    print(f"daemon before {report['daemon_before']} after {report['daemon_after']}")


if __name__ == "__main__":
    main()

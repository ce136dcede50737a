"""SandboxFusion ``/run_code`` through the gateway vs a bare ``python3 -c``, one run.

    python bench/gateway.py [--n 200] [--clients 32] [--requests 256] [--json]

Both deployments of the gateway run in front of one daemon: ``tangramd http`` as its own
process (the issue's contract and the headline, ``gateway: "separate"``) and ``tangramd up
--http``, the gateway in the daemon's own process (``in_process``: the same figures under
that key).

latency: ``/run_code`` of ``print(1)`` (python, 1 core, process backend) over one keep-alive
HTTP connection to each gateway, interleaved round-robin with a bare
``subprocess.run(["python3", "-c", "print(1)"])`` (right after the headline gateway's call)
and with the same one-shot exec sent straight to the daemon (``Client.exec`` of ``python3
main.py`` carrying ``main.py``: what ``/run_code`` asks the daemon for, without HTTP);
p50/p99 of each and of the per-round differences: ``overhead`` (gateway - bare: HTTP, JSON,
the trip to the daemon, scheduling, the throwaway environment, the file, the pinning),
``daemon_overhead`` (direct - bare) and ``http_overhead`` (gateway - direct); and split by the
run time the daemon measured (``execution_time``, spawn to exit): ``run_vs_bare`` (the pinned
command itself against the bare one; on a loaded host a command held to one core waits for
that core while a bare one runs on whichever is free) and ``around_the_run`` (gateway -
execution_time: everything the path adds); ``overhead_same_core``: gateway - a bare run held
to the core the daemon gave its last exec (the path's cost without the core question).
``cpu_ms_per_round``: CPU time the separate gateway's process and the daemon spent per round
(from /proc; the machine's load does not inflate it as it does wall-clock latency; the
daemon's share covers both gateways' calls and the direct exec). ``loadavg``: the 1-minute
load average before and after.

throughput: ``--requests`` calls from ``--clients`` concurrent clients, through each gateway
and bare (the same number of concurrent ``python3 -c``), requests per second each. All
share the machine's cores; the gateway runs each call on one core the daemon allocated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from tangram.client import Client
from tangram.testing import free_port, spawn_daemon, spawn_gateway, wait_http

BODY = {"code": "print(1)", "language": "python", "run_timeout": 30}
BARE = ["python3", "-c", "print(1)"]
DIRECT = ["python3", "main.py"]  # what /run_code runs for python, with main.py sent along


def stats(ms: list[float]) -> dict[str, float]:
    s = sorted(ms)
    return {
        "p50_ms": round(statistics.median(s), 3),
        "p99_ms": round(s[min(len(s) - 1, int(0.99 * len(s)))], 3),
    }


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def latency(
    urls: dict[str, str], socket: str, pids: dict[str, int], n: int, warmup: int
) -> dict[str, object]:
    """``urls``: the gateways, by name; the first is the headline (its figures at the top
    level), each other one's under its name. Every round trip of a round is taken in turn:
    each gateway, the bare run after the first, the direct exec, the bare run on one core."""
    names = list(urls)
    gateway: dict[str, list[float]] = {name: [] for name in names}
    ran: dict[str, list[float]] = {name: [] for name in names}  # execution_time inside each
    bare: list[float] = []
    direct: list[float] = []
    bare_pinned: list[float] = []  # bare, held to the core the daemon's last exec ran on
    everywhere = os.sched_getaffinity(0)
    core = 0
    cpu0: dict[str, float] = {}
    with httpx.Client(timeout=60) as http, Client(socket) as client:
        for i in range(warmup + n):
            if i == warmup:
                cpu0 = {name: cpu_s(pid) for name, pid in pids.items()}
            took: dict[str, float] = {}
            for j, name in enumerate(names):
                t0 = time.perf_counter()
                r = http.post(f"{urls[name]}/run_code", json=BODY)
                took[name] = (time.perf_counter() - t0) * 1e3
                assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "1\n", r.text
                if i >= warmup:
                    ran[name].append(r.json()["run_result"]["execution_time"] * 1e3)
                if j == 0:
                    t1 = time.perf_counter()
                    subprocess.run(BARE, check=True, capture_output=True)
                    took["bare"] = (time.perf_counter() - t1) * 1e3
            t2 = time.perf_counter()
            res = client.exec(DIRECT, files={"main.py": BODY["code"]}, timeout_s=30)
            t3 = time.perf_counter()
            assert res.stdout == "1\n", res
            core = res.cores[0] if res.cores else core
            os.sched_setaffinity(0, {core})  # the child inherits it: no wrapper in between
            try:
                t4 = time.perf_counter()
                subprocess.run(BARE, check=True, capture_output=True)
                t5 = time.perf_counter()
            finally:
                os.sched_setaffinity(0, everywhere)
            if i >= warmup:
                for name in names:
                    gateway[name].append(took[name])
                bare.append(took["bare"])
                direct.append((t3 - t2) * 1e3)
                bare_pinned.append((t5 - t4) * 1e3)
    cpu = {name: round((cpu_s(pid) - cpu0[name]) / n * 1e3, 3) for name, pid in pids.items()}

    def figures(name: str) -> dict[str, object]:
        g, x = gateway[name], ran[name]
        return {
            "gateway_run_code": stats(g),
            "overhead": stats([a - b for a, b in zip(g, bare, strict=True)]),
            "http_overhead": stats([a - d for a, d in zip(g, direct, strict=True)]),
            # the overhead split in two: the pinned command's own run time against the bare
            # run, and everything around it (HTTP, daemon, environment, file, spawn, exit)
            "run_vs_bare": stats([a - b for a, b in zip(x, bare, strict=True)]),
            "around_the_run": stats([a - b for a, b in zip(g, x, strict=True)]),
            # the path's own cost with the core question taken out: bare on the same core
            "overhead_same_core": stats([a - b for a, b in zip(g, bare_pinned, strict=True)]),
        }

    head, *others = names
    return {
        "n": n,
        "gateway": head,
        **figures(head),
        "bare_python3_c": stats(bare),
        "direct_exec": stats(direct),
        "bare_same_core": stats(bare_pinned),
        "daemon_overhead": stats([d - b for d, b in zip(direct, bare, strict=True)]),
        **{name: figures(name) for name in others},
        # the daemon's includes every gateway's requests and the direct execs
        "cpu_ms_per_round": cpu,
    }


async def _gateway_rps(url: str, clients: int, requests: int) -> float:
    left = iter(range(requests))
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=clients)) as c:

        async def worker() -> None:
            for _ in left:
                r = await c.post(f"{url}/run_code", json=BODY)
                assert r.json()["status"] == "Success", r.text

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return requests / (time.perf_counter() - t0)


async def _bare_rps(clients: int, requests: int) -> float:
    left = iter(range(requests))

    async def worker() -> None:
        for _ in left:
            proc = await asyncio.create_subprocess_exec(
                *BARE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
            )
            await proc.communicate()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return requests / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="latency samples of each")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=256, help="calls per throughput run")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = parser.parse_args()
    # `python3` on both sides is this interpreter's own, not a version manager's shim (a
    # pyenv shim is a shell script that adds 100+ ms and its noise to every start)
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    with tempfile.TemporaryDirectory(prefix="tangram-bench-gw-") as tmp:
        port = free_port()
        daemon = spawn_daemon(tmp, "", "--http", f"127.0.0.1:{port}")
        try:
            inside = f"http://127.0.0.1:{port}"
            wait_http(inside, daemon.proc, daemon.log_path)
            with spawn_gateway(daemon.socket, tmp) as gw:
                load_before = os.getloadavg()[0]
                urls = {"separate": gw.url, "in_process": inside}
                pids = {"separate_gateway": gw.proc.pid, "daemon": daemon.proc.pid}
                report: dict[str, object] = {
                    "backend": "process",
                    "latency": latency(urls, daemon.socket, pids, args.n, args.warmup),
                    "throughput": {
                        "clients": args.clients,
                        "requests": args.requests,
                        **{
                            f"{name}_rps": round(
                                asyncio.run(_gateway_rps(url, args.clients, args.requests)), 2
                            )
                            for name, url in urls.items()
                        },
                        "bare_rps": round(asyncio.run(_bare_rps(args.clients, args.requests)), 2),
                    },
                    "loadavg": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                }
        finally:
            daemon.stop()
    if args.json:
        print(json.dumps(report, indent=1))
        return
    lat = report["latency"]
    assert isinstance(lat, dict)
    for key in ("gateway_run_code", "bare_python3_c", "direct_exec", "overhead", "daemon_overhead",
                "http_overhead", "run_vs_bare", "around_the_run", "bare_same_core",
                "overhead_same_core"):  # fmt: skip
        print(f"{key:18} p50 {lat[key]['p50_ms']:8.2f} ms   p99 {lat[key]['p99_ms']:8.2f} ms")
    other = lat["in_process"]
    assert isinstance(other, dict)
    for key in ("gateway_run_code", "overhead", "http_overhead", "overhead_same_core"):
        row = other[key]
        print(f"in_process {key:18} p50 {row['p50_ms']:8.2f} ms   p99 {row['p99_ms']:8.2f} ms")
    print(f"throughput        {report['throughput']}")


if __name__ == "__main__":
    main()

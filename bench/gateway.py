"""SandboxFusion ``/run_code`` through ``tangramd http`` vs a bare ``python3 -c``, one run.

    python bench/gateway.py [--n 200] [--clients 32] [--requests 256] [--json]

latency: ``/run_code`` of ``print(1)`` (python, 1 core, process backend) over one keep-alive
HTTP connection, interleaved round-robin with a bare ``subprocess.run(["python3", "-c",
"print(1)"])``; p50/p99 of both and of the per-pair difference (what the gateway and the
daemon add: HTTP, JSON, the socket round trip, scheduling, the throwaway environment, the
pinning gate).

throughput: ``--requests`` calls from ``--clients`` concurrent clients, through the gateway
and bare (the same number of concurrent ``python3 -c``), requests per second each. Both sides
share the machine's cores; the gateway runs each call on one core the daemon allocated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from tangram.testing import spawn_daemon
from tangramd.gateway.spawn import spawn_gateway

BODY = {"code": "print(1)", "language": "python", "run_timeout": 30}
BARE = ["python3", "-c", "print(1)"]


def stats(ms: list[float]) -> dict[str, float]:
    s = sorted(ms)
    return {
        "p50_ms": round(statistics.median(s), 3),
        "p99_ms": round(s[min(len(s) - 1, int(0.99 * len(s)))], 3),
    }


def latency(url: str, n: int, warmup: int) -> dict[str, object]:
    gateway: list[float] = []
    bare: list[float] = []
    with httpx.Client(timeout=60) as http:
        for i in range(warmup + n):
            t0 = time.perf_counter()
            r = http.post(f"{url}/run_code", json=BODY)
            t1 = time.perf_counter()
            assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "1\n", r.text
            subprocess.run(BARE, check=True, capture_output=True)
            t2 = time.perf_counter()
            if i >= warmup:
                gateway.append((t1 - t0) * 1e3)
                bare.append((t2 - t1) * 1e3)
    overhead = [g - b for g, b in zip(gateway, bare, strict=True)]
    return {
        "n": n,
        "gateway_run_code": stats(gateway),
        "bare_python3_c": stats(bare),
        "overhead": stats(overhead),
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
    with tempfile.TemporaryDirectory(prefix="tangram-bench-gw-") as tmp:
        daemon = spawn_daemon(tmp, "")
        try:
            with spawn_gateway(daemon.socket, tmp) as gw:
                report: dict[str, object] = {
                    "backend": "process",
                    "latency": latency(gw.url, args.n, args.warmup),
                    "throughput": {
                        "clients": args.clients,
                        "requests": args.requests,
                        "gateway_rps": round(
                            asyncio.run(_gateway_rps(gw.url, args.clients, args.requests)), 2
                        ),
                        "bare_rps": round(asyncio.run(_bare_rps(args.clients, args.requests)), 2),
                    },
                }
        finally:
            daemon.stop()
    if args.json:
        print(json.dumps(report, indent=1))
        return
    lat = report["latency"]
    assert isinstance(lat, dict)
    for key in ("gateway_run_code", "bare_python3_c", "overhead"):
        print(f"{key:18} p50 {lat[key]['p50_ms']:8.2f} ms   p99 {lat[key]['p99_ms']:8.2f} ms")
    print(f"throughput        {report['throughput']}")


if __name__ == "__main__":
    main()

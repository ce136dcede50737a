"""IPC benchmark of the Unix-socket wire (docs/design.md §6 targets: p50 <= 100 us, p99 <= 500 us,
>= 20,000 req/s).

The server is a real ``tangramd up`` (``--transport-only``: a bare
:class:`tangramd.transport.UnixServer` with a trivial ``ping`` handler) in its own process,
so client and server do not share a GIL. Latency: one blocking
``Client`` doing sequential pings. Throughput: 32 ``AsyncClient`` connections, each keeping
``--depth`` pings in flight, for ``--duration`` seconds.

    python bench/ipc.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import structlog

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tangram.client import AsyncClient, Client
from tangram.protocol import UnknownOp
from tangram.testing import spawn_daemon
from tangramd.transport import ConnInfo, UnixServer

PONG = {"pong": True, "version": "bench"}


async def _handle(op: str, args: dict[str, Any], conn: ConnInfo) -> Any:
    if op == "ping":
        return PONG
    raise UnknownOp(f"unknown op {op!r}")


def _serve(path: str, ready: Any) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    async def main() -> None:
        server = UnixServer(path, _handle, idle_timeout_s=60)
        await server.start()
        ready.set()
        await asyncio.Event().wait()

    try:
        import uvloop  # optional speed-up, not a dependency

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())


def _latency(path: str, calls: int, warmup: int) -> tuple[float, float]:
    with Client(path) as client:
        for _ in range(warmup):
            client.request("ping", {})
        samples = []
        clock = time.perf_counter_ns
        for _ in range(calls):
            start = clock()
            client.request("ping", {})
            samples.append(clock() - start)
    samples.sort()
    p50 = statistics.median(samples) / 1000
    p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))] / 1000
    return p50, p99


async def _throughput(path: str, conns: int, depth: int, duration_s: float) -> float:
    clients = [AsyncClient(path) for _ in range(conns)]
    await asyncio.gather(*(client.connect() for client in clients))
    done = 0
    stop_at = 0.0

    async def worker(client: AsyncClient) -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await client.request("ping", {})
            done += 1

    stop_at = time.perf_counter() + 0.3  # warm-up
    await asyncio.gather(*(worker(c) for c in clients for _ in range(depth)))
    done = 0
    start = time.perf_counter()
    stop_at = start + duration_s
    await asyncio.gather(*(worker(c) for c in clients for _ in range(depth)))
    elapsed = time.perf_counter() - start
    for client in clients:
        await client.close()
    return done / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--conns", type=int, default=32)
    parser.add_argument("--depth", type=int, default=4, help="calls in flight per connection")
    parser.add_argument("--duration", type=float, default=3.0, help="throughput phase, s")
    parser.add_argument(
        "--transport-only",
        action="store_true",
        help="measure a bare UnixServer with a trivial handler instead of `tangramd up`",
    )
    opts = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tangram-bench-") as tmp:
        if opts.transport_only:
            path = os.path.join(tmp, "bench.sock")
            ctx = multiprocessing.get_context("spawn")
            ready = ctx.Event()
            server = ctx.Process(target=_serve, args=(path, ready), daemon=True)
            server.start()
            stop = server.terminate
            if not ready.wait(30):
                raise SystemExit("server did not start")
        else:  # the real daemon: `tangramd up` in its own process
            daemon = spawn_daemon(tmp, '[daemon]\nlog_level = "warning"\n')
            path, stop = daemon.socket, daemon.stop
        try:
            p50, p99 = _latency(path, opts.calls, opts.warmup)
            rate = asyncio.run(_throughput(path, opts.conns, opts.depth, opts.duration))
        finally:
            stop()
    result = {"p50_us": round(p50, 1), "p99_us": round(p99, 1), "msgs_per_s": round(rate)}
    if opts.json:
        print(json.dumps(result))
    else:
        print(f"p50 {p50:.1f} us   p99 {p99:.1f} us   {rate:,.0f} req/s")


if __name__ == "__main__":
    main()

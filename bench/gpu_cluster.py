"""GPU services under load: calls/s, ACT and restores, with dynamic batching and without.

    python bench/gpu_cluster.py [--nodes 1] [--gpus 4] [--services 3] [--calls 1000]
        [--clients 64] [--max-batch 16] [--pass-ms 20] [--modes single,batch] [--json]

Each mode starts a real ``tangramd up`` on a temp socket with ``[gpu] simulated`` GPUs and
the services declared as ``[[service]]`` (``min_resident = 1``: warm before the first
call), then ``--clients`` asyncio clients, each on its own connection, send ``--calls``
calls in all (service i drawn with weight 1/(i+1): the first is the most popular) and wait
for each answer before sending the next. With ``--nodes N`` > 1 it starts a real
``tangramd coordinator`` (the ``[[service]]`` entries) and N ``tangramd node``s, each with
``--gpus`` simulated GPUs: the coordinator places the replicas on the nodes' GPUs, and the
clients connect to the nodes' sockets in turn (a call through any node runs on any node's
GPUs); ``calls_by_node`` says where the calls ran. ``single`` registers the services with
``max_batch = 1`` (one call per forward pass), ``batch`` with ``max_batch = --max-batch``
(concurrent calls to a resident replica merged into one ``handle_batch`` pass).

The service is a real torch module (a 1024x1024 linear layer and a tanh over the batch)
that also sleeps ``--pass-ms`` per forward pass: a stand-in for the GPU time of a
memory-bound model pass, which hardly grows with the batch, on a host whose "GPUs" are
simulated (their time is not this CPU's). Per mode: ``calls_per_s`` (calls / wall time of
the load), ``act_p50_s``/``act_p99_s`` (the daemon's ``act_s``: submission to answer),
``restores`` (during the load), ``batched_share`` (calls that ran in a pass of two or
more) and ``mean_batch``; ``speedup`` is batch over single calls/s (goal >= 3) and
``p99_ratio`` batch over single p99 ACT (goal <= 1).

Topology: ``--nodes 1`` is one ``tangramd up``; ``--nodes 2`` (the issue's: 2 nodes x 4
simulated GPUs, 3 services, 1,000 calls from 64 clients) a coordinator and two nodes on
this host, all on loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tangram import Client
from tangram.client.aio import AsyncClient
from tangram.testing import spawn_coordinator, spawn_daemon, spawn_node, wait_for

MODEL = '''
import time

import torch


class Scorer(torch.nn.Module):
    """A 1024x1024 linear layer; each forward pass also sleeps PASS_S (its GPU time)."""

    def __init__(self, seed, pass_s):
        super().__init__()
        torch.manual_seed(seed)
        self.layer = torch.nn.Linear(1024, 1024)
        self.pass_s = pass_s

    def handle(self, payload):
        return self.handle_batch([payload])[0]

    def handle_batch(self, payloads):
        xs = torch.stack([torch.full((1024,), float(p["x"])) for p in payloads])
        time.sleep(self.pass_s)
        ys = torch.tanh(self.layer(xs)).sum(dim=1)
        return [{{"score": float(y), "id": p["id"]}} for p, y in zip(payloads, ys.tolist())]


def make(seed):
    return lambda: Scorer(seed, {pass_s})
'''


def gpu_config(args: argparse.Namespace) -> str:
    """``[gpu]``: this host's simulated GPUs (tangramd up's, or one node's)."""
    return f"""
[gpu]
simulated = {{ count = {args.gpus}, mem_gb = {args.gpu_mem_gb}, h2d_gbps = 25 }}
nvml = false
"""


def config(args: argparse.Namespace, model_dir: str, max_batch: int) -> str:
    """``tangramd up``'s config, or (``--nodes`` > 1) the coordinator's: no ``[gpu]``."""
    text = """
[sched]
coalesce_ms = 1.0
"""
    if args.nodes == 1:
        text += gpu_config(args)
    for i in range(args.services):
        text += f"""
[[service]]
name = "svc{i}"
entry = "scorer:svc{i}"
path = "{model_dir}"
mem_gb = {args.service_mem_gb}
min_resident = 1
max_batch = {max_batch}
"""
    return text


def write_model(args: argparse.Namespace, model_dir: Path) -> None:
    source = MODEL.format(pass_s=args.pass_ms / 1000.0)
    source += "".join(f"\nsvc{i} = make({i})\n" for i in range(args.services))
    (model_dir / "scorer.py").write_text(source)


async def load(sockets: list[str], args: argparse.Namespace) -> tuple[float, list[Any]]:
    """``--calls`` calls from ``--clients`` clients, client k on ``sockets[k % n]``;
    (wall seconds, results)."""
    rng = random.Random(7)
    weights = [1.0 / (i + 1) for i in range(args.services)]
    names = rng.choices([f"svc{i}" for i in range(args.services)], weights, k=args.calls)
    todo = list(enumerate(names))
    results: list[Any] = [None] * args.calls

    async def client(socket: str) -> None:
        async with AsyncClient(socket) as c:
            while todo:
                i, name = todo.pop()
                results[i] = await c.call(name, {"x": i / args.calls, "id": i}, timeout_s=120)

    start = time.perf_counter()
    await asyncio.gather(*(client(sockets[k % len(sockets)]) for k in range(args.clients)))
    return time.perf_counter() - start, results


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def start(args: argparse.Namespace, text: str, work: Path) -> tuple[list[Any], list[str]]:
    """The daemons (the one to stop last first) and the sockets the clients use: one
    ``tangramd up``, or a coordinator and ``--nodes`` nodes (the clients on the nodes')."""
    if args.nodes == 1:
        daemon = spawn_daemon(work, text, ready_timeout_s=300)
        return [daemon], [daemon.socket]
    coordinator = spawn_coordinator(work, text, ready_timeout_s=120)
    daemons: list[Any] = [coordinator]
    try:
        for k in range(args.nodes):
            daemons.append(
                spawn_node(work, coordinator, f"n{k}", config=gpu_config(args), ready_timeout_s=120)
            )
    except BaseException:
        stop(daemons)
        raise
    return daemons, [d.socket for d in daemons[1:]]


def stop(daemons: list[Any]) -> None:
    for daemon in reversed(daemons):  # nodes first, the coordinator last
        daemon.stop()


def run_mode(args: argparse.Namespace, mode: str, work: Path, model_dir: Path) -> dict[str, Any]:
    max_batch = 1 if mode == "single" else args.max_batch
    daemons, sockets = start(args, config(args, str(model_dir), max_batch), work / mode)
    try:
        with Client(daemons[0].socket, timeout_s=300) as c:

            def warm() -> bool:
                return all(row["warm"] >= 1 for row in c.service_list())

            wait_for(warm, 300, "the services warm")
            before = sum(row["restores"] for row in c.service_list())
        wall, results = asyncio.run(load(sockets, args))
        with Client(daemons[0].socket, timeout_s=60) as c:

            def told() -> bool:  # (a node tells its rows at the end of its loop turn)
                return sum(row["calls"] for row in c.service_list()) >= args.calls

            wait_for(told, 30, "the nodes' rows")
            rows = c.service_list()
    finally:
        stop(daemons)
    ok = [r for r in results if r is not None and r.outcome == "ok"]
    wrong = [r for i, r in enumerate(results) if r is not None and r.ok and r.result["id"] != i]
    acts = [r.act_s for r in ok]
    by_node: dict[str, int] = {}
    for r in ok:
        by_node[str(r.node)] = by_node.get(str(r.node), 0) + 1
    return {
        "mode": mode,
        "max_batch": max_batch,
        "calls": args.calls,
        "ok": len(ok),
        "wrong_answers": len(wrong),
        "wall_s": round(wall, 3),
        "calls_per_s": round(len(ok) / wall, 1),
        "act_p50_s": round(quantile(acts, 0.50), 4),
        "act_p99_s": round(quantile(acts, 0.99), 4),
        "restores": sum(row["restores"] for row in rows) - before,
        "batched_share": round(sum(1 for r in ok if r.batch > 1) / max(len(ok), 1), 3),
        "mean_batch": round(statistics.fmean(r.batch for r in ok), 2) if ok else 0.0,
        "batches": sum(row["batches"] for row in rows),
        "calls_by_node": dict(sorted(by_node.items())),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--nodes", type=int, default=1, help="1: tangramd up; N > 1: a coordinator and N nodes"
    )
    p.add_argument("--gpus", type=int, default=4, help="simulated GPUs per node")
    p.add_argument("--gpu-mem-gb", type=float, default=8.0)
    p.add_argument("--services", type=int, default=3)
    p.add_argument("--service-mem-gb", type=float, default=6.0)
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--pass-ms", type=float, default=20.0, help="GPU time of one forward pass")
    p.add_argument("--modes", default="single,batch")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.nodes < 1:
        p.error("--nodes must be 1 or more")
    modes = [m for m in args.modes.split(",") if m]
    with tempfile.TemporaryDirectory(prefix="tangram-gpu-cluster-") as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        model_dir.mkdir()
        write_model(args, model_dir)
        rows = {mode: run_mode(args, mode, work, model_dir) for mode in modes}
    out: dict[str, Any] = {
        "bench": "gpu_cluster",
        "topology": {"nodes": args.nodes, "gpus_per_node": args.gpus, "services": args.services},
        "calls": args.calls,
        "clients": args.clients,
        "pass_ms": args.pass_ms,
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "modes": rows,
    }
    if "single" in rows and "batch" in rows:
        single, batch = rows["single"], rows["batch"]
        out["speedup"] = round(batch["calls_per_s"] / single["calls_per_s"], 2)
        out["p99_ratio"] = round(batch["act_p99_s"] / single["act_p99_s"], 3)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for mode, row in rows.items():
            print(mode, " ".join(f"{k}={v}" for k, v in row.items() if k != "mode"))
        if "speedup" in out:
            print(f"speedup={out['speedup']}x p99_ratio={out['p99_ratio']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

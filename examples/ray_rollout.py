"""Rollout workers as Ray tasks on several nodes, each through its own host's tangram node.

    python examples/ray_rollout.py [--local 3] [--trajectories 4] [--steps 3] [--json]
    python examples/ray_rollout.py --address HOST:PORT     # tangram already `ray up`

This is how an RL stack that runs on Ray (verl, OpenRLHF, SkyRL, ROLL) uses ARL-Tangram:
its rollout workers are Ray tasks or actors spread over the nodes, and each one talks to
the tangram node on its own host with a plain ``Client()``, exactly as it would on a host
where tangramd runs under systemd. The coordinator decides where each trajectory's
environment lives (its first action goes to the memory-balanced node with room), so a
worker's actions may run on another host than the worker itself.

Each Ray task here plays ``--trajectories`` trajectories: open an environment, then
``--steps`` tool calls (short shell and Python commands) in it, then close it. At the end
it prints, per Ray node the workers ran on, which tangram nodes ran their actions and the
action completion time (ACT = queue + execution) they saw.

``--local N`` (the default, N = 3) starts a Ray cluster of N nodes on this host
(``ray.cluster_utils.Cluster``, on loopback, each node with its own socket since they
share the host), runs ``tangramctl ray up`` on it, and takes everything down at the end.
``--address`` uses a Ray cluster where ``tangramctl ray up`` has already run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # local mode: loopback
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.getenv("PYTHONPATH")]))

import ray  # noqa: E402

from tangram import Client  # noqa: E402

CONFIG = """
[sched]
coalesce_ms = 1.0

[cpu]
default_env_mem = "64MiB"
"""

TOOL_CALLS = [
    ["sh", "-c", "echo 'def solve(x):\n    return 2 * x' > solution.py && cat solution.py"],
    [sys.executable, "-c", "print(sum(i * i for i in range(300_000)))"],
    ["sh", "-c", "grep -c def solution.py"],
    [sys.executable, "-c", "import solution; assert solution.solve(21) == 42; print('ok')"],
]


@ray.remote(num_cpus=0)
def rollout_worker(worker: int, trajectories: int, steps: int) -> dict[str, Any]:
    """One rollout worker: plays trajectories through this host's tangram node."""
    actions = []
    with Client() as client:  # no socket argument: the host's standard one
        for t in range(trajectories):
            with client.env(trajectory=f"w{worker}-t{t}") as env:
                for step in range(steps):
                    result = env.exec(TOOL_CALLS[step % len(TOOL_CALLS)], cpus=1)
                    actions.append(
                        {
                            "node": result.node,
                            "outcome": result.outcome,
                            "queue_s": result.queue_s,
                            "act_s": result.act_s,
                        }
                    )
    return {
        "worker": worker,
        "ray_node": ray.get_runtime_context().get_node_id(),
        "actions": actions,
    }


def drive(workers_per_node: int, trajectories: int, steps: int) -> dict[str, Any]:
    """Start the workers (spread over the live Ray nodes, pinned) and summarise."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    refs = [
        rollout_worker.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
        ).remote(i * workers_per_node + k, trajectories, steps)
        for i, node_id in enumerate(nodes)
        for k in range(workers_per_node)
    ]
    started = time.monotonic()
    results = ray.get(refs, timeout=600)
    wall = time.monotonic() - started
    per_node: dict[str, dict[str, Any]] = {}
    by_ray_node: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for result in results:
        by_ray_node[result["ray_node"]].extend(result["actions"])
    for ray_node, actions in sorted(by_ray_node.items()):
        acts = [a["act_s"] for a in actions]
        placed: dict[str, int] = defaultdict(int)
        for a in actions:
            placed[a["node"]] += 1
        per_node[f"ray-{ray_node[:12]}"] = {
            "actions": len(actions),
            "ok": sum(a["outcome"] == "ok" for a in actions),
            "ran_on": dict(sorted(placed.items())),
            "act_p50_s": round(statistics.median(acts), 4),
            "act_max_s": round(max(acts), 4),
            "queue_p50_s": round(statistics.median(a["queue_s"] for a in actions), 4),
        }
    return {"wall_s": round(wall, 3), "workers": len(refs), "per_ray_node": per_node}


def render(summary: dict[str, Any]) -> str:
    lines = [
        f"{summary['workers']} rollout workers (Ray tasks), {summary['wall_s']:.1f} s",
        "",
        f"{'worker host':<18} {'actions':>7} {'ok':>4} {'ACT p50':>9} {'ACT max':>9}  ran on",
    ]
    for host, row in summary["per_ray_node"].items():
        ran_on = ", ".join(f"{node}×{n}" for node, n in row["ran_on"].items())
        lines.append(
            f"{host:<18} {row['actions']:>7} {row['ok']:>4} {row['act_p50_s']:>8.3f}s"
            f" {row['act_max_s']:>8.3f}s  {ran_on}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--address", help="a Ray cluster where `tangramctl ray up` ran")
    ap.add_argument("--local", type=int, default=3, help="Ray nodes to start on this host")
    ap.add_argument("--workers-per-node", type=int, default=1)
    ap.add_argument("--trajectories", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    if args.address:
        ray.init(address=args.address, log_to_driver=False)
        summary = drive(args.workers_per_node, args.trajectories, args.steps)
    else:
        summary = run_local(args)
    print(json.dumps(summary, indent=2) if args.json else render(summary))


def run_local(args: argparse.Namespace) -> dict[str, Any]:
    """A Ray cluster on this host, `ray up`, the rollout, `ray down`, cluster gone."""
    from ray.cluster_utils import Cluster

    from tangramctl import ray as tangram_on_ray

    work = Path(tempfile.mkdtemp(prefix="tangram-ray-example-"))
    cluster = Cluster()
    try:
        for i in range(args.local):
            cluster.add_node(
                num_cpus=1,
                include_dashboard=False,
                object_store_memory=80 << 20,
                env_vars={"TANGRAM_SOCKET": str(work / f"node{i}.sock")},
            )
        ray.init(address=cluster.address, log_to_driver=False)
        cores = sorted(os.sched_getaffinity(0))
        up = tangram_on_ray.up(
            config_text=CONFIG, cpus=",".join(map(str, cores)), state_root=str(work / "state")
        )
        ready = f"ray up: {len(up['nodes'])} tangram nodes ready in {up['ready_s']:.1f} s"
        print(ready, file=sys.stderr)  # stdout is the summary (JSON with --json)
        try:
            summary = drive(args.workers_per_node, args.trajectories, args.steps)
            summary["ray_up_ready_s"] = up["ready_s"]
        finally:
            tangram_on_ray.down()
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    return summary


if __name__ == "__main__":
    main()

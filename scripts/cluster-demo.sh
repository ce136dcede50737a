#!/usr/bin/env bash
# Cluster mode on one host: a coordinator and three nodes (disjoint --cpus where the host
# has the cores, else shared), the example rollout driven through node-1's socket, a
# per-node placement summary, then a second rollout during which node-3 is SIGKILLed:
# the actions it was running end infra_error naming it, its environments answer env_lost,
# the rest carries on on the other nodes.
#
#   scripts/cluster-demo.sh [--trajectories 12] [--steps 4]
#
# Everything runs on loopback under a temporary directory, removed at the end, with the
# project venv .venv (made with $PYTHON, else the system python3; scripts/_venv.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
venv_up
install_tangram ""
step "the cluster demo"
exec "$PY" - "$@" <<'EOF'
import argparse
import asyncio
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tangram import AsyncClient, EnvLost, InfraError
from tangram.testing import spawn_coordinator, spawn_node, wait_node_state

ap = argparse.ArgumentParser()
ap.add_argument("--trajectories", type=int, default=12)
ap.add_argument("--steps", type=int, default=4)
args = ap.parse_args()

CONFIG = """
[cluster]
heartbeat_s = 0.5
heartbeat_timeout_s = 3

[cpu]
default_env_mem = "256MiB"

[[api]]
name = "search"
concurrency = 4
quota = 40
period_s = 1.0
"""
cores = sorted(os.sched_getaffinity(0))
if len(cores) >= 6:  # disjoint, at least 2 cores each (the reward suite is profiled at -n 2)
    third = len(cores) // 3
    parts = [cores[:third], cores[third : 2 * third], cores[2 * third :]]
else:  # a small host: node-1 offers every core, node-2 and node-3 one half each (shared)
    half = max(1, len(cores) // 2)
    parts = [cores, cores[:half], cores[half:] or cores[:1]]
cpus = [",".join(str(c) for c in part) for part in parts]

work = Path(tempfile.mkdtemp(prefix="tangram-cluster-demo-"))
daemons = []
try:
    print(f"== coordinator and 3 nodes under {work}", flush=True)
    coord = spawn_coordinator(work, CONFIG)
    daemons.append(coord)
    join = coord.join
    # the token in a private file, never on a command line (`ps` shows those to every user);
    # spawn_node passes it to each node in $TANGRAM_JOIN_TOKEN
    token_file = work / "join-token"
    token_file.touch(mode=0o600)
    token_file.write_text(join["token"] + "\n")
    print(f"   join: tangramd node --coordinator {join['coordinator']} --token-file {token_file} "
          f"--ca-sha256 {join['ca_sha256']}")
    for i, c in enumerate(cpus, 1):
        node = spawn_node(work, coord, f"node-{i}", cpus=c)
        daemons.append(node)
        print(f"   node-{i}: --cpus {c}  socket {node.socket}")
    gateway = daemons[1]

    print("\n== the example rollout through node-1's socket", flush=True)
    subprocess.run(
        [sys.executable, "examples/rollout.py", "--socket", gateway.socket,
         "--trajectories", str(args.trajectories), "--steps", str(args.steps)],
        check=True,
    )

    print("\n== a rollout during which node-3 is killed (SIGKILL) halfway", flush=True)
    rows = []

    async def trajectory(c, k):
        try:
            opened = await c.request("env.open", {"trajectory": f"t{k}"})
        except InfraError as exc:
            rows.append(("?", "env.open", "infra_error", str(exc)))
            return
        env, node = opened["id"], opened["node"]
        for step in range(args.steps):
            try:
                r = await c.exec(["sh", "-c", "sleep 0.4; echo ok"], env=env)
                rows.append((r.node, "exec", r.outcome, r.detail))
            except EnvLost as exc:
                rows.append((node, "exec", "env_lost", str(exc)))
                return
        await c.env_close(env)

    async def rollout():
        async with AsyncClient(gateway.socket) as c:
            await asyncio.gather(*(trajectory(c, k) for k in range(args.trajectories)))

    async def kill_halfway():
        await asyncio.sleep(0.4 * args.steps / 2)
        daemons[3].kill()
        print(f"   node-3 killed at t={0.4 * args.steps / 2:.1f} s", flush=True)

    async def both():
        await asyncio.gather(rollout(), kill_halfway())

    t0 = time.monotonic()
    asyncio.run(both())
    wall = time.monotonic() - t0
    wait_node_state(coord, "node-3", "lost", 10)

    print(f"\n== per-node placement ({len(rows)} actions in {wall:.1f} s)")
    table = collections.defaultdict(collections.Counter)
    for node, _, outcome, _ in rows:
        table[node][outcome] += 1
    print(f"{'node':<8}{'actions':>8}  outcomes")
    for node in sorted(table):
        counts = table[node]
        print(f"{node:<8}{sum(counts.values()):>8}  "
              + " ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    affected = [r for r in rows if r[2] in ("infra_error", "env_lost")]
    print(f"\n{len(affected)} actions affected by the kill:")
    for node, _, outcome, detail in affected:
        print(f"   {node:<8}{outcome:<12}{detail}")
    print("\n== tangramctl nodes")
    subprocess.run([sys.executable, "-m", "tangramctl.main", "--socket", coord.socket, "nodes"],
                   check=True)
finally:
    for d in reversed(daemons):
        if d.proc.poll() is None:
            d.stop()
    shutil.rmtree(work, ignore_errors=True)
EOF

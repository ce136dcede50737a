"""Evict-on-execution with real model workers: three reward services on two simulated GPUs.

    python examples/services/demo.py [--trajectories 3] [--calls 6] [--json]

Each GPU (0.25 GB, 0.5 GB/s simulated link) holds one of the three services (0.15 GB each),
so at most two are resident at a time. Trajectories call one service each, ``--calls``
times, with a short think time between calls (the environment step). Two deployments are
driven in the same run, over the same real worker processes:

- eoe: the pure pool (``GpuNodePool``) decides per call: the GPU where the service is
  resident (waiting for it if busy), otherwise a free GPU whose LRU resident is evicted and
  the service restored there; ``ServiceHost.apply`` carries that out.
- static: one service per GPU for the whole run; the third service's trajectories queue
  until the first GPU's trajectories are done, and it is then loaded there.

This is also the reference for how the daemon's executor drives ``ServiceHost``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tangram.model import ActionId  # noqa: E402
from tangram.pools.gpu import GpuNodePool  # noqa: E402
from tangramd.services import ServiceHost, ServiceSpec, SimulatedGpus, discover  # noqa: E402

HERE = Path(__file__).resolve().parent
SERVICES = {"reward_small": "reward_small", "judge": "judge", "reward_large": "reward_large"}
MEM_GB = 0.15
THINK_S = 0.05


@dataclass
class Stats:
    act_s: list[float] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=lambda: defaultdict(int))


class Eoe:
    """FCFS with cache-aware preference, over the pure pool's chunk and LRU decisions."""

    def __init__(self, host: ServiceHost, pool: GpuNodePool) -> None:
        self.host, self.pool = host, pool
        self.tick = 0
        self.changed = asyncio.Condition()

    def choose(self, name: str) -> tuple[int, ...] | None:
        """The GPU for the next call of ``name``, or None to wait.

        One instance per service: where it is resident, wait for that GPU (a second
        instance would start another worker: a cold start, not a restore); otherwise the
        pool's choice of a free GPU, whose LRU resident the restore plan evicts.
        """
        home = [g for g in range(self.pool.n_gpus) if (name, 1) in self.pool.resident(g)]
        if home:
            return (home[0],) if self.pool.holder(home[0]) is None else None
        return self.pool.pick_chunk(1, name)

    async def run(self, name: str, payload: dict[str, Any]) -> Any:
        action = ActionId(f"call{id(payload)}")
        async with self.changed:
            await self.changed.wait_for(lambda: self.choose(name) is not None)
            gpus = self.choose(name)
            assert gpus is not None
            self.pool.allocate_gpus(action, gpus)
            self.tick += 1
            plan = self.pool.restore(self.pool.service(name), gpus, self.tick)
        try:
            await self.host.apply(name, gpus, plan.evicted)
            return await self.host.call(name, gpus, payload, timeout=60)
        finally:
            async with self.changed:
                self.pool.release(action)
                self.changed.notify_all()


class Static:
    """One service per GPU; the third waits for the first GPU's trajectories to finish."""

    def __init__(self, host: ServiceHost, placement: dict[str, int], waits_for: str) -> None:
        self.host, self.placement, self.waits_for = host, placement, waits_for
        self.locks = {gpu: asyncio.Lock() for gpu in set(placement.values())}
        self.freed = asyncio.Event()

    async def run(self, name: str, payload: dict[str, Any]) -> Any:
        if name not in self.placement:
            await self.freed.wait()
            gpu = self.placement[self.waits_for]
        else:
            gpu = self.placement[name]
        async with self.locks[gpu]:
            if name not in self.placement:  # redeploy: the first service leaves its GPU
                await self.host.evict(self.waits_for, [gpu])
            return await self.host.call(name, [gpu], payload, timeout=60)


async def trajectory(driver: Any, name: str, index: int, calls: int, stats: Stats) -> None:
    for step in range(calls):
        payload = {"prompt": f"task {index}.{step}", "response": f"answer {step * index}"}
        start = time.perf_counter()
        result = await driver.run(name, payload)
        stats.act_s.append(time.perf_counter() - start)
        stats.outcomes[result.outcome] += 1
        await asyncio.sleep(THINK_S)


async def drive(host: ServiceHost, mode: str, trajectories: int, calls: int) -> dict[str, Any]:
    for entry in host.list():  # start from nothing resident
        for replica in entry["replicas"]:
            if replica["gpus"]:
                await host.evict(entry["name"], replica["gpus"])
    before = {name: host.measured(name) for name in SERVICES}
    stats = {name: Stats() for name in SERVICES}
    names = list(SERVICES)
    if mode == "eoe":
        pool = host.inventory.node_pool("demo")
        for spec in host.specs():
            pool.register_service(spec.pool_spec())
        driver: Any = Eoe(host, pool)
    else:
        driver = Static(host, {names[0]: 0, names[1]: 1}, waits_for=names[0])
    started = time.perf_counter()

    async def group(name: str) -> None:
        await asyncio.gather(
            *(trajectory(driver, name, i, calls, stats[name]) for i in range(trajectories))
        )
        if mode == "static" and name == names[0]:
            driver.freed.set()

    await asyncio.gather(*(group(name) for name in names))
    makespan = time.perf_counter() - started
    out: dict[str, Any] = {"mode": mode, "makespan_s": round(makespan, 2), "services": {}}
    for name in names:
        after = host.measured(name)
        acts = sorted(stats[name].act_s)
        out["services"][name] = {
            "calls": len(acts),
            "outcomes": dict(stats[name].outcomes),
            "act_mean_s": round(sum(acts) / len(acts), 3),
            "act_max_s": round(acts[-1], 3),
            "restores": after["restores"] - before[name]["restores"],
            "bytes_moved": after["restore_bytes"] - before[name]["restore_bytes"],
        }
    return out


async def main_async(trajectories: int, calls: int) -> dict[str, Any]:
    inventory = discover(SimulatedGpus(2, 0.25, 0.5), use_nvml=False)
    with tempfile.TemporaryDirectory(prefix="eoe-demo.") as state:
        host = ServiceHost(inventory, state)
        try:
            await asyncio.gather(
                *(
                    host.register(
                        ServiceSpec(name, "torch", MEM_GB, entry=f"reward:{f}", path=str(HERE))
                    )
                    for name, f in SERVICES.items()
                )
            )
            eoe = await drive(host, "eoe", trajectories, calls)
            static = await drive(host, "static", trajectories, calls)
        finally:
            await host.close()
    return {"gpus": 2, "gpu_mem_gb": 0.25, "service_mem_gb": MEM_GB, "runs": [eoe, static]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=3, help="per service")
    parser.add_argument("--calls", type=int, default=6, help="per trajectory")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(main_async(args.trajectories, args.calls))
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for run in result["runs"]:
        print(f"{run['mode']}: makespan {run['makespan_s']} s")
        for name, row in run["services"].items():
            print(
                f"  {name:<13} calls {row['calls']:>3}  ACT mean {row['act_mean_s']:>6} s  "
                f"max {row['act_max_s']:>6} s  restores {row['restores']:>3}  "
                f"moved {row['bytes_moved'] / 1e6:>7.1f} MB  {row['outcomes']}"
            )


if __name__ == "__main__":
    main()

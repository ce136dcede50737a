"""k-worker torch replicas (issue 33 item 2): a replica on k GPUs is k real worker processes,
each holding a shard of the module (a tensor split of its linear layers), and answers exactly
what a 1-worker replica answers. Real processes on simulated GPUs (CPU workers)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch  # noqa: F401  # the tests need torch installed (the gpu extra), as CI has it

from tangram.testing import wait_for_async
from tangramd.services import ServiceHost, ServiceSpec, SimulatedGpus, discover
from tangramd.services.inventory import Inventory
from tangramd.services.torch_runtime import TorchReplica

SERVICES = Path(__file__).parent / "data" / "services"
X = {"x": [1, -2, 3, 5, -8]}


def mlp(name: str = "m", gpus: tuple[int, ...] = (1, 2, 4)) -> ServiceSpec:
    entry = "mlp_services:small"
    return ServiceSpec(name, "torch", 0.01, gpus=gpus, entry=entry, path=str(SERVICES))


def inventory(n: int = 4) -> Inventory:
    return discover(SimulatedGpus(n, 0.1, 10.0), use_nvml=False)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def host(loop: asyncio.AbstractEventLoop) -> Iterator[ServiceHost]:
    """A host on four simulated GPUs with the layered service ``m`` and ``s`` (no linear
    layer: nothing to split)."""
    with tempfile.TemporaryDirectory() as state:
        host = ServiceHost(inventory(), state)
        loop.run_until_complete(host.register(mlp()))
        scaler = ServiceSpec(
            "s", "torch", 0.01, gpus=(1, 2), entry="tiny_services:small", path=str(SERVICES)
        )
        loop.run_until_complete(host.register(scaler))
        try:
            yield host
        finally:
            loop.run_until_complete(host.close())


def replica(host: ServiceHost, name: str, gpus: tuple[int, ...]) -> dict[str, Any]:
    (row,) = [r for r in host.list() if r["name"] == name]
    (entry,) = [r for r in row["replicas"] if tuple(r["gpus"]) == gpus]
    return entry


@pytest.mark.parametrize("chunk", [(0, 1), (0, 1, 2, 3)], ids=["2 workers", "4 workers"])
def test_a_k_worker_replica_answers_as_one_worker_and_each_holds_a_shard(
    loop: asyncio.AbstractEventLoop, host: ServiceHost, chunk: tuple[int, ...]
) -> None:
    """The same input on one GPU and on k GPUs: the same answer, to the bit; the k-GPU
    replica is k live processes (worker 0 answers), each holding part of the module's
    bytes, together all of them."""
    one = loop.run_until_complete(host.call("m", (2,), X, 60))
    many = loop.run_until_complete(host.call("m", chunk, X, 60))
    assert one.outcome == many.outcome == "ok", (one, many)
    assert one.result is not None and many.result is not None
    assert many.result["y"] == one.result["y"]
    entry = replica(host, "m", chunk)
    workers = entry["workers"]
    assert [w["rank"] for w in workers] == list(range(len(chunk)))
    pids = [w["pid"] for w in workers]
    assert len(set(pids)) == len(chunk) and all(psutil.pid_exists(p) for p in pids)
    assert many.result["pid"] == pids[0] != one.result["pid"]
    module = host.measured("m")["module_bytes"]
    shards = [w["shard_bytes"] for w in workers]
    assert all(0 < s < module for s in shards), shards
    assert abs(sum(shards) - module) <= 256 * 4 * len(chunk), (shards, module)  # alignment
    assert many.result["held_bytes"] < one.result["held_bytes"]  # the lead holds its part
    for gpus in ((2,), chunk):
        loop.run_until_complete(host.evict("m", gpus))


def test_a_module_without_linear_layers_runs_whole_on_worker_0(
    loop: asyncio.AbstractEventLoop, host: ServiceHost
) -> None:
    """Nothing to split: worker 0 holds the whole module, worker 1 nothing; the answer is
    the 1-worker answer."""
    one = loop.run_until_complete(host.call("s", (3,), {"x": 2.0}, 60))
    two = loop.run_until_complete(host.call("s", (0, 1), {"x": 2.0}, 60))
    assert one.result is not None and two.result is not None
    assert two.result["y"] == one.result["y"]
    shards = [w["shard_bytes"] for w in replica(host, "s", (0, 1))["workers"]]
    assert shards[0] > 0 and shards[1] == 0, shards
    loop.run_until_complete(host.evict("s", (0, 1)))
    loop.run_until_complete(host.evict("s", (3,)))


def test_a_dead_worker_fails_the_call_as_infra_and_the_next_call_restarts_it(
    loop: asyncio.AbstractEventLoop, host: ServiceHost, tmp_path: Path
) -> None:
    """Killing worker 1 of a 2-GPU replica while worker 0 runs a call (before its forward
    reaches a split layer): that call is an ``infra_error`` (not the handler's failure),
    and the next call runs on new workers with the same answer."""
    first = loop.run_until_complete(host.call("m", (2, 3), X, 60))
    assert first.outcome == "ok"
    victim = replica(host, "m", (2, 3))["workers"][1]["pid"]

    async def kill_during_a_call() -> Any:
        started = tmp_path / "started"
        payload = {**X, "sleep": 1.0, "started": str(started)}
        call = asyncio.ensure_future(host.call("m", (2, 3), payload, 60))
        # worker 0 is in the handler (its sleep)
        await wait_for_async(started.exists, 30, "the call in worker 0's handler")
        os.kill(victim, signal.SIGKILL)
        return await call

    lost = loop.run_until_complete(kill_during_a_call())
    assert lost.outcome == "infra_error", lost
    again = loop.run_until_complete(host.call("m", (2, 3), X, 60))
    assert again.outcome == "ok" and again.result is not None and first.result is not None
    assert again.result["y"] == first.result["y"]
    assert victim not in [w["pid"] for w in replica(host, "m", (2, 3))["workers"]]
    loop.run_until_complete(host.evict("m", (2, 3)))


def test_spawned_workers_split_as_forked_ones(loop: asyncio.AbstractEventLoop) -> None:
    """Without a fork server (a factory that initialises CUDA) the host spawns each worker
    with its peer sockets; two spawned workers answer as one."""
    gpus = inventory(2).gpus
    spec = mlp("spawned", (1, 2))

    async def run() -> tuple[Any, Any, list[dict[str, Any]]]:
        with tempfile.TemporaryDirectory() as logs:
            alone = TorchReplica(spec, Path(logs) / "one.log", python=sys.executable)
            pair = TorchReplica(spec, Path(logs) / "two.log", python=sys.executable, ranks=2)
            try:
                await asyncio.gather(alone.start(gpus[:1]), pair.start(gpus))
                await asyncio.gather(alone.restore(gpus[:1]), pair.restore(gpus))
                one = await alone.call(dict(X), 60)
                two = await pair.call(dict(X), 60)
                return one, two, pair.workers()
            finally:
                await asyncio.gather(alone.close(), pair.close())

    one, two, workers = loop.run_until_complete(run())
    assert one.ok and two.ok and two.result["y"] == one.result["y"]
    assert len({w["pid"] for w in workers}) == 2
    assert all(w["shard_bytes"] > 0 for w in workers), workers

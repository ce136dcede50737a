"""The torch runtime end to end on simulated GPUs: real worker processes, real tensors.

One host (and its workers) serves the tests that leave its services alive, because starting a
worker means importing torch (seconds on a shared CI core); each such test starts from every
replica evicted. Tests that kill workers or remove services get a host of their own. No test
depends on another: each passes alone, in any order, and under ``-n auto``.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch  # noqa: F401  # the tests need torch installed (the gpu extra), as CI has it

from tangram.model import ActionId
from tangram.testing import wait_for_async
from tangramd.services import (
    Oversubscribed,
    ServiceHost,
    ServiceLoadError,
    ServiceNotFound,
    ServiceSpec,
    SimulatedGpus,
    discover,
)

TINY = '''
import os, time
import torch

class Scaler(torch.nn.Module):
    """y = x * sum(weight) + bias, with weight a ramp: checks every byte came back."""

    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(n, dtype=torch.float32) / n)
        self.register_buffer("bias", torch.full((1,), 0.5))

    def handle(self, payload):
        if "x" not in payload:
            raise ValueError("payload needs 'x'")
        if "started" in payload:  # a test waits for this file: the call is in the handler
            open(payload["started"], "w").close()
        time.sleep(float(payload.get("sleep", 0)))
        y = (self.weight * float(payload["x"])).sum() + self.bias
        return {"y": float(y.detach()), "pid": os.getpid()}

def small():
    return Scaler(1000)

def big():
    return Scaler(8 << 20)  # 32 MiB of float32
'''
BROKEN = """
def make():
    raise RuntimeError("no weights here")
"""
GPU_GB = 0.1  # two services of 0.06 GB never share a simulated GPU
H2D_GBPS = 0.12  # a 0.06 GB restore takes 0.5 s on the simulated link


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    (root / "tiny_models.py").write_text(TINY)
    (root / "broken_models.py").write_text(BROKEN)
    return root


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def reference(models: Path) -> Any:
    sys.path.insert(0, str(models))
    try:
        yield importlib.import_module("tiny_models")
    finally:
        sys.path.remove(str(models))


def spec(name: str, factory: str, models: Path, mem_gb: float = 0.06) -> ServiceSpec:
    return ServiceSpec(name, "torch", mem_gb, gpus=(1, 2), entry=factory, path=str(models))


def start_host(
    loop: asyncio.AbstractEventLoop, models: Path, state_dir: Path
) -> tuple[ServiceHost, list[Any]]:
    """A host on two simulated GPUs with services a (small) and b (32 MiB)."""
    inventory = discover(SimulatedGpus(2, GPU_GB, H2D_GBPS), use_nvml=False)
    host = ServiceHost(inventory, state_dir)
    outcomes = loop.run_until_complete(
        gather(
            host.register(spec("a", "tiny_models:small", models)),
            host.register(spec("b", "tiny_models:big", models)),
        )
    )
    return host, outcomes


@pytest.fixture(scope="module")
def shared(
    loop: asyncio.AbstractEventLoop, models: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServiceHost, list[Any]]]:
    """One host for the tests that leave its services alive (starting a worker imports torch:
    seconds on a shared CI core)."""
    host, outcomes = start_host(loop, models, tmp_path_factory.mktemp("state"))
    yield host, outcomes
    loop.run_until_complete(host.close())


@pytest.fixture
def setup(
    shared: tuple[ServiceHost, list[Any]], loop: asyncio.AbstractEventLoop
) -> tuple[ServiceHost, list[Any]]:
    """The shared host with every replica evicted, so no test depends on which ran before
    it (alone, in any order, or spread over xdist workers)."""
    host, _ = shared
    for name in ("a", "b"):
        for gpus in ([0], [1]):
            complete(loop, host.evict(name, gpus))
    return shared


@pytest.fixture
def own(
    loop: asyncio.AbstractEventLoop, models: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServiceHost, list[Any]]]:
    """A host of its own, for a test that kills workers or removes services."""
    host, outcomes = start_host(loop, models, tmp_path_factory.mktemp("own-state"))
    yield host, outcomes
    loop.run_until_complete(host.close())


async def gather(*coros: Any) -> list[Any]:
    return list(await asyncio.gather(*coros, return_exceptions=True))


def complete(loop: asyncio.AbstractEventLoop, coro: Any) -> Any:
    """Run ``coro`` to its end on ``loop``, failing after 60 s."""
    return loop.run_until_complete(asyncio.wait_for(coro, 60))


def by_name(host: ServiceHost) -> dict[str, dict[str, Any]]:
    return {entry["name"]: entry for entry in host.list()}


def test_register_makes_backup_and_refuses_bad_factories(
    setup: tuple[ServiceHost, list[Any]], loop: asyncio.AbstractEventLoop, models: Path
) -> None:
    """Registration backs the module up in a worker; a failing factory is an error naming
    the service and the cause, and is not persisted."""
    host, outcomes = setup
    assert isinstance(outcomes[0], dict) and isinstance(outcomes[1], dict)
    with pytest.raises(ServiceLoadError) as info:
        complete(loop, host.register(spec("bad", "broken_models:make", models)))
    assert "service 'bad'" in str(info.value)
    assert "RuntimeError: no weights here" in str(info.value)
    with pytest.raises(ServiceLoadError, match=r"'missing'.*ModuleNotFoundError"):
        complete(loop, host.register(spec("missing", "no_such_module:make", models)))
    with pytest.raises(ValueError, match="already registered"):
        complete(loop, host.register(spec("a", "tiny_models:big", models)))
    services = by_name(host)
    assert sorted(services) == ["a", "b"]
    assert services["b"]["module_bytes"] >= 32 << 20
    assert [r["state"] for r in services["a"]["replicas"]] == ["backed_up"]
    saved = json.loads((host.state_dir / "services.json").read_text())
    assert sorted(s["name"] for s in saved["services"]) == ["a", "b"]


def test_a_new_speed_up_table_is_persisted_only_when_asked(
    setup: tuple[ServiceHost, list[Any]], loop: asyncio.AbstractEventLoop, models: Path
) -> None:
    """Re-registering a service with only its speed-up table changed (``service.set_eff``)
    keeps the new table; ``services.json`` gets it only with ``persist`` (a cluster node
    registers with ``persist=False``: the coordinator keeps its registrations)."""
    host, _ = setup
    registry = host.state_dir / "services.json"

    def saved_eff() -> str | None:
        (entry,) = [s for s in json.loads(registry.read_text())["services"] if s["name"] == "a"]
        return entry.get("eff")

    before = saved_eff()
    first = replace(spec("a", "tiny_models:small", models), eff={1: 1.0, 2: 1.5})
    complete(loop, host.register(first, persist=False))
    assert by_name(host)["a"]["eff"] == "1:1,2:1.5"
    assert saved_eff() == before
    second = replace(first, eff={1: 1.0, 2: 1.7})
    complete(loop, host.register(second))
    assert saved_eff() == "1:1,2:1.7"
    complete(loop, host.register(spec("a", "tiny_models:small", models)))  # as it was
    assert by_name(host)["a"]["eff"] is None


def test_call_is_correct_after_evict_and_restore(
    setup: tuple[ServiceHost, list[Any]], loop: asyncio.AbstractEventLoop, reference: Any
) -> None:
    """Results equal the module's own after each eviction and restore, on either GPU."""
    host, _ = setup
    expected = reference.small().handle({"x": 3.0})["y"]
    count = {k: by_name(host)["a"][k] for k in ("restores", "calls", "evictions")}
    restored = complete(loop, host.ensure_resident("a", [0]))
    assert restored.needed and restored.nbytes > 0
    assert by_name(host)["a"]["replicas"][0] == {
        **by_name(host)["a"]["replicas"][0],
        "gpus": [0],
        "state": "resident",
    }
    first = complete(loop, host.call("a", [0], {"x": 3.0}, timeout=30))
    assert first.outcome == "ok" and first.result["y"] == pytest.approx(expected)
    assert first.restore_s == 0.0
    complete(loop, host.evict("a", [0]))
    assert by_name(host)["a"]["replicas"][0]["state"] == "backed_up"
    again = complete(loop, host.call("a", [1], {"x": 3.0}, timeout=30))
    assert again.outcome == "ok" and again.result["y"] == pytest.approx(expected)
    assert again.restore_s >= 0.5 * 0.9  # the simulated link: 0.06 GB at 0.12 GB/s
    entry = by_name(host)["a"]
    assert entry["restores"] - count["restores"] == 2
    assert entry["calls"] - count["calls"] == 2 and entry["evictions"] - count["evictions"] == 1
    assert entry["replicas"][0]["gpus"] == [1] and entry["replicas"][0]["state"] == "resident"


def test_eviction_really_frees_the_working_copy(
    setup: tuple[ServiceHost, list[Any]], loop: asyncio.AbstractEventLoop, reference: Any
) -> None:
    """Evicting the 32 MiB module drops the worker's resident memory by about that much."""
    host, _ = setup
    complete(loop, host.evict("a", [1]))
    complete(loop, host.ensure_resident("b", [1]))
    pid = by_name(host)["b"]["replicas"][0]["pid"]
    before = psutil.Process(pid).memory_info().rss
    moved = complete(loop, host.evict("b", [1]))
    after = psutil.Process(pid).memory_info().rss
    assert moved.nbytes >= 32 << 20
    assert before - after >= 0.8 * moved.nbytes
    result = complete(loop, host.call("b", [1], {"x": 1.0}, timeout=30))
    assert result.result["y"] == pytest.approx(reference.big().handle({"x": 1.0})["y"], rel=1e-5)
    assert psutil.Process(pid).memory_info().rss - after >= 0.8 * moved.nbytes


def test_host_follows_the_pool_and_never_oversubscribes(
    setup: tuple[ServiceHost, list[Any]], loop: asyncio.AbstractEventLoop
) -> None:
    """The pool's LRU plan is carried out exactly; a restore the pool did not make room for
    is refused rather than oversubscribing the GPU."""
    host, _ = setup  # every replica evicted
    pool = host.inventory.node_pool("n0")
    specs = {s.name: s.pool_spec() for s in host.specs()}
    for s in specs.values():
        pool.register_service(s)

    def act(tick: int, name: str, gpu: int) -> None:
        action = ActionId(f"act{tick}")
        pool.allocate_gpus(action, [gpu])
        plan = pool.restore(specs[name], [gpu], tick)
        complete(loop, host.apply(name, [gpu], plan.evicted))
        assert complete(loop, host.call(name, [gpu], {"x": 1}, timeout=30)).outcome == "ok"
        pool.release(action)

    act(1, "a", 0)
    act(2, "b", 0)  # GPU 0 holds a: the plan evicts it, the host carries that out
    act(3, "a", 1)
    pool.validate()
    for name in specs:
        for gpu in (0, 1):
            replicas = by_name(host)[name]["replicas"]
            on_gpu = any(r["gpus"] == [gpu] and r["state"] == "resident" for r in replicas)
            assert on_gpu == pool.is_resident(name, [gpu]), (name, gpu)
    assert all(host.resident_bytes(g) <= host.inventory.gpu(g).mem_bytes for g in (0, 1))
    with pytest.raises(Oversubscribed, match="GPU 0"):
        complete(loop, host.ensure_resident("a", [0]))
    with pytest.raises(ServiceNotFound):
        complete(loop, host.ensure_resident("nope", [0]))
    with pytest.raises(ValueError, match="not an aligned chunk"):
        complete(loop, host.ensure_resident("a", [1, 2]))


def test_restores_on_different_gpus_overlap(
    setup: tuple[ServiceHost, list[Any]], loop: asyncio.AbstractEventLoop
) -> None:
    """Two replicas restored onto different GPUs copy at the same time, not one after another."""
    host, _ = setup  # every replica evicted
    start = time.perf_counter()
    one, two = complete(
        loop, gather(host.ensure_resident("a", [0]), host.ensure_resident("b", [1]))
    )
    wall = time.perf_counter() - start
    assert one.needed and two.needed
    assert min(one.seconds, two.seconds) >= 0.45
    assert wall < 0.8 * (one.seconds + two.seconds)


def test_handler_rejection_is_failed_and_worker_lives(
    setup: tuple[ServiceHost, list[Any]], loop: asyncio.AbstractEventLoop
) -> None:
    """A payload the handler rejects ends 'failed' with its message; the worker carries on."""
    host, _ = setup
    pid = by_name(host)["a"]["replicas"][0]["pid"]
    bad = complete(loop, host.call("a", [0], {"y": 1}, timeout=30))
    assert bad.outcome == "failed" and bad.error == "ValueError: payload needs 'x'"
    assert bad.result is None
    good = complete(loop, host.call("a", [0], {"x": 1}, timeout=30))
    assert good.outcome == "ok" and good.result["pid"] == pid


def test_timeout_ends_the_call_and_stops_the_worker(
    own: tuple[ServiceHost, list[Any]], loop: asyncio.AbstractEventLoop
) -> None:
    """A call past its timeout ends 'timeout' and its stuck worker is stopped (a handler
    cannot be interrupted); the replica shows 'failed' until its next use restarts it."""
    host, _ = own
    pid = by_name(host)["a"]["replicas"][0]["pid"]
    slow = complete(loop, host.call("a", [0], {"x": 1, "sleep": 30}, timeout=1.0))
    assert slow.outcome == "timeout" and "1.0 s" in slow.error
    assert by_name(host)["a"]["replicas"][0]["state"] == "failed"
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_killed_worker_is_infra_error_then_restarted(
    own: tuple[ServiceHost, list[Any]],
    loop: asyncio.AbstractEventLoop,
    reference: Any,
    tmp_path: Path,
) -> None:
    """SIGKILL during a call: that call is 'infra_error', other services are untouched, and
    the next call restarts the replica with correct results; an idle replica's death is
    noticed at once, without a call."""
    host, _ = own
    pid = by_name(host)["b"]["replicas"][0]["pid"]
    other = by_name(host)["a"]["replicas"][0]

    async def kill_during_call() -> Any:
        started = tmp_path / "started"
        payload = {"x": 1, "sleep": 20, "started": str(started)}
        call = asyncio.ensure_future(host.call("b", [1], payload, timeout=30))
        await wait_for_async(started.exists, 30, "the call inside the handler")
        os.kill(pid, signal.SIGKILL)
        return await call

    crashed = complete(loop, kill_during_call())
    assert crashed.outcome == "infra_error" and "worker" in crashed.error
    assert by_name(host)["b"]["replicas"][0]["state"] == "failed"
    assert by_name(host)["a"]["replicas"][0] == other
    again = complete(loop, host.call("b", [1], {"x": 5}, timeout=30))
    assert again.outcome == "ok" and again.result["pid"] != pid
    assert again.result["y"] == pytest.approx(reference.big().handle({"x": 5})["y"], rel=1e-5)
    assert by_name(host)["b"]["replicas"][0]["state"] == "resident"

    async def kill_idle() -> str:
        os.kill(again.result["pid"], signal.SIGKILL)
        # noticed without any call: the replica's pidfd fires
        await wait_for_async(
            lambda: by_name(host)["b"]["replicas"][0]["state"] == "failed", 2, "noticed"
        )
        return str(by_name(host)["b"]["replicas"][0]["state"])

    assert complete(loop, kill_idle()) == "failed"
    complete(loop, host.evict("b", [1]))  # the pool moves on: the dead replica leaves its GPU
    assert by_name(host)["b"]["replicas"][0]["gpus"] == []
    assert (
        complete(loop, host.call("b", [1], {"x": 5}, timeout=30)).result["y"] == again.result["y"]
    )
    assert len(by_name(host)["b"]["replicas"]) == 1  # the slot was reused, not leaked


def test_remove_rejects_running_and_queued_calls(
    own: tuple[ServiceHost, list[Any]], loop: asyncio.AbstractEventLoop, tmp_path: Path
) -> None:
    """Removing a service ends its in-flight and queued calls 'rejected' and forgets it."""
    host, _ = own

    async def remove_under_load() -> list[Any]:
        started = tmp_path / "started"
        payload = {"x": 1, "sleep": 20, "started": str(started)}
        running = asyncio.ensure_future(host.call("b", [1], payload, timeout=30))
        queued = asyncio.ensure_future(host.call("b", [1], {"x": 1}, timeout=30))
        await wait_for_async(started.exists, 30, "the first call inside the handler")
        await host.remove("b")
        return list(await asyncio.gather(running, queued))

    outcomes = complete(loop, remove_under_load())
    assert [o.outcome for o in outcomes] == ["rejected", "rejected"]
    assert sorted(by_name(host)) == ["a"]
    saved = json.loads((host.state_dir / "services.json").read_text())
    assert [s["name"] for s in saved["services"]] == ["a"]


def test_registrations_survive_a_restart(
    own: tuple[ServiceHost, list[Any]], loop: asyncio.AbstractEventLoop, reference: Any
) -> None:
    """A new host on the same state dir loads the persisted services and serves them; one
    whose module outgrew its mem_gb is reported, kept registered, and marked failed."""
    host, _ = own
    registry = host.state_dir / "services.json"
    saved = json.loads(registry.read_text())
    (a,) = [s for s in saved["services"] if s["name"] == "a"]
    saved["services"].append({**a, "name": "tight", "entry": "tiny_models:big", "mem_gb": 0.001})
    registry.write_text(json.dumps(saved))
    again = ServiceHost(host.inventory, host.state_dir)
    try:
        errors = complete(loop, again.start())
        assert list(errors) == ["tight"] and "more than mem_gb=0.001" in errors["tight"]
        assert sorted(s["name"] for s in again.list()) == ["a", "b", "tight"]
        assert by_name(again)["tight"]["replicas"][0]["state"] == "failed"
        result = complete(loop, again.call("a", [1], {"x": 4}, timeout=30))
        assert result.outcome == "ok"
        assert result.result["y"] == pytest.approx(reference.small().handle({"x": 4})["y"])
    finally:
        complete(loop, again.close())

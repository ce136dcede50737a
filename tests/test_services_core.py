"""The core's side of dynamic batching and warm replicas, fed events synchronously (issue 33,
items 3 and 4): the exact commands for riders, batch windows and ``min_resident``."""

from __future__ import annotations

from typing import Any

import pytest

from tangram.pools.cpu import CpuCluster, CpuNodePool
from tangram.pools.gpu import GpuCluster, GpuNodePool
from tangram.protocol.results import CallSpec
from tangramd import events as ev
from tangramd.state import Core, CoreConfig

GIB = 1 << 30


def gpu_core(n_gpus: int = 1) -> Core:
    cluster = CpuCluster([CpuNodePool("local", [[0, 1]], 8 * GIB)])
    node = GpuNodePool("local", n_gpus, mem_per_gpu=100, h2d_bytes_per_s=1000.0)
    return Core(cluster, {}, CoreConfig(), gpu=GpuCluster([node], {}))


def register(core: Core, name: str, now: float = 0.0, **extra: Any) -> list[ev.Command]:
    """Register a 60-byte torch service; the commands after the host loaded it."""
    args = {"name": name, "runtime": "torch", "mem_gb": 60e-9, "entry": "m:f", **extra}
    (load,) = core.handle(ev.RegisterService(args=args, token=1), now)
    assert isinstance(load, ev.LoadService)
    reply, *rest = core.handle(ev.ServiceLoaded(spec=load.spec, info={"name": name}), now)
    assert reply.token == 1
    return rest


def submit(core: Core, token: int, name: str, now: float) -> list[ev.Command]:
    return core.handle(ev.SubmitCall(spec=CallSpec(name, {"x": token}), token=token), now)


def tick(core: Core, now: float) -> list[ev.Command]:
    return core.handle(ev.Tick(), now)


def finished(core: Core, aid: str, now: float, batch: int = 1) -> list[ev.Command]:
    done = ev.CallFinished(action_id=aid, outcome="ok", result={"id": aid}, exec_s=0.5, batch=batch)
    return core.handle(done, now)


def test_queued_calls_ride_along_up_to_max_batch():
    """While the GPU is busy, calls queue; the next placement takes up to max_batch - 1 of
    them along, each rider answered with its own result, the batch size and the GPUs."""
    core = gpu_core()
    register(core, "a", max_batch=3)
    assert submit(core, 1, "a", 1.0) == []
    (first,) = tick(core, 1.0)
    assert isinstance(first, ev.RunCall) and first.riders == ()
    for token in (2, 3, 4, 5):
        assert submit(core, token, "a", 1.1) == []
    assert tick(core, 1.1) == []  # the only GPU is held
    (reply,) = finished(core, first.action_id, 2.0)
    assert reply.token == 1 and reply.result["batch"] == 1
    (run,) = tick(core, 2.0)
    assert isinstance(run, ev.RunCall) and run.payload == {"x": 2}
    assert [payload for _, payload in run.riders] == [{"x": 3}, {"x": 4}]
    rider_replies = [finished(core, aid, 2.5, batch=3)[0] for aid, _ in run.riders]
    for reply, token in zip(rider_replies, (3, 4), strict=True):
        answer = reply.result
        assert reply.token == token and answer["batch"] == 3
        assert answer["gpus"] == [0] and answer["node"] == "local"
        assert answer["queue_s"] == pytest.approx(0.9)  # 1.1 to 2.0: until it joined
    assert core.gpu is not None and core.gpu.free_units() == 0  # the leader still holds it
    (leader,) = finished(core, run.action_id, 2.5, batch=3)
    assert leader.token == 2 and leader.result["batch"] == 3
    (last,) = tick(core, 2.5)
    assert isinstance(last, ev.RunCall) and last.payload == {"x": 5} and last.riders == ()
    # the pass time is known per batch size; the next batch of 3 is expected to take it
    assert core.history.estimate("service/a@3") == pytest.approx(0.5)
    core.validate()


def test_a_batch_window_waits_for_more_calls_and_a_full_batch_leaves_at_once():
    """With batch_window_ms, a batch that is not full waits for new calls (a wake-up at the
    window's end); one that fills up is sent at once."""
    core = gpu_core()
    register(core, "a", max_batch=3, batch_window_ms=100)
    assert submit(core, 1, "a", 1.0) == []
    assert tick(core, 1.0) == []  # placed, forming
    assert core.next_wakeup(1.0) == pytest.approx(1.1)
    assert submit(core, 2, "a", 1.05) == []  # joins the open batch
    (run,) = tick(core, 1.1)
    assert isinstance(run, ev.RunCall) and [p for _, p in run.riders] == [{"x": 2}]
    for aid, _ in run.riders:
        finished(core, aid, 1.2, batch=2)
    finished(core, run.action_id, 1.2, batch=2)
    assert submit(core, 3, "a", 2.0) == []
    assert tick(core, 2.0) == []
    assert submit(core, 4, "a", 2.01) == []
    (full,) = submit(core, 5, "a", 2.02)  # the third call fills it: sent before the window
    assert isinstance(full, ev.RunCall) and len(full.riders) == 2
    assert core.services.batch_due() is None
    core.validate()


def test_min_resident_warms_a_replica_when_there_is_room_and_again_after_an_eviction():
    """A min_resident service is restored onto a free GPU when registered; a call of another
    service evicts it (no room for both); it comes back once that service's memory is
    free, never by evicting anything."""
    core = gpu_core()
    (warm,) = register(core, "w", min_resident=1)
    assert isinstance(warm, ev.WarmService) and (warm.service, warm.gpus) == ("w", (0,))
    assert register(core, "x") == []  # no room left for a second warm-up: nothing else
    assert submit(core, 1, "x", 1.0) == []
    (run,) = tick(core, 1.0)
    assert [(v.service, v.gpu) for v in run.evicted] == [("w", 0)]
    (reply,) = finished(core, run.action_id, 1.5)  # x is resident now: no room for w
    assert reply.token == 1
    out = core.handle(ev.RemoveService(name="x", token=9), 2.0)
    assert [type(c) for c in out] == [ev.UnloadService]
    reply, again = core.handle(ev.ServiceUnloaded(name="x"), 2.1)
    assert isinstance(again, ev.WarmService) and again.gpus == (0,)
    core.validate()

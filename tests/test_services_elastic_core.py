"""Elastic GPU calls in the core, fed events synchronously (issue 33 item 2): the scheduler
picks a call's GPU count from the service's speed-up table (``eff``) with the chunk DP,
the call reports the GPUs it ran on, and the duration estimate knows the count."""

from __future__ import annotations

from typing import Any

import pytest

from tangram.pools.cpu import CpuCluster, CpuNodePool
from tangram.pools.gpu import GpuCluster, GpuNodePool
from tangram.protocol.results import CallSpec
from tangramd import events as ev
from tangramd.services.spec import ServiceSpec
from tangramd.state import Core, CoreConfig

GIB = 1 << 30


def gpu_core(n_gpus: int = 2) -> Core:
    cluster = CpuCluster([CpuNodePool("local", [[0, 1]], 8 * GIB)])
    node = GpuNodePool("local", n_gpus, mem_per_gpu=100, h2d_bytes_per_s=1000.0)
    return Core(cluster, {}, CoreConfig(), gpu=GpuCluster([node], {}))


def register(core: Core, name: str, **extra: Any) -> None:
    """Register a 60-byte torch service (restores take 0.06 s over 1000 B/s at one GPU)."""
    args = {"name": name, "runtime": "torch", "mem_gb": 60e-9, "entry": "m:f", **extra}
    (load,) = core.handle(ev.RegisterService(args=args, token=1), 0.0)
    assert isinstance(load, ev.LoadService)
    reply, *_ = core.handle(ev.ServiceLoaded(spec=load.spec, info={"name": name}), 0.0)
    assert reply.token == 1


def submit(core: Core, token: int, name: str, now: float, gpus: int | None = None) -> None:
    spec = CallSpec(name, {"x": token}, gpus=gpus)
    assert core.handle(ev.SubmitCall(spec=spec, token=token), now) == []


def run(core: Core, now: float) -> list[ev.RunCall]:
    out = core.handle(ev.Tick(), now)
    assert all(isinstance(c, ev.RunCall) for c in out), out
    return [c for c in out if isinstance(c, ev.RunCall)]


def finish(core: Core, call: ev.RunCall, now: float, exec_s: float) -> dict[str, Any]:
    done = ev.CallFinished(action_id=call.action_id, outcome="ok", result={}, exec_s=exec_s)
    (reply,) = core.handle(done, now)
    assert isinstance(reply.result, dict)
    return reply.result


def test_an_elastic_call_gets_two_gpus_when_idle_and_reports_them() -> None:
    """On two idle GPUs a call to a service with eff 1:1,2:1.8 runs on both, and its answer
    names them; the same service without eff runs on one."""
    core = gpu_core()
    register(core, "e", gpus=[1, 2], eff="1:1,2:1.8")
    register(core, "plain", gpus=[1, 2])
    submit(core, 1, "e", 1.0)
    (call,) = run(core, 1.0)
    assert call.gpus == (0, 1)
    assert finish(core, call, 2.0, 0.5)["gpus"] == [0, 1]
    submit(core, 2, "plain", 3.0)
    (call,) = run(core, 3.0)
    assert len(call.gpus) == 1
    core.validate()


def test_an_elastic_call_gets_one_gpu_when_the_other_is_held_by_a_long_call() -> None:
    """With one GPU held by a call expected to run for seconds, an elastic call starts at
    once on the free GPU rather than wait for both."""
    core = gpu_core()
    register(core, "e", gpus=[1, 2], eff="1:1,2:1.3")
    register(core, "long")
    submit(core, 1, "long", 0.0)
    (first,) = run(core, 0.0)
    finish(core, first, 10.0, 10.0)  # its history: 10 s a call
    submit(core, 2, "long", 10.0)
    (blocker,) = run(core, 10.0)
    submit(core, 3, "e", 10.1)
    (call,) = run(core, 10.1)
    assert len(call.gpus) == 1 and call.gpus != blocker.gpus
    core.validate()


def test_two_elastic_calls_in_one_pass_share_the_gpus_when_the_speed_up_is_low() -> None:
    """Two calls queued together on two GPUs with a low speed-up at 2 run side by side on
    one GPU each (one after the other on two would end later in sum); with a high
    speed-up the first takes both and the second waits."""
    for eff, counts in (("1:1,2:1.2", [1, 1]), ("1:1,2:1.95", [2])):
        core = gpu_core()
        register(core, "e", gpus=[1, 2], eff=eff)
        submit(core, 1, "e", 1.0)
        submit(core, 2, "e", 1.0)
        calls = run(core, 1.0)
        assert [len(c.gpus) for c in calls] == counts, eff
        core.validate()


def test_gpus_in_the_call_pins_the_count() -> None:
    """``gpus`` in a call runs it at exactly that count (even without eff); a count the
    service does not list, or more GPUs than a node has, is a bad request."""
    core = gpu_core()
    register(core, "e", gpus=[1, 2])
    submit(core, 1, "e", 1.0, gpus=2)
    (call,) = run(core, 1.0)
    assert call.gpus == (0, 1)
    finish(core, call, 1.5, 0.1)
    register(core, "one")
    for name, bad in (("e", 4), ("e", 8), ("one", 2)):
        (reply,) = core.handle(ev.SubmitCall(spec=CallSpec(name, {}, gpus=bad), token=9), 2.0)
        assert reply.error is not None and reply.error[0] == "bad_request", reply
        assert f"gpus={bad} is not one of the counts" in reply.error[1], reply
    assert not core.actions.queue
    core.validate()


def test_the_duration_estimate_knows_the_gpu_count() -> None:
    """The history keeps work at speed-up 1 (a call's seconds times its speed-up), so the
    expected duration at k GPUs is that work over speed-up(k), for a placement as for a
    pinned call."""
    core = gpu_core()
    register(core, "e", gpus=[1, 2], eff="1:1,2:1.6")
    submit(core, 1, "e", 0.0)
    (call,) = run(core, 0.0)
    assert call.gpus == (0, 1)
    finish(core, call, 1.0, 0.5)  # 0.5 s on 2 GPUs = 0.8 s of work at speed-up 1
    assert core.history.estimate("service/e") == pytest.approx(0.8)
    submit(core, 2, "e", 2.0)
    (call,) = run(core, 2.0)  # resident on both: no restore
    assert call.gpus == (0, 1)
    assert core.actions[call.action_id].expected_s == pytest.approx(0.5)
    finish(core, call, 2.5, 0.5)
    submit(core, 3, "e", 3.0, gpus=1)
    (call,) = run(core, 3.0)
    rec = core.actions[call.action_id]
    # 1 GPU: all the work, and a restore
    assert rec.expected_s == pytest.approx(0.8 + 0.06, abs=0.002)
    core.validate()


def test_speedup_and_elastic_terms_of_a_spec() -> None:
    """``ServiceSpec.speedup`` reads the table (linear between counts, proportional below,
    flat above; 1 without one) and ``elastic`` turns it into the model's t1 and E(k) with
    dur(k) = work / speedup(k), a super-linear table included."""
    spec = ServiceSpec("s", "torch", 1.0, gpus=(1, 2, 4, 8), entry="m:f", eff="2:1.8,8:6")
    assert [spec.speedup(k) for k in (1, 2, 4, 8)] == pytest.approx([0.9, 1.8, 3.2, 6.0])
    assert ServiceSpec("p", "torch", 1.0, entry="m:f").speedup(4) == 1.0
    t1, eff = spec.elastic([1, 2, 4, 8], 12.0)
    assert sorted(eff) == [2, 4, 8]  # 1 is below the table: not a choice
    for k, e in eff.items():
        assert t1 / (e * k) == pytest.approx(12.0 / spec.speedup(k))
    fast = ServiceSpec("f", "torch", 1.0, gpus=(1, 2), entry="m:f", eff="1:1,2:2.5")
    t1, eff = fast.elastic([1, 2], 10.0)
    assert max(eff.values()) <= 1.0 and t1 / (eff[2] * 2) == pytest.approx(4.0)
    assert spec.elastic([1, 2], 3.0) == (3.0, {})  # one count covered: not elastic

"""The daemon's garbage-collector policy (tangramd/collector.py): a scheduling pass runs with
the cyclic collector paused, the daemon's passes go through it, and bench/sched.py times
the pass through the same function."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from script_loader import load_script

from tangram.pools.cpu import CpuCluster, CpuNodePool
from tangram.protocol.results import ExecSpec
from tangramd import collector
from tangramd import events as ev
from tangramd.state import Core, CoreConfig
from tangramd.state.handlers import scheduling

GIB = 1 << 30


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_paused_turns_the_collector_off_and_back(collector_on) -> None:
    with collector.paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector.paused():
        raise RuntimeError("boom")
    assert gc.isenabled()  # back on after an exception too
    gc.disable()
    try:
        with collector.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # off before: stays off
    finally:
        gc.enable()


def _core_passes(short: bool, seen: list[bool], monkeypatch) -> Core:
    real = collector.schedule

    def spy(snapshot, now, config):
        seen.append(gc.isenabled())
        return real(snapshot, now, config)

    monkeypatch.setattr(collector, "schedule", spy)
    core = Core(
        CpuCluster([CpuNodePool("n1", [[0, 1]], 8 * GIB)]), {}, CoreConfig(short_passes=short)
    )
    tokens = iter(range(1, 10**6))
    out = core.handle(ev.OpenEnv(token=next(tokens), mem=GIB), 0.0)
    env = next(c.env_id for c in out if isinstance(c, ev.CreateEnv))
    core.handle(ev.EnvCreated(env_id=env), 0.0)
    now = 0.0
    for _ in range(6):
        now += 0.01
        core.handle(
            ev.SubmitExec(spec=ExecSpec(cmd="true", env=env, cpus=1), token=next(tokens)), now
        )
        core.handle(ev.Tick(), now + 0.01)
    return core


@pytest.mark.parametrize("short", [False, True])
def test_the_daemon_runs_its_passes_with_the_collector_paused(
    collector_on, monkeypatch, short: bool
) -> None:
    assert scheduling.schedule_paused is collector.schedule_paused
    seen: list[bool] = []
    core = _core_passes(short, seen, monkeypatch)
    assert core.passes > 0 and seen, "no pass ran the scheduler"
    assert not any(seen)  # every pass: the collector off
    assert gc.isenabled()  # and on again after


def test_the_bench_times_the_daemon_s_pass(collector_on, monkeypatch) -> None:
    path = Path(__file__).resolve().parents[1] / "bench" / "sched.py"
    bench = load_script(path, "bench_sched_gc")
    assert bench.schedule_paused is collector.schedule_paused
    seen: list[bool] = []
    real = collector.schedule

    def spy(snapshot, now, config):
        seen.append(gc.isenabled())
        return real(snapshot, now, config)

    monkeypatch.setattr(collector, "schedule", spy)
    result = bench.run(2, "fcfs", cases=[(64, 64)])  # --gc daemon, the default
    assert result["gc"] == "daemon" and seen and not any(seen)
    seen.clear()
    bench.run(2, "fcfs", gc_mode="plain", cases=[(64, 64)])
    assert not seen  # plain: schedule itself, the collector on (compared against)
    assert gc.isenabled()

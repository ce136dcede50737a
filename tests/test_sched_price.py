"""The "priced" rule: DoP priced by load, short-call reserve, EASY backfill, load meter."""

from __future__ import annotations

import math

import pytest

from tangram.model import ActionId, TrajectoryId, make_action
from tangram.pools.cpu import CpuNodePool
from tangram.sched import LoadMeter, PoolLoad, SchedConfig, Snapshot, schedule
from tangram.sched.price import band, price_bands, priced_dop, probe, short_reserve

GIB = 1 << 30
PROFILE = (1, 2, 4, 8, 16, 32)


def amdahl(f: float) -> dict[int, float]:
    return {m: 1.0 / (1.0 + f * (m - 1)) for m in PROFILE}


def suite_run(i: int, t1: float = 300.0, f: float = 0.09, seq: int | None = None):
    return make_action(
        f"e{i}",
        "exec",
        f"t{i}",
        {"cpu": [1, 32]},
        seq=i if seq is None else seq,
        t1_s=t1,
        eff=amdahl(f),
    )


def tool(i: int, dur: float = 1.0):
    return make_action(f"s{i}", "exec", f"t{i}", {"cpu": 1}, seq=i, dur_s=dur)


def node(cores: int = 64) -> CpuNodePool:
    return CpuNodePool("n0", [list(range(cores))], 64 * GIB)


def snap(pool: CpuNodePool, actions, running=(), load: PoolLoad | None = None) -> Snapshot:
    return Snapshot(
        waiting=list(actions),
        pools={pool.pool_id: pool},
        affinity={TrajectoryId(a.trajectory): pool.pool_id for a in actions},
        running={pool.pool_id: list(running)},
        load={pool.pool_id: load} if load else {},
    )


def amdahl_dur(t1: float, f: float):
    return lambda k: t1 * (1.0 + f * (k - 1)) / k


def sharing(n: float, units: float = 64.0):
    return lambda k: n / units


@pytest.mark.parametrize(
    ("name", "n", "expected"),
    [
        ("alone", 1, 32),  # nothing competes: the widest amount
        ("two share 64", 2, 32),  # fair share 32 each
        ("eight share 64", 8, 8),  # fair share 8 each
        ("forty share 64", 40, 4),  # contended: sqrt(0.91 * 64 / (0.09 * 40)) = 4.0
    ],
)
def test_priced_dop_table(name: str, n: int, expected: int) -> None:
    """The priced DoP is the fair share while uncontended and shrinks with N under load."""
    assert priced_dop(PROFILE, amdahl_dur(300.0, 0.09), sharing(n)) == expected, name


def test_priced_dop_follows_square_root_law_under_load() -> None:
    """Under load the priced DoP tracks k* = sqrt((1 - f) C / (f N)) within the probe set."""
    f, units = 0.09, 256.0
    for n in (40, 160, 640):
        k = priced_dop(PROFILE, amdahl_dur(300.0, f), sharing(n, units))
        exact = math.sqrt((1 - f) * units / (f * n))
        assert k / 2 <= exact <= k * 2, (n, k, exact)


def test_price_bands_is_band_of_priced_dop() -> None:
    """price_bands (priced_dop inlined for speed) bands every elastic action of a queue at
    priced_dop's amount with the pool's sharing term N / C."""
    queue = [suite_run(i, t1=60.0 + 37.0 * i, f=0.02 * (i % 7)) for i in range(12)]
    queue += [tool(100 + i) for i in range(5)]
    for load in (
        PoolLoad(),
        PoolLoad(short_units=3.0, elastic_starts_per_s=0.4, elastic_mean_s=50.0),
    ):
        bands = price_bands(queue, 64, load, lambda a: a.allowed, lambda a, k: a.duration(k, 1.0))
        units = max(1.0, 64 - short_reserve(load))
        n = 12 + max(load.elastic_running, load.elastic_starts_per_s * load.elastic_mean_s)
        for a in queue[:12]:
            k = priced_dop(a.allowed, lambda u, a=a: a.duration(u, 1.0), lambda u, s=n / units: s)
            assert bands[a.id] == band(a.allowed, k), a.id
        assert set(bands) == {a.id for a in queue[:12]}


def test_band_and_probe() -> None:
    """The band is the allowed amounts in [k/2, k]; the probe keeps ends and powers of two."""
    amounts = tuple(range(1, 33))
    assert band(amounts, 8) == (4, 5, 6, 7, 8)
    assert band((1, 3, 9), 2) == (1,)
    assert band((3, 9), 2) == (2,)  # never empty: the priced amount itself
    assert probe(amounts) == (1, 2, 4, 8, 16, 32)
    assert probe((3, 5, 6, 12)) == (3, 12)


def test_short_reserve() -> None:
    """Short calls keep their offered load plus its square root (square-root staffing)."""
    assert short_reserve(PoolLoad()) == 0
    assert short_reserve(PoolLoad(short_units=16.0)) == 20
    assert short_reserve(PoolLoad(short_units=2.0)) == pytest.approx(2 + math.sqrt(2))
    assert short_reserve(PoolLoad(short_units=0.01)) == pytest.approx(0.11)  # not a whole unit


def test_lone_test_run_on_idle_node_takes_the_node() -> None:
    """With nothing else present or forecast, the test run gets the upper half of its set."""
    pool = node(64)
    d = schedule(snap(pool, [suite_run(0)]), 0.0)
    durations = {u: suite_run(0).duration(u, 0.0) for u in range(16, 33)}
    assert [p.amount for p in d.placements] == [min(durations, key=durations.__getitem__)]
    wait_eft = schedule(snap(pool, [suite_run(0)]), 0.0, SchedConfig(rule="wait-eft"))
    assert 16 <= wait_eft.placements[0].amount <= 32


def test_forecast_narrows_the_dop_on_an_idle_node() -> None:
    """An idle node with test runs arriving fast gives the first one less than all."""
    pool = node(64)
    quiet = schedule(snap(pool, [suite_run(0)]), 0.0)
    forecast = PoolLoad(elastic_starts_per_s=0.5, elastic_mean_s=40.0)  # 20 in service
    busy = schedule(snap(pool, [suite_run(0)], load=forecast), 0.0)
    assert busy.placements[0].amount < quiet.placements[0].amount
    # submissions alone are no forecast: queued ones are counted as queued (module doc)
    submitted = schedule(snap(pool, [suite_run(0)], load=PoolLoad(elastic_per_s=0.5)), 0.0)
    assert submitted.placements[0].amount == quiet.placements[0].amount
    assert SchedConfig().rule == "priced"


def test_short_call_backfills_past_blocked_action() -> None:
    """A 1 s call passes an 8-core action waiting 5 s for cores; a 10 s one would delay it."""
    pool = node(8)
    for core in range(6):
        pool.allocate(ActionId(f"busy{core}"), (core,))
    running = [(5.0, 6)]
    head = make_action("h", "exec", "th", {"cpu": 8}, seq=0, dur_s=50.0)
    short, long_ = tool(1, 1.0), tool(2, 10.0)
    d = schedule(snap(pool, [head, short], running), 0.0)
    assert [p.action_id for p in d.placements] == ["s1"]
    d = schedule(snap(pool, [head, long_], running), 0.0)
    assert d.placements == ()
    # the other rules keep strict FCFS behind the blocked head
    strict = schedule(snap(pool, [head, short], running), 0.0, SchedConfig(rule="wait-eft"))
    assert strict.placements == ()


def test_short_calls_pass_waiting_test_run_until_it_starves() -> None:
    """Short calls pass a test run waiting for its band; after the starvation bound they
    may only if they do not delay its reservation."""
    pool = node(8)
    for core in range(6):
        pool.allocate(ActionId(f"busy{core}"), (core,))
    running = [(5.0, 6)]
    head, long_ = suite_run(0), tool(1, 10.0)  # alone on 8 cores: band [4, 8], 2 free
    fresh = schedule(snap(pool, [head, long_], running), 0.0)
    assert [p.action_id for p in fresh.placements] == ["s1"]
    starved = schedule(snap(pool, [head, long_], running), 100.0)
    # reservation at 5 s for 4 of the 8 cores: 4 extra, so even the 10 s call fits
    assert [p.action_id for p in starved.placements] == ["s1"]
    three = make_action("s3", "exec", "t3", {"cpu": 2}, seq=3, dur_s=10.0)
    four = make_action("s4", "exec", "t4", {"cpu": 2}, seq=4, dur_s=10.0)
    late = schedule(snap(pool, [head, three, four], [(5.0, 6)]), 100.0)
    assert [p.action_id for p in late.placements] == ["s3"]  # 2 + 2 > 2 free


def test_long_test_run_gets_its_reservation_at_once() -> None:
    """A waiting test run expected to run longer than the mean of those in service is the
    ACT tail: it gets its EASY reservation at once, not after the starvation bound, so a
    10 s call that would delay it waits; one shorter than the mean is passed as before."""
    pool = node(8)
    for core in range(6):
        pool.allocate(ActionId(f"busy{core}"), (core,))
    running = [(5.0, 1), (60.0, 5)]  # 3 free at 5 s: the head's 3 cores, none extra
    head, call = suite_run(0), tool(1, 10.0)  # band [3, 6]: t(3) = 118 s; 2 cores free now
    long_mean = PoolLoad(elastic_running=1, elastic_mean_s=1000.0)
    passed = schedule(snap(pool, [head, call], running, load=long_mean), 1.0)
    assert [p.action_id for p in passed.placements] == ["s1"]
    short_mean = PoolLoad(elastic_running=1, elastic_mean_s=30.0)
    held = schedule(snap(pool, [head, call], running, load=short_mean), 1.0)
    assert held.placements == ()
    quick = schedule(snap(pool, [head, tool(2, 1.0)], running, load=short_mean), 1.0)
    assert [p.action_id for p in quick.placements] == ["s2"]  # ends before the reservation


def test_short_call_waits_behind_a_reservation_at_most_its_own_run_time() -> None:
    """A short call held behind a reservation starts once it has waited as long as it is
    expected to run (its slowdown stays at most 2), even if it delays the reservation."""
    pool = node(8)
    for core in range(6):
        pool.allocate(ActionId(f"busy{core}"), (core,))
    running = [(5.0, 1), (60.0, 5)]  # the head's band is [3, 6]: 3 free at 5 s, none extra
    head = suite_run(0)
    load = PoolLoad(elastic_running=1, elastic_mean_s=30.0)  # the head is long: reserved
    for waited, starts in ((9.9, False), (10.0, True)):
        call = make_action("s1", "exec", "t1", {"cpu": 1}, seq=1, dur_s=10.0, submitted_at=0.0)
        d = schedule(snap(pool, [head, call], running, load=load), waited)
        assert ([p.action_id for p in d.placements] == ["s1"]) is starts


def test_elastic_action_does_not_backfill() -> None:
    """Behind a blocked action, a later test run waits its turn even if it would fit."""
    pool = node(64)
    for core in range(40):
        pool.allocate(ActionId(f"busy{core}"), (core,))
    head = make_action("h", "exec", "th", {"cpu": 32}, seq=0, dur_s=50.0)
    d = schedule(snap(pool, [head, suite_run(1, seq=1)], [(5.0, 40)]), 0.0)
    assert d.placements == ()


def test_load_meter_window() -> None:
    """Arrivals and short-call load count over the last window only; running is current."""
    meter = LoadMeter(window_s=10.0)
    meter.submitted("p", 0.0, elastic=True)
    meter.submitted("p", 5.0, elastic=True)
    meter.submitted("p", 5.0, elastic=False)  # not an elastic arrival
    meter.started("p", "s", 5.0, elastic=False, units=2, expected_s=10.0)
    meter.started("p", "e", 6.0, elastic=True, units=8, expected_s=60.0)
    load = meter.load("p", 9.0)
    assert load == PoolLoad(
        elastic_per_s=0.2,
        short_units=2.0,
        elastic_running=1,
        elastic_units=8,
        elastic_starts_per_s=0.1,
        elastic_mean_s=60.0,
    )
    meter.finished("p", "e")
    assert meter.load("p", 12.0) == PoolLoad(
        elastic_per_s=0.1, short_units=2.0, elastic_starts_per_s=0.1, elastic_mean_s=60.0
    )
    assert meter.load("p", 16.0) == PoolLoad()
    assert meter.load("other", 0.0) == PoolLoad()


def fed(meter: LoadMeter, pool: CpuNodePool, now: float) -> PoolLoad:
    return meter.load(pool.pool_id, now)


@pytest.mark.parametrize("speedup", [1.3, 1.5])
@pytest.mark.parametrize("tool_call", [False, True])
def test_lone_elastic_action_on_idle_small_pool_takes_the_cores_that_pay(
    speedup: float, tool_call: bool
) -> None:
    """A lone test run on an idle 2-core node whose profile says 2 cores run it faster gets
    both, although its own submission (and maybe a quick tool call) are in the load meter:
    its own arrival does not forecast a second one, and a vanishing short-call load does not
    reserve a whole core (the demo's tail phase: T(1) = 24 s, speed-up 1.3-1.5)."""
    pool = node(2)
    eff = {1: 1.0, 2: speedup / 2}
    lone = make_action("e0", "exec", "t0", {"cpu": [1, 2]}, seq=1, t1_s=24.0, eff=eff)
    meter = LoadMeter()
    if tool_call:
        meter.started(pool.pool_id, "s0", 0.5, elastic=False, units=1, expected_s=0.05)
        meter.finished(pool.pool_id, "s0")
    meter.submitted(pool.pool_id, 1.0, elastic=True)
    load = fed(meter, pool, 1.0)
    assert load.elastic_per_s > 0 and (load.short_units > 0) == tool_call
    d = schedule(snap(pool, [lone], load=load), 1.0)
    assert [(p.action_id, p.amount) for p in d.placements] == [("e0", 2)]
    # the same with no speed-up: one core is enough
    flat = make_action("e1", "exec", "t1", {"cpu": [1, 2]}, seq=2, t1_s=24.0, eff={1: 1.0, 2: 0.5})
    d = schedule(snap(pool, [flat], load=load), 1.0)
    assert [p.amount for p in d.placements] == [1]


def test_steady_stream_of_test_runs_is_still_priced_busy() -> None:
    """Under a steady stream (a test run started every 2 s, 40 s each: by Little's law 16 in
    service, 4 of them so far), a new test run is priced narrower than the 4 running alone
    would make it, and far narrower than a lone one."""
    pool = node(64)
    # a 10 s window: the stream began 8 s ago, so a longer window would average in the
    # quiet before it
    stream, lone = LoadMeter(window_s=10.0), LoadMeter(window_s=10.0)
    for i in range(4):
        at = 2.0 + 2.0 * i
        stream.submitted(pool.pool_id, at, elastic=True)
        stream.started(pool.pool_id, f"x{i}", at, elastic=True, units=8, expected_s=40.0)
        pool.allocate(ActionId(f"x{i}"), tuple(range(8 * i, 8 * i + 8)))
    for meter in (stream, lone):
        meter.submitted(pool.pool_id, 10.0, elastic=True)  # the test run priced now
    running = [(2.0 + 2.0 * i + 40.0, 8) for i in range(4)]
    load = fed(stream, pool, 10.0)
    assert load.elastic_running == 4 and load.elastic_starts_per_s * load.elastic_mean_s == 16
    busy = schedule(snap(pool, [suite_run(9)], running, load=load), 10.0)
    present = PoolLoad(elastic_running=4, elastic_units=32)  # no forecast: N = 1 + 4
    now_only = schedule(snap(pool, [suite_run(9)], running, load=present), 10.0)
    assert busy.placements[0].amount < now_only.placements[0].amount
    idle = node(64)
    quiet = schedule(snap(idle, [suite_run(9)], load=fed(lone, idle, 10.0)), 10.0)
    assert quiet.placements[0].amount > 16  # alone: near the widest amount
    assert busy.placements[0].amount <= 8


def test_long_test_run_is_not_priced_narrower_for_being_long() -> None:
    """Little's law uses the durations of the actions in service, not the priced one's: a
    test run 10x longer than another gets the same priced band under the same load (it
    used to get a narrower one, which made the longest runs the stragglers of the p99)."""
    pool = node(64)
    load = PoolLoad(elastic_starts_per_s=0.3, elastic_mean_s=40.0)
    short = schedule(snap(pool, [suite_run(0, t1=100.0)], load=load), 0.0)
    long_ = schedule(snap(pool, [suite_run(1, t1=1000.0)], load=load), 0.0)
    assert long_.placements[0].amount == short.placements[0].amount


def crowd_behind(meter: LoadMeter, pool: CpuNodePool, n: int, at: float, run_s: float) -> None:
    """``n`` test runs of ``run_s`` on one core each started ``at`` (staggered by 0.5 s)
    and finished: the window remembers them, the node holds none of them now."""
    for i in range(n):
        started = at + 0.5 * i
        meter.submitted(pool.pool_id, started, elastic=True)
        meter.started(pool.pool_id, f"c{i}", started, elastic=True, units=1, expected_s=run_s)
        meter.finished(pool.pool_id, f"c{i}")


def test_straggler_after_a_burst_takes_the_cores_that_pay_when_it_is_alone() -> None:
    """The demo's tail phase: a 2-core node whose window still holds four test runs of a
    burst that just ended, and one straggler left on it (one environment). Little's law
    alone forecasts 1.8 runs in service and gives it one core, although two run it 1.4x
    faster; no more can share its run than the node's environments not queued here (0),
    so it takes both. While the crowd's environments are still on the node (six), or with
    no count (0: no bound), the forecast stands and it takes one."""
    pool = node(2)
    eff = {1: 1.0, 2: 1.4 / 2}
    straggler = make_action("e0", "exec", "t0", {"cpu": [1, 2]}, seq=1, t1_s=8.8, eff=eff)
    meter = LoadMeter()
    crowd_behind(meter, pool, 4, at=0.0, run_s=8.8)
    meter.submitted(pool.pool_id, 12.0, elastic=True)
    for envs, cores in ((1, 2), (6, 1), (0, 1)):
        load = meter.load(pool.pool_id, 12.0, envs=envs)
        assert load.elastic_starts_per_s * load.elastic_mean_s == pytest.approx(1.76)
        d = schedule(snap(pool, [straggler], load=load), 12.0)
        assert [(p.action_id, p.amount) for p in d.placements] == [("e0", cores)], envs


def test_environment_bound_never_hides_the_runs_in_service() -> None:
    """The bound caps the forecast, never the runs holding cores now: two running and one
    queued on a node with (by a stale count) two environments still price N = 1 + 2."""
    pool = node(64)
    meter = LoadMeter()
    for i in range(2):
        meter.started(pool.pool_id, f"r{i}", float(i), elastic=True, units=8, expected_s=40.0)
    capped = meter.load(pool.pool_id, 2.0, envs=2)
    assert capped.envs == 2 and capped.elastic_running == 2
    present = PoolLoad(elastic_running=2, elastic_units=16)  # the same without the forecast
    queue = [suite_run(9)]
    running = [(40.0, 8), (41.0, 8)]
    bands = price_bands(queue, 48, capped, lambda a: PROFILE, lambda a, k: 300.0 / k)
    same = price_bands(queue, 48, present, lambda a: PROFILE, lambda a, k: 300.0 / k)
    assert bands == same
    assert schedule(snap(pool, queue, running, load=capped), 2.0).placements


def test_load_meter_drops_the_bound_after_a_throwaway_elastic_start() -> None:
    """An elastic action in a throwaway environment (opened for that action alone) means any
    number more may come: ``envs`` reads 0 (no bound) until its start leaves the window."""
    meter = LoadMeter(window_s=10.0)
    assert meter.load("p", 0.0, envs=3).envs == 3  # nothing seen yet: the count as given
    meter.started("p", "a", 1.0, elastic=True, units=2, expected_s=5.0)
    assert meter.load("p", 2.0, envs=3).envs == 3  # a persistent environment's run
    meter.started("p", "b", 3.0, elastic=True, units=2, expected_s=5.0, throwaway=True)
    assert meter.load("p", 4.0, envs=3).envs == 0
    meter.started("p", "c", 5.0, elastic=False, units=1, expected_s=0.1, throwaway=True)
    assert meter.load("p", 12.9, envs=3).envs == 0  # short calls do not matter; b still in
    assert meter.load("p", 13.1, envs=3).envs == 3

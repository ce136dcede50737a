"""The replay's specialised loops (plain, EFT) give exactly the generic loop's result."""

from __future__ import annotations

import heapq

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tangram.model import make_action
from tangram.pools.cpu import CpuNodePool
from tangram.sched import SchedConfig
from tangram.sched.operators import BaseOperator, ChunkOperator
from tangram.sched.replay import NEVER, Durations, Replay, eft_amount, elastic_amounts

GIB = 1 << 30
CORES = 16


@st.composite
def replays(draw: st.DrawFn):
    """A waiting list of short fixed and elastic actions, a busy heap, free cores, bands."""
    n = draw(st.integers(1, 14))
    acts = []
    for i in range(n):
        if draw(st.booleans()):
            hi = draw(st.sampled_from([2, 4, 8, 16]))
            eff = {m: draw(st.floats(0.3, 1.0)) for m in (2, 4, 8, 16) if m <= hi}
            eff[1] = 1.0
            t1 = draw(st.floats(1.0, 100.0))
            acts.append(
                make_action(f"a{i}", "exec", f"t{i}", {"cpu": [1, hi]}, seq=i, t1_s=t1, eff=eff)
            )
        else:
            need = draw(st.integers(1, 4))
            dur = draw(st.floats(0.0, 5.0))
            acts.append(make_action(f"a{i}", "exec", f"t{i}", {"cpu": need}, seq=i, dur_s=dur))
    heap = draw(st.lists(st.tuples(st.floats(0.0, 50.0), st.integers(1, 8)), max_size=6))
    free = draw(st.integers(0, CORES))
    banded = draw(st.booleans())
    return acts, sorted(heap), free, banded


def pool() -> CpuNodePool:
    return CpuNodePool("n0", [list(range(CORES))], 64 * GIB)


@settings(max_examples=300, deadline=None)
@given(replays(), st.sampled_from(["paper", "wait", "wait-eft", "priced"]), st.integers(1, 3))
def test_fast_replay_equals_generic_loop(case, rule, depth) -> None:
    """For every rule and depth, the fast loops return the generic loop's sum bit for bit."""
    acts, heap, free, banded = case
    cfg = SchedConfig(rule=rule, depth=depth)  # type: ignore[arg-type]
    p = pool()
    bands = {}
    if banded:  # what the priced rule hands the replay: the upper half of each set
        for a in acts:
            amounts = elastic_amounts(a, CORES)
            if a.elastic:
                bands[a.id] = tuple(u for u in amounts if 2 * u >= amounts[-1])
    results = []
    for fast in (True, False):
        dur = Durations(p, lambda klass: 1.0, bands)
        replay = Replay(BaseOperator(free), dur, cfg, fast=fast)
        h = list(heap)
        heapq.heapify(h)
        results.append(replay.run(acts, free, h))
    assert results[0] == results[1]


@settings(max_examples=200, deadline=None)
@given(
    replays(),
    st.sampled_from(["paper", "wait", "priced"]),
    st.integers(1, 3),
    st.tuples(*[st.integers(0, 2)] * 4),
)
def test_fast_chunk_replay_equals_generic_loop(case, rule, depth, counts) -> None:
    """On GPU chunks (no plain unit counts) the specialised depth-1 loop returns the
    generic loop's sum bit for bit."""
    acts, heap, _, _ = case
    assume(all(a.allowed[-1] <= 8 for a in acts))
    cfg = SchedConfig(rule=rule, depth=depth)  # type: ignore[arg-type]
    op = ChunkOperator(dict(zip((1, 2, 4, 8), counts, strict=True)))
    results = []
    for fast in (True, False):
        replay = Replay(op, Durations(pool(), lambda klass: 1.0), cfg, fast=fast)
        h = list(heap)
        heapq.heapify(h)
        results.append(replay.run(acts, op.start(), h))
    assert results[0] == results[1]


@st.composite
def any_action(draw: st.DrawFn):
    """An exec action with a profile, a known duration, or neither (the history's turn)."""
    which = draw(st.sampled_from(["profiled", "known", "history"]))
    if which == "profiled":
        hi = draw(st.sampled_from([2, 4, 8, 16]))
        lo = draw(st.sampled_from([1, 2]))
        eff = {m: draw(st.floats(0.3, 1.0)) for m in (2, 4, 8, 16) if lo <= m <= hi}
        eff[lo] = 1.0
        return make_action("a", "exec", "t", {"cpu": [1, hi]}, t1_s=draw(st.floats(1, 99)), eff=eff)
    if which == "known":
        return make_action("a", "exec", "t", {"cpu": 2}, dur_s=draw(st.floats(0.0, 5.0)))
    return make_action("a", "exec", "t", {"cpu": 2}, klass=draw(st.sampled_from(["x", "y"])))


@settings(max_examples=200, deadline=None)
@given(any_action(), st.integers(1, CORES), st.floats(0.01, 10.0))
def test_durations_follow_action_duration(action, amount, estimate) -> None:
    """Durations gives Action.duration (history estimate as fallback) plus the pool's extra
    cost, through the cache, minimum() and the DP tables alike."""
    p = pool()
    history = {"x": estimate, "y": 2 * estimate}
    expected = action.duration(amount, history.get(action.klass, 1.0)) + p.extra_cost(
        action, amount
    )
    dur = Durations(p, lambda klass: history.get(klass, 1.0))
    assert dur(action, amount) == expected
    assert dur.table(action, (amount,)) == {amount: expected}
    lowest = action.min_units
    assert dur.minimum(action) == action.duration(
        lowest, history.get(action.klass, 1.0)
    ) + p.extra_cost(action, lowest)


def _eft_reference(opts, free, order, head, clock):
    """eft_amount without its early stop: every option's finish, the first earliest wins."""
    best, pick = NEVER, opts[0]
    if free >= opts[-1][0]:  # all start now: compared by duration alone
        return min(opts, key=lambda o: o[1]) if min(d for _, d in opts) < NEVER else pick
    for amount, dur in opts:
        s, clk, j = free, clock, head
        while s < amount and j < len(order):
            clk = max(clk, order[j][0])
            s += order[j][1]
            j += 1
        if s >= amount and clk + dur < best:
            best, pick = clk + dur, (amount, dur)
    return pick


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 32), st.floats(0.0, 100.0)), min_size=1, max_size=5),
    st.integers(0, 32),
    st.lists(st.tuples(st.floats(0.0, 100.0), st.integers(1, 16)), max_size=12),
    st.integers(0, 3),
    st.floats(0.0, 20.0),
)
def test_eft_amount_stops_early_without_changing_the_pick(opts, free, busy, head, clock) -> None:
    """eft_amount's early stop (a later start cannot beat the best finish) picks exactly what
    scanning every option picks."""
    amounts = sorted({a for a, _ in opts})
    opts = [(a, next(d for b, d in opts if b == a)) for a in amounts]
    order = sorted(busy)
    head = min(head, len(order))
    assert eft_amount(opts, free, order, head, clock) == _eft_reference(
        opts, free, order, head, clock
    )

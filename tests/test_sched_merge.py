"""The pass's fast paths give what they replace, exactly: the FCFS merges
(tangram/sched/schedule.py ``_merge_by_seq``, ``_seq_sorted``) are the stable sorts they
replace (ties included, a sort when a run is out of order), and the helpers that lost their
lru_cache (``price.probe``, ``replay._at_or_below``, ``replay.spread``) answer as the
set-and-sort versions did, on sorted allowed sets and on anything else."""

from __future__ import annotations

import bisect
import random
from operator import attrgetter

import pytest

from tangram.model import make_action
from tangram.sched.price import probe
from tangram.sched.replay import _at_or_below, spread
from tangram.sched.schedule import _merge_by_seq, _seq_sorted


def _actions(seqs: list[int], tag: str) -> list:
    return [
        make_action(f"{tag}{i}", "exec", f"t{tag}{i}", {"cpu": 1}, seq=s)
        for i, s in enumerate(seqs)
    ]


@pytest.mark.parametrize("seed", range(40))
def test_merge_is_the_stable_sort_of_the_concatenation(seed: int) -> None:
    rng = random.Random(seed)
    first = _actions([rng.randrange(30) for _ in range(rng.randrange(12))], "a")
    second = _actions([rng.randrange(30) for _ in range(rng.randrange(12))], "b")
    if rng.random() < 0.7:  # mostly runs in order (as the pass has them), ties included
        first.sort(key=attrgetter("seq"))
        second.sort(key=attrgetter("seq"))
    want = sorted([*first, *second], key=attrgetter("seq"))
    got = _merge_by_seq(first, second)
    assert [a.id for a in got] == [a.id for a in want]
    assert _seq_sorted(first) == (first == sorted(first, key=attrgetter("seq")))


def _probe_before(amounts: tuple[int, ...]) -> tuple[int, ...]:
    lo, hi = amounts[0], amounts[-1]
    out = {lo, hi}
    k = 1
    while k < hi:
        if k > lo and k in amounts:
            out.add(k)
        k *= 2
    return tuple(sorted(out))


def _spread_before(values: tuple[int, ...], k: int) -> tuple[int, ...]:
    if len(values) <= k:
        return values
    step = (len(values) - 1) / (k - 1)
    return tuple(sorted({values[round(i * step)] for i in range(k)}))


def test_helpers_answer_as_before() -> None:
    rng = random.Random(7)
    for _ in range(5000):
        t = tuple(rng.randrange(0, 70) for _ in range(rng.randrange(1, 12)))
        if rng.random() < 0.7:  # allowed sets are sorted and distinct
            t = tuple(sorted(set(t)))
        assert probe(t) == _probe_before(t), t
        m = rng.randrange(0, 70)
        assert _at_or_below(t, m) == tuple(a for a in t if a <= m), (t, m)
        k = rng.randrange(2, 6)
        assert spread(t, k) == _spread_before(t, k), (t, k)


@pytest.mark.parametrize("own_loop", [False, True])
def test_insort_is_bisect_insort(monkeypatch, own_loop: bool) -> None:
    """replay._insort (compiled: its own binary search on unboxed floats and ints) puts an
    entry where bisect.insort puts the tuple: ties on the finish by units, NaN, inf, ints."""
    from tangram import _native
    from tangram.sched import replay

    if own_loop and not _native.ACTIVE:
        monkeypatch.setattr(replay, "_C_INSORT", False)  # the loop the compiled core runs
    rng = random.Random(3)
    pool = [0.0, 0.5, 1.0, 1.0, 2.0, 3, float("inf"), float("nan"), -0.0]
    for _ in range(3000):
        base = sorted((rng.choice(pool[:7]), rng.randrange(1, 4)) for _ in range(rng.randrange(8)))
        fin, u = rng.choice(pool), rng.randrange(1, 4)
        lo = rng.randrange(len(base) + 1)
        want, got = list(base), list(base)
        bisect.insort(want, (fin, u), lo)
        replay._insort(got, fin, u, lo)
        # (compiled, the finish is stored as the float it is typed as: compare as floats)
        assert repr([(float(f), k) for f, k in got]) == repr([(float(f), k) for f, k in want])


@pytest.mark.parametrize("own_loop", [False, True])
def test_bisect_left_is_bisect_bisect_left(monkeypatch, own_loop: bool) -> None:
    from tangram import _native
    from tangram.sched import replay

    if own_loop and not _native.ACTIVE:
        monkeypatch.setattr(replay, "_C_INSORT", False)
    rng = random.Random(4)
    pool = [0.0, 0.25, 0.5, 0.5, 1.0, float("inf"), float("nan")]
    for _ in range(3000):
        base = sorted((rng.choice(pool[:6]), rng.randrange(6)) for _ in range(rng.randrange(9)))
        key, k = rng.choice(pool), rng.randrange(6)
        assert replay._bisect_left(base, key, k) == bisect.bisect_left(base, (key, k))

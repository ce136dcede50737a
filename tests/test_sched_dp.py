"""DPArrange: named table cases and a brute-force oracle for both operators."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.sched import ChunkOperator, DPTable, InfeasibleArrangement, chunk_level, dp_arrange

CASES = [
    # (name, choices, units, expected total, expected amounts)
    ("single_takes_all", [{1: 8.0, 2: 4.0, 4: 2.0}], 4, 2.0, [4]),
    ("two_share_evenly", [{1: 8.0, 2: 4.0, 4: 2.5}, {1: 8.0, 2: 4.0, 4: 2.5}], 4, 8.0, [2, 2]),
    ("tie_favours_earlier_candidate", [{1: 10.0, 3: 9.0}, {1: 10.0, 3: 9.0}], 4, 19.0, [3, 1]),
    ("minimum_only", [{2: 3.0}, {2: 3.0}], 4, 6.0, [2, 2]),
    ("idle_units_allowed", [{1: 1.0, 2: 1.0}], 5, 1.0, [1]),
    ("empty", [], 3, 0.0, []),
]


@pytest.mark.parametrize(("name", "choices", "units", "total", "amounts"), CASES)
def test_table_base_operator(name, choices, units, total, amounts):
    """Each named case gets the known optimal split under the base operator."""
    arr = dp_arrange(choices, units)
    assert arr.total == pytest.approx(total), name
    assert arr.amounts == amounts, name


def test_infeasible_minimum_raises_typed_error():
    """Minimums that exceed the free units raise InfeasibleArrangement, never return junk."""
    with pytest.raises(InfeasibleArrangement):
        dp_arrange([{3: 1.0}, {2: 1.0}], 4)


def test_chunk_operator_respects_buddy_chunks():
    """Two 4-GPU requests cannot share one 4-chunk plus a 2-chunk and a 1-chunk."""
    op = ChunkOperator({4: 1, 2: 1, 1: 1})
    arr = dp_arrange([{1: 9.0, 2: 5.0, 4: 3.0}, {1: 9.0, 2: 5.0, 4: 3.0}], 7, op)
    assert arr.total == pytest.approx(8.0)
    assert sorted(arr.amounts) == [2, 4]
    with pytest.raises(InfeasibleArrangement):
        dp_arrange([{4: 1.0}, {4: 1.0}], 7, ChunkOperator({4: 1, 2: 1, 1: 1}))


def test_rows_serve_every_eviction_step():
    """Row t of one table equals a fresh dp_arrange over the first t candidates."""
    rng = random.Random(7)
    choices = [_random_choices(rng, 6) for _ in range(6)]
    table = DPTable(choices, ChunkOperator({8: 2}))
    for t in range(1, 7):
        row = table.row(t)
        assert row.total == pytest.approx(dp_arrange(choices[:t], 16, ChunkOperator({8: 2})).total)


def _random_choices(rng: random.Random, max_units: int, pow2: bool = False) -> dict[int, float]:
    pool = [1, 2, 4, 8] if pow2 else list(range(1, max_units + 1))
    pool = [u for u in pool if u <= max_units]
    amounts = sorted(rng.sample(pool, rng.randint(1, min(4, len(pool)))))
    t1 = rng.uniform(1.0, 20.0)
    return {u: round(t1 / (u * rng.uniform(0.4, 1.0)), 3) for u in amounts}


def _brute(choices, fits):
    best = None
    for combo in itertools.product(*[sorted(c) for c in choices]):
        if not fits(combo):
            continue
        total = sum(c[u] for c, u in zip(choices, combo, strict=True))
        if best is None or total < best - 1e-12:
            best = total
    return best


def _chunks_fit(requests, counts):
    """Independent oracle: first-fit decreasing is optimal for power-of-two (divisible) sizes."""
    free = []
    for size, n in counts.items():
        free += [size] * n
    for r in sorted((chunk_level(x) for x in requests), reverse=True):
        options = [f for f in free if f >= r]
        if not options:
            return False
        f = min(options)
        free.remove(f)
        while f > r:  # split the remainder into buddies
            f //= 2
            free.append(f)
    return True


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_base_operator_matches_brute_force(seed):
    """dp_arrange is optimal on random small inputs (base operator)."""
    rng = random.Random(seed)
    units = rng.randint(1, 9)
    choices = [_random_choices(rng, units) for _ in range(rng.randint(1, 4))]
    expected = _brute(choices, lambda combo: sum(combo) <= units)
    if expected is None:
        with pytest.raises(InfeasibleArrangement):
            dp_arrange(choices, units)
        return
    arr = dp_arrange(choices, units)
    assert arr.total == pytest.approx(expected)
    assert sum(arr.amounts) <= units
    assert all(u in c for c, u in zip(choices, arr.amounts, strict=True))


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_chunk_operator_matches_brute_force(seed):
    """dp_arrange is optimal on random small inputs (GPU chunk operator)."""
    rng = random.Random(seed)
    counts = {s: rng.randint(0, 2) for s in (1, 2, 4, 8)}
    if not any(counts.values()):
        counts[8] = 1
    total_units = sum(s * n for s, n in counts.items())
    choices = [_random_choices(rng, 8, pow2=True) for _ in range(rng.randint(1, 4))]
    expected = _brute(choices, lambda combo: _chunks_fit(combo, counts))
    op = ChunkOperator(counts)
    if expected is None:
        with pytest.raises(InfeasibleArrangement):
            dp_arrange(choices, total_units, op)
        return
    arr = dp_arrange(choices, total_units, op)
    assert arr.total == pytest.approx(expected)
    assert _chunks_fit(arr.amounts, counts)

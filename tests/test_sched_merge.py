"""The pass's FCFS merges (tangram/sched/schedule.py ``_merge_by_seq``, ``_seq_sorted``) are the
stable sorts they replace: the same list for sorted runs, ties included, and a sort when a
run is not in seq order."""

from __future__ import annotations

import random
from operator import attrgetter

import pytest

from tangram.model import make_action
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

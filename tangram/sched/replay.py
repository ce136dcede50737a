"""Alg. 2's objective: an FCFS replay of a pool's waiting queue against its completion heap.

Contract
--------
``Replay(op, dur, cfg, max_single).run(waiting, state, heap)`` returns the estimated sum of
the ACTs (seconds from now) of ``waiting`` (FCFS order) when each action starts as soon as
the units it is replayed at are free, popping expected finishes from ``heap`` (a list of
``(finish, units)``; sorted on entry). Reads the actions, writes nothing but ``heap``.

Which amount a replayed elastic action gets depends on the rule (``SchedConfig.rule``):

- every rule: the first ``depth - 1`` elastic actions branch over at most ``max_branch``
  amounts spread over their set, each option judged on a look-ahead of ``branch_window``;
  "paper" tries only the amounts that fit at once, the others may wait for more units;
- "paper" / "wait": later actions start at their lowest amount as soon as it fits;
- "wait-eft" / "priced" on plain unit counts (CPU nodes): later elastic actions start at the
  amount (of the spread) with the earliest expected finish; on other pools as "wait".

``Durations.choices`` gives the amounts an action may take in this pass: its allowed set,
or the band the ``priced`` rule narrowed it to. The loop exists once, generically
(``_run`` with ``fast=False``); ``_plain`` and ``_eft`` are the same loop specialised to
plain unit counts, kept because they are faster, and tested to give exactly the
generic loop's result.

Complexity: ``O(W log W)`` per replay of ``W`` actions, plus ``O(|s| · W)`` for EFT.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Protocol

from tangram.model import Action, ActionId
from tangram.sched.operators import BaseOperator, Operator
from tangram.sched.pool import SchedPool


class ReplayConfig(Protocol):
    """What the replay reads of the scheduler's config (``SchedConfig`` satisfies it; the
    replay does not import the module that runs it)."""

    @property
    def rule(self) -> str: ...

    @property
    def depth(self) -> int: ...

    @property
    def max_branch(self) -> int: ...


NEVER = 1e9  # replay penalty (seconds) for an action that cannot start at all

# (amount, duration, options) of an action in the EFT replay (``Replay._entry``)
Entry = tuple[int, float, list[tuple[int, float]] | None]
# where an EFT replay stopped: (free units, finishes, head into them, clock, total)
_EftState = tuple[int, list[tuple[float, int]], int, float, float]


def _insort(order: list[tuple[float, int]], fin: float, u: int, lo: int) -> None:
    """``bisect.insort(order, (fin, u), lo)``: after every entry <= (fin, u) from ``lo`` on,
    found by the same binary search (``(fin, u) < (f, k)`` is ``fin < f or (fin == f and
    u < k)`` for tuples of a float and an int, NaN included)."""
    if _C_INSORT:
        bisect.insort(order, (fin, u), lo)
        return
    hi = len(order)
    while lo < hi:
        mid = (lo + hi) // 2
        f, k = order[mid]
        if fin < f or (fin == f and u < k):
            hi = mid
        else:
            lo = mid + 1
    order.insert(lo, (fin, u))


# Interpreted, bisect's C loop is the faster; compiled, _insort's own (its comparisons on
# unboxed floats and ints, not through tuple comparison): the same search either way. An
# interpreted function has a code object, a compiled one none (the core imports nothing to
# ask tangram._native; Final: compiled, a constant, not a dict look-up on every read).
_C_INSORT: Final = hasattr(_insort, "__code__")


def _bisect_left(order: list[tuple[float, int]], key: float, k: int) -> int:
    """``bisect.bisect_left(order, (key, k))``, by the same binary search (see _insort)."""
    if _C_INSORT:
        return bisect.bisect_left(order, (key, k))
    lo, hi = 0, len(order)
    while lo < hi:
        mid = (lo + hi) // 2
        f, j = order[mid]
        if f < key or (f == key and j < k):
            lo = mid + 1
        else:
            hi = mid
    return lo


def elastic_amounts(action: Action, max_single: int) -> tuple[int, ...]:
    return _at_or_below(action.allowed, max_single)


# The helpers below are pure functions of small tuples, asked for every queued elastic
# action on every pass. Not memoised where a direct answer is cheaper than the memo's
# look-up: with more distinct allowed sets than an lru_cache holds (one per action in
# bench/sched.py's 10x cases) every call was a miss, paying the hash, the look-up and the
# eviction on top of the work.


def _at_or_below(allowed: tuple[int, ...], max_single: int) -> tuple[int, ...]:
    for a in allowed:
        if a > max_single:
            return tuple([b for b in allowed if b <= max_single])
    return allowed  # all of them (the common case): the same tuple


def spread(values: tuple[int, ...], k: int) -> tuple[int, ...]:
    """At most k values spread over a sorted tuple, always keeping both ends."""
    if len(values) <= k:
        return values
    return _spread(values, k)


def _spread(values: tuple[int, ...], k: int) -> tuple[int, ...]:
    step = (len(values) - 1) / (k - 1)
    out: list[int] = []
    ascending = True
    for i in range(k):
        v = values[round(i * step)]
        if out and v <= out[-1]:
            if v == out[-1]:
                continue  # (the same index again: the set's one copy)
            ascending = False
        out.append(v)
    if not ascending:  # (values are sorted; anything else as a set, sorted)
        return tuple(sorted(set(out)))
    return tuple(out)


class Durations:
    """Per-pass, per-pool cache of durations (history estimate + pool extra cost) and of the
    amounts each action may take in this pass (``bands`` narrows elastic actions' sets)."""

    __slots__ = ("_cache", "_estimate", "_extra", "_pool", "at_min", "bands", "low", "max_single")

    def __init__(
        self,
        pool: SchedPool,
        estimate: Callable[[str], float],
        bands: Mapping[ActionId, tuple[int, ...]] | None = None,
    ) -> None:
        self._pool = pool
        self._estimate = estimate
        self.max_single = pool.max_single()
        self._cache: dict[tuple[ActionId, int], float] = {}
        self.bands = bands or {}
        # lowest amount per action where it is not its minimum (banded elastic actions)
        self.low: dict[ActionId, int] = {aid: b[0] for aid, b in self.bands.items()}
        self.at_min: dict[ActionId, float] = {}  # duration at the lowest amount, by action id
        # extra_cost depends only on (kind, service, amount) within one pass (SchedPool doc)
        self._extra: dict[tuple[str, str | None, int], float] = {}

    def narrow(self, bands: Mapping[ActionId, tuple[int, ...]]) -> None:
        """Restrict elastic actions to ``bands`` (before any duration at the minimum is read)."""
        assert not self.at_min
        self.bands = bands
        self.low = {aid: b[0] for aid, b in bands.items()}

    def choices(self, action: Action) -> tuple[int, ...]:
        band = self.bands.get(action.id)
        return band if band is not None else elastic_amounts(action, self.max_single)

    def lowest(self, action: Action) -> int:
        return self.low.get(action.id, action.min_units)

    def table(self, action: Action, amounts: tuple[int, ...]) -> dict[int, float]:
        """Durations at each of ``amounts`` (the DP's choices for one candidate), through
        the per-pass cache: pricing already read some of them."""
        return dict(zip(amounts, self.many(action, amounts), strict=True))

    def many(self, action: Action, amounts: Sequence[int]) -> list[float]:
        """``[self(action, u) for u in amounts]``, the profiled ones written out."""
        profiled, extra, kind, service = action.profiled, self._extra, action.kind, action.service
        out = []
        for u in amounts:
            base = profiled.get(u)
            if base is None:
                out.append(self(action, u))
                continue
            x = extra.get((kind, service, u))  # _extra_at's memo, read in place
            out.append(base + (self._extra_at(action, u) if x is None else x))
        return out

    def minimum(self, action: Action) -> float:
        """Duration at the lowest amount the action may take in this pass."""
        aid = action.id
        d = self.at_min.get(aid)
        if d is None:
            u = self.low.get(aid)  # lowest(), inlined
            base = action.base_min  # own_duration(min_units), kept on the action
            if u is None and base is not None:  # _compute's value at the minimum
                x = self._extra.get(action.min_cost_key)
                d = base + (self._extra_at(action, action.min_units) if x is None else x)
            else:
                d = self._compute(action, action.min_units if u is None else u)
            self.at_min[aid] = d
        return d

    def __call__(self, action: Action, amount: int) -> float:
        base = action.profiled.get(amount)
        if base is not None:  # _compute's value, without its cache entry
            x = self._extra.get((action.kind, action.service, amount))  # _extra_at's memo
            return base + (self._extra_at(action, amount) if x is None else x)
        key = (action.id, amount)
        dur = self._cache.get(key)
        if dur is None:
            dur = self._cache[key] = self._compute(action, amount)
        return dur

    def _compute(self, action: Action, amount: int) -> float:
        """The duration at ``amount``, uncached (the callers cache what they reuse): the
        action's own (``Action.duration``'s order), reading the history estimate only when
        it has none, plus the pool's extra cost."""
        base = action.own_duration(amount)
        if base is None:
            base = self._estimate(action.klass)
        return base + self._extra_at(action, amount)

    def _extra_at(self, action: Action, amount: int) -> float:
        """The pool's extra cost, memoised: it depends only on (kind, service, amount) within
        one pass (SchedPool doc)."""
        key = (action.kind, action.service, amount)
        extra = self._extra.get(key)
        if extra is None:
            extra = self._extra[key] = self._pool.extra_cost(action, amount)
        return extra


def eft_amount(
    opts: list[tuple[int, float]],
    free: int,
    order: list[tuple[float, int]],
    head: int,
    clock: float,
) -> tuple[int, float]:
    """(amount, duration) of ``opts`` (ascending amounts) with the earliest finish, given
    ``free`` units now and expected finishes ``order[head:]`` (ascending).

    Durations are >= 0 and a larger amount never starts earlier, so once the start clock
    reaches the best finish so far no later option can beat it: the scan stops there."""
    best, pick = NEVER, opts[0]
    if free >= opts[-1][0]:  # all start now: the shortest duration wins
        for opt in opts:
            if opt[1] < best:
                best, pick = opt[1], opt
        return pick
    s, clk, j, n = free, clock, head, len(order)
    for opt in opts:
        amount = opt[0]
        while s < amount and j < n:
            finish, units = order[j]
            j += 1
            if finish > clk:
                clk = finish
                if clk >= best:
                    return pick
            s += units
        if s < amount:
            break
        fin = clk + opt[1]
        if fin < best:
            best, pick = fin, opt
    return pick


class Replay:
    """Alg. 2: estimated sum of ACTs (relative to now) of a waiting list replayed FCFS.

    See the module doc. ``fast=False`` forces the generic loop (the reference the
    specialised loops are tested against).
    """

    branch_window = 16

    def __init__(
        self, op: Operator[Any], dur: Durations, cfg: ReplayConfig, *, fast: bool = True
    ) -> None:
        self.op = op
        self.dur = dur
        self.cfg = cfg
        self.plain = isinstance(op, BaseOperator)
        self.fast = fast and self.plain
        # any other operator (GPU chunks): the depth-1 loop specialised (lowest amounts)
        self.fast_other = fast and not self.plain
        # EFT replay on plain unit counts only (CPU nodes): on GPU chunk pools it was
        # measured worse than "wait" (docs/results.md, "Findings for the scheduler", 2)
        self.eft = cfg.rule in ("wait-eft", "priced") and self.plain
        self._options: dict[ActionId, list[tuple[int, float]]] = {}

    def run(
        self,
        waiting: Sequence[Action],
        state: Any,
        heap: list[tuple[float, int]],
        ents: list[Entry] | None = None,
    ) -> float:
        """``ents``: ``self.entries(waiting)`` when the caller already has it (it replays
        subsets of one list, so it looks the entries up once); else looked up here."""
        if self.fast and self.eft:
            if ents is None:
                ents = self._entries_of(waiting)
        else:
            ents = None
        return self._run(waiting, 0, len(waiting), state, heap, 0.0, self.cfg.depth, ents)

    def entries(self, waiting: Sequence[Action]) -> list[Entry] | None:
        """The EFT entries of ``waiting`` as ``run`` wants them, or None where ``run``
        reads none (not the EFT replay)."""
        return self._entries_of(waiting) if self.fast and self.eft else None

    def _entries_of(self, waiting: Sequence[Action]) -> list[Entry]:
        """The EFT entries of ``waiting``, position by position: looked up once per run and
        shared by every branch's replay of the same list (computed, not memoised per action:
        the scheduler asks once per pool and pass; the durations behind them are memoised in
        ``Durations`` and ``_option_durs``)."""
        # (methods called on their objects, not bound to locals: compiled, that is a direct
        # call; a bound method is a generic Python call)
        dur = self.dur
        low, at_min, extra = dur.low, dur.at_min, dur._extra
        out = []
        for w in waiting:
            if w.elastic:
                e = self._entry(w)
            else:  # _entry(), inlined for the common case (lowest amount, minimum)
                aid = w.id
                d = at_min.get(aid)
                if d is None:
                    # minimum()'s own-base path, inlined while the extra cost is memoised
                    # (as a call per action it was a measurable share of a pass)
                    base = w.base_min
                    if (
                        base is not None
                        and aid not in low
                        and (x := extra.get(w.min_cost_key)) is not None
                    ):
                        d = at_min[aid] = base + x
                    else:
                        d = dur.minimum(w)
                e = (low.get(aid, w.min_units), d, None)
            out.append(e)
        return out

    def _run(
        self,
        waiting: Sequence[Action],
        i: int,
        end: int,
        state: Any,
        heap: list[tuple[float, int]],
        clock: float,
        depth: int,
        ents: list[Entry] | None = None,
    ) -> float:
        if depth <= 1 and self.fast:  # no branching left: the specialised replays
            if self.eft:
                return self._eft(waiting, i, end, state, heap, clock, ents)
            return self._plain(waiting, i, end, state, heap, clock)
        if depth <= 1 and self.fast_other:
            return self._lowest(waiting, i, end, state, heap, clock)
        if depth == 2 and ents is not None:  # ents: fast and eft (see run)
            return self._eft_to_branch(waiting, ents, i, end, state, heap, clock)
        total = 0.0
        dur = self.dur
        take = self.op.take
        while i < end:
            w = waiting[i]
            if depth > 1 and w.elastic:
                state, clock, ok = self._wait_for(state, heap, clock, dur.lowest(w))
                if not ok:
                    return total + NEVER * (end - i)
                return total + self._branch(waiting, i, end, state, heap, clock, depth, ents)
            if self.eft and w.elastic:
                u, d = self._eft_pick(w, state, heap, clock)
            else:
                u, d = dur.lowest(w), dur.minimum(w)
            state, clock, ok = self._wait_for(state, heap, clock, u)
            if not ok:
                return total + NEVER * (end - i)
            total += clock + d
            heapq.heappush(heap, (clock + d, u))
            state = take(state, u)
            i += 1
        return total

    def _lowest(
        self,
        waiting: Sequence[Action],
        i: int,
        end: int,
        state: Any,
        heap: list[tuple[float, int]],
        clock: float,
    ) -> float:
        """``_run`` at depth 1 on any operator without EFT: each action at its lowest amount
        as soon as the operator can take it (``_wait_for`` inlined)."""
        total = 0.0
        dur = self.dur
        at_min, low = dur.at_min, dur.low
        take, give = self.op.take, self.op.give
        pop, push = heapq.heappop, heapq.heappush
        while i < end:
            w = waiting[i]
            u = low.get(w.id, w.min_units)
            d = at_min.get(w.id)
            if d is None:
                d = dur.minimum(w)
            nxt = take(state, u)
            while nxt is None:
                if not heap:
                    return total + NEVER * (end - i)
                finish, units = pop(heap)
                if finish > clock:
                    clock = finish
                state = give(state, units)
                nxt = take(state, u)
            total += clock + d
            push(heap, (clock + d, u))
            state = nxt
            i += 1
        return total

    def _eft_to_branch(
        self,
        waiting: Sequence[Action],
        ents: list[Entry],
        i: int,
        end: int,
        free: int,
        heap: list[tuple[float, int]],
        clock: float,
    ) -> float:
        """``_run`` at depth 2 on plain unit counts with EFT amounts: the actions before the
        first elastic one at their entry (lowest amount, minimum), then its branch.

        The heap is kept as a sorted list with a moving head (as in ``_eft_from``): it pops
        in the heap's order, and the branch gets the rest already sorted."""
        total = 0.0
        order = sorted(heap)
        head, size = 0, len(order)
        while i < end:
            w = waiting[i]
            u, d, _ = ents[i]
            if w.elastic:
                u = self.dur.lowest(w)  # the branch's own _wait_for, over the sorted heap
            while free < u:
                if head == size:
                    return total + NEVER * (end - i)
                finish, units = order[head]
                head += 1
                if finish > clock:
                    clock = finish
                free += units
            if w.elastic:
                rest = order[head:]
                return total + self._branch(waiting, i, end, free, rest, clock, 2, ents, rest)
            fin = clock + d
            total += fin
            _insort(order, fin, u, head)  # lo=head: finishes never precede the clock
            size += 1
            free -= u
            i += 1
        return total

    def _eft_pick(
        self, w: Action, free: int, heap: list[tuple[float, int]], clock: float
    ) -> tuple[int, float]:
        opts = self._option_durs(w)
        if len(opts) == 1:
            return opts[0]
        return eft_amount(opts, free, sorted(heap), 0, clock)

    def _plain(
        self,
        waiting: Sequence[Action],
        i: int,
        end: int,
        free: int,
        heap: list[tuple[float, int]],
        clock: float,
    ) -> float:
        """``_run`` at depth 1 on plain unit counts, lowest amounts (rules paper / wait)."""
        total = 0.0
        dur = self.dur
        at_min, low = dur.at_min, dur.low
        pop, push = heapq.heappop, heapq.heappush
        while i < end:
            w = waiting[i]
            need = low.get(w.id, w.min_units)
            while free < need:
                if not heap:
                    return total + NEVER * (end - i)
                finish, units = pop(heap)
                if finish > clock:
                    clock = finish
                free += units
            d = at_min.get(w.id)
            if d is None:
                d = dur.minimum(w)
            total += clock + d
            push(heap, (clock + d, need))
            free -= need
            i += 1
        return total

    def _eft(
        self,
        waiting: Sequence[Action],
        i: int,
        end: int,
        free: int,
        heap: list[tuple[float, int]],
        clock: float,
        ents: list[Entry] | None = None,
    ) -> float:
        """``_run`` at depth 1 on plain unit counts with EFT amounts.

        The completion heap is kept as a sorted list with a moving head, so each elastic
        action's look-up scans it in order without re-sorting; ties in the heap order are
        harmless (equal finishes pop in any order with the same clock and unit sum).
        """
        if ents is None:
            ents = self._entries_of(waiting)
        return self._eft_from(ents, i, end, free, sorted(heap), 0, clock, 0.0, None)

    def _eft_from(
        self,
        ents: list[Entry],
        i: int,
        end: int,
        free: int,
        order: list[tuple[float, int]],
        head: int,
        clock: float,
        total: float,
        keep: list[_EftState] | None,
    ) -> float:
        """``_eft``'s loop from position ``i`` with the pending finishes ``order[head:]``
        (sorted) and ``total`` so far; when it reaches ``end`` it appends its state to
        ``keep``, from which a later call resumes exactly where it stopped."""
        size = len(order)
        for k in range(i, end):
            u, d, opts = ents[k]
            if opts is not None:
                u, d = eft_amount(opts, free, order, head, clock)
            while free < u:
                if head == size:
                    return total + NEVER * (end - k)
                finish, units = order[head]
                head += 1
                if finish > clock:
                    clock = finish
                free += units
            fin = clock + d
            total += fin
            _insort(order, fin, u, head)  # lo=head: finishes never precede the clock
            size += 1
            free -= u
        if keep is not None:
            keep.append((free, order, head, clock, total))
        return total

    def _entry(self, w: Action) -> Entry:
        """(amount, duration, options) of ``w`` in the EFT replay (its options and durations
        cached per pass): the options are None unless the amount is chosen per replay
        (elastic, >= 2 options)."""
        if w.elastic:
            opts = self._option_durs(w)
            u, d = opts[0]
            return (u, d, opts if len(opts) > 1 else None)
        return (self.dur.lowest(w), self.dur.minimum(w), None)

    def _option_durs(self, w: Action) -> list[tuple[int, float]]:
        """(amount, duration) for the spread of w's amounts in this pass, cached per pass."""
        opts = self._options.get(w.id)
        if opts is None:
            amounts = spread(self.dur.choices(w), self.cfg.max_branch)
            ds = self.dur.many(w, amounts)  # one per amount
            opts = self._options[w.id] = [(amounts[i], ds[i]) for i in range(len(amounts))]
        return opts

    def _wait_for(
        self, state: Any, heap: list[tuple[float, int]], clock: float, need: int
    ) -> tuple[Any, float, bool]:
        if self.plain:  # plain unit counts
            while state < need:
                if not heap:
                    return state, clock, False
                finish, units = heapq.heappop(heap)
                if finish > clock:
                    clock = finish
                state += units
            return state, clock, True
        take, give = self.op.take, self.op.give
        while take(state, need) is None:
            if not heap:
                return state, clock, False
            finish, units = heapq.heappop(heap)
            if finish > clock:
                clock = finish
            state = give(state, units)
        return state, clock, True

    def _branch(
        self,
        waiting: Sequence[Action],
        i: int,
        end: int,
        state: Any,
        heap: list[tuple[float, int]],
        clock: float,
        depth: int,
        ents: list[Entry] | None = None,
        ordered: list[tuple[float, int]] | None = None,
    ) -> float:
        """``ordered``: ``sorted(heap)`` when the caller has it (the heap is then not read)."""
        w = waiting[i]
        take = self.op.take
        amounts = spread(self.dur.choices(w), self.cfg.max_branch)
        if self.cfg.rule == "paper":
            options = [u for u in amounts if take(state, u) is not None]
        else:
            options = list(amounts)
        look = min(end, i + 1 + self.branch_window)
        # the look-ahead replays below are the EFT loop: each keeps its state at ``look`` so
        # the chosen option's full replay resumes there instead of replaying the look-ahead
        resumable = ents is not None and self.fast and self.eft and depth - 1 <= 1
        saved: dict[int, tuple[float, float, _EftState]] = {}
        # there the heap is sorted once: _wait_for pops it in that order, and the EFT loop
        # wants the rest sorted, so each option slices it instead of copying and re-sorting
        if ordered is None or not resumable:
            ordered = sorted(heap) if resumable else heap

        def cost(u: int, stop: int) -> float:
            if resumable:
                assert ents is not None
                s, clk, j, n = state, clock, 0, len(ordered)
                while s < u:  # _wait_for over the sorted heap
                    if j == n:
                        return NEVER
                    finish, units = ordered[j]
                    j += 1
                    if finish > clk:
                        clk = finish
                    s += units
                d = self.dur(w, u)
                rest_heap = ordered[j:]
                _insort(rest_heap, clk + d, u, 0)
                keep: list[_EftState] | None = [] if stop < end else None
                # plain unit counts: take(s, u) is s - u
                rest = self._eft_from(ents, i + 1, stop, s - u, rest_heap, 0, clk, 0.0, keep)
                if keep:
                    saved[u] = (clk, d, keep[0])
                return clk + d + rest
            h = list(heap)
            s, clk, ok = self._wait_for(state, h, clock, u)  # "wait": start when u are free
            if not ok:
                return NEVER
            d = self.dur(w, u)
            heapq.heappush(h, (clk + d, u))
            rest = self._run(waiting, i + 1, stop, take(s, u), h, clk, depth - 1, ents)
            return clk + d + rest

        if len(options) == 1:
            return cost(options[0], end)
        costs = {u: cost(u, look) for u in options}
        best_u = min(options, key=costs.__getitem__)
        if look >= end:  # the look-ahead already covered the whole window: reuse it
            return costs[best_u]
        resume = saved.get(best_u)
        if resume is None:
            return cost(best_u, end)
        clk, d, (free, order, head, at, total) = resume
        assert ents is not None
        return clk + d + self._eft_from(ents, look, end, free, order, head, at, total, None)

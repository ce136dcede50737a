"""The ``priced`` rule: how many units an elastic action should take, given the pool's load.

Why
---
Splitting every free unit among the actions present (Alg. 1) is optimal only if nothing else
arrives: on a node that looks idle the first test runs take 32 cores and the ones arriving a
few seconds later queue behind them. A fixed DoP keeps units free for later arrivals, and
beats the elastic scheduler under load. This module prices a unit by the load instead.

Model
-----
``N`` elastic actions share ``C`` units, each at amount ``k`` with duration ``t(k)``: ``C / k``
of them run at a time. If ``N k <= C`` every one starts at once and its ACT is ``t(k)``; if
not, they go through in about ``N k / C`` waves and the mean ACT is about
``t(k) · (1 + N k / C) / 2``. So an action's expected ACT at ``k`` is

    cost(k) = t(k) · max(1, (1 + k · N / C) / 2)

and its *priced DoP* ``k*`` is the amount that minimises it: the fair share ``C / N`` (or
more) while the pool is not contended, shrinking as ``1 / sqrt(N)`` under load (for Amdahl
speed-ups ``E(k) = 1 / (1 + f (k - 1))`` the minimum is at ``k = sqrt((1 - f) C / (f N))``):
taking more units shortens an action's own run but delays the ``N k / C`` actions behind it.

- ``N`` counts the elastic actions that share the pool with this one over its run: the ones
  queued on the pool (itself included) plus the ones in service. The latter come from
  Little's law on the service stage, L = λ W: the rate at which elastic actions *went into
  service* (``LoadMeter``: elastic starts per second over the last window, assumed to go on)
  times *their* mean expected duration (the durations they started with), and at least the
  ones running now. So a node that looks idle while test runs keep arriving (and starting)
  is priced as busy. Two things are deliberately not in it:

  * submissions: one that is still queued is already in the first term, so counting it in
    the rate too would count it twice; a lone action on an idle pool (its own submission
    the only one in the window) was priced against itself as ``N = 1 + t(k) / window`` and
    took too few units (on a 2-core node, one core although two ran it faster).
    Counted by starts, a lone action sees ``N = 1``; under a steady stream of arrivals that
    start at once, starts and submissions agree and an arrival sees itself plus ``λ W`` in
    service (arrivals see time averages).
  * the priced action's own duration: ``W`` is the population's, not the queued action's,
    so a long test run is not priced narrow because *it* is long (it was: ``λ t(k)`` with
    its own ``t(k)``, which made the longest runs the narrowest and the p99's stragglers).
    ``N`` is then the same for every amount and every queued action of the pool.

  The forecast is capped by who could send the work. Every elastic action comes from an
  environment living on the pool, one action at a time, so at most ``E - q`` of them can
  be in service next to the ``q`` queued ones, ``E`` the pool's environments
  (``PoolLoad.envs``; and never fewer than the ones running). This matters at the end of
  a burst: the window still remembers the crowd's test runs, but the stragglers left on
  a node are alone, and each got one core of two that ran it faster (the demo's tail
  phase; docs/notebook.md, "the environment cap"). With no known bound (``envs`` 0: not
  given, or elastic actions arriving in throwaway environments, of which any number may
  come) there is no cap.
- ``C`` is the pool's capacity less the units short non-elastic calls keep busy: their
  offered load ``a`` plus ``sqrt(a)`` (square-root staffing), so that elastic actions are
  sized for the units they will really have. The reserve is a real number, not rounded up:
  it only enters the price, and a rounded one would take a whole unit from a small pool for
  a vanishing load (a 2-core node with one quick tool call in the window would price as 1).
- ``k*`` is found in two steps: the price at both ends of the allowed set and every power
  of two between (``probe``), then at every allowed amount strictly between the least
  probed amount's two neighbours (``between``; *refined*). The price is unimodal in ``k``
  for Amdahl-like speed-ups, so that is its least over the whole set at the cost of a few
  more durations per action; with ``k*`` on powers of two only, a node's test runs jumped
  between bands ``[4, 8]`` and ``[8, 16]`` (AI coding at batch 2048: 954 of 2048 started
  at 8) and took 3-4% longer (docs/results.md, Fig. 9 per action kind).
- The action may start at any allowed amount in ``[k*/2, k*]``: within a factor of two the
  cost is near its minimum, and an action started far below its priced DoP is a straggler
  that holds its units for minutes. Below the band it waits (the replay judges how long).

Short calls are not held behind an elastic action waiting for its band either: they start
past it until it gets an EASY reservation (after the starvation bound, or at once when it
is expected to run longer than ``W``, the mean of those in service: the long runs are the
ACT tail), from then on only when they do not delay it or have waited their own expected
run time (``schedule._candidates_easy``).

Pure: no I/O, no clock. ``O(q · (|probe| + r))`` per pool and pass for ``q`` queued elastic
actions, ``r`` the refined amounts (at most ``3 k* / 2``, fewer than the allowed set).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from tangram.model import Action, ActionId
from tangram.sched.load import PoolLoad

NO_LOAD = PoolLoad()


# What pricing read of an action, kept across passes where it is a function of the action
# and the pool's largest single amount alone: its durations are its own
# (``Action.own_duration`` never None: an elasticity or a known duration; the action is
# frozen) and the pool adds no extra cost (a CPU node's is 0). A node's queue is priced again
# on every pass while any trajectory waits node-less (10x: 3-5 nodes a pass, ~30 queued
# actions each). Kept: the probed amounts and their durations, the refined ones per least
# probed index, the band per pick, and the last N / C with its band. A pure memo: the same
# bands either way (the same floats multiplied in the same order); cleared when full.
class _Priced:
    __slots__ = ("action", "band_at", "ds", "ks", "last", "refined")

    def __init__(self, action: Action, ks: tuple[int, ...], ds: list[float]) -> None:
        self.action = action
        self.ks = ks
        self.ds = ds
        self.refined: dict[int, tuple[tuple[int, ...], list[float]]] = {}
        self.band_at: dict[int, tuple[int, ...]] = {}
        # (N / C, its band): one attribute, set at once (a pass in another thread reads a pair)
        self.last: tuple[float, tuple[int, ...]] = (-1.0, ())


_PRICED: dict[tuple[ActionId, int], _Priced] = {}
_PRICED_MAX = 1 << 16


def short_reserve(load: PoolLoad) -> float:
    """Units kept for short calls: offered load plus its square root (0 when there are none)."""
    a = load.short_units
    return a + math.sqrt(a) if a > 0 else 0.0


# pure functions of small tuples, asked for every queued elastic action on every pass; not
# memoised: one pass over the tuple costs less than an lru_cache's look-up, and with more
# distinct allowed sets than it holds every call was a miss (replay.py, _at_or_below)
def probe(amounts: tuple[int, ...]) -> tuple[int, ...]:
    """The amounts the price is evaluated at: both ends and every power of two between."""
    lo, hi = amounts[0], amounts[-1]
    out: list[int] = []
    ascending = True
    for a in amounts:
        if a in (lo, hi) or (lo < a < hi and a > 0 and a & (a - 1) == 0):  # a power of two
            if out and a <= out[-1]:
                ascending = False
            out.append(a)
    if not ascending:  # (allowed sets are sorted; anything else as a set, sorted)
        return tuple(sorted(set(out)))
    return tuple(out)


def between(amounts: tuple[int, ...], ks: tuple[int, ...], i: int) -> tuple[int, ...]:
    """The allowed amounts strictly between ``ks[i]``'s probed neighbours, other than
    ``ks[i]``: where the price's least lies when ``ks[i]`` is the least probed (the price is
    unimodal in ``k`` for Amdahl-like speed-ups), priced next (module doc, "refined")."""
    lo = ks[i - 1] if i > 0 else ks[i]
    hi = ks[i + 1] if i + 1 < len(ks) else ks[i]
    k = ks[i]
    return tuple(u for u in amounts if lo < u < hi and u != k)


def price_factor(k: int, sharing: float) -> float:
    """What ``t(k)`` is multiplied by in the price: ``max(1, (1 + k · N / C) / 2)`` with
    ``sharing = N / C`` (module doc)."""
    return max(1.0, (1.0 + k * sharing) / 2.0)


def priced_dop(
    amounts: tuple[int, ...], dur: Callable[[int], float], sharing: Callable[[int], float]
) -> int:
    """``k*``: the amount of ``amounts`` with the least ``t(k) · max(1, (1 + k · N(k) / C) / 2)``
    where ``sharing(k) = N(k) / C``: the least of the probe, refined between its neighbours
    (module doc)."""
    best, pick, at = math.inf, amounts[-1], 0
    ks = probe(amounts)
    for i, k in enumerate(ks):
        cost = dur(k) * price_factor(k, sharing(k))
        if cost < best:
            best, pick, at = cost, k, i
    for k in between(amounts, ks, at):
        cost = dur(k) * price_factor(k, sharing(k))
        if cost < best:
            best, pick = cost, k
    return pick


def band(amounts: tuple[int, ...], k: int) -> tuple[int, ...]:
    """The allowed amounts in ``[k/2, k]``."""
    return tuple(u for u in amounts if 2 * u >= k and u <= k) or (k,)


def price_bands(
    queue: Sequence[Action],
    capacity: int,
    load: PoolLoad | None,
    amounts_of: Callable[[Action], tuple[int, ...]],
    dur: Callable[[Action, int], float],
    durs: Callable[[Action, tuple[int, ...]], list[float]] | None = None,
    memo_at: int = -1,
) -> dict[ActionId, tuple[int, ...]]:
    """The band of amounts each elastic action of ``queue`` may start at in this pass.

    ``durs(a, ks)``: ``[dur(a, k) for k in ks]`` in one call, where the caller has it.
    ``memo_at`` >= 0: the pool adds no extra cost to durations and ``amounts_of`` is the
    allowed amounts up to ``memo_at`` units; bands of actions whose durations are their own
    are then memoised across passes (``_BANDS``)."""
    load = load or NO_LOAD
    elastic = [(a, amounts_of(a)) for a in queue if a.elastic]
    if not elastic:
        return {}
    units = max(1.0, capacity - short_reserve(load))
    in_service = max(load.elastic_running, load.elastic_starts_per_s * load.elastic_mean_s)
    if load.envs:  # no more can share the run than the environments not queued here (doc)
        in_service = min(in_service, max(load.envs - len(elastic), load.elastic_running))
    share = (len(elastic) + in_service) / units  # N / C, the same for every k and action
    # priced_dop()'s loop, with each amount's price factor computed once for the queue
    factor: dict[int, float] = {}
    out: dict[ActionId, tuple[int, ...]] = {}
    memo = _PRICED
    if memo_at >= 0 and len(memo) > _PRICED_MAX:
        memo.clear()
    for a, amounts in elastic:
        if len(amounts) > 1:
            seen: _Priced | None = None
            if memo_at >= 0 and (a.elasticity is not None or a.dur_s is not None):
                seen = memo.get((a.id, memo_at))
                if seen is None or seen.action is not a:
                    ks = probe(amounts)
                    ds = [dur(a, k) for k in ks] if durs is None else durs(a, ks)
                    seen = memo[(a.id, memo_at)] = _Priced(a, ks, ds)
                else:
                    last = seen.last
                    if last[0] == share:
                        out[a.id] = last[1]
                        continue
                ks, ds = seen.ks, seen.ds
            else:
                ks = probe(amounts)
                ds = [dur(a, k) for k in ks] if durs is None else durs(a, ks)
            best, pick, at = math.inf, amounts[-1], 0
            for i, (k, d) in enumerate(zip(ks, ds, strict=True)):
                f = factor.get(k)
                if f is None:
                    f = factor[k] = price_factor(k, share)
                cost = d * f
                if cost < best:
                    best, pick, at = cost, k, i
            if seen is None:
                more = between(amounts, ks, at)
                ds = [dur(a, k) for k in more] if durs is None or not more else durs(a, more)
            else:
                got = seen.refined.get(at)
                if got is None:
                    more = between(amounts, ks, at)
                    ds = [dur(a, k) for k in more] if durs is None or not more else durs(a, more)
                    seen.refined[at] = (more, ds)
                else:
                    more, ds = got
            if more:  # refined: the amounts between the least probed one's neighbours
                for k, d in zip(more, ds, strict=True):
                    f = factor.get(k)
                    if f is None:
                        f = factor[k] = price_factor(k, share)
                    cost = d * f
                    if cost < best:
                        best, pick = cost, k
            if seen is None:
                out[a.id] = band(amounts, pick)
            else:
                picked = seen.band_at.get(pick)
                if picked is None:
                    picked = seen.band_at[pick] = band(amounts, pick)
                out[a.id] = picked
                seen.last = (share, picked)
    return out

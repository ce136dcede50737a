"""Why an action got the DoP it got: the scheduler's reasoning, as a story can tell it.

``schedule`` decides the amount of each elastic action in two steps (``tangram.sched.
schedule``'s doc): under the ``priced`` rule the amount ``k*`` of least priced time
``t(k) · max(1, (1 + k · N/C) / 2)`` bounds a band ``[k*/2, k*]`` (``tangram.sched.price``);
the DP and the replay then pick an amount in the band from the free units. ``dop_why``
repeats the first step for one placed action, on the pass's own inputs (the pool's load,
its queue length, the action's durations), and keeps the figures; ``DopWhy.__str__``
words them only when a story is read (a pass may place hundreds of actions).

The forecast ``N`` is what makes identical runs differ: it counts the elastic actions
queued now plus those in service, and "in service" is the larger of those running and
Little's law on the starts of the load window (``λ · W``): a lone caller running test
after test, each for W seconds, still looks like ``λ · W`` runs in service for a window
after its last start, so its next run is priced as if it shared the node.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tangram.model import Action
from tangram.sched.load import PoolLoad
from tangram.sched.price import band, between, price_factor, probe, short_reserve


@dataclass(frozen=True, slots=True)
class Sharing:
    """``N / C`` of the priced rule and its parts (``price_bands`` computes the same)."""

    queued: int  # elastic actions queued on the pool in the pass
    running: int  # elastic actions holding units
    recent_starts_per_s: float  # elastic starts per second over the load window
    mean_s: float  # their mean expected duration (W of Little's law)
    in_service: float  # N's other part: max(running, λW), capped by the environments
    capped: bool  # the cap by the pool's environments applied
    units: float  # C: capacity less the reserve for short calls

    @property
    def share(self) -> float:
        return (self.queued + self.in_service) / self.units


def sharing(load: PoolLoad, queued: int, capacity: int) -> Sharing:
    """``N / C`` as ``price_bands`` computes it for a pool queue of ``queued`` elastic
    actions (tests/test_dop_why.py checks the two agree)."""
    units = max(1.0, capacity - short_reserve(load))
    in_service = max(load.elastic_running, load.elastic_starts_per_s * load.elastic_mean_s)
    capped = False
    if load.envs:
        bound = max(load.envs - queued, load.elastic_running)
        capped = bound < in_service
        in_service = min(in_service, bound)
    return Sharing(
        queued,
        load.elastic_running,
        load.elastic_starts_per_s,
        load.elastic_mean_s,
        in_service,
        capped,
        units,
    )


@dataclass(frozen=True, slots=True)
class DopWhy:
    """The figures behind one placement's amount; worded by ``str()``."""

    amount: int
    allowed: tuple[int, ...]  # the amounts the action allows (1 amount: not elastic)
    free: int  # units free on the pool when it was placed
    eff: float | None  # E(amount) of its profile (None: no profile)
    not_elastic: str = ""  # why it is not elastic, where it is not
    rule: str = "priced"
    prices: tuple[tuple[int, float, float, float | None], ...] = ()  # (k, t(k), factor, E(k))
    best: int = 0  # k*: least priced time (rule priced)
    load: Sharing | None = None

    def __str__(self) -> str:
        head = f"dop {self.amount}"
        if self.not_elastic:
            return f"{head}: {self.not_elastic}"
        span = f"{self.allowed[0]}-{self.allowed[-1]}"
        eff = "" if self.eff is None else f"; E({self.amount})={self.eff:.2f}"
        free = f"{self.free} core{'s' if self.free != 1 else ''} free"
        if self.rule != "priced" or self.load is None:
            return f"{head} of {span}: the replay's least total ACT (rule {self.rule}){eff}; {free}"
        s = self.load
        priced = ", ".join(
            f"k={k} {t:.3g}s{'' if e is None else f' (E={e:.2f})'}×{f:.2f}={t * f:.3g}s"
            for k, t, f, e in self.prices
        )
        service = f"{s.running} running"
        if s.recent_starts_per_s * s.mean_s > s.running:
            service = (
                f"recent starts {s.recent_starts_per_s:.3g}/s × {s.mean_s:.3g}s, "
                f"{s.running} running"
            )
        if s.capped:
            service += ", capped by the node's environments"
        load = (
            f"N/C=({s.queued} queued + {s.in_service:.2f} in service: {service})/"
            f"{s.units:.3g} cores={s.share:.2f}"
        )
        if self.amount == self.best:
            pick = f"least priced time at {self.best}"
        else:
            lo, hi = band(self.allowed, self.best)[0], self.best
            pick = f"least priced time at {self.best}, band {lo}-{hi}, took {self.amount}"
        return f"{head} of {span}: {pick}; price t(k)×max(1, (1+k·N/C)/2): {priced}; {load}; {free}"


def dop_why(
    action: Action,
    amount: int,
    free: int,
    *,
    rule: str,
    load: PoolLoad | None,
    queued: int,
    capacity: int,
    dur: Callable[[Action, Sequence[int]], Sequence[float]],
    profile_not_elastic: str | None = None,
) -> DopWhy:
    """Why ``action`` was placed at ``amount``, from the pass's inputs: the pool's ``load``,
    its ``queued`` elastic actions, its ``capacity`` and ``dur(action, ks)`` (the pass's
    durations); ``profile_not_elastic``: the name of the non-elastic profile it named."""
    allowed = tuple(a for a in action.allowed if a <= capacity) or (amount,)
    e = action.elasticity
    eff = _eff(action, amount)
    if len(allowed) < 2:
        if profile_not_elastic is not None:
            why = f"profile {profile_not_elastic!r} is not elastic (more cores do not pay)"
        elif e is None and action.key_amounts.max > action.key_amounts.min:
            why = "not elastic (a core range needs a profile: --profile, or t1_s and eff)"
        else:
            why = "fixed (one core count allowed)"
        return DopWhy(amount, allowed, free, eff, not_elastic=why, rule=rule)
    if rule != "priced" or load is None:
        return DopWhy(amount, allowed, free, eff, rule=rule)
    share = sharing(load, max(queued, 1), capacity)
    ks = probe(allowed)
    prices = tuple(
        (k, t, price_factor(k, share.share), _eff(action, k))
        for k, t in zip(ks, dur(action, ks), strict=True)
    )
    best, cost, at = allowed[-1], math.inf, 0
    for i, (k, t, f, _) in enumerate(prices):  # priced_dop's loop: the first least price wins
        if t * f < cost:
            best, cost, at = k, t * f, i
    more = between(allowed, ks, at)  # refined between the least probed one's neighbours
    if more:
        refined = tuple(
            (k, t, price_factor(k, share.share), _eff(action, k))
            for k, t in zip(more, dur(action, more), strict=True)
        )
        for k, t, f, _ in refined:
            if t * f < cost:
                best, cost = k, t * f
        prices = tuple(sorted((*prices, *refined), key=lambda p: p[0]))
    return DopWhy(amount, allowed, free, eff, rule=rule, prices=prices, best=best, load=share)


def _eff(action: Action, k: int) -> float | None:
    """E(k) of the action's profile (None: no profile, or k outside it)."""
    e = action.elasticity
    return e.efficiency(k) if e is not None and e.lo <= k <= e.hi else None


__all__ = ["DopWhy", "Sharing", "dop_why", "sharing"]

"""Fair-share rules tried for tenancy.py's burst goal (issue 34), not in the scheduler.

Usage: python bench/paper/tenancy_variants.py VARIANT [--seed N] [--scenarios burst,share_2_1]
       [--time-s T] [--cap-s C] [--window-s W] [--a-weight W]

Each variant replaces the simulator's ``Engine._usage`` (the per-job ``usage`` that
``tangram.sched.share.fair_order`` orders by instead of ``held``), so the pass, the per-pool
rule and everything else are the repository's. Variants (docs/results.md, tenancy):

- ``memoryless``: today's rule (no usage passed);
- ``credit-others`` / ``credit-both``: contended lag. Per job and resource, a lag in
  unit-seconds: while some job has actions waiting for the resource and two or more jobs
  are active (hold units or wait), each active job's lag grows by ``(e - held) * dt``,
  where ``e`` is its weighted share of the units held; ``credit-both`` counts only intervals
  where two or more jobs wait. The lag is kept in ``[0, e * C]`` and reset when the job is
  inactive (no credit for idle time); the order counts ``held - lag / T`` (a job with
  credit may exceed its share by up to ``e * C / T`` units);
- ``tie``: a job with the fewest waiting actions wins ties (its held counts half a unit less);
- ``light``: a job whose offered load (expected unit-seconds submitted, averaged over the
  last ``W`` s) is within its share goes ahead of the jobs above theirs.

``--a-weight W``: A's weight in the burst (memoryless): the weights A needs.
Prints one JSON object: the burst row (A alone and with the variant) and the 2:1 row.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

# It replaces a method of the simulator's Engine, which a compiled Engine (tangram/_native.py)
# does not allow: the interpreted core, chosen before tangram is imported
os.environ["TANGRAM_PURE"] = "1"

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "paper"))
sys.path.insert(0, str(ROOT))

import tenancy  # noqa: E402

from tangram.model import Action  # noqa: E402
from tangram.sched.share import resource_of  # noqa: E402
from tangram.sim.engine import Engine  # noqa: E402

ARGS = argparse.Namespace()


class ContendedLag:
    """The ``credit-*`` variants' per-job lag (module doc)."""

    def __init__(self, totals: dict[str, int], both: bool, time_s: float, cap_s: float):
        self.totals, self.both, self.time_s, self.cap_s = totals, both, time_s, cap_s
        self.last: float | None = None
        self.lag: dict[str, dict[str, float]] = {}
        self.prev: tuple[dict[str, dict[str, int]], dict[str, set[str]]] | None = None

    def update(
        self,
        now: float,
        held: dict[str, dict[str, int]],
        waiting: list[Action],
        weights: dict[str, float],
    ) -> dict[str, dict[str, float]]:
        wait: dict[str, set[str]] = {}
        for a in waiting:
            wait.setdefault(resource_of(a), set()).add(a.job)
        if self.prev is not None and self.last is not None and now > self.last:
            dt = now - self.last
            was_held, was_waiting = self.prev  # what held over (last, now)
            for r in self.totals:
                waiters = was_waiting.get(r, set())
                active = waiters | {j for j, h in was_held.items() if h.get(r, 0) > 0}
                if not waiters or len(active) < 2 or (self.both and len(waiters) < 2):
                    continue
                used = sum(was_held.get(j, {}).get(r, 0) for j in active)
                wsum = sum(weights.get(j, 1.0) for j in active)
                for j in active:
                    e = used * weights.get(j, 1.0) / wsum
                    mine = self.lag.setdefault(j, {})
                    got = mine.get(r, 0.0) + (e - was_held.get(j, {}).get(r, 0)) * dt
                    mine[r] = max(0.0, min(got, e * self.cap_s))
        if self.last is None or now > self.last:
            self.last = now
        for j, mine in self.lag.items():  # an inactive job keeps no credit
            for r in mine:
                if held.get(j, {}).get(r, 0) == 0 and j not in wait.get(r, ()):
                    mine[r] = 0.0
        self.prev = ({j: dict(h) for j, h in held.items()}, wait)
        out: dict[str, dict[str, float]] = {}
        for j, h in held.items():
            out[j] = {r: u - self.lag.get(j, {}).get(r, 0.0) / self.time_s for r, u in h.items()}
        for j, mine in self.lag.items():
            for r, c in mine.items():
                out.setdefault(j, {}).setdefault(r, -c / self.time_s)
        return out


def usage(self: Any, now: float, waiting: list[Action]) -> dict[str, dict[str, float]] | None:
    v = ARGS.variant
    if v == "memoryless" or len(self.jobs) < 2:
        return None
    weights = {n: j.weight for n, j in self.jobs.items()}
    if v == "tie":
        count: dict[str, int] = {}
        for a in waiting:
            count[a.job] = count.get(a.job, 0) + 1
        if len(count) < 2:
            return None
        low = min(count, key=lambda j: count[j])
        return {
            j: {r: u - (0.5 if j == low else 0.0) for r, u in h.items()}
            for j, h in self.held.items()
        }
    if v == "light":
        st = self.__dict__.setdefault("_light", {"last": now, "rate": {}, "seen": -1})
        w = ARGS.window_s
        keep = math.exp(-(now - st["last"]) / w) if now > st["last"] else 1.0
        st["last"] = max(now, st["last"])
        rate: dict[str, float] = st["rate"]
        for j in rate:
            rate[j] *= keep
        top = st["seen"]
        for a in waiting:  # each action counted once, at the first pass that sees it
            if a.seq > st["seen"]:
                work = a.min_units * self.history.estimate(a.klass) / w
                rate[a.job] = rate.get(a.job, 0.0) + work
                top = max(top, a.seq)
        st["seen"] = top
        active = {a.job for a in waiting} | {j for j, h in self.held.items() if any(h.values())}
        if len(active) < 2:
            return None
        wsum = sum(weights.get(j, 1.0) for j in active)
        out: dict[str, dict[str, float]] = {}
        for j, h in self.held.items():
            out[j] = {}
            for r, u in h.items():
                total = self.totals.get(r, 0)
                light = r == "cpu" and rate.get(j, 0.0) <= total * weights.get(j, 1.0) / wsum
                out[j][r] = u - (total if light else 0)
        return out
    lag = self.__dict__.get("_lag")
    if lag is None:
        both = v == "credit-both"
        lag = self.__dict__["_lag"] = ContendedLag(dict(self.totals), both, ARGS.time_s, ARGS.cap_s)
    result: dict[str, dict[str, float]] = lag.update(now, self.held, waiting, weights)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "variant", choices=["memoryless", "credit-others", "credit-both", "tie", "light"]
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scenarios", default="burst,share_2_1")
    ap.add_argument("--time-s", type=float, default=10.0, help="credit: T (s)")
    ap.add_argument("--cap-s", type=float, default=2.5, help="credit: C (s)")
    ap.add_argument("--window-s", type=float, default=60.0, help="light: W (s)")
    ap.add_argument("--a-weight", type=float, default=1.0, help="A's weight in the burst")
    ap.parse_args(namespace=ARGS)
    Engine._usage = usage  # type: ignore[method-assign]
    out: dict[str, Any] = {"variant": ARGS.variant, "seed": ARGS.seed}
    if ARGS.variant.startswith("credit"):
        out |= {"time_s": ARGS.time_s, "cap_s": ARGS.cap_s}
    if ARGS.variant == "light":
        out["window_s"] = ARGS.window_s
    if ARGS.a_weight != 1.0:
        out["a_weight"] = ARGS.a_weight
    for name in ARGS.scenarios.split(","):
        if name == "burst":
            out["burst"] = tenancy.burst(ARGS.seed, full=False, a_weight=ARGS.a_weight)
        elif name == "share_2_1":
            out["share_2_1"] = tenancy.share_2_1(ARGS.seed)
        elif name == "priority":
            out["priority"] = tenancy.priority(ARGS.seed)
        else:
            raise SystemExit(f"unknown scenario {name!r}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()

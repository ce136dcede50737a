"""``Decision.quiet``: a CPU node whose pass found no candidate reports until when a pass at
the same state (queue, free cores, running actions, load, and estimates that still hold
the calls it held) finds none either. Random small nodes: a pass at any later time before
that bound, with the estimates it names still holding (``tangram.sim.engine._holds``),
places nothing there either."""

from __future__ import annotations

import random

import pytest

from tangram.model import Action, ActionId, TrajectoryId, make_action
from tangram.pools.cpu import CpuNodePool
from tangram.sched import PoolLoad, SchedConfig, Snapshot, schedule
from tangram.sim.engine import _holds

PROFILE = (1, 2, 4, 8, 16)


def _queue(rng: random.Random, now: float) -> list[Action]:
    out = []
    for i in range(rng.randint(1, 8)):
        at = now - rng.uniform(0.0, 60.0)
        if rng.random() < 0.4:  # an elastic run (its own durations)
            f = rng.choice((0.02, 0.1, 0.3))
            eff = {m: 1.0 / (1.0 + f * (m - 1)) for m in PROFILE}
            a = make_action(
                f"e{i}", "exec", f"t{i}", {"cpu": [1, 16]}, seq=i, t1_s=rng.uniform(5, 400),
                eff=eff, submitted_at=at,
            )  # fmt: skip
        elif rng.random() < 0.5:  # a short call of known duration
            a = make_action(
                f"s{i}", "exec", f"t{i}", {"cpu": rng.choice((1, 2))}, seq=i,
                dur_s=rng.uniform(0.1, 30.0), submitted_at=at,
            )  # fmt: skip
        else:  # a short call on its class's history estimate
            a = make_action(
                f"h{i}", "exec", f"t{i}", {"cpu": rng.choice((1, 2))}, seq=i,
                klass=rng.choice(("ka", "kb")), submitted_at=at,
            )  # fmt: skip
        out.append(a)
    return out


@pytest.mark.parametrize("rule", ["priced", "wait-eft"])
def test_no_candidate_before_the_quiet_bound(rule: str) -> None:
    rng = random.Random(7)
    cfg = SchedConfig(rule=rule, quiet=True)  # type: ignore[arg-type]
    quiet_seen = later_checked = 0
    for _ in range(1500):
        now = rng.uniform(100.0, 1000.0)
        node = CpuNodePool("n0", [list(range(16))], 1 << 40)
        pid = node.pool_id
        busy = rng.randint(8, 16)
        running: list[tuple[float, int]] = []
        used = 0
        while used < busy:
            units = min(rng.randint(1, 6), busy - used)
            node.allocate(ActionId(f"r{used}"), tuple(range(used, used + units)))
            # expected finishes ahead, some already past (they count as 0)
            running.append((now + rng.uniform(-5.0, 120.0), units))
            used += units
        queue = _queue(rng, now)
        est = {"ka": rng.uniform(0.5, 40.0), "kb": rng.uniform(0.5, 40.0)}
        load = PoolLoad(elastic_mean_s=rng.choice((0.0, 30.0, 300.0)), elastic_running=2)
        snap = Snapshot(
            waiting=queue,
            pools={pid: node},
            affinity={TrajectoryId(a.trajectory): pid for a in queue},
            running={pid: running},
            estimate=lambda k, e=est: e.get(k, 1.0),  # type: ignore[misc]
            load={pid: load},
        )
        first = schedule(snap, now, cfg)
        if not first.quiet:
            continue
        ((at, until, reads),) = first.quiet
        assert at == pid and until > now and not first.placements
        quiet_seen += 1
        for _ in range(6):
            later = now + rng.uniform(0.0, min(until - now, 300.0))
            moved = {k: v * rng.choice((1.0, 0.5, 1.5, 3.0)) for k, v in est.items()}
            if not _holds(reads, lambda k, m=moved: m.get(k, 1.0), later):  # type: ignore[misc]
                continue
            again = schedule(
                Snapshot(
                    waiting=queue,
                    pools={pid: node},
                    affinity=snap.affinity,
                    running=snap.running,
                    estimate=lambda k, m=moved: m.get(k, 1.0),  # type: ignore[misc]
                    load=snap.load,
                ),
                later,
                cfg,
            )
            assert not again.placements, (now, later, until, reads)
            later_checked += 1
    assert quiet_seen > 50 and later_checked > 200

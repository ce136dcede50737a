"""Scheduler/pool behaviours the simulator found, kept as regression tests.

1. With the paper's replay rule an elastic action always starts at once on whatever is free;
   the "wait" rule (default) lets it wait briefly for more units when that lowers ACT.
2. ``GpuCluster.pick_units`` could split, for residency, a chunk that a later request of
   the same pass needed; it now falls back to residency-blind largest-first packing.
"""

from __future__ import annotations

from tangram.model import ActionId, TrajectoryId, make_action
from tangram.pools.cpu import CpuNodePool
from tangram.pools.gpu import GpuCluster, GpuNodePool, ServiceSpec
from tangram.sched import SchedConfig, Snapshot, schedule

GB = 1_000_000_000


def test_lone_elastic_action_waits_one_second_for_four_cores() -> None:
    """An elastic 100 s test run waits 1 s for 4 cores (ACT 26 s) rather than take 1 (100 s)."""
    node = CpuNodePool("n0", [[0, 1, 2, 3]], GB)
    for core in (0, 1, 2):
        node.allocate(ActionId(f"busy{core}"), (core,))
    action = make_action(
        "a", "exec", "t", {"cpu": [1, 4]}, t1_s=100.0, eff={1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}
    )
    snap = Snapshot(
        waiting=[action],
        pools={node.pool_id: node},
        affinity={TrajectoryId("t"): node.pool_id},
        running={node.pool_id: [(1.0, 1), (1.0, 1), (1.0, 1)]},
    )
    decision = schedule(snap, 0.0, SchedConfig())
    assert not decision.placements or decision.placements[0].amount == 4
    paper = schedule(snap, 0.0, SchedConfig(rule="paper"))
    assert [p.amount for p in paper.placements] == [1]  # the paper's rule, kept selectable


def test_gpu_pick_units_fits_what_the_chunk_operator_accepts() -> None:
    """Requests 1 + 1 + 2 GPUs fit one free 4-GPU chunk even when the service is resident."""
    judge = ServiceSpec("judge", 10 * GB)
    gpus = GpuCluster(
        [GpuNodePool("g0", 4, mem_per_gpu=80 * GB, h2d_bytes_per_s=10e9)], {"judge": judge}
    )
    for i, gpu in enumerate((1, 2)):  # leave judge@1 resident on GPUs 1 and 2
        aid = ActionId(f"warm{i}")
        gpus.allocate(aid, (gpu,))
        gpus.restore_for(aid, "judge", i + 1)
        gpus.release(aid)
    reqs = [
        (
            make_action(
                f"a{i}",
                "service",
                "t",
                {"gpu": {"set": [1, 2, 4]}},
                service="judge",
                t1_s=1.0,
                eff={1: 1.0, 2: 1.0, 4: 1.0},
            ),
            k,
        )
        for i, k in enumerate((1, 1, 2))
    ]
    assert gpus.operator().counts == (0, 0, 1, 0)  # one free chunk of 4: the DP accepts 1+1+2
    picked = gpus.pick_units(reqs)
    assert sorted(len(p) for p in picked) == [1, 1, 2]

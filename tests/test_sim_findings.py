"""Scheduler/pool behaviours the simulator found, kept as regression tests.

1. With the paper's replay rule an elastic action always starts at once on whatever is free;
   the "wait" rule lets it wait briefly for more units when that lowers ACT.
1b. "wait" still starts an elastic action on 1 core when the queued elastic action behind it
   is replayed at its minimum; the "wait-eft" rule (default, policy ``tangram``)
   replays later elastic actions at their earliest-finishing amount on CPU nodes.
2. ``GpuCluster.pick_units`` could split, for residency, a chunk that a later request of
   the same pass needed; it now falls back to residency-blind largest-first packing.
"""

from __future__ import annotations

from tangram.model import ActionId, TrajectoryId, make_action
from tangram.pools.cpu import CpuNodePool
from tangram.pools.gpu import GpuCluster, GpuNodePool, ServiceSpec
from tangram.sched import SchedConfig, Snapshot, schedule
from tangram.sim.policy import parse_policy

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
    for rule in ("wait", "wait-eft"):
        decision = schedule(snap, 0.0, SchedConfig(rule=rule))
        assert decision.placements == (), rule  # it waits: 4 cores are free in 1 s
        assert decision.waiting == (action.id,), rule
    paper = schedule(snap, 0.0, SchedConfig(rule="paper"))
    assert [p.amount for p in paper.placements] == [1]  # the paper's rule, kept selectable


def test_wait_eft_defers_straggler_that_wait_starts_on_one_core() -> None:
    """Two queued 100 s test runs, 1 core free, 6 free in 1 s: only "wait-eft" waits."""
    node = CpuNodePool("n0", [list(range(8))], GB)
    for core in range(7):
        node.allocate(ActionId(f"busy{core}"), (core,))
    eff = {1: 1.0, 2: 0.9, 4: 0.75, 8: 0.55}
    acts = [
        make_action(f"a{i}", "exec", f"t{i}", {"cpu": [1, 8]}, seq=i, t1_s=100.0, eff=eff)
        for i in range(2)
    ]
    snap = Snapshot(
        waiting=acts,
        pools={node.pool_id: node},
        affinity={TrajectoryId(f"t{i}"): node.pool_id for i in range(2)},
        running={node.pool_id: [(1.0, 6), (100.0, 1)]},
    )
    assert [p.amount for p in schedule(snap, 0.0, SchedConfig(rule="wait")).placements] == [1]
    assert not schedule(snap, 0.0, SchedConfig(rule="wait-eft")).placements


def test_policy_names_select_the_replay_rule() -> None:
    """``tangram`` runs the default rule; suffixes and aliases select the others."""
    assert parse_policy("tangram").rule == SchedConfig().rule
    assert parse_policy("tangram+backfill").rule == SchedConfig().rule
    assert parse_policy("tangram+backfill").order == "backfill"
    assert parse_policy("tangram-wait").rule == "wait"
    assert parse_policy("tangram-paper").rule == "paper"
    assert parse_policy("fixed-dop:8+paper").rule == "paper"


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

"""Chunk choice avoids evictions (issue 33 item 2): among equally good free chunks, the one
whose GPUs take the service's shard without evicting another service wins; residency and
buddy size still come first, and with no memory pressure nothing changes."""

from __future__ import annotations

import pytest

from tangram.model import Action, ActionId, make_action
from tangram.pools.buddy import BuddyChunks, choose_chunk, least_evictions
from tangram.pools.gpu import GpuCluster, GpuNodePool, ServiceSpec

GB = 10**9
FULL = ServiceSpec("full", 10 * GB)  # fills one GPU of 10 GB
HALF = ServiceSpec("half", 6 * GB)  # a shard of 6 GB at 1 GPU, 3 GB at 2
SMALL = ServiceSpec("small", 1 * GB)


def node(node_id: str = "g0", n_gpus: int = 4) -> GpuNodePool:
    pool = GpuNodePool(node_id, n_gpus, mem_per_gpu=10 * GB, h2d_bytes_per_s=10 * GB)
    for spec in (FULL, HALF, SMALL):
        pool.register_service(spec)
    return pool


def resident(pool: GpuNodePool, spec: ServiceSpec, gpus: tuple[int, ...], tick: int) -> None:
    """Make ``spec`` resident on ``gpus`` as a finished call would leave it."""
    holder = ActionId(f"warm-{spec.name}-{gpus}")
    pool.allocate_gpus(holder, gpus)
    pool.restore(spec, gpus, tick)
    pool.release(holder)


def call(name: str, service: str, k: int) -> Action:
    return make_action(name, "service", "t", {"gpu": k}, service=service)


CASES = [
    # (name, GPUs held by actions, residents (service, gpus), request, service, chosen,
    #  whether the chosen chunk's restore evicts nothing)
    ("split away from the full GPU's pair", [], [(FULL, (0,))], 1, "half", (2,), True),
    ("split within the pair to the room", [(2, 3)], [(FULL, (0,))], 1, "half", (1,), True),
    ("four: the pair with room", [], [(FULL, (0,)), (FULL, (1,))], 2, "half", (2, 3), True),
    ("equal singles: the one with room", [(1,), (2,)], [(FULL, (0,))], 1, "half", (3,), True),
    ("a smaller free chunk still wins", [(1,)], [(FULL, (0,))], 1, "half", (0,), False),
    ("no pressure: the lowest, as before", [], [(SMALL, (0,))], 1, "half", (0,), True),
    ("all evict: the lowest", [(2, 3)], [(FULL, (0,)), (FULL, (1,))], 1, "half", (0,), False),
    ("residency first", [], [(HALF, (0,)), (FULL, (1,))], 1, "half", (0,), True),
]


@pytest.mark.parametrize(
    ("busy", "residents", "k", "service", "chosen", "no_eviction"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_chunk_choice_prefers_a_chunk_that_evicts_nothing(
    busy: list[tuple[int, ...]],
    residents: list[tuple[ServiceSpec, tuple[int, ...]]],
    k: int,
    service: str,
    chosen: tuple[int, ...],
    no_eviction: bool,
) -> None:
    """The node's pick for a request, per case: residency, then the smallest free chunk,
    then a chunk whose memory takes the shard without evicting, then the lowest."""
    pool = node()
    for tick, (spec, gpus) in enumerate(residents, 1):
        resident(pool, spec, gpus, tick)
    for i, gpus in enumerate(busy):
        pool.allocate_gpus(ActionId(f"busy{i}"), gpus)
    assert pool.pick_chunk(k, service) == chosen
    plan = pool.restore(pool.service(service), chosen, 99)
    assert (plan.evicted == ()) == no_eviction, plan
    pool.validate()


def test_the_cluster_picks_the_node_where_nothing_is_evicted() -> None:
    """Two nodes with one free GPU each: node a's is full of another service, node b's is
    empty; a call there restores without evicting (node order alone would pick a)."""
    a, b = node("a", 2), node("b", 2)
    resident(a, FULL, (0,), 1)
    cluster = GpuCluster([a, b], {s.name: s for s in (FULL, HALF, SMALL)})
    for pool in (a, b):
        cluster.allocate(ActionId(f"busy-{pool.node_id}"), cluster.global_ids(pool.node_id, [1]))
    (units,) = cluster.pick_units([(call("c1", "half", 1), 1)])
    assert cluster.locate(units[0]) == ("b", 0)
    cluster.allocate(ActionId("c1"), units)
    assert cluster.restore_for(ActionId("c1"), "half", 5).evicted == ()
    cluster.validate()


def test_several_picks_in_one_pass_each_prefer_room() -> None:
    """Two requests in one pass on a 4-GPU node whose GPU 0 is full: both land on GPUs with
    room (the picks are taken in order on a copy of the chunks; the first keeps the pair
    with the full GPU whole, so the second need not evict either)."""
    pool = node("n", 4)
    resident(pool, FULL, (0,), 1)
    cluster = GpuCluster([pool], {s.name: s for s in (FULL, HALF, SMALL)})
    picked = cluster.pick_units([(call("c1", "half", 1), 1), (call("c2", "half", 1), 1)])
    assert sorted(u for units in picked for u in units) == [2, 3]


def test_least_evictions_reads_the_best_sub_chunk() -> None:
    """``least_evictions`` is the fewest evicting GPUs over the aligned sub-chunks of a span
    (0 without a score), and ``choose_chunk`` without scores is the old choice."""
    short = {0: True, 1: False, 2: True, 3: True}

    def evicts(start: int, size: int) -> int:
        return sum(short[g] for g in range(start, start + size))

    assert least_evictions(None, 0, 4, 1) == 0
    assert least_evictions(evicts, 0, 4, 1) == 0
    assert least_evictions(evicts, 0, 4, 2) == 1
    assert least_evictions(evicts, 2, 2, 2) == 2
    buddy = BuddyChunks(4)
    assert choose_chunk([(buddy, None)], 1) == (0, 0)
    assert choose_chunk([(buddy, None)], 1, [evicts]) == (0, 1)
    assert choose_chunk([(buddy, None)], 2, [evicts]) == (0, 0)

"""GPU pools: buddy chunks, residency LRU with memory accounting, and the cluster SchedPool."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tangram.model import Action, ActionId, make_action
from tangram.pools.buddy import BuddyChunks
from tangram.pools.gpu import (
    Eviction,
    GpuCluster,
    GpuNodePool,
    RestorePlan,
    ServiceSpec,
)
from tangram.sched.operators import ChunkOperator, chunk_level

GB = 10**9
H2D = 10 * GB  # bytes per second per GPU


def node(node_id: str = "g0", n_gpus: int = 8, mem: int = 80 * GB) -> GpuNodePool:
    return GpuNodePool(node_id, n_gpus, mem_per_gpu=mem, h2d_bytes_per_s=H2D)


def service_action(name: str, service: str, gpus: object = (1, 2, 4, 8)) -> Action:
    demand = {"gpu": {"set": list(gpus)}} if isinstance(gpus, tuple) else {"gpu": gpus}
    return make_action(name, "service", "t", demand, service=service)


def aid(name: str) -> ActionId:
    return ActionId(name)


# --------------------------------------------------------------------------- buddy chunks


def test_node_sizes_are_powers_of_two_up_to_eight() -> None:
    """Only 1, 2, 4 or 8 GPUs per node form buddy chunks; others are named and refused."""
    for n in (1, 2, 4, 8):
        assert node(n_gpus=n).free_chunks() == ((0, n),)
    for n in (0, 3, 6, 16):
        with pytest.raises(ValueError, match="allowed: 1, 2, 4, 8"):
            node(n_gpus=n)


CHUNK_CASES = [
    ("one gpu splits 8 into 1+1+2+4", [1], ((1, 2), (2, 4), (4, 8))),
    ("two gpus take an aligned pair", [2], ((2, 4), (4, 8))),
    ("three gpus take a chunk of four", [3], ((4, 8),)),
    ("second single reuses the buddy", [1, 1], ((2, 4), (4, 8))),
    ("smallest chunk first", [1, 4, 1], ((2, 4),)),
    ("whole node", [8], ()),
]


@pytest.mark.parametrize(
    ("requests", "free"),
    [case[1:] for case in CHUNK_CASES],
    ids=[case[0] for case in CHUNK_CASES],
)
def test_allocate_chunk_table(requests: list[int], free: tuple[tuple[int, int], ...]) -> None:
    """Requests take the smallest fitting aligned chunk, splitting larger ones buddy-wise."""
    pool = node()
    for i, k in enumerate(requests):
        gpus = pool.allocate_chunk(aid(f"a{i}"), k)
        assert len(gpus) == chunk_level(k) and gpus[0] % len(gpus) == 0
    assert pool.free_chunks() == free
    pool.validate()


def test_release_merges_buddies_back() -> None:
    """Freed buddies merge upwards so an idle node is one chunk again."""
    pool = node()
    pool.allocate_chunk(aid("a"), 1)
    pool.allocate_chunk(aid("b"), 1)
    pool.allocate_chunk(aid("c"), 2)
    assert pool.release(aid("a")) == (0,)
    assert pool.free_chunks() == ((0, 1), (4, 8))  # 0 cannot merge: its buddy 1 is held
    pool.release(aid("b"))
    assert pool.free_chunks() == ((0, 2), (4, 8))
    pool.release(aid("c"))
    assert pool.free_chunks() == ((0, 8),)
    with pytest.raises(KeyError):
        pool.release(aid("c"))


def test_no_free_chunk_raises() -> None:
    """A request with no free chunk big enough is a ValueError; nothing changes."""
    pool = node(n_gpus=4)
    pool.allocate_chunk(aid("a"), 1)
    with pytest.raises(ValueError, match="no free chunk of 4"):
        pool.allocate_chunk(aid("b"), 4)
    assert pool.free_chunks() == ((1, 2), (2, 4))


def test_allocate_gpus_takes_an_exact_aligned_free_chunk() -> None:
    """Exact placement accepts only one aligned free chunk and splits around it."""
    pool = node()
    pool.allocate_gpus(aid("a"), (6, 7))
    assert pool.free_chunks() == ((0, 4), (4, 6))
    for bad in [(1, 2), (0, 2, 3), (6,), (), (8,)]:
        with pytest.raises(ValueError):
            pool.allocate_gpus(aid("b"), bad)
    assert pool.holder(6) == aid("a") and pool.holder(5) is None


class BuddyMachine(RuleBasedStateMachine):
    """Random allocate/release sequences on an 8-GPU node."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = node()
        self.held: dict[ActionId, tuple[int, ...]] = {}
        self.counter = 0

    @rule(k=st.sampled_from([1, 2, 3, 4, 8]))
    def allocate(self, k: int) -> None:
        self.counter += 1
        action_id = aid(f"a{self.counter}")
        counts = self.pool.chunk_counts()
        state = (counts[1], counts[2], counts[4], counts[8])
        predicted = ChunkOperator(counts).take(state, k)
        if self.pool.pick_chunk(k) is None:
            assert predicted is None
            with pytest.raises(ValueError):
                self.pool.allocate_chunk(action_id, k)
            return
        gpus = self.pool.allocate_chunk(action_id, k)
        self.held[action_id] = gpus
        assert predicted == tuple(self.pool.chunk_counts().values())

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        action_id = data.draw(st.sampled_from(sorted(self.held)))
        assert self.pool.release(action_id) == self.held.pop(action_id)

    @invariant()
    def consistent(self) -> None:
        self.pool.validate()
        gpus = [g for chunk in self.held.values() for g in chunk]
        assert len(gpus) == len(set(gpus))
        assert self.pool.free_gpus() == 8 - len(gpus)

    def teardown(self) -> None:
        for action_id in list(self.held):
            self.pool.release(action_id)
        assert self.pool.free_chunks() == ((0, 8),)


TestBuddyMachine = BuddyMachine.TestCase
TestBuddyMachine.settings = settings(max_examples=60, stateful_step_count=30)


@given(order=st.permutations(list(range(8))))
def test_releasing_singles_in_any_order_restores_the_node(order: list[int]) -> None:
    """Eight single-GPU chunks released in any order merge back into one chunk of eight."""
    buddy = BuddyChunks(8)
    for gpu in range(8):
        buddy.split(gpu, 1)
    for gpu in order:
        buddy.merge(gpu, 1)
    assert buddy.chunks() == [(0, 8)]


# --------------------------------------------------------------------------- residency


def registered(*specs: ServiceSpec, mem: int = 80 * GB, n_gpus: int = 8) -> GpuNodePool:
    pool = node(mem=mem, n_gpus=n_gpus)
    for spec in specs:
        pool.register_service(spec)
    return pool


def test_restore_time_is_shard_copy_time() -> None:
    """Restoring a DoP-k instance copies mem/k bytes per GPU in parallel."""
    pool = node()
    spec = ServiceSpec("rm", 40 * GB)
    assert pool.restore_time_s(spec, 1) == pytest.approx(4.0)
    assert pool.restore_time_s(spec, 4) == pytest.approx(1.0)
    assert spec.mem_per_gpu(3) == -(-40 * GB // 3)


def test_restore_marks_resident_and_second_restore_is_free() -> None:
    """First restore copies the state; a second on the same chunk only touches the LRU."""
    spec = ServiceSpec("rm", 20 * GB)
    pool = registered(spec)
    plan = pool.restore(spec, (0, 1), tick=1)
    assert plan.needed and plan.evicted == ()
    assert plan.seconds == pytest.approx(1.0)
    assert pool.is_resident("rm", (0, 1))
    assert not pool.is_resident("rm", (0,))  # DoP 1 is a different variant
    assert not pool.is_resident("rm", (2, 3))
    assert (pool.mem_used(0), pool.mem_used(1), pool.mem_used(2)) == (10 * GB, 10 * GB, 0)
    assert pool.restore(spec, (0, 1), tick=2) == RestorePlan((), False, 0.0)
    pool.validate()


def test_lru_eviction_order_and_memory_accounting() -> None:
    """Least recently used services leave first, only as many as the new one needs."""
    a, b, c, d = (ServiceSpec(n, 30 * GB) for n in "abcd")
    pool = registered(a, b, c, d)
    pool.restore(a, (0,), tick=1)
    pool.restore(b, (0,), tick=2)
    assert pool.mem_free(0) == 20 * GB
    pool.touch("a", (0,), tick=3)  # b is now the least recently used
    assert pool.resident(0) == (("b", 1), ("a", 1))
    plan = pool.restore(c, (0,), tick=4)
    assert plan.evicted == (Eviction(0, "b", 1),)
    assert pool.resident(0) == (("a", 1), ("c", 1))
    assert pool.mem_used(0) == 60 * GB
    plan = pool.restore(ServiceSpec("d", 30 * GB), (0,), tick=5)
    assert plan.evicted == (Eviction(0, "a", 1),)
    pool.validate()


def test_eviction_of_a_multi_gpu_instance_frees_all_its_gpus() -> None:
    """A service spanning several GPUs is evicted from all of them, not just the one needed."""
    big, small = ServiceSpec("big", 4 * 70 * GB), ServiceSpec("small", 20 * GB)
    pool = registered(big, small)
    pool.restore(big, (0, 1, 2, 3), tick=1)
    plan = pool.restore(small, (1,), tick=2)
    assert plan.evicted == tuple(Eviction(g, "big", 4) for g in range(4))
    assert all(pool.mem_used(g) == 0 for g in (0, 2, 3))
    assert pool.mem_used(1) == 20 * GB
    pool.validate()


def test_restore_evicts_until_every_gpu_of_the_chunk_has_room() -> None:
    """Each GPU of the target chunk gets room; untouched GPUs keep their services."""
    a, b, two = ServiceSpec("a", 50 * GB), ServiceSpec("b", 50 * GB), ServiceSpec("two", 80 * GB)
    pool = registered(a, b, two)
    pool.restore(a, (0,), tick=1)
    pool.restore(b, (1,), tick=2)
    pool.restore(a, (2,), tick=3)
    plan = pool.restore(two, (0, 1), tick=4)
    assert plan.evicted == (Eviction(0, "a", 1), Eviction(1, "b", 1))
    assert pool.resident(2) == (("a", 1),)
    pool.validate()


def test_restore_needs_a_host_backup_and_a_fitting_shard() -> None:
    """Restore refuses unregistered services, shards larger than a GPU, and non-chunks."""
    pool = node(mem=10 * GB)
    spec = ServiceSpec("rm", 40 * GB)
    with pytest.raises(ValueError, match="register"):
        pool.restore(spec, (0,), tick=1)
    pool.register_service(spec)
    with pytest.raises(ValueError, match="bytes per GPU"):
        pool.restore(spec, (0, 1), tick=1)
    with pytest.raises(ValueError, match="not one chunk"):
        pool.restore(spec, (0, 2, 4, 6), tick=1)
    plan = pool.restore(spec, (0, 1, 2, 3), tick=1)
    assert plan.needed and pool.is_resident("rm", (0, 1, 2, 3))


def test_unregister_evicts_everywhere() -> None:
    """Dropping a host backup evicts every variant of the service from every GPU."""
    rm, other = ServiceSpec("rm", 8 * GB), ServiceSpec("other", GB)
    pool = registered(rm, other)
    pool.restore(rm, (0, 1), tick=1)
    pool.restore(rm, (4,), tick=2)
    pool.restore(other, (4,), tick=3)
    evicted = pool.unregister_service("rm")
    assert set(evicted) == {Eviction(0, "rm", 2), Eviction(1, "rm", 2), Eviction(4, "rm", 1)}
    assert pool.backups == frozenset({"other"})
    assert pool.resident(4) == (("other", 1),)


def test_allocation_prefers_resident_chunks() -> None:
    """A chunk already holding the service variant wins over a smaller non-resident one."""
    spec = ServiceSpec("rm", 8 * GB)
    pool = registered(spec)
    pool.restore(spec, (5,), tick=1)
    pool.allocate_chunk(aid("x"), 1)  # takes GPU 0: free is 1, 2-4, 4-8
    assert pool.pick_chunk(1) == (1,)
    assert pool.pick_chunk(1, "rm") == (5,)
    assert pool.pick_chunk(2, "rm") == (2, 3)  # variant 2 is not resident anywhere
    pool.restore(spec, (6, 7), tick=2)
    assert pool.allocate_chunk(aid("y"), 2, "rm") == (6, 7)


def test_splitting_descends_towards_partial_residency() -> None:
    """When a larger chunk must be split, the half holding the variant is kept."""
    spec = ServiceSpec("rm", GB)
    pool = registered(spec)
    pool.restore(spec, (6, 7), tick=1)
    pool.allocate_gpus(aid("x"), (6, 7))  # running on it: not free
    pool.release(aid("x"))
    assert pool.pick_chunk(2, "rm") == (6, 7)


# --------------------------------------------------------------------------- cluster


def gpu_cluster(n_nodes: int = 2, mem: int = 80 * GB, **services: int) -> GpuCluster:
    specs = {name: ServiceSpec(name, size) for name, size in services.items()}
    return GpuCluster([node(f"g{i}", mem=mem) for i in range(n_nodes)], specs)


def test_cluster_schedpool_fields_and_operator() -> None:
    """The cluster is one 'gpu' pool whose chunk counts add up over nodes."""
    c = gpu_cluster(2)
    assert (c.pool_id, c.resource, c.capacity, c.max_single()) == ("gpu", "gpu", 16, 8)
    c.allocate(aid("a"), (8,))
    assert c.free_units() == 15
    assert c.chunk_counts() == {1: 1, 2: 1, 4: 1, 8: 1}
    op = c.operator()
    assert isinstance(op, ChunkOperator) and op.units(op.start()) == 15
    c.validate()


def test_global_ids_and_locate() -> None:
    """Global GPU ids are node index * 8 + local GPU; locate inverts them."""
    c = gpu_cluster(3)
    assert c.locate(0) == ("g0", 0)
    assert c.locate(13) == ("g1", 5)
    assert c.global_ids("g2", (0, 1)) == (16, 17)
    with pytest.raises(ValueError):
        c.locate(24)


def test_cluster_pick_units_plans_on_a_copy() -> None:
    """Planned chunks never overlap, never span nodes, and planning changes nothing."""
    c = gpu_cluster(2)
    a8, b4, d4 = service_action("a", "x"), service_action("b", "x"), service_action("d", "x")
    plan = c.pick_units([(a8, 8), (b4, 4), (d4, 4)])
    assert plan == [tuple(range(8)), (8, 9, 10, 11), (12, 13, 14, 15)]
    assert c.free_units() == 16
    with pytest.raises(ValueError, match="do not fit the free chunks"):
        c.pick_units([(a8, 8), (b4, 8), (d4, 1)])
    for action, units in zip((a8, b4, d4), plan, strict=True):
        c.allocate(action.id, units)
    assert c.free_units() == 0
    assert c.release(b4.id) == (8, 9, 10, 11)
    c.validate()


def test_cluster_allocate_rejects_bad_unit_sets() -> None:
    """Units must be one free aligned chunk on one node."""
    c = gpu_cluster(2)
    for bad in [(7, 8), (1, 2), (0, 1, 2), ()]:
        with pytest.raises(ValueError):
            c.allocate(aid("a"), bad)
    c.allocate(aid("a"), (2, 3))
    with pytest.raises(ValueError, match="held"):
        c.allocate(aid("b"), (0, 1, 2, 3))
    c.validate()


def test_cluster_prefers_resident_chunks_and_extra_cost_follows() -> None:
    """extra_cost is 0 exactly when pick_units would land on a resident variant."""
    c = gpu_cluster(2, rm=40 * GB)
    action = service_action("a", "rm")
    assert c.extra_cost(action, 2) == pytest.approx(2.0)  # 40 GB / (10 GB/s * 2)
    c.allocate(aid("warm"), (12, 13))
    plan = c.restore_for(aid("warm"), "rm", tick=1)
    assert plan.needed and plan.seconds == pytest.approx(2.0)
    assert c.is_resident("rm", (12, 13))
    assert c.extra_cost(action, 2) == pytest.approx(2.0)  # resident chunk is busy
    c.release(aid("warm"))
    assert c.extra_cost(action, 2) == 0.0
    assert c.extra_cost(action, 4) == pytest.approx(1.0)  # other variant
    assert c.pick_units([(action, 2)]) == [(12, 13)]
    assert c.pick_units([(service_action("o", "other"), 2)]) == [(0, 1)]
    c.allocate(action.id, (12, 13))
    assert c.restore_for(action.id, "rm", tick=2) == RestorePlan((), False, 0.0)


def test_cluster_restore_reports_global_evictions() -> None:
    """Evictions in a cluster restore plan carry global GPU ids."""
    c = gpu_cluster(2, mem=50 * GB, a=40 * GB, b=40 * GB)
    c.allocate(aid("x"), (9,))
    c.restore_for(aid("x"), "a", tick=1)
    c.release(aid("x"))
    c.allocate(aid("y"), (9,))
    plan = c.restore_for(aid("y"), "b", tick=2)
    assert plan.evicted == (Eviction(9, "a", 1),)
    assert c.node("g1").resident(1) == (("b", 1),)


def speeds(*h2d: float, mem: int = 80 * GB, **services: int) -> GpuCluster:
    """Nodes g0, g1, ... with these bandwidth estimates (bytes/s per GPU)."""
    nodes = [
        GpuNodePool(f"g{i}", 8, mem_per_gpu=mem, h2d_bytes_per_s=rate) for i, rate in enumerate(h2d)
    ]
    return GpuCluster(nodes, {name: ServiceSpec(name, size) for name, size in services.items()})


def test_a_cold_call_goes_to_the_node_that_restores_it_fastest() -> None:
    """Nothing resident: the call lands on the node with the smallest restore time by its
    own estimate (the one extra_cost prices it at), not on the lowest node; a node with no
    room is passed over; a measured bandwidth that moves the estimates moves the choice."""
    c = speeds(H2D, 4 * H2D, rm=40 * GB)
    action = service_action("a", "rm")
    assert c.extra_cost(action, 2) == pytest.approx(40 * GB / (4 * H2D * 2))  # g1's
    assert c.pick_units([(action, 2)]) == [(8, 9)]
    assert c.pick_units([(service_action("b", "rm"), 8)]) == [tuple(range(8, 16))]
    # two at once: both prefer g1, which holds both
    two = c.pick_units([(action, 4), (service_action("b", "rm"), 4)])
    assert two == [(8, 9, 10, 11), (12, 13, 14, 15)]
    # g1 full: g0 takes it
    c.allocate(aid("big"), tuple(range(8, 16)))
    assert c.pick_units([(action, 2)]) == [(0, 1)]
    c.release(aid("big"))
    # g1's measured restores come in slower than g0's estimate: g0 is the quicker now
    for _ in range(20):
        c.node("g1").observe_h2d(H2D / 2)
    assert c.node("g1").h2d_bytes_per_s < c.node("g0").h2d_bytes_per_s
    assert c.pick_units([(action, 2)]) == [(0, 1)]
    c.validate()


def test_a_resident_replica_beats_a_faster_node() -> None:
    """The variant resident on the slow node: the call goes there (no restore at all)."""
    c = speeds(H2D, 4 * H2D, rm=40 * GB)
    c.allocate(aid("warm"), (4, 5))
    assert c.restore_for(aid("warm"), "rm", tick=1).needed
    c.release(aid("warm"))
    action = service_action("a", "rm")
    assert c.extra_cost(action, 2) == 0.0
    assert c.pick_units([(action, 2)]) == [(4, 5)]
    # another variant (4 GPUs) is resident nowhere: the fast node
    assert c.pick_units([(action, 4)]) == [(8, 9, 10, 11)]


def test_equal_estimates_choose_as_before_and_a_node_keeps_its_eviction_tie_breaks() -> None:
    """Equal bandwidths: the smallest enclosing free chunk, then the lowest node, as
    without the estimates; a slower node with that small chunk loses it to a faster one.
    Within the chosen node, the chunk whose memory takes the shard without evicting wins."""
    for h2d_g1, want in ((H2D, (15,)), (H2D / 2, (0,))):
        c = speeds(H2D, h2d_g1, rm=40 * GB)
        c.allocate(aid("x"), tuple(range(8, 12)))  # g1: only GPU 15 left free
        c.allocate(aid("y"), (12, 13))
        c.allocate(aid("z"), (14,))
        assert c.pick_units([(service_action("a", "rm"), 1)]) == [want]
    # memory pressure on the fast node: it still takes the call, on GPUs with room
    c = speeds(H2D, 4 * H2D, mem=50 * GB, a=40 * GB, b=40 * GB)
    c.allocate(aid("w"), (8,))
    c.restore_for(aid("w"), "a", tick=1)
    c.release(aid("w"))
    assert c.pick_units([(service_action("b", "b"), 1)]) == [(12,)]
    # the same pools at equal bandwidths: the lowest node, as before
    same = speeds(H2D, H2D, mem=50 * GB, a=40 * GB, b=40 * GB)
    same.allocate(aid("w"), (8,))
    same.restore_for(aid("w"), "a", tick=1)
    same.release(aid("w"))
    assert same.pick_units([(service_action("b", "b"), 1)]) == [(0,)]


def test_cluster_never_fits() -> None:
    """More GPUs than one node, unknown services and oversized shards never fit."""
    c = gpu_cluster(2, mem=40 * GB, small=GB, huge=8 * 50 * GB, wide=4 * 30 * GB)
    too_wide = make_action("a", "service", "t", {"gpu": 16}, service="small")
    short = c.never_fits(too_wide)
    assert short is not None and short.reason == "needs 16 GPUs in one node, nodes have 8"
    unknown = c.never_fits(service_action("b", "nope"))
    assert unknown is not None and "not registered" in unknown.reason
    huge = c.never_fits(service_action("c", "huge"))
    assert huge is not None and huge.resource == "gpu_mem"
    assert c.never_fits(service_action("d", "small")) is None
    # a non-elastic action runs at its minimum only, where the shard does not fit
    fixed_wide = c.never_fits(service_action("e", "wide"))
    assert fixed_wide is not None and "at DoP 1" in fixed_wide.reason
    # an elastic one may use the variants that fit; the others cost inf
    wide = make_action(
        "f",
        "service",
        "t",
        {"gpu": {"set": [1, 2, 4]}},
        service="wide",
        t1_s=8.0,
        eff={1: 1.0, 4: 0.8},
    )
    assert c.never_fits(wide) is None
    assert c.extra_cost(wide, 1) == math.inf
    assert c.extra_cost(wide, 4) == pytest.approx(12.0 / 4)


def test_duplicate_names_rejected() -> None:
    """Node ids and service names must be unique and consistent."""
    with pytest.raises(ValueError, match="duplicate"):
        GpuCluster([node("g"), node("g")], {})
    with pytest.raises(ValueError, match="named"):
        GpuCluster([node("g")], {"a": ServiceSpec("b", 1)})


@settings(max_examples=60)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(0, 6), st.sampled_from([1, 2, 4, 8])),
        min_size=1,
        max_size=40,
    ),
    service=st.sampled_from([None, "rm", "judge"]),
)
def test_cluster_random_sequences_keep_gpus_exclusive(
    ops: list[tuple[bool, int, int]], service: str | None
) -> None:
    """Any plan/allocate/restore/release sequence keeps GPUs exclusive and memory in bounds."""
    c = gpu_cluster(2, mem=30 * GB, rm=40 * GB, judge=16 * GB)
    held: dict[ActionId, tuple[int, ...]] = {}
    tick = 0
    for is_alloc, who, k in ops:
        action_id = aid(f"a{who}")
        tick += 1
        if is_alloc and action_id not in held:
            action = service_action(action_id, service or "rm")
            try:
                (units,) = c.pick_units([(action, k)])
            except ValueError:
                assert all(s < k for s, n in c.chunk_counts().items() if n)
                continue
            c.allocate(action_id, units)
            held[action_id] = units
            if service is not None and c.node(c.locate(units[0])[0]).fits_memory(
                c.services[service], len(units)
            ):
                c.restore_for(action_id, service, tick)
                assert c.is_resident(service, units)
        elif not is_alloc and action_id in held:
            assert c.release(action_id) == held.pop(action_id)
        c.validate()
        flat = [g for units in held.values() for g in units]
        assert len(flat) == len(set(flat)) and c.free_units() == 16 - len(flat)
    for action_id in list(held):
        c.release(action_id)
    assert all(n.free_chunks() == ((0, 8),) for n in c.nodes)

"""CPU pools: exclusive NUMA-aware cores per node, environment memory, trajectory affinity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.model import Action, ActionId, EnvId, Shortfall, TrajectoryId, make_action
from tangram.pools.cpu import (
    BUSY,
    NEVER,
    CpuCluster,
    CpuNodePool,
    NeverFits,
    NoRoomYet,
    Placed,
    pick_cores,
)

GiB = 1 << 30


def exec_action(name: str, cores: int, trajectory: str = "t") -> Action:
    return make_action(name, "exec", trajectory, {"cpu": cores})


def two_numa(node_id: str = "n1", per_numa: int = 4, mem: int = 64 * GiB) -> CpuNodePool:
    return CpuNodePool(node_id, [range(0, per_numa), range(per_numa, 2 * per_numa)], mem)


# --------------------------------------------------------------------------- core picking

PICK_CASES = [
    ("fits one numa: lowest ids", [[0, 1, 2, 3], [4, 5, 6, 7]], 2, (0, 1)),
    ("best fit: the fuller numa that still fits", [[0, 1, 2, 3], [5, 6]], 2, (5, 6)),
    ("best fit ties by numa index", [[0, 1], [4, 5]], 2, (0, 1)),
    ("only the big numa fits", [[0, 1, 2, 3], [5]], 3, (0, 1, 2)),
    ("spread: fullest first then the smallest cover", [[0, 1, 2], [4], [8, 9]], 4, (0, 1, 2, 4)),
    ("spread over two when three would also do", [[0, 1], [4, 5], [8, 9]], 3, (0, 1, 4)),
    ("zero cores", [[0, 1]], 0, ()),
    ("all cores", [[0, 1], [2]], 3, (0, 1, 2)),
]


@pytest.mark.parametrize(
    ("free", "amount", "expected"),
    [case[1:] for case in PICK_CASES],
    ids=[case[0] for case in PICK_CASES],
)
def test_pick_cores_table(free: list[list[int]], amount: int, expected: tuple[int, ...]) -> None:
    """Core picking prefers one NUMA node (best fit), else the fewest, lowest ids first."""
    assert pick_cores(free, amount) == expected


def test_pick_cores_too_many_raises() -> None:
    """Asking for more cores than are free is a ValueError, never a partial pick."""
    with pytest.raises(ValueError, match="only 3 free"):
        pick_cores([[0, 1], [2]], 4)


@given(
    free=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    data=st.data(),
)
def test_pick_cores_numa_properties(free: list[int], data: st.DataObject) -> None:
    """Picks are distinct free cores, from one NUMA node when possible, else the fewest."""
    layout = [list(range(i * 10, i * 10 + n)) for i, n in enumerate(free)]
    amount = data.draw(st.integers(0, sum(free)))
    picked = pick_cores(layout, amount)
    assert len(picked) == amount == len(set(picked))
    assert set(picked) <= {c for cores in layout for c in cores}
    used = {c // 10 for c in picked}
    if amount and any(n >= amount for n in free):
        assert len(used) == 1
    elif amount:
        fewest, covered = 0, 0
        for n in sorted(free, reverse=True):
            if covered >= amount:
                break
            covered += n
            fewest += 1
        assert len(used) == fewest


# --------------------------------------------------------------------------- one node


def test_node_reports_schedpool_fields() -> None:
    """A node pool names itself cpu:<node> and reports its cores as capacity and operator."""
    pool = two_numa()
    assert (pool.pool_id, pool.resource) == ("cpu:n1", "cpu")
    assert pool.capacity == pool.max_single() == pool.free_units() == 8
    pool.allocate(ActionId("a"), (0, 1, 2))
    assert pool.free_units() == 5
    assert pool.operator().start() == 5
    assert pool.extra_cost(exec_action("a", 3), 3) == 0.0
    pool.validate()


def test_allocate_rejects_held_unknown_and_duplicate_cores() -> None:
    """A core is never given to two actions; unknown or repeated cores are refused."""
    pool = two_numa()
    pool.allocate(ActionId("a"), (0, 1))
    with pytest.raises(ValueError, match="held by action a"):
        pool.allocate(ActionId("b"), (1, 2))
    with pytest.raises(ValueError, match="no core 99"):
        pool.allocate(ActionId("b"), (99,))
    with pytest.raises(ValueError, match="twice"):
        pool.allocate(ActionId("b"), (3, 3))
    with pytest.raises(ValueError, match="already holds"):
        pool.allocate(ActionId("a"), (5,))
    assert pool.holder(2) is None
    pool.validate()


def test_release_returns_cores_and_unknown_release_raises() -> None:
    """Release hands back exactly the action's cores; releasing twice is a KeyError."""
    pool = two_numa()
    pool.allocate(ActionId("a"), (5, 4))
    assert pool.held(ActionId("a")) == (4, 5)
    assert pool.release(ActionId("a")) == (4, 5)
    assert pool.free_units() == 8
    with pytest.raises(KeyError):
        pool.release(ActionId("a"))


def test_pick_units_is_a_pure_sequential_plan() -> None:
    """pick_units plans requests in order on a copy; allocating the plan then succeeds."""
    pool = two_numa()
    pool.allocate(ActionId("x"), (0,))
    requests = [(exec_action("a", 3), 3), (exec_action("b", 4), 4)]
    plan = pool.pick_units(requests)
    assert plan == [(1, 2, 3), (4, 5, 6, 7)]
    assert pool.free_units() == 7  # unchanged by planning
    for (action, _), cores in zip(requests, plan, strict=True):
        pool.allocate(action.id, cores)
    assert pool.free_units() == 0
    pool.validate()


@given(
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    data=st.data(),
)
def test_pick_units_is_pick_cores_one_by_one(sizes: list[int], data: st.DataObject) -> None:
    """The plan is exactly what pick_cores gives each request in turn, on the cores left
    by the ones before (pick_units inlines its single-NUMA best fit)."""
    layout = [range(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes))]
    pool, reference = CpuNodePool("n", layout, GiB), CpuNodePool("r", layout, GiB)
    for k, core in enumerate(data.draw(st.sets(st.sampled_from(range(sum(sizes)))))):
        for p in (pool, reference):
            p.allocate(ActionId(f"held{k}"), (core,))
    amounts = data.draw(st.lists(st.integers(0, 8), max_size=12))
    requests = [(exec_action(f"a{k}", max(1, n)), n) for k, n in enumerate(amounts)]
    expected: list[tuple[int, ...]] | str = []
    for action, amount in requests:
        try:
            cores = pick_cores(reference.free_by_numa(), amount)
        except ValueError:
            expected = "raises"
            break
        assert isinstance(expected, list)
        expected.append(cores)
        reference.allocate(action.id, cores)
    if expected == "raises":
        with pytest.raises(ValueError):
            pool.pick_units(requests)
    else:
        assert pool.pick_units(requests) == expected


def test_pick_units_that_do_not_fit_raise() -> None:
    """A plan that does not fit together is a ValueError naming the action."""
    pool = two_numa()
    with pytest.raises(ValueError, match="action b"):
        pool.pick_units([(exec_action("a", 6), 6), (exec_action("b", 3), 3)])


def test_never_fits_names_the_node_size() -> None:
    """An action needing more cores than the node has never fits, with a typed reason."""
    pool = CpuNodePool("big", [range(128), range(128, 256)], GiB)
    short = pool.never_fits(exec_action("a", 300))
    assert short == Shortfall("cpu", 300, 256, 256, "needs 300 cores in one node, nodes have 256")
    assert pool.never_fits(exec_action("b", 256)) is None
    mem_hog = make_action("m", "exec", "t", {"cpu": 1, "mem": 2 * GiB})
    mem_short = pool.never_fits(mem_hog)
    assert mem_short is not None and mem_short.resource == "mem"


def test_memory_reservations() -> None:
    """Environment memory is reserved whole, refused when it does not fit, and returned."""
    pool = two_numa(mem=10 * GiB)
    assert pool.reserve_mem(EnvId("e1"), 6 * GiB)
    assert not pool.reserve_mem(EnvId("e2"), 5 * GiB)
    assert pool.reserve_mem(EnvId("e2"), 4 * GiB)
    assert (pool.mem_reserved, pool.mem_free) == (10 * GiB, 0)
    with pytest.raises(ValueError, match="already"):
        pool.reserve_mem(EnvId("e1"), 0)
    assert pool.unreserve_mem(EnvId("e1")) == 6 * GiB
    assert pool.unreserve_mem(EnvId("e1")) == 0
    assert pool.mem_free == 6 * GiB
    pool.validate()


def test_layout_validation() -> None:
    """A core listed in two NUMA nodes or an empty node is rejected at construction."""
    with pytest.raises(ValueError, match="twice"):
        CpuNodePool("n", [[0, 1], [1, 2]], GiB)
    with pytest.raises(ValueError, match="no cores"):
        CpuNodePool("n", [[]], GiB)


@settings(max_examples=60)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(0, 5), st.integers(1, 9)), min_size=1, max_size=40
    )
)
def test_random_allocate_release_never_double_holds(ops: list[tuple[bool, int, int]]) -> None:
    """Any allocate/release sequence keeps every core with at most one action, within capacity."""
    pool = CpuNodePool("n", [range(0, 4), range(4, 8), range(8, 12)], GiB)
    holding: dict[ActionId, tuple[int, ...]] = {}
    for is_alloc, who, amount in ops:
        action_id = ActionId(f"a{who}")
        if is_alloc and action_id not in holding and amount <= pool.free_units():
            (cores,) = pool.pick_units([(exec_action(action_id, amount), amount)])
            pool.allocate(action_id, cores)
            holding[action_id] = cores
        elif not is_alloc and action_id in holding:
            assert pool.release(action_id) == tuple(sorted(holding.pop(action_id)))
        pool.validate()
        assert pool.free_units() == 12 - sum(len(c) for c in holding.values())
        assert pool.free_units() >= 0


# --------------------------------------------------------------------------- cluster


def cluster(*mems: int, cores: int = 8) -> CpuCluster:
    return CpuCluster(
        [CpuNodePool(f"n{i}", [range(cores)], mem) for i, mem in enumerate(mems, start=1)]
    )


def test_placement_balances_memory_load() -> None:
    """A trajectory goes to the node with the lowest memory load, ties by node id."""
    c = cluster(100, 100, 200)
    assert c.place_trajectory(TrajectoryId("t1"), EnvId("e1"), 1, 50) == Placed("n1")
    assert c.place_trajectory(TrajectoryId("t2"), EnvId("e2"), 1, 50) == Placed("n2")
    assert c.place_trajectory(TrajectoryId("t3"), EnvId("e3"), 1, 50) == Placed("n3")  # load 0
    assert c.place_trajectory(TrajectoryId("t4"), EnvId("e4"), 1, 10) == Placed("n3")  # 0.25 < 0.5
    assert c.pool("n3").mem_reserved == 60
    c.validate()


def test_placement_needs_free_cores_for_the_first_action() -> None:
    """A node whose cores are busy is skipped even when its memory load is lowest."""
    c = cluster(100, 100)
    c.pool("n1").allocate(ActionId("busy"), tuple(range(7)))
    assert c.place_trajectory(TrajectoryId("t"), EnvId("e"), 2, 10) == Placed("n2")


def test_affinity_sticks_until_forgotten() -> None:
    """Later actions of a trajectory find its node; forgetting frees the environment memory."""
    c = cluster(100, 100)
    trajectory = TrajectoryId("t")
    assert c.node_of(trajectory) is None
    placed = c.place_trajectory(trajectory, EnvId("e"), 1, 40)
    assert isinstance(placed, Placed)
    node = placed.node
    assert node == "n1" and c.node_of(trajectory) == "n1"
    assert c.env_of(trajectory) == EnvId("e")
    assert c.place_trajectory(trajectory, EnvId("e"), 1, 40) == Placed("n1")  # idempotent
    assert c.pool("n1").mem_reserved == 40
    assert c.forget_trajectory(trajectory) == "n1"
    assert c.node_of(trajectory) is None and c.pool("n1").mem_reserved == 0
    assert c.forget_trajectory(trajectory) is None
    c.validate()


SHORT_CASES = [
    ("too many cores for any node", 9, 10, "cpu", NEVER),
    ("too much memory for any node", 1, 500, "mem", NEVER),
    ("cores busy everywhere", 8, 10, "cpu", BUSY),
    ("memory full everywhere", 1, 80, "mem", BUSY),
]


@pytest.mark.parametrize(
    ("cores", "mem", "resource", "reason"),
    [case[1:] for case in SHORT_CASES],
    ids=[case[0] for case in SHORT_CASES],
)
def test_placement_shortfalls(cores: int, mem: int, resource: str, reason: str) -> None:
    """Placement misfits are Shortfalls saying 'never' (can't ever fit) or 'busy' (not now)."""
    c = cluster(100, 100)
    for node in c.nodes:
        node.allocate(ActionId(f"hog-{node.node_id}"), (0,))
        assert node.reserve_mem(EnvId(f"env-{node.node_id}"), 30)
    placed = c.place_trajectory(TrajectoryId("t"), EnvId("e"), cores, mem)
    assert isinstance(placed, NeverFits if reason == NEVER else NoRoomYet)
    short = placed.shortfall
    assert (short.resource, short.reason) == (resource, reason)
    assert c.node_of(TrajectoryId("t")) is None


def test_never_when_no_single_node_has_both() -> None:
    """Cores on one node and memory on another do not make a fit: 'never'."""
    c = CpuCluster([CpuNodePool("cores", [range(16)], 10), CpuNodePool("mem", [range(2)], 1000)])
    placed = c.place_trajectory(TrajectoryId("t"), EnvId("e"), 8, 500)
    assert isinstance(placed, NeverFits) and placed.shortfall.reason == NEVER


def test_duplicate_node_ids_rejected() -> None:
    """Two nodes with the same id would make affinity ambiguous."""
    with pytest.raises(ValueError, match="duplicate"):
        CpuCluster([two_numa("a"), two_numa("a")])


@settings(max_examples=50)
@given(
    mems=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    envs=st.lists(st.integers(0, 3), min_size=1, max_size=12),
)
def test_placement_never_overcommits_memory(mems: list[int], envs: list[int]) -> None:
    """Placement keeps every node's reservations within its memory and picks a least-loaded fit."""
    c = cluster(*[m * 10 for m in mems])
    for i, size in enumerate(envs):
        loads = {n.node_id: (n.mem_load, n.node_id) for n in c.nodes if n.mem_free >= size}
        placed = c.place_trajectory(TrajectoryId(f"t{i}"), EnvId(f"e{i}"), 1, size)
        if isinstance(placed, Placed):
            assert loads[placed.node] == min(loads.values())
        else:
            assert not loads
        c.validate()

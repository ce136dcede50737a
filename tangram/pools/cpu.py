"""CPU pools (docs/design.md §5.2, allocate-on-execution): exclusive cores per node, NUMA-aware.

Contract:

- ``CpuNodePool`` owns the cores and the memory of one node. Each core is held by at most one
  action at a time; an environment's memory is reserved for its whole life, its cores are
  not (they are allocated per action and returned when the action ends).
- ``CpuCluster`` places a trajectory's environment on one node (enough free cores for the
  first action, enough free memory for the whole environment, lowest memory load first) and
  remembers that affinity until the trajectory is forgotten.
- Pure: no I/O, no clock. Questions (``pick_units``, ``operator``, ``never_fits``) never
  mutate; ``allocate``/``release`` and ``reserve_mem``/``unreserve_mem`` are the only
  mutators. Core picking is ``O(c log c)`` per request for ``c`` cores on the node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tangram.model import Action, ActionId, EnvId, Shortfall, TrajectoryId
from tangram.sched.operators import BaseOperator

# Shortfall reasons of ``CpuCluster.place_trajectory``: compare against these constants.
NEVER = "never"  # no node could hold the trajectory even when idle
BUSY = "busy"  # some node could, but none can right now


def _cpu_minimum(action: Action) -> int:
    amounts = action.demand.get("cpu")
    return 0 if amounts is None else amounts.min


def _mem_minimum(action: Action) -> int:
    amounts = action.demand.get("mem")
    return 0 if amounts is None else amounts.min


# --------------------------------------------------------------------------- core picking


def pick_cores(free_by_numa: Sequence[Sequence[int]], amount: int) -> tuple[int, ...]:
    """Choose ``amount`` cores from the free cores of each NUMA node (each list sorted).

    One NUMA node when any has enough free cores: the best fit (fewest free cores that still
    fit, ties by NUMA index), to keep large NUMA nodes whole for large actions. Otherwise the
    fewest NUMA nodes: the fullest first, and for the last part the smallest NUMA node that
    covers the rest. Lowest core ids first everywhere, so the result is deterministic.
    """
    if amount < 0:
        raise ValueError(f"core amount must be >= 0, got {amount}")
    if amount == 0:
        return ()
    total = sum(len(cores) for cores in free_by_numa)
    if amount > total:
        raise ValueError(f"needs {amount} cores, only {total} free")
    fitting = [i for i, cores in enumerate(free_by_numa) if len(cores) >= amount]
    if fitting:
        best = min(fitting, key=lambda i: (len(free_by_numa[i]), i))
        return tuple(free_by_numa[best][:amount])
    return tuple(sorted(_spread(free_by_numa, amount)))


def _spread(free_by_numa: Sequence[Sequence[int]], amount: int) -> list[int]:
    """Cores from the fewest NUMA nodes when no single one has ``amount`` free cores."""
    order = sorted(range(len(free_by_numa)), key=lambda i: (-len(free_by_numa[i]), i))
    chosen: list[int] = []
    remaining = amount
    unused = list(order)
    while remaining > 0:
        covering = [i for i in unused if len(free_by_numa[i]) >= remaining]
        if covering:
            last = min(covering, key=lambda i: (len(free_by_numa[i]), i))
            chosen.extend(free_by_numa[last][:remaining])
            return chosen
        fullest = unused.pop(0)
        chosen.extend(free_by_numa[fullest])
        remaining -= len(free_by_numa[fullest])
    return chosen


# --------------------------------------------------------------------------- one node


class CpuNodePool:
    """The cores (with NUMA layout) and the memory of one node; a ``SchedPool`` for ``cpu``."""

    resource = "cpu"

    def __init__(
        self, node_id: str, cores_by_numa: Sequence[Sequence[int]], mem_bytes: int
    ) -> None:
        layout = tuple(tuple(sorted(cores)) for cores in cores_by_numa)
        flat = [core for cores in layout for core in cores]
        if not flat:
            raise ValueError(f"node {node_id!r} has no cores")
        if len(set(flat)) != len(flat):
            raise ValueError(f"node {node_id!r}: a core id appears twice in the NUMA layout")
        if any(core < 0 for core in flat):
            raise ValueError(f"node {node_id!r}: core ids must be >= 0")
        if mem_bytes < 0:
            raise ValueError(f"node {node_id!r}: memory must be >= 0, got {mem_bytes}")
        self.node_id = node_id
        self.pool_id = f"cpu:{node_id}"
        self.numa: tuple[tuple[int, ...], ...] = layout
        self._numa_of: dict[int, int] = {c: i for i, cores in enumerate(layout) for c in cores}
        self._holder: dict[int, ActionId] = {}  # core -> action holding it
        self._held: dict[ActionId, tuple[int, ...]] = {}  # action -> its cores
        self.mem_total = mem_bytes
        self._mem: dict[EnvId, int] = {}  # environment -> reserved bytes
        self._mem_used = 0  # sum of _mem's values (read every pass, per node: not summed)

    # ------------------------------------------------------------------ SchedPool

    @property
    def capacity(self) -> int:
        return len(self._numa_of)

    def free_units(self) -> int:
        return self.capacity - len(self._holder)

    def max_single(self) -> int:
        return self.capacity

    def operator(self) -> BaseOperator:
        return BaseOperator(self.free_units())

    def never_fits(self, action: Action) -> Shortfall | None:
        cores = _cpu_minimum(action)
        if cores > self.capacity:
            return Shortfall(
                "cpu",
                cores,
                self.free_units(),
                self.capacity,
                f"needs {cores} cores in one node, nodes have {self.capacity}",
            )
        mem = _mem_minimum(action)
        if mem > self.mem_total:
            return Shortfall(
                "mem",
                mem,
                self.mem_free,
                self.mem_total,
                f"needs {mem} bytes of memory in one node, nodes have {self.mem_total}",
            )
        return None

    def extra_cost(self, action: Action, amount: int) -> float:
        return 0.0

    def pick_units(self, requests: Sequence[tuple[Action, int]]) -> list[tuple[int, ...]]:
        free = [list(cores) for cores in self.free_by_numa()]
        picked: list[tuple[int, ...]] = []
        for action, amount in requests:
            # pick_cores' single-NUMA best fit, inlined (a pass picks for hundreds of
            # actions): the fewest free cores that still fit, the lowest index on ties
            best, best_len = -1, 0
            if amount > 0:
                for i, numa in enumerate(free):
                    n = len(numa)
                    if n >= amount and (best < 0 or n < best_len):
                        best, best_len = i, n
            if best >= 0:
                numa = free[best]
                picked.append(tuple(numa[:amount]))
                free[best] = numa[amount:]
                continue
            try:
                cores = pick_cores(free, amount)
            except ValueError as exc:
                raise ValueError(f"{self.pool_id}: action {action.id}: {exc}") from None
            picked.append(cores)
            # pick_cores takes a prefix of each NUMA node's sorted free list: drop it
            taken = set(cores)
            for i, numa in enumerate(free):
                k = 0
                while k < len(numa) and numa[k] in taken:
                    k += 1
                if k:
                    free[i] = numa[k:]
        return picked

    def allocate(self, action_id: ActionId, units: tuple[int, ...]) -> None:
        """Give ``units`` (core ids) to the action; all must exist and be free."""
        if action_id in self._held:
            raise ValueError(f"{self.pool_id}: action {action_id} already holds cores")
        if len(set(units)) != len(units):
            raise ValueError(f"{self.pool_id}: core listed twice in {units}")
        for core in units:
            if core not in self._numa_of:
                raise ValueError(f"{self.pool_id}: no core {core}")
            if core in self._holder:
                raise ValueError(
                    f"{self.pool_id}: core {core} is held by action {self._holder[core]}"
                )
        cores = tuple(sorted(units))
        for core in cores:
            self._holder[core] = action_id
        self._held[action_id] = cores

    def release(self, action_id: ActionId) -> tuple[int, ...]:
        """Return the action's cores to the pool; ``KeyError`` if it holds none here."""
        try:
            cores = self._held.pop(action_id)
        except KeyError:
            raise KeyError(f"{self.pool_id}: action {action_id} holds no cores") from None
        for core in cores:
            del self._holder[core]
        return cores

    # ------------------------------------------------------------------ queries

    def free_by_numa(self) -> tuple[tuple[int, ...], ...]:
        """Free core ids of each NUMA node, sorted."""
        holder = self._holder  # lists, not generators: read on every scheduling pass
        return tuple([tuple([c for c in cores if c not in holder]) for cores in self.numa])

    def held(self, action_id: ActionId) -> tuple[int, ...]:
        """Cores the action holds (empty when none)."""
        return self._held.get(action_id, ())

    def holder(self, core: int) -> ActionId | None:
        return self._holder.get(core)

    def actions(self) -> tuple[ActionId, ...]:
        return tuple(self._held)

    # ------------------------------------------------------------------ memory

    @property
    def mem_reserved(self) -> int:
        return self._mem_used

    @property
    def mem_free(self) -> int:
        return self.mem_total - self.mem_reserved

    @property
    def mem_load(self) -> float:
        """Reserved share of the node's memory (1.0 for a node without memory)."""
        return self.mem_reserved / self.mem_total if self.mem_total else 1.0

    def reserve_mem(self, env_id: EnvId, nbytes: int) -> bool:
        """Reserve an environment's memory for its life; False if it does not fit now."""
        if nbytes < 0:
            raise ValueError(f"{self.pool_id}: memory must be >= 0, got {nbytes}")
        if env_id in self._mem:
            raise ValueError(f"{self.pool_id}: environment {env_id} already reserved memory")
        if nbytes > self.mem_free:
            return False
        self._mem[env_id] = nbytes
        self._mem_used += nbytes
        return True

    def unreserve_mem(self, env_id: EnvId) -> int:
        """Return an environment's memory; the bytes freed (0 if it reserved none)."""
        freed = self._mem.pop(env_id, 0)
        self._mem_used -= freed
        return freed

    def mem_of(self, env_id: EnvId) -> int | None:
        return self._mem.get(env_id)

    def validate(self) -> None:
        """Raise ``AssertionError`` if an invariant is broken (tests run it at teardown)."""
        seen: set[int] = set()
        for action_id, cores in self._held.items():
            for core in cores:
                assert core not in seen, f"core {core} held twice"
                assert self._holder.get(core) == action_id, f"core {core} holder mismatch"
                seen.add(core)
        assert seen == set(self._holder), "core holders disagree with held cores"
        assert seen <= set(self._numa_of), "unknown core held"
        assert self._mem_used == sum(self._mem.values()), "memory total out of date"
        assert self.mem_reserved <= self.mem_total, "memory over-reserved"

    def __repr__(self) -> str:
        return (
            f"CpuNodePool({self.node_id!r}, free={self.free_units()}/{self.capacity}, "
            f"mem={self.mem_reserved}/{self.mem_total})"
        )


# --------------------------------------------------------------------------- cluster


@dataclass(frozen=True, slots=True)
class Placed:
    """The trajectory's environment is on ``node`` (its memory reserved there)."""

    node: str


@dataclass(frozen=True, slots=True)
class NoRoomYet:
    """No node has room now; one will when others' environments go (``shortfall`` says what)."""

    shortfall: Shortfall


@dataclass(frozen=True, slots=True)
class NeverFits:
    """No node could hold the environment even when idle."""

    shortfall: Shortfall


TrajectoryPlacement = Placed | NoRoomYet | NeverFits


class CpuCluster:
    """Trajectory → node affinity over the CPU nodes (docs/design.md §5.2 'Placement')."""

    def __init__(self, nodes: Sequence[CpuNodePool]) -> None:
        ids = [node.node_id for node in nodes]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate CPU node ids in {ids}")
        self._nodes: dict[str, CpuNodePool] = {node.node_id: node for node in nodes}
        self._placed: dict[TrajectoryId, tuple[str, EnvId]] = {}
        self._draining: set[str] = set()  # nodes that take no new trajectories

    @property
    def nodes(self) -> tuple[CpuNodePool, ...]:
        return tuple(self._nodes.values())

    def pool(self, node_id: str) -> CpuNodePool:
        try:
            return self._nodes[node_id]
        except KeyError:
            raise KeyError(f"no CPU node {node_id!r}") from None

    def add_node(self, node: CpuNodePool) -> None:
        """A node joined the cluster (cluster mode adds nodes at run time)."""
        if node.node_id in self._nodes:
            raise ValueError(f"CPU node {node.node_id!r} already exists")
        self._nodes[node.node_id] = node

    def remove_node(self, node_id: str) -> tuple[TrajectoryId, ...]:
        """A node left (lost): drop it and the affinities that pointed at it.

        The node's pool goes with its memory reservations; returns the trajectories that
        were placed there. Raises ``ValueError`` while an action still holds its cores.
        """
        node = self.pool(node_id)
        if node.actions():
            raise ValueError(f"CPU node {node_id!r} still has actions holding cores")
        gone = tuple(t for t, (n, _) in self._placed.items() if n == node_id)
        for trajectory in gone:
            del self._placed[trajectory]
        del self._nodes[node_id]
        self._draining.discard(node_id)
        return gone

    def set_draining(self, node_id: str, draining: bool) -> None:
        """A draining node keeps its environments and takes no new trajectories."""
        self.pool(node_id)  # KeyError for an unknown node
        if draining:
            self._draining.add(node_id)
        else:
            self._draining.discard(node_id)

    def is_draining(self, node_id: str) -> bool:
        return node_id in self._draining

    def node_of(self, trajectory: TrajectoryId) -> str | None:
        placed = self._placed.get(trajectory)
        return None if placed is None else placed[0]

    def env_of(self, trajectory: TrajectoryId) -> EnvId | None:
        placed = self._placed.get(trajectory)
        return None if placed is None else placed[1]

    def trajectories(self) -> tuple[TrajectoryId, ...]:
        return tuple(self._placed)

    def place_trajectory(
        self, trajectory: TrajectoryId, env_id: EnvId, min_cores: int, env_mem_bytes: int
    ) -> TrajectoryPlacement:
        """Pick the trajectory's node for its first action, reserve the environment's memory.

        Among nodes with ``min_cores`` free cores and ``env_mem_bytes`` free memory, the one
        with the lowest memory load (reserved / total), ties by node id; draining nodes take
        no new trajectories. An already placed trajectory keeps its node. ``NeverFits`` when
        no node could hold it even idle, ``NoRoomYet`` when none can right now (each with
        its ``Shortfall``).
        """
        if trajectory in self._placed:
            return Placed(self._placed[trajectory][0])
        never = self._never_fits(min_cores, env_mem_bytes)
        if never is not None:
            return NeverFits(never)
        fitting = [
            node
            for node in self._nodes.values()
            if node.free_units() >= min_cores
            and node.mem_free >= env_mem_bytes
            and node.node_id not in self._draining
        ]
        if not fitting:
            return NoRoomYet(self._busy_shortfall(min_cores, env_mem_bytes))
        best = min(fitting, key=lambda node: (node.mem_load, node.node_id))
        reserved = best.reserve_mem(env_id, env_mem_bytes)
        assert reserved, "memory fit was checked just above"
        self._placed[trajectory] = (best.node_id, env_id)
        return Placed(best.node_id)

    def place_on(
        self, trajectory: TrajectoryId, env_id: EnvId, node_id: str, env_mem_bytes: int
    ) -> bool:
        """Put a trajectory back on the node it was on (a restarted coordinator restoring
        its environments); False when that node cannot hold its memory now."""
        if trajectory in self._placed or not self.pool(node_id).reserve_mem(env_id, env_mem_bytes):
            return False
        self._placed[trajectory] = (node_id, env_id)
        return True

    def forget_trajectory(self, trajectory: TrajectoryId) -> str | None:
        """Drop the affinity and return the environment's memory; the node it was on."""
        placed = self._placed.pop(trajectory, None)
        if placed is None:
            return None
        node_id, env_id = placed
        self._nodes[node_id].unreserve_mem(env_id)
        return node_id

    def never_fits(self, min_cores: int, env_mem_bytes: int) -> Shortfall | None:
        """A ``NEVER`` shortfall when no node could hold the trajectory even when idle."""
        return self._never_fits(min_cores, env_mem_bytes)

    def _never_fits(self, min_cores: int, env_mem_bytes: int) -> Shortfall | None:
        nodes = list(self._nodes.values())
        if not nodes:
            return Shortfall("cpu", min_cores, 0, 0, NEVER)
        most_cores = max(node.capacity for node in nodes)
        most_mem = max(node.mem_total for node in nodes)
        if min_cores > most_cores:
            free = max(node.free_units() for node in nodes)
            return Shortfall("cpu", min_cores, free, most_cores, NEVER)
        if env_mem_bytes > most_mem:
            free = max(node.mem_free for node in nodes)
            return Shortfall("mem", env_mem_bytes, free, most_mem, NEVER)
        both = [n for n in nodes if n.capacity >= min_cores and n.mem_total >= env_mem_bytes]
        if not both:
            free = max(node.free_units() for node in nodes)
            return Shortfall("cpu", min_cores, free, most_cores, NEVER)
        return None

    def _busy_shortfall(self, min_cores: int, env_mem_bytes: int) -> Shortfall:
        nodes = list(self._nodes.values())
        core_fit = [node for node in nodes if node.free_units() >= min_cores]
        if not core_fit:
            free = max(node.free_units() for node in nodes)
            return Shortfall("cpu", min_cores, free, max(n.capacity for n in nodes), BUSY)
        free_mem = max(node.mem_free for node in core_fit)
        return Shortfall("mem", env_mem_bytes, free_mem, max(n.mem_total for n in nodes), BUSY)

    def validate(self) -> None:
        """Every node's invariants, and every affinity points at a reserved environment."""
        for node in self._nodes.values():
            node.validate()
        for trajectory, (node_id, env_id) in self._placed.items():
            assert node_id in self._nodes, f"trajectory {trajectory} on unknown node"
            assert self._nodes[node_id].mem_of(env_id) is not None, (
                f"trajectory {trajectory}: environment {env_id} has no memory reserved"
            )

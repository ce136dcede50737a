"""GPU pools (docs/design.md §5.3, evict-on-execution): buddy chunks and a residency LRU per node.

Contract:

- ``GpuNodePool`` owns one node's GPUs as buddy chunks ``(start, end)`` with
  ``end - start = 2^a``, ``start % 2^a == 0``, ``a ∈ {0, 1, 2, 3}``. A request for ``k`` GPUs
  takes one aligned chunk of ``chunk_level(k)`` GPUs (so 3 GPUs take a chunk of 4); freed
  buddies merge back. At most one action holds a GPU.
- Residency: each GPU keeps the services whose state is on it, with their last-use tick.
  Each DoP variant of a service is its own cache entry, keyed ``(name, dop)``; an instance of
  variant ``dop`` always occupies one aligned chunk of ``dop`` GPUs and is restored and
  evicted as a whole. ``ServiceSpec.mem_bytes`` is the state of one whole instance; it is
  sharded evenly, so each GPU of a DoP-``d`` instance holds ``ceil(mem_bytes / d)`` bytes,
  and a restore copies the shards in parallel: ``mem_bytes / (h2d_bytes_per_s * d)`` s.
- ``GpuCluster`` is the scheduler's single ``gpu`` pool over all GPU nodes. Chunks never span
  nodes, so the nodes' free chunk counts add up into one ``ChunkOperator``. Unit ids are
  global: ``slot * GPU_STRIDE + local_gpu``; ``locate`` maps them back. A node's slot is
  fixed when it first joins and kept for its name: nodes join (``add_node``) and leave
  (``remove_node``, a cluster node lost) without changing any other node's ids.
- Chunk choice for a service (``buddy.choose_chunk``): a free aligned chunk where the variant
  is already resident wins (no restore; this is what ``extra_cost`` assumes); otherwise the
  node with the smallest expected restore time (``restore_time_s``, from that node's own
  bandwidth estimate: ``extra_cost`` prices the call at the quickest node with room, and the
  call goes there), then the smallest free chunk that holds the request, preferring more
  resident GPUs of the variant, then a chunk whose memory takes the shard without evicting
  another service (``evict_score``), then the lowest node and start. Splitting descends
  into the half with more resident GPUs, and between halves as resident into the one that
  evicts nothing.
- Pure: no I/O, no clock; LRU order comes from caller-supplied integer ticks.
  Choosing a chunk is ``O(g)`` per node for ``g`` GPUs; eviction ``O(g·s)`` for ``s``
  resident services.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tangram.model import Action, ActionId, Shortfall
from tangram.pools.buddy import (
    BuddyChunks,
    EvictScore,
    ResidentScore,
    check_chunk,
    choose_chunk,
    fully_resident,
    resident_nowhere,
)
from tangram.sched.operators import CHUNK_SIZES, ChunkOperator, chunk_level

GPU_STRIDE = CHUNK_SIZES[-1]  # global GPU id = node slot * GPU_STRIDE + local GPU
ALLOWED_GPU_COUNTS: tuple[int, ...] = CHUNK_SIZES

ServiceKey = tuple[str, int]  # (service name, DoP): each DoP variant is its own service


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """A GPU service: ``mem_bytes`` is the state of one instance, sharded over its GPUs."""

    name: str
    mem_bytes: int

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("service name must be non-empty")
        if self.mem_bytes < 0:
            raise ValueError(f"service {self.name!r}: mem_bytes must be >= 0")

    def mem_per_gpu(self, dop: int) -> int:
        """Bytes each GPU of a DoP-``dop`` instance holds (even shards, rounded up)."""
        if dop <= 0:
            raise ValueError(f"DoP must be positive, got {dop}")
        return -(-self.mem_bytes // dop)


class Eviction(NamedTuple):
    """One GPU copy dropped: ``service`` variant ``dop`` leaves ``gpu``."""

    gpu: int
    service: str
    dop: int


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """What making a service resident on a chunk takes: evictions first, then the copy."""

    evicted: tuple[Eviction, ...]
    needed: bool  # False when the variant was already resident there
    seconds: float  # host-to-device copy time (0.0 when not needed)


# --------------------------------------------------------------------------- one node


class GpuNodePool:
    """One node's GPUs: buddy chunks, the action on each GPU, and the residency LRU."""

    def __init__(
        self,
        node_id: str,
        n_gpus: int = 8,
        *,
        mem_per_gpu: int,
        h2d_bytes_per_s: float,
    ) -> None:
        if n_gpus not in ALLOWED_GPU_COUNTS:
            raise ValueError(
                f"GPU node {node_id!r}: n_gpus={n_gpus} is not allowed "
                f"(allowed: {', '.join(map(str, ALLOWED_GPU_COUNTS))})"
            )
        if mem_per_gpu <= 0:
            raise ValueError(f"GPU node {node_id!r}: mem_per_gpu must be positive")
        if not (math.isfinite(h2d_bytes_per_s) and h2d_bytes_per_s > 0):
            raise ValueError(f"GPU node {node_id!r}: h2d_bytes_per_s must be positive")
        self.node_id = node_id
        self.n_gpus = n_gpus
        self.mem_per_gpu = mem_per_gpu
        self.h2d_bytes_per_s = float(h2d_bytes_per_s)
        self.buddy = BuddyChunks(n_gpus)
        self._held: dict[ActionId, tuple[int, int]] = {}  # action -> (start, size)
        self._holder: dict[int, ActionId] = {}  # gpu -> action
        self._specs: dict[str, ServiceSpec] = {}  # host backups
        # gpu -> resident variant -> (last-use tick, insertion order): the LRU key
        self._resident: list[dict[ServiceKey, tuple[int, int]]] = [{} for _ in range(n_gpus)]
        self._used = [0] * n_gpus  # bytes of the resident shards per GPU (mem_used, kept)
        self._order = 0

    # ------------------------------------------------------------------ chunks

    def free_chunks(self) -> tuple[tuple[int, int], ...]:
        """Free chunks as sorted ``(start, end)`` pairs."""
        return tuple((start, start + size) for start, size in self.buddy.chunks())

    def chunk_counts(self) -> dict[int, int]:
        """Free chunks per size ``{1: n1, 2: n2, 4: n4, 8: n8}``."""
        return self.buddy.counts()

    def free_gpus(self) -> int:
        return self.buddy.free_gpus()

    def pick_chunk(self, k: int, service: str | None = None) -> tuple[int, ...] | None:
        """The GPUs ``allocate_chunk`` would take now, or None when no chunk is free."""
        size = chunk_level(k)
        if size > self.n_gpus:
            return None
        scored = [(self.buddy, self.resident_score(service, size))]
        chosen = choose_chunk(scored, size, [self.evict_score(service, size)])
        return None if chosen is None else tuple(range(chosen[1], chosen[1] + size))

    def allocate_chunk(
        self, action_id: ActionId, k: int, service: str | None = None
    ) -> tuple[int, ...]:
        """Take one aligned chunk of ``chunk_level(k)`` GPUs; ``ValueError`` if none is free."""
        gpus = self.pick_chunk(k, service)
        if gpus is None:
            raise ValueError(
                f"GPU node {self.node_id!r}: no free chunk of {chunk_level(k)} GPUs "
                f"(free chunks {list(self.free_chunks())})"
            )
        self.allocate_gpus(action_id, gpus)
        return gpus

    def allocate_gpus(self, action_id: ActionId, gpus: Sequence[int]) -> None:
        """Take exactly ``gpus``, which must form one free aligned chunk."""
        if action_id in self._held:
            raise ValueError(f"GPU node {self.node_id!r}: action {action_id} already holds GPUs")
        start, size = self._as_chunk(gpus)
        for gpu in range(start, start + size):
            if gpu in self._holder:
                raise ValueError(
                    f"GPU node {self.node_id!r}: GPU {gpu} is held by {self._holder[gpu]}"
                )
        self.buddy.split(start, size)
        self._held[action_id] = (start, size)
        for gpu in range(start, start + size):
            self._holder[gpu] = action_id

    def release(self, action_id: ActionId) -> tuple[int, ...]:
        """Return the action's chunk (merging buddies); ``KeyError`` if it holds none."""
        try:
            start, size = self._held.pop(action_id)
        except KeyError:
            raise KeyError(f"GPU node {self.node_id!r}: action {action_id} holds no GPUs") from None
        for gpu in range(start, start + size):
            del self._holder[gpu]
        self.buddy.merge(start, size)
        return tuple(range(start, start + size))

    def held(self, action_id: ActionId) -> tuple[int, ...]:
        chunk = self._held.get(action_id)
        return () if chunk is None else tuple(range(chunk[0], chunk[0] + chunk[1]))

    def holder(self, gpu: int) -> ActionId | None:
        return self._holder.get(gpu)

    def actions(self) -> tuple[ActionId, ...]:
        return tuple(self._held)

    def _as_chunk(self, gpus: Sequence[int]) -> tuple[int, int]:
        ordered = sorted(gpus)
        if not ordered or ordered != list(range(ordered[0], ordered[0] + len(ordered))):
            raise ValueError(f"GPU node {self.node_id!r}: {tuple(gpus)} is not one chunk")
        check_chunk(ordered[0], len(ordered), self.n_gpus)
        return ordered[0], len(ordered)

    # ------------------------------------------------------------------ host backups

    @property
    def backups(self) -> frozenset[str]:
        """Services whose state is loaded in host memory (restorable)."""
        return frozenset(self._specs)

    def register_service(self, spec: ServiceSpec) -> None:
        """Record the host backup of a service (loaded once at start-up)."""
        known = self._specs.get(spec.name)
        if known is not None and known != spec:
            raise ValueError(f"service {spec.name!r} already registered as {known}")
        self._specs[spec.name] = spec

    def unregister_service(self, name: str) -> tuple[Eviction, ...]:
        """Drop the backup and evict every variant of the service from every GPU."""
        evicted: list[Eviction] = []
        for gpu in range(self.n_gpus):
            for key in [key for key in self._resident[gpu] if key[0] == name]:
                if key in self._resident[gpu]:
                    evicted.extend(self.evict(key, gpu))
        self._specs.pop(name, None)  # (after: an eviction gives back its shard's bytes)
        return tuple(evicted)

    def service(self, name: str) -> ServiceSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise KeyError(f"service {name!r} is not registered") from None

    # ------------------------------------------------------------------ residency

    def restore_time_s(self, service: ServiceSpec, k: int) -> float:
        """Seconds to copy a DoP-``k`` instance from host memory (shards in parallel)."""
        return service.mem_bytes / (self.h2d_bytes_per_s * k)

    def observe_h2d(self, bytes_per_s: float, weight: float = 0.25) -> None:
        """Fold one measured restore bandwidth into the estimate (exponential average), so
        restore times follow the node's real links (ignores non-positive measurements)."""
        if math.isfinite(bytes_per_s) and bytes_per_s > 0:
            self.h2d_bytes_per_s += weight * (bytes_per_s - self.h2d_bytes_per_s)

    def fits_memory(self, service: ServiceSpec, dop: int) -> bool:
        """Whether one shard of the variant fits an empty GPU of this node."""
        return dop <= self.n_gpus and service.mem_per_gpu(dop) <= self.mem_per_gpu

    def is_resident(self, service: str, gpus: Sequence[int]) -> bool:
        """Whether variant ``(service, len(gpus))`` is resident on exactly these GPUs."""
        try:
            start, size = self._as_chunk(gpus)
        except ValueError:
            return False
        return self.resident_gpus((service, size), start, size) == size

    def holds(self, key: ServiceKey) -> bool:
        """Whether variant ``key`` is resident on any GPU of this node (a cheap pre-check)."""
        # a list, not a generator: asked per variant on every scheduling pass (8 GPUs)
        return any([key in entries for entries in self._resident])

    def resident_gpus(self, key: ServiceKey, start: int, size: int) -> int:
        """How many GPUs of ``[start, start + size)`` hold variant ``key``."""
        resident = self._resident
        return len([gpu for gpu in range(start, start + size) if key in resident[gpu]])

    def resident_score(self, service: str | None, size: int) -> ResidentScore | None:
        """Scoring function for ``choose_chunk``: resident GPUs of ``(service, size)``.

        For use at once: a variant resident nowhere on the node scores 0 everywhere without
        looking (the common case, asked for every chunk the scheduler picks).
        """
        if service is None:
            return None
        key = (service, size)
        if not self.holds(key):
            return resident_nowhere
        return lambda start, span: self.resident_gpus(key, start, span)

    def evict_score(self, service: str | None, size: int) -> EvictScore | None:
        """Scoring function for ``choose_chunk``: GPUs of a chunk whose free memory cannot
        take a shard of ``(service, size)`` (its restore would evict there).

        For use at once; None (no preference) when the service is unknown or every GPU of
        the node has room for the shard (the common case: asked for every chunk picked).
        """
        spec = None if service is None else self._specs.get(service)
        if spec is None:
            return None
        shard = spec.mem_per_gpu(size)
        short = [self.mem_free(gpu) < shard for gpu in range(self.n_gpus)]
        if not any(short):
            return None
        return lambda start, span: len([g for g in range(start, start + span) if short[g]])

    def resident(self, gpu: int) -> tuple[ServiceKey, ...]:
        """Variants resident on ``gpu``, least recently used first."""
        entries = self._resident[gpu]
        return tuple(sorted(entries, key=lambda key: entries[key]))

    def mem_used(self, gpu: int) -> int:
        return self._used[gpu]

    def mem_free(self, gpu: int) -> int:
        return self.mem_per_gpu - self.mem_used(gpu)

    def restore(self, service: ServiceSpec, gpus: Sequence[int], tick: int) -> RestorePlan:
        """Make variant ``(service, len(gpus))`` resident on ``gpus`` (one aligned chunk).

        Evicts the least recently used variants on those GPUs until the shard fits (an
        instance spanning several GPUs leaves all of them), then marks it resident and
        touches it at ``tick``. Already resident: nothing is evicted, only the touch.
        """
        start, size = self._as_chunk(gpus)
        spec = self._specs.get(service.name)
        if spec is None:
            raise ValueError(f"service {service.name!r} has no host backup; register it first")
        if spec != service:
            raise ValueError(f"service {service.name!r} is registered as {spec}, not {service}")
        key = (service.name, size)
        if self.resident_gpus(key, start, size) == size:
            self.touch(service.name, gpus, tick)
            return RestorePlan((), False, 0.0)
        shard = service.mem_per_gpu(size)
        if shard > self.mem_per_gpu:
            raise ValueError(
                f"service {service.name!r} needs {shard} bytes per GPU at DoP {size}, "
                f"GPUs of node {self.node_id!r} have {self.mem_per_gpu}"
            )
        evicted = self._make_room(range(start, start + size), shard)
        for gpu in range(start, start + size):
            self._resident[gpu][key] = (tick, self._next_order())
            self._used[gpu] += shard
        return RestorePlan(tuple(evicted), True, self.restore_time_s(service, size))

    def touch(self, service: str, gpus: Sequence[int], tick: int) -> None:
        """Mark a resident variant as used at ``tick`` (moves it to the LRU tail)."""
        start, size = self._as_chunk(gpus)
        key = (service, size)
        order = self._next_order()
        for gpu in range(start, start + size):
            if key in self._resident[gpu]:
                self._resident[gpu][key] = (tick, order)

    def evict(self, key: ServiceKey, gpu: int) -> list[Eviction]:
        """Drop the instance of ``key`` that covers ``gpu`` from all its GPUs."""
        name, dop = key
        first = gpu - gpu % dop
        dropped: list[Eviction] = []
        for member in range(first, first + dop):
            if self._resident[member].pop(key, None) is not None:
                self._used[member] -= self._specs[name].mem_per_gpu(dop)
                dropped.append(Eviction(member, name, dop))
        return dropped

    def _make_room(self, gpus: range, shard: int) -> list[Eviction]:
        evicted: list[Eviction] = []
        while True:
            short = [gpu for gpu in gpus if self.mem_free(gpu) < shard]
            if not short:
                return evicted
            victim_gpu, victim = min(
                ((gpu, key) for gpu in short for key in self._resident[gpu]),
                key=lambda entry: (self._resident[entry[0]][entry[1]], entry[0]),
            )
            evicted.extend(self.evict(victim, victim_gpu))

    def _next_order(self) -> int:
        self._order += 1
        return self._order

    # ------------------------------------------------------------------ invariants

    def validate(self) -> None:
        """Raise ``AssertionError`` if an invariant is broken (tests run it at teardown)."""
        seen: set[int] = set()
        for action_id, (start, size) in self._held.items():
            check_chunk(start, size, self.n_gpus)
            for gpu in range(start, start + size):
                assert gpu not in seen, f"GPU {gpu} held twice"
                assert self._holder.get(gpu) == action_id, f"GPU {gpu} holder mismatch"
                seen.add(gpu)
        assert seen == set(self._holder), "GPU holders disagree with held chunks"
        free: set[int] = set()
        for start, size in self.buddy.chunks():
            check_chunk(start, size, self.n_gpus)
            span = set(range(start, start + size))
            assert not span & free, f"free chunk ({start}, {start + size}) overlaps another"
            assert not span & seen, f"free chunk ({start}, {start + size}) is held"
            free |= span
        assert free | seen == set(range(self.n_gpus)), "a GPU is neither free nor held"
        for gpu in range(self.n_gpus):
            held = sum(self._specs[name].mem_per_gpu(dop) for name, dop in self._resident[gpu])
            assert self._used[gpu] == held, f"GPU {gpu} memory accounted {self._used[gpu]}"
            assert self.mem_used(gpu) <= self.mem_per_gpu, f"GPU {gpu} memory over-committed"
            for name, dop in self._resident[gpu]:
                first = gpu - gpu % dop
                assert all((name, dop) in self._resident[g] for g in range(first, first + dop)), (
                    f"instance of {name}@{dop} on GPU {gpu} is partial"
                )

    def __repr__(self) -> str:
        return f"GpuNodePool({self.node_id!r}, free_chunks={list(self.free_chunks())})"


# --------------------------------------------------------------------------- cluster


class GpuCluster:
    """All GPU nodes as the scheduler's one ``gpu`` pool (global GPU ids)."""

    pool_id = "gpu"
    resource = "gpu"

    def __init__(self, nodes: Sequence[GpuNodePool], services: Mapping[str, ServiceSpec]) -> None:
        ids = [node.node_id for node in nodes]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate GPU node ids in {ids}")
        self._nodes: tuple[GpuNodePool, ...] = tuple(nodes)
        self._index = {node.node_id: i for i, node in enumerate(self._nodes)}  # id -> slot
        self._by_slot: dict[int, GpuNodePool] = dict(enumerate(self._nodes))
        self._services: dict[str, ServiceSpec] = {}
        self._where: dict[ActionId, int] = {}  # action -> node slot
        for name, spec in services.items():
            if name != spec.name:
                raise ValueError(f"service registered as {name!r} is named {spec.name!r}")
            self.register_service(spec)

    # ------------------------------------------------------------------ topology

    @property
    def nodes(self) -> tuple[GpuNodePool, ...]:
        return self._nodes

    def node(self, node_id: str) -> GpuNodePool:
        return self._by_slot[self._index[node_id]]

    def add_node(self, node: GpuNodePool) -> None:
        """A node joins (cluster mode): its GPUs take the slot its name had before, else the
        next free one; every registered service gets its host backup there."""
        if node.node_id in self._index and self._index[node.node_id] in self._by_slot:
            raise ValueError(f"GPU node {node.node_id!r} is already in the pool")
        slot = self._index.get(node.node_id, max(self._index.values(), default=-1) + 1)
        for spec in self._services.values():
            node.register_service(spec)
        self._index[node.node_id] = slot
        self._by_slot[slot] = node
        self._nodes = tuple(self._by_slot[s] for s in sorted(self._by_slot))

    def remove_node(self, node_id: str) -> None:
        """A node leaves with its residency; ``ValueError`` while an action holds its GPUs
        (release them first). Its slot stays reserved for its name."""
        slot = self._index.get(node_id)
        node = None if slot is None else self._by_slot.get(slot)
        if slot is None or node is None:
            raise KeyError(f"no GPU node {node_id!r}")
        if node.actions():
            raise ValueError(f"GPU node {node_id!r}: actions {list(node.actions())} hold GPUs")
        del self._by_slot[slot]
        self._nodes = tuple(self._by_slot[s] for s in sorted(self._by_slot))

    @property
    def services(self) -> Mapping[str, ServiceSpec]:
        return dict(self._services)

    def locate(self, global_id: int) -> tuple[str, int]:
        """``(node_id, local_gpu)`` of a global GPU id."""
        index, local = divmod(global_id, GPU_STRIDE)
        node = self._by_slot.get(index)
        if node is None or not 0 <= local < node.n_gpus:
            raise ValueError(f"no GPU with global id {global_id}")
        return node.node_id, local

    def global_ids(self, node_id: str, local: Sequence[int]) -> tuple[int, ...]:
        base = self._index[node_id] * GPU_STRIDE
        return tuple(base + gpu for gpu in local)

    def register_service(self, spec: ServiceSpec) -> None:
        """Record a service's host backup on every node (a different spec under a known name
        is a ``ValueError``; unregister it first)."""
        known = self._services.get(spec.name)
        if known is not None and known != spec:
            raise ValueError(f"service {spec.name!r} already registered as {known}")
        for node in self._nodes:
            node.register_service(spec)
        self._services[spec.name] = spec

    def unregister_service(self, name: str) -> tuple[Eviction, ...]:
        """Forget the service everywhere; evictions carry global GPU ids."""
        self._services.pop(name, None)
        evicted: list[Eviction] = []
        for node in self._nodes:
            base = self._index[node.node_id] * GPU_STRIDE
            for ev in node.unregister_service(name):
                evicted.append(ev._replace(gpu=base + ev.gpu))
        return tuple(evicted)

    # ------------------------------------------------------------------ SchedPool

    @property
    def capacity(self) -> int:
        return sum(node.n_gpus for node in self._nodes)

    def free_units(self) -> int:
        return sum(node.free_gpus() for node in self._nodes)

    def max_single(self) -> int:
        most = 0  # a loop: asked for every queued service action's amounts on every pass
        for node in self._nodes:
            if node.n_gpus > most:
                most = node.n_gpus
        return most

    def chunk_counts(self) -> dict[int, int]:
        totals = dict.fromkeys(CHUNK_SIZES, 0)
        for node in self._nodes:
            for size, count in node.chunk_counts().items():
                totals[size] += count
        return totals

    def operator(self) -> ChunkOperator:
        return ChunkOperator(self.chunk_counts())

    def never_fits(self, action: Action) -> Shortfall | None:
        amounts = action.demand.get("gpu")
        if amounts is None:
            return None
        largest = self.max_single()
        if amounts.min > largest:
            return Shortfall(
                "gpu",
                amounts.min,
                self.free_units(),
                largest,
                f"needs {amounts.min} GPUs in one node, nodes have {largest}",
            )
        if action.service is None:
            return None
        spec = self._services.get(action.service)
        if spec is None:
            return Shortfall(
                "gpu",
                amounts.min,
                self.free_units(),
                self.capacity,
                f"service {action.service!r} is not registered",
            )
        candidates = self._gpu_amounts(action)
        if any(self._memory_fits(spec, chunk_level(k)) for k in candidates if k <= largest):
            return None
        dop = chunk_level(min(max(candidates), largest))
        most = max((node.mem_per_gpu for node in self._nodes), default=0)
        return Shortfall(
            "gpu_mem",
            spec.mem_per_gpu(dop),
            most,
            most,
            f"service {spec.name!r} needs {spec.mem_per_gpu(dop)} bytes per GPU at DoP {dop}, "
            f"GPUs have {most}",
        )

    def extra_cost(self, action: Action, amount: int) -> float:
        """Restore seconds at ``amount`` GPUs unless a free chunk already holds the variant.

        ``inf`` when the variant can never fit (too many GPUs, or its shard is larger than
        any GPU's memory), so the scheduler never picks that amount.
        """
        if action.service is None:
            return 0.0
        spec = self._services.get(action.service)
        if spec is None or amount > self.max_single():
            return math.inf
        size = chunk_level(amount)
        per_gpu = spec.mem_per_gpu(size)  # node.fits_memory(spec, size), inlined
        fitting = [n for n in self._nodes if size <= n.n_gpus and per_gpu <= n.mem_per_gpu]
        if not fitting:
            return math.inf
        key = (action.service, size)
        for node in self._nodes:
            if node.holds(key):
                if fully_resident(self._choices(action.service, size), size) is not None:
                    return 0.0
                break
        with_room = [n for n in fitting if n.buddy.has_chunk(size)]
        return min([node.restore_time_s(spec, size) for node in with_room or fitting])

    def pick_units(self, requests: Sequence[tuple[Action, int]]) -> list[tuple[int, ...]]:
        """Global GPU ids of one aligned chunk per request, taken in order on a copy.

        First in request order preferring chunks where the service is resident; if that
        splits a chunk a later request needed, the requests are packed residency-blind,
        largest first, into the smallest fitting chunk of the quickest node to restore them,
        which always succeeds when the ``ChunkOperator`` accepted them (buddy sizes divide
        each other: with the larger requests placed first, any free chunk that holds a
        request leaves as much room for the smaller ones as any other).
        """
        picked = self._pick(requests, range(len(requests)), by_residency=True)
        if picked is None:
            order = sorted(range(len(requests)), key=lambda i: (-chunk_level(requests[i][1]), i))
            picked = self._pick(requests, order, by_residency=False)
        if picked is None:
            raise ValueError(
                f"gpu: requests {[(a.id, k) for a, k in requests]} do not fit the free chunks "
                f"{self.chunk_counts()}"
            )
        return picked

    def _pick(
        self,
        requests: Sequence[tuple[Action, int]],
        order: Iterable[int],
        *,
        by_residency: bool,
    ) -> list[tuple[int, ...]] | None:
        copies = [node.buddy.copy() for node in self._nodes]
        picked: list[tuple[int, ...]] = [() for _ in requests]
        for i in order:
            action, amount = requests[i]
            size = chunk_level(amount)
            scored = [
                (copy, node.resident_score(action.service, size) if by_residency else None)
                for copy, node in zip(copies, self._nodes, strict=True)
            ]
            chosen = fully_resident(scored, size) if by_residency else None
            if chosen is None:
                evicts = (  # (read only where a restore is needed, on nodes with room)
                    [
                        node.evict_score(action.service, size) if copy.has_chunk(size) else None
                        for copy, node in zip(copies, self._nodes, strict=True)
                    ]
                    if by_residency
                    else []
                )
                chosen = choose_chunk(scored, size, evicts, self._restore_s(action, size))
            if chosen is None:
                return None
            index, start = chosen
            copies[index].split(start, size)
            base = self._index[self._nodes[index].node_id] * GPU_STRIDE
            picked[i] = tuple(base + gpu for gpu in range(start, start + size))
        return picked

    def allocate(self, action_id: ActionId, units: tuple[int, ...]) -> None:
        """Take exactly ``units`` (global ids of one free aligned chunk on one node)."""
        if action_id in self._where:
            raise ValueError(f"gpu: action {action_id} already holds GPUs")
        if not units:
            raise ValueError(f"gpu: action {action_id}: no GPUs given")
        located = [self.locate(unit) for unit in units]
        node_ids = {node_id for node_id, _ in located}
        if len(node_ids) != 1:
            raise ValueError(f"gpu: {units} span nodes {sorted(node_ids)}")
        index = self._index[located[0][0]]
        self._by_slot[index].allocate_gpus(action_id, [local for _, local in located])
        self._where[action_id] = index

    def release(self, action_id: ActionId) -> tuple[int, ...]:
        try:
            index = self._where.pop(action_id)
        except KeyError:
            raise KeyError(f"gpu: action {action_id} holds no GPUs") from None
        base = index * GPU_STRIDE
        return tuple(base + gpu for gpu in self._by_slot[index].release(action_id))

    # ------------------------------------------------------------------ residency

    def held(self, action_id: ActionId) -> tuple[int, ...]:
        index = self._where.get(action_id)
        if index is None:
            return ()
        base = index * GPU_STRIDE
        return tuple(base + gpu for gpu in self._by_slot[index].held(action_id))

    def node_of_action(self, action_id: ActionId) -> str | None:
        index = self._where.get(action_id)
        return None if index is None else self._by_slot[index].node_id

    def restore_for(self, action_id: ActionId, service: str, tick: int) -> RestorePlan:
        """Make ``service`` (variant = the chunk size) resident on the action's GPUs.

        Evictions in the plan carry global GPU ids.
        """
        index = self._where.get(action_id)
        if index is None:
            raise KeyError(f"gpu: action {action_id} holds no GPUs")
        spec = self._services.get(service)
        if spec is None:
            raise KeyError(f"service {service!r} is not registered")
        node = self._by_slot[index]
        plan = node.restore(spec, node.held(action_id), tick)
        base = index * GPU_STRIDE
        evicted = tuple(ev._replace(gpu=base + ev.gpu) for ev in plan.evicted)
        return RestorePlan(evicted, plan.needed, plan.seconds)

    def is_resident(self, service: str, units: Sequence[int]) -> bool:
        """Whether the variant ``(service, len(units))`` is resident on these global GPUs."""
        located = [self.locate(unit) for unit in units]
        node_ids = {node_id for node_id, _ in located}
        if len(node_ids) != 1:
            return False
        return self.node(located[0][0]).is_resident(service, [gpu for _, gpu in located])

    def validate(self) -> None:
        for node in self._nodes:
            node.validate()
        for action_id, index in self._where.items():
            assert self._by_slot[index].held(action_id), f"action {action_id} lost its GPUs"
        for index, node in self._by_slot.items():
            for action_id in node.actions():
                assert self._where.get(action_id) == index, f"action {action_id} misplaced"

    # ------------------------------------------------------------------ helpers

    def _choices(
        self, service: str | None, size: int
    ) -> list[tuple[BuddyChunks, ResidentScore | None]]:
        return [(node.buddy, node.resident_score(service, size)) for node in self._nodes]

    def _restore_s(self, action: Action, size: int) -> list[float]:
        """Each node's expected seconds to restore the action's service at ``size`` GPUs
        (its own bandwidth estimate; evictions cost no time); empty for no service."""
        spec = None if action.service is None else self._services.get(action.service)
        if spec is None:
            return []
        return [node.restore_time_s(spec, size) for node in self._nodes]

    def _memory_fits(self, spec: ServiceSpec, dop: int) -> bool:
        return any(node.fits_memory(spec, dop) for node in self._nodes)

    @staticmethod
    def _gpu_amounts(action: Action) -> tuple[int, ...]:
        if action.key == "gpu":
            return action.allowed_units()
        return (action.demand["gpu"].min,)

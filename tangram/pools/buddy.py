"""GPU buddy chunks (docs/design.md §5.3): the free aligned chunks of one node and chunk choice.

A chunk ``(start, size)`` has ``size = 2^a`` GPUs, ``a ∈ {0, 1, 2, 3}``, and ``start`` divisible
by ``size``. Taking a chunk splits the free chunk around it buddy-wise; giving one back merges
it with its free buddy upwards. ``choose_chunk`` picks where a request lands across nodes,
preferring GPUs where the requested service variant is already resident, then the node
that restores it quickest, then, among equally good chunks, GPUs whose memory holds it
without evicting anything.

Pure: no I/O, no clock. ``split``/``merge`` are ``O(log g)``; ``choose_chunk`` is ``O(g)`` per
node for ``g`` GPUs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tangram.sched.operators import CHUNK_SIZES


def check_chunk(start: int, size: int, n_gpus: int) -> None:
    if size not in CHUNK_SIZES or size > n_gpus or start % size or not 0 <= start < n_gpus:
        raise ValueError(
            f"({start}, {start + size}) is not an aligned chunk of a {n_gpus}-GPU node"
        )


class BuddyChunks:
    """The free aligned chunks of one node; ``split`` on take, ``merge`` on give."""

    __slots__ = ("_free", "n_gpus")

    def __init__(self, n_gpus: int) -> None:
        self.n_gpus = n_gpus
        self._free: dict[int, set[int]] = {s: set() for s in CHUNK_SIZES if s <= n_gpus}
        self._free[n_gpus].add(0)

    def copy(self) -> BuddyChunks:
        other = BuddyChunks(self.n_gpus)  # (compiled: a native class has no bare __new__)
        other._free = {size: set(starts) for size, starts in self._free.items()}
        return other

    def counts(self) -> dict[int, int]:
        return {size: len(self._free.get(size, ())) for size in CHUNK_SIZES}

    def has_chunk(self, size: int) -> bool:
        """Whether a free chunk of at least ``size`` GPUs exists."""
        return any([s >= size for s, starts in self._free.items() if starts])

    def chunks(self) -> list[tuple[int, int]]:
        """Free chunks as sorted ``(start, size)`` pairs."""
        return sorted([(start, size) for size, starts in self._free.items() for start in starts])

    def free_gpus(self) -> int:
        return sum(size * len(starts) for size, starts in self._free.items())

    def containing(self, start: int, size: int) -> tuple[int, int] | None:
        """The free chunk that contains the aligned chunk ``(start, size)``, if any."""
        for big in self._free:  # sizes ascending: the map is built in CHUNK_SIZES order
            if big < size:
                continue
            outer = start - start % big
            if outer in self._free[big]:
                return outer, big
        return None

    def split(self, start: int, size: int) -> None:
        """Take the aligned chunk ``(start, size)``, splitting the free chunk around it."""
        check_chunk(start, size, self.n_gpus)
        outer = self.containing(start, size)
        if outer is None:
            raise ValueError(f"GPUs ({start}, {start + size}) are not free")
        ostart, osize = outer
        self._free[osize].remove(ostart)
        while osize > size:
            osize //= 2
            low, high = ostart, ostart + osize
            keep, spare = (low, high) if start < high else (high, low)
            self._free[osize].add(spare)
            ostart = keep

    def merge(self, start: int, size: int) -> None:
        """Give back the chunk ``(start, size)``, merging it with free buddies upwards."""
        check_chunk(start, size, self.n_gpus)
        while size < self.n_gpus:
            buddy = start ^ size
            if buddy not in self._free[size]:
                break
            self._free[size].remove(buddy)
            start = min(start, buddy)
            size *= 2
        self._free[size].add(start)


ResidentScore = Callable[[int, int], int]  # (start, size) -> resident GPUs of the variant
# (start, size) -> GPUs of that chunk whose memory cannot take the variant's shard without
# evicting something (the LRU restore would evict there); 0 everywhere: no pressure
EvictScore = Callable[[int, int], int]


def resident_nowhere(start: int, size: int) -> int:
    """The score of a variant resident on no GPU of a node (chunk choice then skips it)."""
    return 0


def least_evictions(evicts: EvictScore | None, start: int, span: int, size: int) -> int:
    """The fewest GPUs that would evict, over the aligned ``size`` chunks of ``[start,
    start + span)`` (0 without a score)."""
    if evicts is None:
        return 0
    best = size
    for sub in range(start, start + span, size):
        n = evicts(sub, size)
        if n < best:
            best = n
            if n == 0:
                break
    return best


def choose_chunk(
    nodes: Sequence[tuple[BuddyChunks, ResidentScore | None]],
    size: int,
    evicts: Sequence[EvictScore | None] = (),
    restore_s: Sequence[float] = (),
) -> tuple[int, int] | None:
    """``(node index, start)`` of the chunk of ``size`` GPUs to take, or None if none is free.

    A fully resident aligned chunk inside any free chunk wins (smallest enclosing free chunk,
    then node, then start). Otherwise the node whose restore is quickest (``restore_s[i]``:
    node ``i``'s expected restore seconds; none given: the same everywhere), then the
    smallest enclosing free chunk, more resident GPUs, fewer evictions (``evicts[i]``
    scores node ``i``; none given: no eviction anywhere), node, start; then split towards
    the half with more resident GPUs, and between halves as resident, towards the one where
    the shard fits without evicting, then the one with fewer GPUs that would evict (else
    the low one).
    """
    resident = fully_resident(nodes, size)
    if resident is not None:
        return resident
    # (restore s, outer, -score, evicts, node, start)
    best: tuple[float, int, int, int, int, int] | None = None
    for index, (buddy, score) in enumerate(nodes):
        if score is resident_nowhere:
            score = None  # scores 0 everywhere, as no score does
        cost = evicts[index] if index < len(evicts) else None
        seconds = restore_s[index] if index < len(restore_s) else 0.0
        for start, outer in buddy.chunks():
            if outer < size:
                continue
            key = (
                seconds,
                outer,
                -(score(start, outer) if score else 0),
                least_evictions(cost, start, outer, size),
                index,
                start,
            )
            if best is None or key < best:
                best = key
    if best is None:
        return None
    _, outer, _, _, index, start = best
    score = nodes[index][1]
    if score is resident_nowhere:
        score = None
    cost = evicts[index] if index < len(evicts) else None
    while outer > size:
        outer //= 2
        low, high = start, start + outer
        lo_score = score(low, outer) if score is not None else 0
        hi_score = score(high, outer) if score is not None else 0
        if hi_score != lo_score:
            start = high if hi_score > lo_score else low
        elif cost is not None and _room_key(cost, high, outer, size) < _room_key(
            cost, low, outer, size
        ):
            start = high
    return index, start


def _room_key(evicts: EvictScore, start: int, span: int, size: int) -> tuple[int, int]:
    """How a half of a split ranks by memory: whether the shard fits there without
    evicting, then fewer GPUs that would evict (the half whose GPUs hold other services
    stays free whole, for those services' calls and for larger requests)."""
    return least_evictions(evicts, start, span, size), evicts(start, span)


def fully_resident(
    nodes: Sequence[tuple[BuddyChunks, ResidentScore | None]], size: int
) -> tuple[int, int] | None:
    """``(node index, start)`` of a free aligned chunk of ``size`` GPUs that is fully resident
    (smallest enclosing free chunk, then node, then start), or None."""
    best: tuple[int, int, int] | None = None  # (outer size, node, start)
    for index, (buddy, score) in enumerate(nodes):
        if score is None or score is resident_nowhere:  # no chunk is fully resident
            continue
        for outer_start, outer in buddy.chunks():
            if outer < size:
                continue
            for start in range(outer_start, outer_start + outer, size):
                if score(start, size) == size:
                    key = (outer, index, start)
                    if best is None or key < best:
                        best = key
    return None if best is None else (best[1], best[2])

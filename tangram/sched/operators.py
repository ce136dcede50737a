"""DP operators (paper appendix B, Alg. 3 'base operator' and Alg. 4 'chunk operator').

An operator describes the free units of one pool as a *state* and says what taking an
amount does to it. ``dp_arrange`` and the objective replay are written against this small
interface only, so they are topology-agnostic:

- ``start()``: the state holding every free unit.
- ``take(state, k)``: the state after one action takes ``k`` units, or ``None`` if impossible.
- ``give(state, k)``: the state after an action holding ``k`` units returns them (used by the
  objective replay; may be an optimistic approximation of the real topology).
- ``units(state)``: how many units are free in ``state``.
- ``encode(state)`` / ``size()``: a dense integer index for table-driven DP.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Protocol, TypeVar

S = TypeVar("S")

CHUNK_SIZES: tuple[int, ...] = (1, 2, 4, 8)


class Operator(Protocol[S]):
    def start(self) -> S: ...
    def take(self, state: S, k: int) -> S | None: ...
    def give(self, state: S, k: int) -> S: ...
    def units(self, state: S) -> int: ...
    def encode(self, state: S) -> int: ...
    def size(self) -> int: ...


class BaseOperator:
    """Interchangeable units (the cores of one node): state = number of free units."""

    __slots__ = ("free",)

    def __init__(self, free: int) -> None:
        if free < 0:
            raise ValueError(f"free units must be >= 0, got {free}")
        self.free = free

    def start(self) -> int:
        return self.free

    def take(self, state: int, k: int) -> int | None:
        return state - k if 0 <= k <= state else None

    def give(self, state: int, k: int) -> int:
        return state + k

    def units(self, state: int) -> int:
        return state

    def encode(self, state: int) -> int:
        return state

    def size(self) -> int:
        return self.free + 1

    def __repr__(self) -> str:
        return f"BaseOperator(free={self.free})"


def chunk_level(k: int) -> int:
    """Chunk size that serves a request for ``k`` GPUs: the next power of two (<= 8)."""
    if k <= 0:
        raise ValueError(f"GPU amount must be positive, got {k}")
    size = 1
    while size < k:
        size *= 2
    if size > CHUNK_SIZES[-1]:
        raise ValueError(f"GPU amount {k} exceeds the largest chunk {CHUNK_SIZES[-1]}")
    return size


ChunkState = tuple[int, int, int, int]


# A pure function of two small values, asked for every DP state and amount on every pass
# (memoised across passes and operators, bounded).
@lru_cache(maxsize=4096)
def _chunk_take(state: ChunkState, k: int) -> ChunkState | None:
    """``ChunkOperator.take``: the smallest free chunk of at least ``chunk_level(k)`` GPUs,
    split buddy-wise, or None when there is none."""
    need = chunk_level(k)
    counts = list(state)
    idx = CHUNK_SIZES.index(need)
    src = idx
    while src < len(CHUNK_SIZES) and counts[src] == 0:
        src += 1
    if src == len(CHUNK_SIZES):
        return None
    counts[src] -= 1
    # split: a chunk of size 2^src leaves one free buddy at every level idx..src-1
    for level in range(idx, src):
        counts[level] += 1
    return (counts[0], counts[1], counts[2], counts[3])


@lru_cache(maxsize=4096)
def _chunk_give(state: ChunkState, k: int) -> ChunkState:
    """``ChunkOperator.give`` (memoised as ``_chunk_take``: the replay returns chunks often)."""
    counts = list(state)
    level = CHUNK_SIZES.index(chunk_level(k))
    counts[level] += 1
    while level < len(CHUNK_SIZES) - 1 and counts[level] >= 2:
        counts[level] -= 2
        counts[level + 1] += 1
        level += 1
    return (counts[0], counts[1], counts[2], counts[3])


class ChunkOperator:
    """GPU buddy chunks (Alg. 4): state = free chunk counts (n1, n2, n4, n8).

    Taking ``k`` GPUs consumes one aligned chunk of size ``chunk_level(k)``: the smallest free
    chunk at least that large, split buddy-wise when larger (an 8 split for a 2 leaves a 2 and
    a 4 free). States are mixed-radix encoded over the counts reachable from the start.
    """

    __slots__ = ("_bases", "_caps", "counts")

    def __init__(self, counts: Mapping[int, int]) -> None:
        for size in counts:
            if size not in CHUNK_SIZES:
                raise ValueError(f"chunk size {size} not in {CHUNK_SIZES}")
        c = tuple(int(counts.get(s, 0)) for s in CHUNK_SIZES)
        if any(x < 0 for x in c):
            raise ValueError(f"chunk counts must be >= 0, got {dict(counts)}")
        self.counts: ChunkState = (c[0], c[1], c[2], c[3])
        # Splitting can create smaller chunks: an 8 yields at most one each of 4, 2, 1 per
        # split level, so the reachable count of size s is bounded by the starting count of s
        # plus the number of larger chunks that can be split down through s.
        n1, n2, n4, n8 = self.counts
        cap8 = n8
        cap4 = n4 + cap8 * 2
        cap2 = n2 + cap4 * 2
        cap1 = n1 + cap2 * 2
        self._caps = (cap1, cap2, cap4, cap8)
        self._bases = (1, cap1 + 1, (cap1 + 1) * (cap2 + 1), (cap1 + 1) * (cap2 + 1) * (cap4 + 1))

    def start(self) -> ChunkState:
        return self.counts

    def take(self, state: ChunkState, k: int) -> ChunkState | None:
        return _chunk_take(state, k)

    def give(self, state: ChunkState, k: int) -> ChunkState:
        """Return a chunk and merge equal pairs upwards (optimistic: assumes they are buddies)."""
        return _chunk_give(state, k)

    def units(self, state: ChunkState) -> int:
        n1, n2, n4, n8 = state  # sum over CHUNK_SIZES (1, 2, 4, 8), unrolled
        return n1 + 2 * n2 + 4 * n4 + 8 * n8

    def encode(self, state: ChunkState) -> int:
        b1, b2, b4, b8 = self._bases
        return state[0] * b1 + state[1] * b2 + state[2] * b4 + state[3] * b8

    def decode(self, index: int) -> ChunkState:
        out = []
        for cap in self._caps:
            out.append(index % (cap + 1))
            index //= cap + 1
        return (out[0], out[1], out[2], out[3])

    def size(self) -> int:
        return self._bases[3] * (self._caps[3] + 1)

    def __repr__(self) -> str:
        return f"ChunkOperator({dict(zip(CHUNK_SIZES, self.counts, strict=True))})"

"""The service book: GPU services registered on this core and the calls to them.

A service is registered in two steps: the core validates the spec and asks the host to
load it (``LoadService``); only once the host has (``ServiceLoaded``) does the GPU pool
learn it and the client get its answer. A call is an action on the ``gpu`` pool: placed by
the pass, started with the pool's restore plan (LRU evictions, then the restore), ended by
the host's ``CallFinished``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tangram.model import ActionId
from tangram.pools.gpu import Eviction, GpuCluster
from tangramd.services.spec import ServiceSpec
from tangramd.state.actions import ActionRec

if TYPE_CHECKING:
    pass


@dataclass(eq=False)
class Batch:
    """Calls merged into one forward pass on one replica (dynamic batching).

    ``leader`` was placed by the scheduler and holds the GPUs; ``riders`` hold none and end
    with it. A batch that is not full stays open (``forming``) until ``due`` (its window),
    taking new calls to the service as they come; then it is sent to the host.
    """

    leader: ActionRec
    node: str
    gpus: tuple[int, ...]  # the node's local ids
    evicted: tuple[Eviction, ...]
    limit: int  # max_batch
    due: float
    riders: list[ActionRec] = field(default_factory=list)

    @property
    def size(self) -> int:
        return 1 + len(self.riders)


class ServiceBook:
    """Registered services and the registrations / removals under way."""

    def __init__(self) -> None:
        self.specs: dict[str, ServiceSpec] = {}
        self.registering: dict[str, int | None] = {}  # name -> token of the request
        self.removing: dict[str, tuple[int | None, int]] = {}  # name -> (token, rejected)
        self.gpu_tick = 0  # LRU clock of the GPU residency
        self.forming: dict[str, list[Batch]] = {}  # service -> batches open to more calls
        self.riding: dict[ActionId, tuple[str, tuple[int, ...]]] = {}  # rider -> node, gpus
        self.placing: frozenset[ActionId] = frozenset()  # placed by the pass under way

    def batch_due(self) -> float | None:
        """When the earliest open batch must be sent (None: none is open)."""
        return min((b.due for bs in self.forming.values() for b in bs), default=None)

    def waiting(self, queue: Sequence[ActionRec]) -> dict[str, int]:
        """Queued calls per service."""
        waiting: dict[str, int] = {}
        for rec in queue:
            if rec.call is not None:
                waiting[rec.call.name] = waiting.get(rec.call.name, 0) + 1
        return waiting


def gpu_place(gpu: GpuCluster | None, units: Sequence[int]) -> tuple[str, tuple[int, ...]]:
    """``(node, local GPU ids)`` of global GPU ids on one node."""
    assert gpu is not None, "GPU units imply the gpu pool"
    located = [gpu.locate(unit) for unit in units]
    return located[0][0], tuple(local for _, local in located)

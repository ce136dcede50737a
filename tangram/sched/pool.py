"""The contract between the elastic scheduler and the pools it asks (``SchedPool``).

The scheduler is the consumer of this protocol, so it owns it: ``tangram.pools`` implements
it and imports it from here (pools depend on sched, never the other way round).

A pool owns the units of one key resource (the cores of one node, the GPUs of the cluster's
GPU nodes, one API endpoint) and answers the scheduler's questions without mutating itself.
The driver (daemon or simulator) applies a decision with ``allocate`` and undoes it with
``release``. Pure: no I/O, no clock (time-based state such as API quota windows and lease
TTLs advances only through ``advance(now)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tangram.model import Action, ActionId, Shortfall
from tangram.sched.operators import Operator


class SchedPool(Protocol):
    pool_id: str  # "cpu:<node>", "gpu", "api:<name>"
    resource: str  # the key resource it provides: "cpu" (adds no extra_cost), "gpu" or "api:<name>"

    @property
    def capacity(self) -> int: ...

    def free_units(self) -> int: ...

    def max_single(self) -> int:
        """Largest key amount one action can ever get here (e.g. cores of the node)."""
        ...

    def operator(self) -> Operator[Any]:
        """DP operator over the currently free units."""
        ...

    def never_fits(self, action: Action) -> Shortfall | None:
        """A shortfall when the action's minimum can never fit this pool even when idle."""
        ...

    def extra_cost(self, action: Action, amount: int) -> float:
        """Seconds to add to the action's duration at ``amount`` (GPU: restore if not resident).

        Must depend only on (action.kind, action.service, amount): the scheduler memoises
        it per pass on that key.
        """
        ...

    def pick_units(self, requests: Sequence[tuple[Action, int]]) -> list[tuple[int, ...]]:
        """Concrete unit ids for each (action, amount), as ``allocate`` would take them in order.

        Computed on a copy; raises ``ValueError`` if the requests do not fit together.
        """
        ...

    def allocate(self, action_id: ActionId, units: tuple[int, ...]) -> None: ...

    def release(self, action_id: ActionId) -> tuple[int, ...]: ...

"""GPU service runtimes on a node (docs/design.md §5.3, evict-on-execution).

``ServiceHost`` runs the registered services' replicas and carries out the pure pool's
decisions (``tangram.pools.gpu``): evict, restore onto a chunk, call. ``discover`` builds
the node's GPU inventory (NVML and/or simulated). Importing this package does not import
torch: only the worker processes do.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tangramd.services.host import (
        HostResult,
        Oversubscribed,
        Restored,
        ServiceHost,
        ServiceNotFound,
    )
    from tangramd.services.inventory import Gpu, Inventory, SimulatedGpus, discover
    from tangramd.services.runtime_base import (
        OUTCOMES,
        Moved,
        ReplicaCrashed,
        ServiceError,
        ServiceLoadError,
    )
    from tangramd.services.spec import ServiceRegistry, ServiceSpec, SpecError

# Names are imported lazily (PEP 562): ``tangramd.services.spec`` is part of the pure state
# package's imports, and must not bring the service host's asyncio with it.
_WHERE = {
    "HostResult": "host",
    "Oversubscribed": "host",
    "Restored": "host",
    "ServiceHost": "host",
    "ServiceNotFound": "host",
    "Gpu": "inventory",
    "Inventory": "inventory",
    "SimulatedGpus": "inventory",
    "discover": "inventory",
    "OUTCOMES": "runtime_base",
    "Moved": "runtime_base",
    "ReplicaCrashed": "runtime_base",
    "ServiceError": "runtime_base",
    "ServiceLoadError": "runtime_base",
    "ServiceRegistry": "spec",
    "ServiceSpec": "spec",
    "SpecError": "spec",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"tangramd.services.{where}"), name)


__all__ = [
    "OUTCOMES",
    "Gpu",
    "HostResult",
    "Inventory",
    "Moved",
    "Oversubscribed",
    "ReplicaCrashed",
    "Restored",
    "ServiceError",
    "ServiceHost",
    "ServiceLoadError",
    "ServiceNotFound",
    "ServiceRegistry",
    "ServiceSpec",
    "SimulatedGpus",
    "SpecError",
    "discover",
]

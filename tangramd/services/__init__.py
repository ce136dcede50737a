"""GPU service runtimes on a node (docs/design.md §5.3, evict-on-execution).

``ServiceHost`` runs the registered services' replicas and carries out the pure pool's
decisions (``tangram.pools.gpu``): evict, restore onto a chunk, call. ``discover`` builds
the node's GPU inventory (NVML and/or simulated). Importing this package does not import
torch: only the worker processes do.
"""

from tangramd.services.host import (
    CallResult,
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
from tangramd.services.spec import Registry, ServiceSpec, SpecError

__all__ = [
    "OUTCOMES",
    "CallResult",
    "Gpu",
    "Inventory",
    "Moved",
    "Oversubscribed",
    "Registry",
    "ReplicaCrashed",
    "Restored",
    "ServiceError",
    "ServiceHost",
    "ServiceLoadError",
    "ServiceNotFound",
    "ServiceSpec",
    "SimulatedGpus",
    "SpecError",
    "discover",
]

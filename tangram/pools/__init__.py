"""Pure pools (docs/design.md §5): CPU cores with NUMA, GPU buddy chunks with residency, API quotas.

Each pool answers the scheduler's ``SchedPool`` questions without I/O or a clock; the daemon
and the simulator apply decisions through ``allocate`` / ``release``.
"""

from tangram.pools.api import OVERFLOW_POLICIES, UNLIMITED_UNITS, ApiPool, Lease, Overflow
from tangram.pools.buddy import BuddyChunks, choose_chunk
from tangram.pools.cpu import BUSY, NEVER, CpuCluster, CpuNodePool, pick_cores
from tangram.pools.gpu import (
    ALLOWED_GPU_COUNTS,
    GPU_STRIDE,
    Eviction,
    GpuCluster,
    GpuNodePool,
    RestorePlan,
    ServiceKey,
    ServiceSpec,
)
from tangram.sched.pool import SchedPool

__all__ = [
    "ALLOWED_GPU_COUNTS",
    "BUSY",
    "GPU_STRIDE",
    "NEVER",
    "OVERFLOW_POLICIES",
    "UNLIMITED_UNITS",
    "ApiPool",
    "BuddyChunks",
    "CpuCluster",
    "CpuNodePool",
    "Eviction",
    "GpuCluster",
    "GpuNodePool",
    "Lease",
    "Overflow",
    "RestorePlan",
    "SchedPool",
    "ServiceKey",
    "ServiceSpec",
    "choose_chunk",
    "pick_cores",
]

"""The node's GPUs: discovered through NVML, declared as a simulated inventory, or both.

Local GPU ids ``0..n-1`` are what the pure pool (``tangram.pools.gpu``) and ``ServiceHost``
speak; each maps to a device: a physical CUDA index (NVML GPUs) or the CPU (simulated GPUs,
whose memory is accounted, not physical). NVML GPUs are ordered so that aligned buddy chunks
(``[0,2)``, ``[0,4)``, ...) group GPUs that are close in the topology.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tangram.pools.gpu import ALLOWED_GPU_COUNTS, GpuNodePool
from tangramd.services.spec import GB

# Default host-to-device bandwidth for NVML GPUs until a restore has been measured (B/s):
# PCIe gen4 x16 pinned copies; the measured figure replaces it (``GpuNodePool.observe_h2d``,
# fed by each call's restore).
DEFAULT_NVML_H2D = 25 * GB


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU as the node sees it."""

    local: int  # the id the pool uses on this node
    mem_bytes: int
    h2d_bytes_per_s: float
    cuda_index: int | None  # physical index for CUDA_VISIBLE_DEVICES; None = simulated
    name: str = "simulated"
    uuid: str | None = None
    pci_bus_id: str | None = None

    @property
    def simulated(self) -> bool:
        return self.cuda_index is None

    def to_json(self) -> dict[str, Any]:
        return {
            "local": self.local,
            "mem_bytes": self.mem_bytes,
            "h2d_bytes_per_s": self.h2d_bytes_per_s,
            "cuda_index": self.cuda_index,
            "name": self.name,
            "uuid": self.uuid,
            "pci_bus_id": self.pci_bus_id,
        }


@dataclass(frozen=True, slots=True)
class SimulatedGpus:
    """``[gpu] simulated = { count = N, mem_gb = G, h2d_gbps = B }``."""

    count: int
    mem_gb: float
    h2d_gbps: float

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 0:
            raise ValueError(f"[gpu] simulated.count: {self.count!r} must be an integer >= 0")
        for key in ("mem_gb", "h2d_gbps"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"[gpu] simulated.{key}: {value!r} must be a positive number")


@dataclass(frozen=True, slots=True)
class Inventory:
    """The node's GPUs in local-id order, plus the NVML topology levels between them."""

    gpus: tuple[Gpu, ...]
    nvml_error: str | None = None  # why NVML found nothing (None when it was used)
    topology: tuple[tuple[int, ...], ...] = ()  # NVML common-ancestor level, local x local

    def __len__(self) -> int:
        return len(self.gpus)

    def gpu(self, local: int) -> Gpu:
        return self.gpus[local]

    def node_pool(self, node_id: str) -> GpuNodePool:
        """The pure pool over these GPUs (uniform memory and bandwidth: the smallest)."""
        if len(self.gpus) not in ALLOWED_GPU_COUNTS:
            raise ValueError(
                f"GPU node {node_id!r} has {len(self.gpus)} GPUs; the buddy pool needs one of "
                f"{', '.join(map(str, ALLOWED_GPU_COUNTS))}"
            )
        return GpuNodePool(
            node_id,
            len(self.gpus),
            mem_per_gpu=min(gpu.mem_bytes for gpu in self.gpus),
            h2d_bytes_per_s=min(gpu.h2d_bytes_per_s for gpu in self.gpus),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "gpus": [gpu.to_json() for gpu in self.gpus],
            "nvml_error": self.nvml_error,
            "topology": [list(row) for row in self.topology],
        }


NvmlLoader = Callable[[], Any]


def _import_pynvml() -> Any:
    import pynvml  # nvidia-ml-py: importing works everywhere, nvmlInit needs the driver

    return pynvml


def discover(
    simulated: SimulatedGpus | None = None,
    *,
    use_nvml: bool = True,
    nvml: NvmlLoader = _import_pynvml,
) -> Inventory:
    """NVML GPUs first (when present), then the simulated ones; NVML absence is not an error."""
    found: list[Gpu] = []
    topology: tuple[tuple[int, ...], ...] = ()
    error: str | None = "disabled"
    if use_nvml:
        found, topology, error = _nvml_gpus(nvml)
    if simulated is not None:
        for _ in range(simulated.count):
            found.append(
                Gpu(
                    local=len(found),
                    mem_bytes=int(simulated.mem_gb * GB),
                    h2d_bytes_per_s=simulated.h2d_gbps * GB,
                    cuda_index=None,
                )
            )
    return Inventory(tuple(found), error, topology)


def _nvml_gpus(nvml: NvmlLoader) -> tuple[list[Gpu], tuple[tuple[int, ...], ...], str | None]:
    try:
        lib = nvml()
        lib.nvmlInit()
    except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, driver not loaded, ...
        return [], (), f"{type(exc).__name__}: {exc}"
    try:
        handles = [lib.nvmlDeviceGetHandleByIndex(i) for i in range(lib.nvmlDeviceGetCount())]
        infos = []
        for index, handle in enumerate(handles):
            name = lib.nvmlDeviceGetName(handle)
            infos.append(
                (
                    _text(lib.nvmlDeviceGetPciInfo(handle).busId),
                    index,
                    handle,
                    _text(name),
                    _text(lib.nvmlDeviceGetUUID(handle)),
                    int(lib.nvmlDeviceGetMemoryInfo(handle).total),
                )
            )
        # PCI bus order puts GPUs behind one switch / NVLink island next to each other, so
        # aligned buddy chunks of the local order are topologically close.
        infos.sort(key=lambda info: info[0])
        gpus = [
            Gpu(local, mem, DEFAULT_NVML_H2D, index, name, uuid, bus)
            for local, (bus, index, _, name, uuid, mem) in enumerate(infos)
        ]
        levels = tuple(tuple(_topology_level(lib, a[2], b[2]) for b in infos) for a in infos)
        return gpus, levels, None
    except Exception as exc:
        return [], (), f"{type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(Exception):  # after a failed query: nothing more to say
            lib.nvmlShutdown()


def _topology_level(lib: Any, a: Any, b: Any) -> int:
    if a is b:
        return 0
    try:
        return int(lib.nvmlDeviceGetTopologyCommonAncestor(a, b))
    except Exception:
        return -1  # not supported on this platform (e.g. some virtualised GPUs)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def visible_devices(gpus: Sequence[Gpu]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a chunk: its physical indices ('' for simulated GPUs)."""
    return ",".join(str(gpu.cuda_index) for gpu in gpus if gpu.cuda_index is not None)

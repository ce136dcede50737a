"""A module's parameters and buffers as one flat byte buffer: host backup, evict, restore.

The host backup is one contiguous uint8 tensor (pinned when the device is CUDA) holding
every parameter and buffer, each at a 256-byte aligned offset. The working copy on the
device is one buffer of the same layout; the module's tensors are views into it. So a
restore is one allocation and one copy of the whole set (as fast as a bare copy of the same
bytes), and an eviction drops the only reference to the working buffer, which really frees
it (``empty_cache`` hands CUDA memory back to the driver).

Imports torch: only the worker process and the benchmark use this module.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tangramd.services.runtime_base import Moved  # (seconds: the copy, synchronised)

ALIGN = 256


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one tensor lives in the flat buffer, and which module attribute holds it."""

    module: torch.nn.Module
    attr: str
    is_param: bool
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class FlatWeights:
    """Backup once, then ``evict()`` / ``restore()`` the module's tensors on ``device``."""

    def __init__(
        self,
        module: torch.nn.Module,
        device: torch.device,
        *,
        pin: bool | None = None,
        shared: bool = False,
    ) -> None:
        self.module = module
        self.device = device  # where the next restore goes (a worker may be moved)
        self.slots = _layout(module)
        self.nbytes = _end(self.slots)
        # Pinned host memory makes the H2D copy a single DMA at full PCIe/NVLink speed.
        # A shared backup (the fork server's) lives in shared memory instead: the forked
        # replicas map the same pages and pin them with ``pin_backup`` after they fork.
        if shared:
            pin = False  # and no CUDA call at all: the fork server must stay fork-safe
        elif pin is None:
            pin = torch.cuda.is_available()
        self.backup = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        if shared:
            self.backup.share_memory_()  # type: ignore[no-untyped-call]  # torch stub
        self.pinned = pin
        for slot in self.slots:
            tensor = getattr(slot.module, slot.attr)
            _view(self.backup, slot).copy_(tensor.detach())
        self.working: torch.Tensor | None = None
        self.resident = True  # the factory's tensors: drop them, the backup holds the bytes
        self.evict()

    def pin_backup(self) -> bool:
        """Page-lock the (shared) backup for DMA; False when CUDA refuses (copies still work,
        through a staging buffer, at lower bandwidth)."""
        if not self.pinned and self.nbytes and torch.cuda.is_available():
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # torch stub
            code = cudart.cudaHostRegister(self.backup.data_ptr(), self.nbytes, 0)
            self.pinned = int(code) == 0
        return self.pinned

    def restore(self) -> Moved:
        """Allocate the device buffer, copy the backup into it, point the module at it."""
        if self.resident:
            return Moved(0, 0.0)
        if self.device.type == "cuda":
            self.pin_backup()
        start = time.perf_counter()
        working = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        working.copy_(self.backup, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        self.working = working
        self._point_at(working)
        self.resident = True
        return Moved(self.nbytes, seconds)

    def evict(self) -> Moved:
        """Drop the device copy: the module's tensors become empty, the buffer is freed."""
        if not self.resident:
            return Moved(0, 0.0)
        start = time.perf_counter()
        for slot in self.slots:
            empty = torch.empty(0, dtype=slot.dtype, device=self.device)
            _assign(slot, empty)
        self.working = None
        self.resident = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        return Moved(self.nbytes, time.perf_counter() - start)

    def _point_at(self, flat: torch.Tensor) -> None:
        for slot in self.slots:
            _assign(slot, _view(flat, slot))


def _layout(module: torch.nn.Module) -> list[Slot]:
    """One slot per distinct tensor (tied parameters share one), in registration order."""
    slots: list[Slot] = []
    offsets: dict[int, int] = {}
    end = 0
    for owner in module.modules():
        for is_param, table in ((True, owner._parameters), (False, owner._buffers)):
            for attr, tensor in table.items():
                if tensor is None:
                    continue
                key = id(tensor)
                nbytes = tensor.numel() * tensor.element_size()
                if key not in offsets:
                    offsets[key] = end
                    end = -(-(end + nbytes) // ALIGN) * ALIGN
                slots.append(
                    Slot(
                        owner,
                        attr,
                        is_param,
                        offsets[key],
                        nbytes,
                        tensor.dtype,
                        tuple(tensor.shape),
                    )
                )
    return slots


def _end(slots: list[Slot]) -> int:
    return max((-(-(s.offset + s.nbytes) // ALIGN) * ALIGN for s in slots), default=0)


def _view(flat: torch.Tensor, slot: Slot) -> torch.Tensor:
    return flat[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


def _assign(slot: Slot, tensor: torch.Tensor) -> None:
    if slot.is_param:
        # Keep the Parameter object (optimisers and tied modules hold it): swap its data.
        slot.module._parameters[slot.attr].data = tensor  # type: ignore[union-attr]
    else:
        slot.module._buffers[slot.attr] = tensor

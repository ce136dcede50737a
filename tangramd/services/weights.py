"""A module's parameters and buffers as one flat byte buffer: host backup, evict, restore.

The host backup is one contiguous uint8 tensor (pinned when the device is CUDA) holding
every parameter and buffer, each at a 256-byte aligned offset. The working copy on the
device is one buffer of the same layout; the module's tensors are views into it. So a
restore is one allocation and one copy of the whole set (as fast as a bare copy of the same
bytes), and an eviction drops the only reference to the working buffer, which really frees
it (``empty_cache`` hands CUDA memory back to the driver).

A worker of a multi-GPU replica holds only its shard (``shard``): the working copy is then
the pieces of the backup that worker owns (whole tensors, or a range of a tensor's rows),
packed, each a copy of its own; the tensors it does not own stay empty.

Imports torch: only the worker process and the benchmark use this module.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tangramd.services.runtime_base import Moved  # (seconds: the copy, synchronised)

ALIGN = 256


@dataclass(frozen=True, slots=True)
class Piece:
    """Part of a tensor a shard holds: ``nbytes`` from ``start`` of its slot in the backup,
    viewed with ``shape`` (a range of rows of a row-major tensor is contiguous)."""

    slot: Slot
    start: int
    nbytes: int
    shape: tuple[int, ...]


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
        self.pieces: list[tuple[Piece, int]] | None = None  # a shard's: (piece, working offset)
        self.working_bytes = self.nbytes  # what a restore copies
        self.resident = True  # the factory's tensors: drop them, the backup holds the bytes
        self.evict()

    def shard(self, pieces: list[Piece]) -> None:
        """Hold only ``pieces`` from now on (one worker of a multi-GPU replica); evicted."""
        self.evict()
        packed: list[tuple[Piece, int]] = []
        end = 0
        for piece in pieces:
            packed.append((piece, end))
            end = -(-(end + piece.nbytes) // ALIGN) * ALIGN
        self.pieces = packed
        self.working_bytes = sum(piece.nbytes for piece in pieces)

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
        cuda = self.device.type == "cuda"
        if self.pieces is None:
            working = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            working.copy_(self.backup, non_blocking=cuda)
        else:
            size = max((at + p.nbytes for p, at in self.pieces), default=0)
            working = torch.empty(size, dtype=torch.uint8, device=self.device)
            for piece, at in self.pieces:
                src = self.backup[piece.slot.offset + piece.start :][: piece.nbytes]
                working[at : at + piece.nbytes].copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        self.working = working
        if self.pieces is None:
            self._point_at(working)
        else:
            for piece, at in self.pieces:
                flat = working[at : at + piece.nbytes]
                _assign(piece.slot, flat.view(piece.slot.dtype).view(piece.shape))
        self.resident = True
        return Moved(self.working_bytes, seconds)

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
        return Moved(self.working_bytes, time.perf_counter() - start)

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

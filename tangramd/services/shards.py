"""A torch replica on k GPUs: k worker processes, each holding a shard of the module.

The split is a tensor split of the module's linear layers (Megatron's column split): every
``torch.nn.Linear`` called as a module, whose weight and bias no other module shares, has
its output rows cut into k contiguous ranges, as even as the rows allow; worker ``r``
holds range ``r`` of each (on device ``r`` of the chunk: ``cuda:i`` on real GPUs, the CPU on
simulated ones). Worker 0 (the *lead*) also holds every other tensor (embeddings, norms,
tied or unsplittable layers) and runs ``handle``: when its forward reaches a split layer it
sends the layer's input to the other workers, computes its own rows meanwhile, and joins
the parts (``torch.cat`` on the last dimension). So each output element is the same dot
product as on one worker: the answer is the 1-worker answer.

The workers talk over socket pairs the host made (one per other worker, from the lead),
in the frames of ``tangramd.services.wire``; a tensor travels as its dtype, shape and raw
bytes (no pickle). A worker that is gone makes the call an infrastructure error
(:class:`ShardLost`), not a handler failure.

What the split assumes: the module uses a split layer by calling it (``layer(x)``), not by
reading its ``weight`` itself (the lead's ``weight`` holds rows of range 0 only). A layer
with fewer output rows than workers, or whose weight is tied, stays whole on the lead.

Imports torch: only the worker processes use this module.
"""

from __future__ import annotations

import selectors
import socket
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tangramd.services import wire
from tangramd.services.weights import FlatWeights, Piece, Slot


class ShardLost(Exception):
    """Another worker of the replica is gone (the call is an infrastructure error)."""


@dataclass(frozen=True, slots=True)
class Split:
    """One split linear layer: its index in the plan and each worker's row range."""

    index: int
    layer: torch.nn.Linear
    bounds: tuple[int, ...]  # k + 1 row boundaries: worker r holds rows [bounds[r], bounds[r+1])


def plan(module: torch.nn.Module, ranks: int) -> list[Split]:
    """The linear layers that are split over ``ranks`` workers, in module order."""
    if ranks <= 1:
        return []
    uses: dict[int, int] = {}  # tensor id -> modules holding it (tied weights: more than one)
    for owner in module.modules():
        for table in (owner._parameters, owner._buffers):
            for tensor in table.values():
                if tensor is not None:
                    uses[id(tensor)] = uses.get(id(tensor), 0) + 1
    splits: list[Split] = []
    for layer in module.modules():
        if type(layer) is not torch.nn.Linear or layer.out_features < ranks:
            continue
        tensors = [t for t in (layer.weight, layer.bias) if t is not None]
        if any(uses.get(id(t), 0) != 1 for t in tensors):
            continue
        rows = layer.out_features
        bounds = tuple(r * rows // ranks for r in range(ranks + 1))
        splits.append(Split(len(splits), layer, bounds))
    return splits


def pieces(weights: FlatWeights, splits: Sequence[Split], rank: int) -> list[Piece]:
    """What worker ``rank`` holds: its rows of each split layer, and on the lead every tensor
    that is not split."""
    rows_of: dict[tuple[int, str], tuple[int, int]] = {}
    for split in splits:
        lo, hi = split.bounds[rank], split.bounds[rank + 1]
        rows_of[(id(split.layer), "weight")] = (lo, hi)
        if split.layer.bias is not None:
            rows_of[(id(split.layer), "bias")] = (lo, hi)
    out: list[Piece] = []
    for slot in weights.slots:
        rows = rows_of.get((id(slot.module), slot.attr))
        if rows is None:
            if rank == 0:
                out.append(Piece(slot, 0, slot.nbytes, slot.shape))
            continue
        out.append(_rows(slot, *rows))
    return out


def _rows(slot: Slot, lo: int, hi: int) -> Piece:
    row_bytes = slot.nbytes // slot.shape[0] if slot.shape and slot.shape[0] else 0
    return Piece(slot, lo * row_bytes, (hi - lo) * row_bytes, (hi - lo, *slot.shape[1:]))


# --------------------------------------------------------------------------- tensors on the wire


def pack_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return {
        "dtype": str(flat.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "data": flat.view(torch.uint8).numpy().tobytes(),
    }


def unpack_tensor(msg: dict[str, Any], device: torch.device) -> torch.Tensor:
    dtype = getattr(torch, str(msg["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {msg['dtype']!r}")
    raw = torch.frombuffer(bytearray(msg["data"]), dtype=torch.uint8)
    return raw.view(dtype).reshape([int(n) for n in msg["shape"]]).to(device)


# --------------------------------------------------------------------------- the lead


class Peer:
    """The lead's end of one other worker's socket (blocking frames)."""

    def __init__(self, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.sock = sock
        self.inp = sock.makefile("rb")
        self.out = sock.makefile("wb")

    def send(self, msg: dict[str, Any]) -> None:
        try:
            wire.write_frame(self.out, msg)
        except OSError as exc:
            raise ShardLost(f"worker {self.rank} of the replica is gone: {exc}") from None

    def receive(self) -> dict[str, Any]:
        try:
            reply = wire.read_frame(self.inp)
        except (OSError, wire.WireError) as exc:
            raise ShardLost(f"worker {self.rank} of the replica is gone: {exc}") from None
        if reply is None:
            raise ShardLost(f"worker {self.rank} of the replica is gone")
        return reply


def lead(splits: Sequence[Split], peers: Sequence[Peer]) -> None:
    """Make each split layer of the lead compute its rows and gather the others' rows."""
    for split in splits:
        split.layer.forward = types.MethodType(_gathering(split, peers), split.layer)  # type: ignore[method-assign]


def _gathering(
    split: Split, peers: Sequence[Peer]
) -> Callable[[torch.nn.Linear, torch.Tensor], torch.Tensor]:
    def forward(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        request = {"op": "linear", "index": split.index, "x": pack_tensor(x)}
        for peer in peers:
            peer.send(request)
        parts = [torch.nn.functional.linear(x, layer.weight, layer.bias)]
        for peer in peers:
            reply = peer.receive()
            if not reply.get("ok"):
                raise RuntimeError(f"worker {peer.rank}: {reply.get('error')}")
            parts.append(unpack_tensor(reply["y"], x.device).to(parts[0].dtype))
        return torch.cat(parts, dim=-1)

    return forward


# --------------------------------------------------------------------------- the others


def serve_shard(
    splits: Sequence[Split],
    weights: FlatWeights,
    host_in: Any,
    host_out: Any,
    peer: socket.socket,
    answer: Callable[[dict[str, Any]], dict[str, Any]],
) -> int:
    """A worker other than the lead: the host's requests (restore, evict, info: ``answer``)
    and the lead's layer requests, whichever comes, until the host's end closes.

    Both ends speak one request, then wait for its answer (the host holds the replica's
    lock; the lead waits for each layer's rows), so a buffered reader never holds a frame
    that ``select`` does not see."""
    streams = {"host": (host_in, host_out), "peer": (peer.makefile("rb"), peer.makefile("wb"))}
    chooser = selectors.DefaultSelector()
    chooser.register(host_in, selectors.EVENT_READ, "host")
    chooser.register(peer, selectors.EVENT_READ, "peer")
    while True:
        for key, _ in chooser.select():
            inp, out = streams[key.data]
            try:
                msg = wire.read_frame(inp)
            except wire.WireError:
                msg = None
            if msg is None:
                if key.data == "host":
                    return 0  # the host closed the replica
                chooser.unregister(peer)  # the lead is gone: the host will notice
                continue
            reply = answer(msg) if key.data == "host" else _compute(splits, weights, msg)
            wire.write_frame(out, reply)


def _compute(splits: Sequence[Split], weights: FlatWeights, msg: dict[str, Any]) -> dict[str, Any]:
    """One layer's rows for the lead."""
    try:
        if msg.get("op") != "linear":
            raise ValueError(f"unknown op {msg.get('op')!r}")
        if not weights.resident:
            raise RuntimeError("not resident: restore first")
        layer = splits[int(msg["index"])].layer
        with torch.inference_mode():
            x = unpack_tensor(msg["x"], weights.device)
            y = torch.nn.functional.linear(x, layer.weight, layer.bias)
        return {"ok": True, "y": pack_tensor(y)}
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

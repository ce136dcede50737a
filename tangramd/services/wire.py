"""The pipe between ``ServiceHost`` and a torch worker: 4-byte big-endian length + msgpack map.

Requests ``{"op": "call"|"restore"|"evict"|"info", ...}``; replies ``{"ok": true, ...}`` or
``{"ok": false, "kind": "failed"|"error", "error": str}``. One request at a time per worker.
"""

from __future__ import annotations

import asyncio
import struct
from typing import IO, Any

import msgpack

MAX_FRAME = 256 << 20
_LEN = struct.Struct(">I")


class WireError(Exception):
    """The peer closed the pipe or sent something that is not a frame."""


def encode(msg: dict[str, Any]) -> bytes:
    body: bytes = msgpack.packb(msg, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise WireError(f"message of {len(body)} bytes exceeds the {MAX_FRAME}-byte frame limit")
    return _LEN.pack(len(body)) + body


def pack(msg: dict[str, Any]) -> bytes:
    """One message without a length prefix (SOCK_SEQPACKET keeps message boundaries)."""
    body: bytes = msgpack.packb(msg, use_bin_type=True)
    return body


def unpack(body: bytes) -> dict[str, Any]:
    try:
        return _decode(body)
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireError(f"bad message: {exc}") from None


def _decode(body: bytes) -> dict[str, Any]:
    msg = msgpack.unpackb(body, raw=False, strict_map_key=False)
    if not isinstance(msg, dict):
        raise WireError(f"frame holds a {type(msg).__name__}, not a map")
    return msg


def read_frame(stream: IO[bytes]) -> dict[str, Any] | None:
    """Blocking read of one frame; None at a clean end of stream."""
    head = stream.read(_LEN.size)
    if not head:
        return None
    if len(head) < _LEN.size:
        raise WireError("stream ended inside a frame header")
    (size,) = _LEN.unpack(head)
    if size > MAX_FRAME:
        raise WireError(f"frame of {size} bytes exceeds the limit")
    body = stream.read(size)
    if len(body) < size:
        raise WireError("stream ended inside a frame")
    return _decode(body)


def write_frame(stream: IO[bytes], msg: dict[str, Any]) -> None:
    stream.write(encode(msg))
    stream.flush()


async def read_frame_async(reader: asyncio.StreamReader) -> dict[str, Any]:
    """One frame; ``WireError`` when the worker's end of the pipe is gone."""
    try:
        (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
        if size > MAX_FRAME:
            raise WireError(f"frame of {size} bytes exceeds the limit")
        return _decode(await reader.readexactly(size))
    except asyncio.IncompleteReadError:
        raise WireError("worker closed its pipe") from None

"""Sans-IO frame codec (docs/design.md §6): bytes in, messages out; no sockets, no clock.

A frame is a 4-byte big-endian unsigned length followed by that many bytes holding exactly
one msgpack map with ``str`` keys. The length prefix is checked against ``max_frame``
*before* any of the body is buffered, so a hostile 4 GiB prefix costs four bytes of memory.

msgpack is used with ``raw=False`` (strings are ``str``, bytes are ``bytes``), without ext
types and without any object hooks: nothing on the wire can construct arbitrary Python
objects. Never pickle.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any, Final

import msgpack

from tangram.protocol.errors import BadRequest

DEFAULT_MAX_FRAME: Final = 16 * 1024 * 1024  # bytes
HEADER_SIZE: Final = 4
MAX_FRAME_LIMIT: Final = 0xFFFFFFFF  # what a 4-byte length can express

_HEADER = struct.Struct(">I")


class FrameError(BadRequest):
    """The byte stream is not a valid frame; the connection cannot be trusted any more."""


def _ext_hook(code: int, data: bytes) -> Any:
    raise FrameError(f"msgpack ext type {code} is not allowed")


def _check_keys(msg: dict[str, Any]) -> None:
    """Reject non-``str`` map keys anywhere in the message (they cannot be field names),
    naming the first one's path (``$.a[0]``), depth first in the message's order.

    Every frame passes here, so the walk needs no recursion and formats no path until it
    finds a bad key: each nested map or list carries its place as a (parent's place, key
    or index) pair. msgpack gives plain ``dict`` and ``list``, never subclasses."""
    stack: list[tuple[Any, Any]] = [(msg, None)]
    while stack:
        value, where = stack.pop()
        nested: list[tuple[Any, Any]] = []
        if type(value) is dict:
            for key, item in value.items():
                if type(key) is not str:
                    raise FrameError(
                        f"{_path(where)}: map key {key!r} is {type(key).__name__}, expected str"
                    )
                if type(item) is dict or type(item) is list:
                    nested.append((item, (where, key)))
        else:
            for index, item in enumerate(value):
                if type(item) is dict or type(item) is list:
                    nested.append((item, (where, index)))
        if nested:
            stack.extend(reversed(nested))  # the first on top: the message's order


def _path(where: Any) -> str:
    """``$.a[0]`` from a place of :func:`_check_keys` (None: the message itself)."""
    parts: list[str] = []
    while where is not None:
        where, step = where
        parts.append(f"[{step}]" if isinstance(step, int) else f".{step}")
    return "$" + "".join(reversed(parts))


def decode_body(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Decode one frame body (without its length prefix) into a map; raise FrameError."""
    try:
        msg = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=False,  # we check keys ourselves to give a precise error
            ext_hook=_ext_hook,
            use_list=True,
        )
    except FrameError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types (ValueError, ...)
        raise FrameError(f"undecodable msgpack: {exc}") from None
    if not isinstance(msg, dict):
        raise FrameError(f"frame payload is {type(msg).__name__}, expected a map")
    try:
        _check_keys(msg)
    except FrameError as exc:
        request_id = msg.get("id")
        if type(request_id) is int:
            exc.request_id = request_id
        raise
    return msg


def encode(msg: Mapping[str, Any], *, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """Encode one message as a complete frame (length prefix + msgpack map).

    Raises ``TypeError`` for values msgpack cannot represent and ``FrameError`` when the
    encoded body would exceed ``max_frame`` (the peer would reject it anyway).
    """
    if not isinstance(msg, Mapping):
        raise TypeError(f"a message must be a map, got {type(msg).__name__}")
    body: bytes = msgpack.packb(msg, use_bin_type=True, strict_types=False)
    if len(body) > max_frame:
        raise FrameError(f"frame of {len(body)} bytes exceeds the limit of {max_frame}")
    return _HEADER.pack(len(body)) + body


class FrameDecoder:
    """Incremental decoder: ``feed`` bytes as they arrive, pop messages with ``next_message``.

    After a ``FrameError`` the stream position is lost; the decoder stays broken (every
    later call raises the same error) and the caller should close the connection.
    """

    __slots__ = ("_buf", "_error", "_need", "_pos", "max_frame")

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        if not 0 < max_frame <= MAX_FRAME_LIMIT:
            raise ValueError(f"max_frame must be in 1..{MAX_FRAME_LIMIT}, got {max_frame}")
        self.max_frame = max_frame
        self._buf = bytearray()
        self._pos = 0  # start of the unread part of _buf (compacted lazily)
        self._need = -1  # body length of the frame being read, -1 while reading a header
        self._error: FrameError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as messages."""
        return len(self._buf) - self._pos

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append received bytes; a complete length prefix is checked immediately."""
        if self._error is not None:
            raise self._error
        if self._pos and self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        self._buf += data
        if self._need < 0 and len(self._buf) - self._pos >= HEADER_SIZE:
            self._read_header()

    def _fail(self, exc: FrameError) -> FrameError:
        self._error = exc
        self._buf = bytearray()
        self._pos = 0
        return exc

    def _read_header(self) -> None:
        (length,) = _HEADER.unpack_from(self._buf, self._pos)
        if length > self.max_frame:
            raise self._fail(
                FrameError(f"frame length {length} exceeds the limit of {self.max_frame} bytes")
            )
        self._need = length
        self._pos += HEADER_SIZE

    def next_message(self) -> dict[str, Any] | None:
        """Return the next complete message, or None when more bytes are needed."""
        if self._error is not None:
            raise self._error
        if self._need < 0:
            if len(self._buf) - self._pos < HEADER_SIZE:
                return None
            self._read_header()
        start = self._pos
        end = start + self._need
        if len(self._buf) < end:
            return None
        body = self._buf[start:end]
        self._need = -1
        if end == len(self._buf):
            self._buf.clear()
            self._pos = 0
        elif end > 65536 and end * 2 > len(self._buf):
            del self._buf[:end]  # compact: keep the buffer from growing without bound
            self._pos = 0
        else:
            self._pos = end
        try:
            return decode_body(body)
        except FrameError as exc:
            raise self._fail(exc) from None

    def messages(self) -> list[dict[str, Any]]:
        """Every complete message currently buffered, in order."""
        out: list[dict[str, Any]] = []
        while (msg := self.next_message()) is not None:
            out.append(msg)
        return out

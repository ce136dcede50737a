"""The node ↔ coordinator link: the client protocol's frames (4-byte length + msgpack map)
over a TLS (or, with ``--insecure``, loopback-only plain) asyncio stream.

What travels on it is declared once, in :mod:`tangram.protocol.link` (``LINK_MESSAGES``:
each message's name, sender, fields and doc; ``make_message`` builds one), and rendered
into the "Link messages" section of ``docs/protocol.md``: the join (``ca``, ``hello``,
``welcome`` or ``refused``), then heartbeats, the coordinator's commands, the node's
outcomes (kept until the coordinator's ``ack``), and the requests of the node's clients.
This module only moves maps: it sends what it is given, in order, and gives back each map
received. An acknowledgement can be deferred (:meth:`Link.defer`) to ride with the next
message, and the answers to one message corked (:meth:`Link.cork`) into one write.

Framing and decoding are :mod:`tangram.protocol.codec` (sans-IO, size-checked before
buffering, no object hooks): a malformed frame ends the link, never the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import Mapping
from typing import Any

from tangram.protocol.codec import DEFAULT_MAX_FRAME, FrameDecoder, encode

READ_CHUNK = 1 << 16
DEFER_S = 0.05  # how long a deferred message (an acknowledgement) waits for company


class LinkClosed(Exception):
    """The peer closed the link, or it broke."""


class Link:
    """One framed, bidirectional stream (either end)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.max_frame = max_frame
        self._decoder = FrameDecoder(max_frame)
        self.closed = False
        self._corked: list[bytes] | None = None
        self._deferred: list[bytes] = []  # sent with the next write, or after DEFER_S
        self._defer_timer: asyncio.TimerHandle | None = None
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)

    def send(self, msg: Mapping[str, Any]) -> bool:
        """Queue one message; False when the link is already closed (nothing sent)."""
        if self.closed or self.writer.is_closing():
            return False
        data = encode(msg, max_frame=self.max_frame)
        if self._corked is not None:
            self._corked.append(data)
        elif self._deferred:
            self._deferred.append(data)
            self._flush_deferred()
        else:
            self.writer.write(data)
        return True

    def defer(self, msg: Mapping[str, Any]) -> bool:
        """Queue a message that need not leave at once (an acknowledgement): it goes out in
        the same write as the next message sent, or on its own after ``DEFER_S``, so a
        busy link carries it without a write (and a wake-up of the peer) of its own."""
        if self.closed or self.writer.is_closing():
            return False
        self._deferred.append(encode(msg, max_frame=self.max_frame))
        if self._defer_timer is None:
            loop = asyncio.get_running_loop()
            self._defer_timer = loop.call_later(DEFER_S, self._flush_deferred)
        return True

    def _flush_deferred(self) -> None:
        held, self._deferred = self._deferred, []
        if self._defer_timer is not None:
            self._defer_timer.cancel()
            self._defer_timer = None
        if held and not self.closed and not self.writer.is_closing():
            self.writer.write(held[0] if len(held) == 1 else b"".join(held))

    def cork(self) -> None:
        """Hold what is sent until :meth:`uncork`, then write it at once: one TLS record
        and one system call (each wakes the peer) for the answers to one message, such
        as a result and its acknowledgement."""
        if self._corked is None:
            self._corked = []

    def uncork(self) -> None:
        held, self._corked = self._corked, None
        if held:
            if self._deferred:
                self._deferred.extend(held)
                self._flush_deferred()
            elif not self.closed and not self.writer.is_closing():
                self.writer.write(held[0] if len(held) == 1 else b"".join(held))

    async def drain(self) -> None:
        try:
            await self.writer.drain()
        except (ConnectionError, OSError) as exc:
            raise LinkClosed(str(exc)) from None

    async def recv(self) -> dict[str, Any]:
        """The next message; raise LinkClosed at end of stream, FrameError on garbage."""
        while True:
            msg = self._decoder.next_message()
            if msg is not None:
                return msg
            try:
                data = await self.reader.read(READ_CHUNK)
            except (ConnectionError, OSError, asyncio.IncompleteReadError) as exc:
                raise LinkClosed(str(exc) or type(exc).__name__) from None
            if not data:
                raise LinkClosed("closed by peer")
            self._decoder.feed(data)

    def peer_cert_der(self) -> bytes | None:
        """The DER certificate the peer presented in the TLS handshake (None: plain TCP)."""
        ssl_obj = self.writer.get_extra_info("ssl_object")
        return None if ssl_obj is None else ssl_obj.getpeercert(binary_form=True)

    def close(self) -> None:
        if not self.closed:
            self._flush_deferred()  # (a goodbye still carries what was deferred)
            self.closed = True
            self.writer.close()

    def abort(self) -> None:
        """Close at once, without a TLS goodbye (the peer may be unreachable)."""
        self.closed = True
        if self._defer_timer is not None:
            self._defer_timer.cancel()
            self._defer_timer = None
        self.writer.transport.abort()

    async def wait_closed(self) -> None:
        self.close()
        with contextlib.suppress(ConnectionError, OSError, asyncio.CancelledError):
            await self.writer.wait_closed()


def split_host_port(text: str) -> tuple[str, int]:
    """``("10.0.0.1", 7000)`` from ``10.0.0.1:7000`` or ``[::1]:7000``; raise ValueError."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    number = int(port)
    if not 0 <= number <= 65535:
        raise ValueError(f"port out of range in {text!r}")
    return host, number


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (where ``--insecure`` is allowed)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(
                ipaddress.ip_address(info[4][0]).is_loopback
                for info in socket.getaddrinfo(host, None)
            )
        except (OSError, ValueError):
            return False

"""The gateway's HTTP connections, bounded (issue 31, item 6).

uvicorn alone keeps a connection open for as long as its client dribbles a header line
now and then, and accepts as many as the process has descriptors: 1,100 slow clients left
the daemon (``tangramd up --http`` serves HTTP in its own process) no descriptor for its
Unix socket, so every socket exec failed, and nothing was logged. Here:

- at most :func:`connection_cap` connections are open at once, below the descriptor limit
  by ``FD_RESERVE`` kept for the daemon's socket, its environments and its files; a
  connection past the cap is closed as soon as it is accepted;
- a request's headers must arrive within ``read_timeout_s`` of its first byte (of the
  connection, for its first request), and its body within ``read_timeout_s`` of its
  headers; a connection past either deadline is closed;
- each cap or deadline hit is logged (``http_connection_refused``,
  ``http_read_timeout``), at most once per ``LOG_EVERY_S`` with the count since.

A uvicorn ``http`` protocol class (httptools, which the http extra installs), built by
:func:`guarded_protocol` with the limits as class attributes.
"""

from __future__ import annotations

import asyncio
import resource
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import structlog
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tangramd.config import HttpConfig
from tangramd.gateway.callers import PEER_STATE

log = structlog.get_logger("tangramd.gateway")

FD_RESERVE = 256  # descriptors the cap leaves to the daemon (socket, environments, files)
LOG_EVERY_S = 10.0
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this long
MAX_HEADERS = 64 * 1024  # bytes of a request's line and headers (h11; httptools: its own)


def raise_fd_limit() -> int:
    """Raise this process's soft descriptor limit to its hard one; return the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def connection_cap(max_connections: int, fd_limit: int) -> int:
    """How many HTTP connections may be open at once: ``max_connections``, lowered to
    leave ``FD_RESERVE`` descriptors (at least 1)."""
    return max(1, min(max_connections, fd_limit - FD_RESERVE))


class _Throttled:
    """A warning logged at most once per ``LOG_EVERY_S``, with the count since."""

    def __init__(self, event: str) -> None:
        self.event = event
        self.count = 0
        self.last = -LOG_EVERY_S

    def note(self, **fields: Any) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= LOG_EVERY_S:
            log.warning(self.event, times=self.count, **fields)
            self.count, self.last = 0, now


def uvicorn_limits(limits: HttpConfig, peer_check: PeerCheck | None = None) -> dict[str, Any]:
    """uvicorn's options for ``[http]``: the guarded protocol, the cap as its concurrency
    limit too (503 past it), keep-alive and header-size limits; logs the cap when the
    descriptor limit lowered it."""
    fd_limit = raise_fd_limit()
    cap = connection_cap(limits.max_connections, fd_limit)
    if cap < limits.max_connections:
        log.warning("http_connection_cap_lowered", cap=cap, fd_limit=fd_limit, reserve=FD_RESERVE)
    return {
        "http": guarded_protocol(cap, limits.read_timeout_s, peer_check),
        "limit_concurrency": cap,
        "timeout_keep_alive": KEEP_ALIVE_S,
        "h11_max_incomplete_event_size": MAX_HEADERS,
        "backlog": min(2048, cap),
    }


PeerCheck = Callable[[int, int, int], str]  # (pid, uid, gid) -> why refused, '' if served


def _peer(transport: asyncio.Transport) -> tuple[int, int, int] | None:
    """(pid, uid, gid) of a Unix socket connection's peer (SO_PEERCRED), else None."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX or not hasattr(socket, "SO_PEERCRED"):
        return None
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


def guarded_protocol(
    cap: int, read_timeout_s: float, peer_check: PeerCheck | None = None
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a connection cap and read deadlines; on a Unix
    socket each connection's peer must pass ``peer_check`` and its requests carry the
    peer's (uid, gid) in ``scope["state"][PEER_STATE]``."""
    refused = _Throttled("http_connection_refused")
    slow = _Throttled("http_read_timeout")

    class Guarded(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None
        _peer_ids: tuple[int, int] | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > cap:
                refused.note(reason="max_connections", cap=cap)
                transport.abort()
                return
            peer = _peer(transport)
            if peer is not None:
                why = "" if peer_check is None else peer_check(*peer)
                if why:
                    log.warning("http_peer_refused", reason=why, pid=peer[0], uid=peer[1])
                    transport.abort()
                    return
                self._peer_ids = (peer[1], peer[2])
            self._arm("headers")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            if self._deadline is None:
                self._arm("headers")
            super().on_message_begin()
            if self._peer_ids is not None:
                self.scope["state"][PEER_STATE] = self._peer_ids

        def on_headers_complete(self) -> None:
            self._arm("body")
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def _arm(self, part: str) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(read_timeout_s, self._expired, part)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self, part: str) -> None:
            self._deadline = None
            slow.note(part=part, read_timeout_s=read_timeout_s)
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.disconnected = True  # the app's receive() sees the client gone
            self.transport.abort()

    return Guarded

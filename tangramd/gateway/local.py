"""The gateway's client inside the daemon (``tangramd up --http``): an
:class:`~tangram.client.AsyncClient` whose requests go to the daemon's own server through a
:class:`~tangramd.transport.LocalConnection` instead of its Unix socket.

Every call is still a request the daemon parses, validates and schedules as it does one
from its socket (the same frames, the same typed errors); what goes is the gateway process,
its socket round trip and two process wake-ups per call. The peer is the daemon's own
user, as a ``tangramd http`` started by that user would be, or the one given
(``--http-user``): under ``cpu.exec_user = "peer"`` that is who HTTP callers' commands run
as and who owns their environments, so a root daemon runs them as root unless told
otherwise (it says so at start-up).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tangram.client import AsyncClient
from tangramd.transport import LocalConnection, UnixServer


class InProcessClient(AsyncClient):
    """``AsyncClient`` over a :class:`LocalConnection` of ``server``."""

    def __init__(self, server: UnixServer, *, peer: tuple[int, int] | None = None) -> None:
        super().__init__(server.path, cancel_abandoned=False)  # as the socket's gateway
        self._server = server
        self._peer = peer
        self._local: LocalConnection | None = None

    async def connect(self) -> None:
        self._connection()

    def _connection(self) -> LocalConnection:
        if self._local is None or self._local.closed:
            uid, gid = self._peer if self._peer is not None else (None, None)
            self._local = self._server.local_connection(uid, gid)
        return self._local

    async def request(self, op: str, args: Mapping[str, Any]) -> Any:
        response = await self._connection().request(op, args)
        return response.unwrap()

    async def close(self) -> None:
        local, self._local = self._local, None
        if local is not None:
            local.close()

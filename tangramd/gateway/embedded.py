"""``tangramd up --http HOST:PORT``: the HTTP gateway served by uvicorn on the daemon's own
event loop, through :class:`~tangramd.gateway.local.InProcessClient`.

The listening socket is bound before the daemon starts (an address in use is a clear
error and nothing else has happened yet); uvicorn's own signal handling is off (the
daemon's SIGTERM/SIGINT handlers stop it: the gateway finishes its requests for up to
``GRACE_S``, then the daemon stops).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Iterator, Sequence
from typing import Any

import structlog
import uvicorn

from tangram.client import AsyncClient
from tangramd.config import HttpConfig
from tangramd.gateway.app import build_app
from tangramd.gateway.conns import uvicorn_limits
from tangramd.gateway.local import InProcessClient
from tangramd.transport import SOCKET_MODE, UnixServer, check_socket_free

log = structlog.get_logger("tangramd.gateway")

GRACE_S = 5.0


def bind_unix(path: str) -> socket.socket:
    """A listening Unix socket at ``path``, mode 0660 as the daemon's own (a stale socket
    file is replaced; raise OSError if a server answers there or it is not a socket)."""
    check_socket_free(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, SOCKET_MODE)  # before listen(): nobody could connect yet
        sock.listen(2048)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 when the host is an IPv6 address);
    raise OSError (address in use, not available)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the daemon owns SIGTERM and SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class EmbeddedGateway:
    """The gateway app on ``sock``, in this process, for the daemon whose server is
    ``server``."""

    def __init__(
        self,
        server: UnixServer,
        sock: socket.socket | None,
        *,
        unix_sock: socket.socket | None = None,
        api_key: str | None,
        cpus: int,
        peer: tuple[int, int] | None = None,
        limits: HttpConfig | None = None,
        keys: Sequence[tuple[str, tuple[int, int] | None]] = (),
    ) -> None:
        """``peer``: the (uid, gid) HTTP callers count as (None: the daemon's own);
        ``limits``: the config's ``[http]``; ``keys``: ``[http] keys``, each key with the
        (uid, gid) its requests count as (None: ``peer``); ``unix_sock``: a Unix socket
        (``--http-unix``) whose peers pass ``daemon.allowed_uids`` as on the daemon's
        socket and are each served as their own uid, without an API key."""
        self.sock = sock
        self.unix_sock = unix_sock
        self.unix_path = unix_sock.getsockname() if unix_sock is not None else ""
        self.sockets = [s for s in (sock, unix_sock) if s is not None]
        self.client = InProcessClient(server, peer=peer)
        limits = limits or HttpConfig()
        own: list[tuple[str, AsyncClient | None]] = [
            (key, None if user is None else InProcessClient(server, peer=user))
            for key, user in keys
        ]
        app = build_app(
            client=self.client,
            api_key=api_key,
            keys=own,
            peer_client=lambda uid, gid: InProcessClient(server, peer=(uid, gid)),
            cpus=cpus,
            max_body=limits.max_body,
            max_run_timeout_s=limits.max_run_timeout_s,
        )
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            **uvicorn_limits(limits, server.peer_refusal),
            timeout_graceful_shutdown=int(GRACE_S),
            lifespan="on",
        )
        self._uvicorn = _Server(config)
        self._task: asyncio.Task[Any] | None = None

    @property
    def address(self) -> str:
        where = []
        if self.sock is not None:
            host, port = self.sock.getsockname()[:2]
            where.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        if self.unix_sock is not None:
            where.append(f"unix:{self.unix_sock.getsockname()}")
        return " ".join(where)

    async def start(self) -> None:
        """Serve; return once uvicorn listens (raise if it failed to start)."""
        self._task = asyncio.get_running_loop().create_task(self._serve())
        while not self._uvicorn.started:
            if self._task.done():
                self._task.result()  # its exception
                raise RuntimeError("the HTTP gateway stopped during start-up")
            await asyncio.sleep(0.01)
        log.info("gateway_listening", address=self.address, in_process=True)

    async def _serve(self) -> None:
        try:
            await self._uvicorn.serve(sockets=self.sockets)
        except SystemExit as exc:  # uvicorn exits on a start-up failure: not the daemon
            why = f"the HTTP gateway failed to start (uvicorn exit {exc.code})"
            raise RuntimeError(why) from None

    async def stop(self) -> None:
        """Stop accepting, finish open requests (up to ``GRACE_S``), close the client."""
        self._uvicorn.should_exit = True
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._task), GRACE_S + 2.0)
        await self.client.close()
        for sock in self.sockets:
            sock.close()
        if self.unix_sock is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.unix_path)

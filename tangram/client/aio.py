"""``AsyncClient``: the asyncio client; any number of concurrent calls pipelined over one
connection, answers matched to waiting futures by request id."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from typing import Any, TypeVar, cast

from tangram.client.ops import Env, Ops, Size
from tangram.protocol import (
    DEFAULT_MAX_FRAME,
    ConnectionFailed,
    FrameDecoder,
    FrameError,
    MalformedResponse,
    NotFound,
    Response,
    default_socket_path,
    encode,
    make_request,
    parse_response,
)

T = TypeVar("T")


class _ClientProtocol(asyncio.Protocol):
    """One connection of an AsyncClient: answers are matched to waiting futures by id."""

    def __init__(self, max_frame: int) -> None:
        self.decoder = FrameDecoder(max_frame)
        self.pending: dict[int, asyncio.Future[Response]] = {}
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self._drained: asyncio.Event | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream transport; not always an asyncio.Transport subclass (uvloop's is not)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.decoder.feed(data)
            while (msg := self.decoder.next_message()) is not None:
                response = parse_response(msg)
                if response.id is None:
                    self._fail_all(response.error or MalformedResponse("answer without an id"))
                    continue
                future = self.pending.pop(response.id, None)
                if future is not None and not future.done():
                    future.set_result(response)
        except (FrameError, MalformedResponse) as exc:
            self._fail_all(MalformedResponse(f"bad answer from tangramd: {exc}"))
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._drained is not None:
            self._drained.set()
        self._fail_all(ConnectionFailed(f"connection to tangramd lost: {exc or 'closed'}"))

    def pause_writing(self) -> None:
        self._drained = asyncio.Event()

    def resume_writing(self) -> None:
        if self._drained is not None:
            self._drained.set()
            self._drained = None

    async def drain(self) -> None:
        if self._drained is not None:
            await self._drained.wait()

    def _fail_all(self, exc: BaseException) -> None:
        pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(exc)


class AsyncClient(Ops):
    """asyncio client: any number of concurrent calls pipelined over one connection.

    Cancelling the coroutine of an ``exec`` or a ``call`` cancels its action (``cancel``
    by its ``ref``): withdrawn if it waits, killed (an exec) or its forward pass stopped (a
    call) if it runs; ``cancel_abandoned=False`` leaves it running instead."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        connect_timeout_s: float = 5.0,
        max_frame: int = DEFAULT_MAX_FRAME,
        cancel_abandoned: bool = True,
        job: str | None = None,
    ) -> None:
        self.path = os.fspath(path) if path is not None else default_socket_path()
        self.job = job or os.environ.get("TANGRAM_JOB") or None  # the actions' job
        # an exec or call whose awaiting coroutine is cancelled is cancelled too
        # (``_cancellable``); False: it runs on, as a disconnected client's running exec
        # does (the HTTP gateway's rule)
        self.cancel_abandoned = cancel_abandoned
        self.connect_timeout_s = connect_timeout_s
        self.max_frame = max_frame
        self._protocol: _ClientProtocol | None = None
        self._connecting: asyncio.Lock | None = None
        self._ids = itertools.count(1)
        self._refs = itertools.count(1)  # exec and call refs, unique on each connection

    async def connect(self) -> None:
        """Connect now (calls connect lazily anyway); raise ConnectionFailed."""
        await self._connected()

    async def _connected(self) -> _ClientProtocol:
        protocol = self._protocol
        if protocol is not None and not protocol.lost:
            return protocol
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            protocol = self._protocol
            if protocol is not None and not protocol.lost:
                return protocol
            loop = asyncio.get_running_loop()
            try:
                _, fresh = await asyncio.wait_for(
                    loop.create_unix_connection(lambda: _ClientProtocol(self.max_frame), self.path),
                    self.connect_timeout_s,
                )
            except (OSError, TimeoutError) as exc:
                raise ConnectionFailed(f"cannot connect to tangramd at {self.path}: {exc}") from exc
            self._protocol = fresh
            return fresh

    async def _reconnected(self) -> tuple[_ClientProtocol, asyncio.Transport]:
        """A new connection in place of one that is closing (nothing was sent on it)."""
        self._protocol = None
        protocol = await self._connected()
        assert protocol.transport is not None
        return protocol, protocol.transport

    async def close(self) -> None:
        """Close the connection; calls still waiting fail with ConnectionFailed."""
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()
            await asyncio.sleep(0)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def request(self, op: str, args: Mapping[str, Any]) -> Any:
        """Send one request and await its result; raise the typed error it failed with."""
        request_id = next(self._ids)
        frame = encode(make_request(request_id, op, args), max_frame=self.max_frame)
        protocol = await self._connected()
        transport = protocol.transport
        if transport is None or transport.is_closing():
            # Closed between connecting and writing: nothing was sent, reconnect once.
            protocol, transport = await self._reconnected()
        future: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        protocol.pending[request_id] = future
        try:
            transport.write(frame)
            if transport.is_closing():
                # The write failed at once: the daemon had shut this connection (an idle
                # close) and never read the request. Resend it on a new connection, once
                # (the future leaves the old connection before it can fail it).
                protocol.pending.pop(request_id, None)
                protocol, transport = await self._reconnected()
                protocol.pending[request_id] = future
                transport.write(frame)
            await protocol.drain()
            response = await future
        finally:
            protocol.pending.pop(request_id, None)
        return response.unwrap()

    # -- the op methods (declared once, in tangram.client.ops): each returns a coroutine

    def _op(  # type: ignore[override]  # the async client's ops return coroutines
        self, op: str, args: Mapping[str, Any], parse: Callable[[Any], T]
    ) -> Coroutine[Any, Any, T]:
        if op in ("exec", "call") and self.cancel_abandoned:
            return self._cancellable(op, args, parse)
        return self._parsed(op, args, parse)

    async def _cancellable(self, op: str, args: Mapping[str, Any], parse: Callable[[Any], T]) -> T:
        """An exec or call that a cancelled caller takes back: the coroutine carries a
        ``ref`` (unless the caller named one) and, when it is cancelled while the daemon
        has the request, sends ``cancel`` with that ref on the same connection (not
        awaited: the caller is leaving). The action never runs if it still waits; a
        running exec is killed, a running call's forward pass stopped."""
        ref = args.get("ref")
        if ref is None:
            ref = f"aio-{next(self._refs)}"
            args = {**args, "ref": ref}
        try:
            return parse(await self.request(op, args))
        except asyncio.CancelledError:
            self._send_cancel(ref)
            raise

    def _send_cancel(self, ref: str) -> None:
        protocol = self._protocol
        if protocol is None or protocol.lost or protocol.transport is None:
            return  # the connection is gone: its waiting actions are withdrawn anyway
        if protocol.transport.is_closing():
            return
        request = make_request(next(self._ids), "cancel", {"ref": ref})
        protocol.transport.write(encode(request, max_frame=self.max_frame))

    async def _parsed(self, op: str, args: Mapping[str, Any], parse: Callable[[Any], T]) -> T:
        return parse(await self.request(op, args))

    @contextlib.asynccontextmanager
    async def env(
        self,
        image: str | None = None,
        mem: Size | None = None,
        trajectory: str | None = None,
        *,
        timeout_s: float | None = None,
    ) -> AsyncIterator[Env]:
        """An environment open for the ``async with`` block, closed after it (``timeout_s``
        bounds the open's wait for memory, as for ``env_open``)."""
        ops: Any = self  # the shared op methods return coroutines here (see _op)
        opened = await ops.env_open(
            image=image, mem=mem, trajectory=trajectory, timeout_s=timeout_s
        )
        handle = Env(self, opened)
        try:
            yield handle
        finally:
            with contextlib.suppress(NotFound, ConnectionFailed):
                await ops.env_close(handle.id)

    @contextlib.asynccontextmanager
    async def lease(
        self,
        api: str,
        ttl_s: float | None = None,
        policy: str | None = None,
        deadline_s: float | None = None,
        *,
        job: str | None = None,
    ) -> AsyncIterator[str]:
        """A lease held for the ``async with`` block (an expired lease is fine on exit)."""
        ops: Any = self  # the shared op methods return coroutines here (see _op)
        lease_id: str = await ops.acquire_lease(
            api, ttl_s=ttl_s, policy=policy, deadline_s=deadline_s, job=job
        )
        try:
            yield lease_id
        finally:
            with contextlib.suppress(NotFound, ConnectionFailed):
                await ops.release_lease(lease_id)

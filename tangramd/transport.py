"""Unix-socket transport of the daemon (docs/design.md §6): frames in, handler calls, frames out.

One :class:`asyncio.Protocol` per connection (cheaper than streams on the hot path):

- every request runs in its own task, so requests pipeline and answers may leave out of
  order; ``transport.write`` runs on the loop thread, so writes never interleave;
- at most ``max_inflight_per_conn`` requests run per connection: past that, reading pauses;
- a slow reader fills the transport's write buffer past ``WRITE_HIGH_WATER``: reading
  pauses and finished handlers wait before writing, so memory stays bounded;
- a bad frame is answered (with the request id when it could be read, else ``null``) and
  the connection is closed;
- a client that disconnects does not cancel its handler tasks (an exec keeps its cores
  until it ends, a lease lives until its TTL): :class:`ConnInfo` exposes ``closed`` and
  ``on_close`` so the daemon decides;
- a connection with nothing in flight and no frame for ``idle_timeout_s`` is closed: its
  reading is shut first, so a request written after that fails to send (the client knows
  to resend it) and one written before is still read and answered;
- a frame must arrive whole within ``frame_timeout_s`` of its first byte, else the
  connection is closed (a slow sender cannot hold a connection open byte by byte);
- at most ``max_connections`` connections are served (past it a new one is answered
  ``bad_request`` and closed), and the bytes of unfinished frames buffered across all
  connections stay under ``max_buffered_bytes``: past it the connections holding the most
  are closed, so small well-behaved requests keep being served;
- peers are checked at accept with ``SO_PEERCRED``: with an allowlist (``allowed_uids``,
  ``allowed_gids``; supplementary groups count) any other peer is answered and closed.
  Root and the daemon's own user are always allowed.

The transport knows nothing about ops: the handler dispatches (and validates) them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import itertools
import os
import select
import socket
import stat
import struct
import termios
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, cast

import structlog

from tangram.model import TangramError
from tangram.protocol import (
    DEFAULT_MAX_FRAME,
    BadRequest,
    FrameDecoder,
    FrameError,
    InternalError,
    Response,
    ShuttingDown,
    decode_body,
    encode,
    error_response,
    make_request,
    ok_response,
    parse_request,
    parse_response,
)

log = structlog.get_logger(__name__)

SOCKET_MODE = 0o660
DIR_MODE = 0o750
WRITE_HIGH_WATER = 1 << 20  # bytes queued to a slow reader before we stop producing
WRITE_LOW_WATER = 1 << 18
READ_CHUNK = 1 << 16

_PEERCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}
DEFAULT_FRAME_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_MAX_BUFFERED = 256 << 20


@dataclass(eq=False)
class ConnInfo:
    """What a handler knows about the connection a request came on."""

    id: int
    pid: int | None = None  # peer credentials (SO_PEERCRED), None where unavailable
    uid: int | None = None
    gid: int | None = None
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    _callbacks: list[Callable[[ConnInfo], object]] = field(default_factory=list, repr=False)

    @property
    def peer(self) -> tuple[int, int] | None:
        """(uid, gid) of the connecting process (SO_PEERCRED), None where unknown.

        What an exec runs as under ``cpu.exec_user = "peer"`` (``ExecRequest.run_as``) and
        who owns an environment it opens (``create_env(owner=...)``)."""
        if self.uid is None or self.gid is None:
            return None
        return (self.uid, self.gid)

    def on_close(self, callback: Callable[[ConnInfo], object]) -> None:
        """Call ``callback(conn)`` once when the connection closes (now, if it already has).

        Callbacks run on the loop thread and must not block; an exception is logged.
        """
        if self.closed.is_set():
            _run_callback(callback, self)
        else:
            self._callbacks.append(callback)

    def _fire(self) -> None:
        self.closed.set()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            _run_callback(callback, self)


def _shut_reading(transport: asyncio.BaseTransport) -> bool:
    """``shutdown(SHUT_RD)`` the connection's socket; whether bytes it had received before
    wait unread (a request the loop has not read yet)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    fd = sock.fileno()  # (uvloop's transport socket offers no shutdown: a plain one on its fd)
    raw = socket.socket(fileno=fd)
    try:
        raw.shutdown(socket.SHUT_RD)
        (unread,) = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))
        return bool(unread > 0)
    except OSError:
        return False
    finally:
        raw.detach()


def _peer_gone(transport: asyncio.BaseTransport | None) -> bool:
    """Whether the peer of a Unix socket that sent EOF closed both ways (POLLHUP), not
    only its write side (``shutdown(SHUT_WR)``, still reading its answers)."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return False
    try:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLHUP)
        return any(mask & select.POLLHUP for _, mask in poller.poll(0))
    except (OSError, ValueError):
        return False


def _run_callback(callback: Callable[[ConnInfo], object], conn: ConnInfo) -> None:
    try:
        callback(conn)
    except Exception:
        log.exception("conn_close_callback_failed", conn=conn.id)


NOT_SYNC: Final = object()  # a sync handler's answer for "use the async handler"


class Later:
    """A sync handler's answer that comes later, without a task: whoever holds it calls
    ``resolve`` or ``fail`` once, on the loop thread (the exec fast path: the core's reply
    is written at the end of the turn that produces it; see ``UnixServer._deferred``)."""

    __slots__ = ("_callback", "_done", "error", "result")

    def __init__(self) -> None:
        self._done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self._callback: Callable[[Later], object] | None = None

    def resolve(self, result: Any) -> None:
        self._finish(result, None)

    def fail(self, error: BaseException) -> None:
        self._finish(None, error)

    def done(self) -> bool:
        return self._done

    set_exception = fail  # (as a Future's, for code that fails what is owed at shutdown)

    def _finish(self, result: Any, error: BaseException | None) -> None:
        if self._done:
            return
        self._done, self.result, self.error = True, result, error
        callback, self._callback = self._callback, None
        if callback is not None:
            callback(self)

    def then(self, callback: Callable[[Later], object]) -> None:
        """Call ``callback(self)`` once it is answered (now, if it is)."""
        if self._done:
            callback(self)
        else:
            self._callback = callback


SyncHandler = Callable[[str, dict[str, Any], "ConnInfo"], Any]
"""``sync_handler(op, args, conn)``: the result of a cheap op, a :class:`Later`, or
``NOT_SYNC``."""


class Handler(Protocol):
    """``async def handle(op, args, conn) -> result``; raise a TangramError for typed errors."""

    def __call__(self, op: str, args: dict[str, Any], conn: ConnInfo) -> Awaitable[Any]: ...


class _Connection(asyncio.Protocol):
    """One client connection: decode, dispatch, answer."""

    def __init__(self, server: UnixServer, conn_id: int) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self.info = ConnInfo(conn_id)
        self._decoder = FrameDecoder(server.max_frame)
        self._transport: asyncio.Transport | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._laters: set[Later] = set()  # answers owed by sync handlers
        self._closing = False
        self._read_paused = False
        self._write_paused = False
        self._can_write: asyncio.Event | None = None
        self._last_activity = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._frame_timer: asyncio.TimerHandle | None = None
        self.buffered = 0  # bytes of an unfinished frame held by the decoder

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream transport; not an asyncio.Transport subclass under uvloop
        transport = cast(asyncio.Transport, transport)
        self._transport = transport
        transport.set_write_buffer_limits(WRITE_HIGH_WATER, WRITE_LOW_WATER)
        sock = transport.get_extra_info("socket")
        if sock is not None and hasattr(socket, "SO_PEERCRED"):
            with contextlib.suppress(OSError):
                raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
                self.info.pid, self.info.uid, self.info.gid = _PEERCRED.unpack(raw)
        server = self._server
        server._connections.add(self)
        refusal = server._refusal(self.info)
        if refusal:
            log.warning(
                "conn_refused", conn=self.info.id, reason=refusal, uid=self.info.uid,
                gid=self.info.gid, pid=self.info.pid,
            )  # fmt: skip
            self._abort_with(None, BadRequest(refusal))
            return
        self._last_activity = self._loop.time()
        self._arm_idle_timer(server.idle_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        self._last_activity = self._loop.time()
        decoder = self._decoder
        try:
            decoder.feed(data)
            completed = False
            while (msg := decoder.next_message()) is not None:
                completed = True
                self._dispatch(msg)
                if self._closing:
                    return
        except FrameError as exc:
            log.warning("bad_frame", conn=self.info.id, error=exc.message)
            self._abort_with(exc.request_id, exc)
            return
        self._track_partial(decoder.buffered, restart=completed)

    # -- unfinished frames: a deadline each, and a budget across connections

    def _track_partial(self, buffered: int, *, restart: bool) -> None:
        server = self._server
        server._buffered += buffered - self.buffered
        self.buffered = buffered
        if not buffered or self._read_paused:  # paused: we are the ones not reading
            self._cancel_frame_timer()
        elif restart or self._frame_timer is None:
            # A new frame began (its first byte is in this chunk): its deadline starts now.
            self._cancel_frame_timer()
            self._frame_timer = self._loop.call_later(server.frame_timeout_s, self._frame_timed_out)
        if server._buffered > server.max_buffered_bytes:
            server._shed_buffered()

    def _cancel_frame_timer(self) -> None:
        if self._frame_timer is not None:
            self._frame_timer.cancel()
            self._frame_timer = None

    def _frame_timed_out(self) -> None:
        self._frame_timer = None
        if self._closing or not self.buffered:
            return
        log.info("conn_frame_timeout", conn=self.info.id, buffered=self.buffered)
        self._abort_with(
            None,
            BadRequest(f"frame not received whole within {self._server.frame_timeout_s:g} s"),
        )

    def _release_buffer(self) -> None:
        self._server._buffered -= self.buffered
        self.buffered = 0
        self._cancel_frame_timer()

    def eof_received(self) -> bool:
        # The client finished sending; keep the write side open so pending answers still
        # reach a half-closed peer, then close once nothing is in flight. A peer that closed
        # both ways (gave up waiting) is gone now: close, so ``on_close`` fires at once
        # and the daemon withdraws what it queued (not when its answer fails to write).
        if (not self._tasks and not self._laters) or _peer_gone(self._transport):
            return False
        self._closing = True
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._release_buffer()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self._can_write is not None:
            self._can_write.set()  # wake writers so they notice the close
        self._server._connections.discard(self)
        self.info._fire()

    def pause_writing(self) -> None:
        self._write_paused = True
        if self._can_write is None:
            self._can_write = asyncio.Event()
        self._can_write.clear()
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._can_write is not None:
            self._can_write.set()
        self._update_reading()

    # -- requests

    def _dispatch(self, msg: dict[str, Any]) -> None:
        try:
            request = parse_request(msg)
        except BadRequest as exc:
            if exc.request_id is None:
                # No id: the client cannot match any answer, the stream is unusable.
                self._abort_with(None, exc)
            else:
                self._write(error_response(exc.request_id, exc))
            return
        sync = self._server.sync_handler
        if sync is not None and not self._write_paused:
            # Cheap ops answer inline: no task, no extra loop iteration (about half the
            # round trip of a no-op op).
            answer = _inline(sync, request.id, request.op, request.args, self.info)
            if isinstance(answer, Later):
                self._laters.add(answer)
                answer.then(functools.partial(self._answer_later, request.id))
                if self._inflight() >= self._server.max_inflight_per_conn:
                    self._update_reading()
                return
            if answer is not None:
                self._write(answer)
                return
        task = self._loop.create_task(self._run(request.id, request.op, request.args))
        self._tasks.add(task)
        if self._inflight() >= self._server.max_inflight_per_conn:
            self._update_reading()

    def _inflight(self) -> int:
        return len(self._tasks) + len(self._laters)

    def _answer_later(self, request_id: int, later: Later) -> None:
        if later not in self._laters:
            return  # answered at shutdown already
        self._laters.discard(later)
        response = _later_response(request_id, later, self.info.id)
        if self._write_paused and self._can_write is not None and not self._closing:
            # a slow reader: wait for room as the task path does (memory stays bounded)
            task = self._loop.create_task(self._write_when_drained(response))
            self._tasks.add(task)
            return
        server = self._server
        if not server._closing:  # written at the end of this turn of the loop
            if not server._deferred:
                self._loop.call_soon(server._flush_deferred)
            server._deferred.append((self, response))
            return
        self._write(response)
        self._finished(None)

    async def _write_when_drained(self, response: dict[str, Any]) -> None:
        try:
            if self._can_write is not None and not self._closing:
                await self._can_write.wait()
            self._write(response)
        finally:
            self._finished(asyncio.current_task())

    def answer_laters(self, error: TangramError) -> None:
        """Answer every owed answer with ``error`` (the server is closing)."""
        for later in list(self._laters):
            later.fail(error)

    async def _run(self, request_id: int, op: str, args: dict[str, Any]) -> None:
        try:
            try:
                response = await _handled(self._server, request_id, op, args, self.info)
            except asyncio.CancelledError:
                # Only the server's own shutdown cancels handlers: tell the client why.
                self._write(error_response(request_id, ShuttingDown("daemon is shutting down")))
                raise
            if self._write_paused and self._can_write is not None and not self._closing:
                await self._can_write.wait()
            self._write(response)
        finally:
            self._finished(asyncio.current_task())

    def _finished(self, task: asyncio.Task[Any] | None) -> None:
        if task is not None:
            self._tasks.discard(task)
        if self._read_paused:
            self._update_reading()
        if self._closing and not self._inflight() and self._transport is not None:
            self._transport.close()  # a half-closed peer got all its answers

    def _write(self, response: dict[str, Any]) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return  # the client left; the answer has nowhere to go
        try:
            frame = encode(response, max_frame=self._server.max_frame)
        except (FrameError, TypeError, ValueError, OverflowError) as exc:
            log.error("response_unencodable", conn=self.info.id, error=str(exc))
            frame = encode(
                error_response(
                    response.get("id"), InternalError(f"response could not be encoded: {exc}")
                )
            )
        transport.write(frame)

    def _abort_with(self, request_id: int | None, exc: TangramError) -> None:
        """Answer a protocol violation, then close (buffered answers are flushed first)."""
        self._write(error_response(request_id, exc))
        self._closing = True
        self._release_buffer()
        self._decoder = FrameDecoder(self._server.max_frame)  # drop what it held
        if self._transport is not None:
            self._transport.close()

    def _update_reading(self) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        should_pause = self._write_paused or (
            self._inflight() >= self._server.max_inflight_per_conn
        )
        if should_pause and not self._read_paused:
            transport.pause_reading()
            self._read_paused = True
            self._cancel_frame_timer()  # we stopped reading: the sender is not slow
        elif not should_pause and self._read_paused:
            transport.resume_reading()
            self._read_paused = False
            if self.buffered:
                self._track_partial(self.buffered, restart=True)

    # -- idle timeout

    def _arm_idle_timer(self, delay: float) -> None:
        if self._server.idle_timeout_s > 0:
            self._idle_timer = self._loop.call_later(delay, self._check_idle)

    def _check_idle(self) -> None:
        self._idle_timer = None
        if self._closing or self._transport is None:
            return
        timeout = self._server.idle_timeout_s
        idle_for = self._loop.time() - self._last_activity
        if self._tasks or self._laters:
            self._arm_idle_timer(timeout)  # waiting on us is not idling
        elif idle_for >= timeout:
            # Stop reading first: a request the client writes from now on fails to send
            # (EPIPE), so the client knows it was never read and resends it on a new
            # connection. One that came in before is still read and answered (the loop
            # then sees the EOF and closes once nothing is in flight).
            if _shut_reading(self._transport):
                self._arm_idle_timer(timeout)
                return
            log.info("conn_idle_closed", conn=self.info.id, idle_s=round(idle_for, 3))
            self._closing = True
            self._transport.close()
        else:
            self._arm_idle_timer(timeout - idle_for)

    # -- shutdown

    def cancel_tasks(self) -> list[asyncio.Task[None]]:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        return tasks

    def close(self) -> None:
        self._closing = True
        if self._transport is not None:
            self._transport.close()


class UnixServer:
    """Serve ``handler`` on a Unix socket at ``path`` (created with mode 0660)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        handler: Handler | Callable[[str, dict[str, Any], ConnInfo], Awaitable[Any]],
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        idle_timeout_s: float = 300.0,
        max_inflight_per_conn: int = 1024,
        sync_handler: SyncHandler | None = None,
        frame_timeout_s: float = DEFAULT_FRAME_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED,
        allowed_uids: Iterable[int] = (),
        allowed_gids: Iterable[int] = (),
    ) -> None:
        if max_inflight_per_conn < 1:
            raise ValueError("max_inflight_per_conn must be at least 1")
        if frame_timeout_s <= 0 or max_connections < 1 or max_buffered_bytes < 1:
            raise ValueError("frame_timeout_s, max_connections, max_buffered_bytes must be > 0")
        self.frame_timeout_s = frame_timeout_s
        self.max_connections = max_connections
        self.max_buffered_bytes = max_buffered_bytes
        self.allowed_uids = frozenset(allowed_uids)
        self.allowed_gids = frozenset(allowed_gids)
        self._buffered = 0  # bytes of unfinished frames across connections
        self.path = os.fspath(path)
        self.handler = handler
        self.max_frame = max_frame
        self.idle_timeout_s = idle_timeout_s
        self.max_inflight_per_conn = max_inflight_per_conn
        self.sync_handler = sync_handler
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[_Connection] = set()
        # Answers owed (``Later``) and resolved in this turn of the loop, written at its end
        # (``_flush_deferred``): writing one wakes its client, and a woken client takes the
        # core the daemon runs on (a Unix socket wakes its reader as a sync wake-up), so the
        # rest of the turn (the spawn for the other core that freed, a lodger's report
        # read in the same poll) would wait for the client. What it gained under a flood
        # of short execs: docs/results.md, ``bench/load.py``.
        self._deferred: list[tuple[_Connection, dict[str, Any]]] = []
        self._closing = False
        self._locals: set[LocalConnection] = set()
        self._ids = itertools.count(1)
        self._inode: tuple[int, int] | None = None

    @property
    def connections(self) -> int:
        """Open client connections (in-process ones included)."""
        return len(self._connections) + len(self._locals)

    def local_connection(self, uid: int | None = None, gid: int | None = None) -> LocalConnection:
        """An in-process client of this server (see :class:`LocalConnection`), whose peer is
        ``uid``/``gid`` (default: the daemon's own, as a client process of its user would be)."""
        info = ConnInfo(
            next(self._ids),
            pid=os.getpid(),
            uid=os.geteuid() if uid is None else uid,
            gid=os.getegid() if gid is None else gid,
        )
        conn = LocalConnection(self, info)
        self._locals.add(conn)
        return conn

    @property
    def buffered_bytes(self) -> int:
        """Bytes of unfinished frames held across all connections."""
        return self._buffered

    def peer_refusal(self, pid: int, uid: int, gid: int) -> str:
        """Why a peer with these credentials is refused by ``daemon.allowed_uids`` /
        ``allowed_gids`` ('' if allowed): the rule of this socket's accept, for the HTTP
        gateway's Unix socket (``tangramd up --http-unix``)."""
        if not self.allowed_uids and not self.allowed_gids:
            return ""
        if uid in (0, os.geteuid()) or uid in self.allowed_uids:
            return ""
        if self.allowed_gids & peer_groups(ConnInfo(0, pid=pid, uid=uid, gid=gid)):
            return ""
        return f"uid {uid} is not allowed (daemon.allowed_uids / daemon.allowed_gids)"

    def _refusal(self, info: ConnInfo) -> str:
        """Why a new connection is refused ('' if it is served)."""
        if len(self._connections) > self.max_connections:
            return f"too many connections (daemon.max_connections = {self.max_connections})"
        if not self.allowed_uids and not self.allowed_gids:
            return ""
        if info.uid is None or info.uid in (0, os.geteuid()) or info.uid in self.allowed_uids:
            return ""  # None: no SO_PEERCRED on this platform, the socket mode guards
        if self.allowed_gids & peer_groups(info):
            return ""
        return f"uid {info.uid} is not allowed (daemon.allowed_uids / daemon.allowed_gids)"

    def _flush_deferred(self) -> None:
        """Write the answers resolved in this turn of the loop, in the order resolved."""
        deferred, self._deferred = self._deferred, []
        for conn, response in deferred:
            conn._write(response)
            conn._finished(None)

    def _shed_buffered(self) -> None:
        """Over the buffer budget: close the connections holding the most until under it."""
        holders = sorted(self._connections, key=lambda c: c.buffered, reverse=True)
        for conn in holders:
            if self._buffered <= self.max_buffered_bytes or not conn.buffered:
                break
            log.warning(
                "conn_buffer_shed", conn=conn.info.id, buffered=conn.buffered,
                total=self._buffered, limit=self.max_buffered_bytes,
            )  # fmt: skip
            conn._abort_with(None, BadRequest("daemon input buffer full: frame dropped"))

    async def start(self) -> None:
        """Bind, chmod 0660 and listen; a stale socket file is replaced, a live one is not."""
        loop = asyncio.get_running_loop()
        sock = _bind_unix(self.path)
        try:
            st = os.stat(self.path)
            self._inode = (st.st_dev, st.st_ino)
            self._server = await loop.create_unix_server(
                lambda: _Connection(self, next(self._ids)), sock=sock, backlog=1024
            )
        except BaseException:
            sock.close()
            self._remove_socket_file()
            raise
        log.info("transport_listening", path=self.path)

    async def close(self, *, grace_s: float = 0.0) -> None:
        """Stop accepting, remove the socket file, finish or cancel in-flight work, close.

        Handlers still running after ``grace_s`` seconds are cancelled; their clients get
        ``shutting_down``.
        """
        if self._server is not None:
            self._server.close()
        self._remove_socket_file()
        self._closing = True  # owed answers are written as they come from now on
        self._flush_deferred()
        tasks = [task for conn in self._connections for task in conn._tasks]
        if tasks and grace_s > 0:
            await asyncio.wait(tasks, timeout=grace_s)
        for conn in list(self._connections):
            conn.answer_laters(ShuttingDown("daemon is shutting down"))
        for local in list(self._locals):
            local.close()
        cancelled = [task for conn in list(self._connections) for task in conn.cancel_tasks()]
        if cancelled:
            await asyncio.gather(*cancelled, return_exceptions=True)
        for conn in list(self._connections):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        await asyncio.sleep(0)  # let connection_lost callbacks run

    async def __aenter__(self) -> UnixServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _remove_socket_file(self) -> None:
        """Unlink the socket file only if it is still ours (not a successor's)."""
        if self._inode is None:
            return
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._inode:
                os.unlink(self.path)
        self._inode = None


class LocalConnection:
    """A client of a :class:`UnixServer` in the daemon's own process (the in-process HTTP
    gateway of ``tangramd up --http``): each request takes the socket's path, the same
    frames both ways (encoded and decoded, so handlers see exactly the wire's types and the
    caller gets the wire's typed errors), the sync handler inline and else the handler as a
    task, without the socket and the hop between processes.

    As on the socket, a caller that stops waiting (its coroutine is cancelled) does not
    cancel its request: an exec keeps running and its cores stay allocated until it ends.
    ``close`` is the connection closing (``ConnInfo.on_close`` callbacks run); requests
    still owed then fail with ``shutting_down``."""

    def __init__(self, server: UnixServer, info: ConnInfo) -> None:
        self._server = server
        self.info = info
        self._ids = itertools.count(1)
        self._owed: set[asyncio.Future[dict[str, Any]]] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.closed = False

    async def request(self, op: str, args: Any) -> Response:
        """One request, its parsed response (``Response.unwrap`` raises its typed error)."""
        if self.closed:
            raise ShuttingDown("daemon is shutting down")
        server = self._server
        frame = encode(make_request(next(self._ids), op, args), max_frame=server.max_frame)
        try:
            request = parse_request(decode_body(memoryview(frame)[4:]))
        except BadRequest as exc:
            return parse_response(error_response(exc.request_id, exc))
        loop = asyncio.get_running_loop()
        owed: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._owed.add(owed)
        try:
            self._dispatch(request.id, request.op, request.args, owed, loop)
            # Not shielded: a caller cancelled here cancels only ``owed`` (its answer then
            # goes nowhere), never the handler's task or ``Later``. A shield would put a
            # second turn of the loop between the answer and the caller, behind whatever
            # the answering turn queued (the action's log line), measurably delaying the
            # caller's resumption (docs/notebook.md, the gateway in the daemon's process).
            response = await owed
        finally:
            self._owed.discard(owed)
        try:
            body = encode(response, max_frame=server.max_frame)
        except (FrameError, TypeError, ValueError, OverflowError) as exc:
            log.error("response_unencodable", conn=self.info.id, error=str(exc))
            error = InternalError(f"response could not be encoded: {exc}")
            body = encode(error_response(request.id, error))
        return parse_response(decode_body(memoryview(body)[4:]))

    def _dispatch(
        self,
        request_id: int,
        op: str,
        args: dict[str, Any],
        owed: asyncio.Future[dict[str, Any]],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        sync = self._server.sync_handler
        if sync is not None:
            answer = _inline(sync, request_id, op, args, self.info)
            if isinstance(answer, Later):
                answer.then(functools.partial(_settle_later, owed, request_id, self.info.id))
                return
            if answer is not None:
                _settle(owed, answer)
                return
        task = loop.create_task(self._run(request_id, op, args, owed))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(
        self, request_id: int, op: str, args: dict[str, Any], owed: asyncio.Future[dict[str, Any]]
    ) -> None:
        try:
            response = await _handled(self._server, request_id, op, args, self.info)
        except asyncio.CancelledError:
            _settle(owed, error_response(request_id, ShuttingDown("daemon is shutting down")))
            raise
        _settle(owed, response)

    def close(self) -> None:
        """The connection closes: owed answers fail with ``shutting_down``, its handler
        tasks are cancelled, ``on_close`` callbacks run (once)."""
        if self.closed:
            return
        self.closed = True
        self._server._locals.discard(self)
        for owed in list(self._owed):
            _settle(owed, error_response(None, ShuttingDown("daemon is shutting down")))
        for task in list(self._tasks):
            task.cancel()
        self.info._fire()


def _settle(owed: asyncio.Future[dict[str, Any]], response: dict[str, Any]) -> None:
    if not owed.done():
        owed.set_result(response)


def _settle_later(
    owed: asyncio.Future[dict[str, Any]], request_id: int, conn_id: int, later: Later
) -> None:
    _settle(owed, _later_response(request_id, later, conn_id))


# How a request is answered, for a socket connection and a LocalConnection alike: a typed
# error is the client's answer, any other exception is a bug, logged with its traceback
# and answered ``internal``.


def _inline(
    sync: SyncHandler, request_id: int, op: str, args: dict[str, Any], info: ConnInfo
) -> dict[str, Any] | Later | None:
    """The sync handler's answer: a response map, a :class:`Later`, or None (``NOT_SYNC``:
    the async handler answers)."""
    try:
        result = sync(op, args, info)
    except TangramError as exc:
        return error_response(request_id, exc)
    except Exception as exc:
        log.exception("handler_failed", conn=info.id, op=op)
        return error_response(request_id, exc)
    if result is NOT_SYNC:
        return None
    if isinstance(result, Later):
        return result
    return ok_response(request_id, result)


async def _handled(
    server: UnixServer, request_id: int, op: str, args: dict[str, Any], info: ConnInfo
) -> dict[str, Any]:
    """The async handler's answer as a response map (cancellation propagates)."""
    try:
        return ok_response(request_id, await server.handler(op, args, info))
    except TangramError as exc:
        return error_response(request_id, exc)
    except Exception as exc:
        log.exception("handler_failed", conn=info.id, op=op, request_id=request_id)
        return error_response(request_id, exc)


def _later_response(request_id: int, later: Later, conn_id: int) -> dict[str, Any]:
    """A resolved :class:`Later` as a response map."""
    error = later.error
    if error is None:
        return ok_response(request_id, later.result)
    if not isinstance(error, TangramError):
        log.error("handler_failed", conn=conn_id, request_id=request_id, error=str(error))
    return error_response(request_id, error)


def peer_groups(info: ConnInfo) -> frozenset[int]:
    """The peer's primary and supplementary groups (``/proc/<pid>/status``), as far as known."""
    groups = {info.gid} if info.gid is not None else set()
    if info.pid:
        with contextlib.suppress(OSError, ValueError), open(f"/proc/{info.pid}/status") as st:
            for line in st:
                if line.startswith("Groups:"):
                    groups.update(int(g) for g in line.split()[1:])
                    break
    return frozenset(groups)


def _bind_unix(path: str) -> socket.socket:
    """A bound (not yet listening) socket at ``path``, mode 0660 before anyone can connect."""
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, mode=DIR_MODE, exist_ok=True)
    _remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        # Connecting needs listen(), which has not happened yet: no window with a wider mode.
        os.chmod(path, SOCKET_MODE)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def check_socket_free(path: str) -> None:
    """Raise FileExistsError if a daemon serves ``path`` or it is not a socket (start-up)."""
    _remove_stale_socket(path)


def _remove_stale_socket(path: str) -> None:
    """Unlink ``path`` if it is a socket nobody listens on; refuse anything else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(errno.EEXIST, "not a socket, refusing to replace it", path)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        log.info("stale_socket_removed", path=path)
        return
    except OSError as exc:
        raise FileExistsError(errno.EADDRINUSE, f"socket in use ({exc})", path) from exc
    finally:
        probe.close()
    raise FileExistsError(errno.EADDRINUSE, "another daemon is listening on it", path)

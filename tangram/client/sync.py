"""``Client``: the blocking client of the daemon's Unix socket (one request at a time).

It connects lazily: the first call connects, and a call after the daemon dropped the
connection reconnects. A request is resent on a fresh connection only when writing it
failed outright (the daemon cannot have read it: it shuts an idle connection's reading
before closing it, so a request that races the idle close fails to send, and one that got
in is answered); a connection lost while waiting for the answer raises
``ConnectionFailed``, since the action may or may not have run.

Ctrl-C (``KeyboardInterrupt``) while an ``exec`` waits for its answer cancels its action
(``cancel`` by the exec's ``ref``, on the same connection) and raises
:class:`ExecInterrupted` once the action has ended: withdrawn if it waited, killed with
everything it started if it ran. The same for a ``call`` (a GPU service call), which
raises :class:`CallInterrupted`: withdrawn from the queue if it waited, its forward pass
stopped (the replica's workers killed) if it ran.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from tangram.client.ops import Env, Ops, Size
from tangram.model import TangramError
from tangram.protocol import (
    DEFAULT_MAX_FRAME,
    CallResult,
    ConnectionFailed,
    ExecResult,
    FrameDecoder,
    FrameError,
    MalformedResponse,
    NotFound,
    Response,
    Timeout,
    default_socket_path,
    encode,
    make_request,
    parse_response,
)

T = TypeVar("T")
_RECV_CHUNK = 1 << 16


class ExecInterrupted(KeyboardInterrupt):
    """Ctrl-C while a blocking ``exec`` waited: its action was cancelled and has ended.

    ``result`` is how it ended (outcome ``cancelled``, or its real outcome when it ended
    before the cancel reached it); None when that answer could not be read (a second
    Ctrl-C, the connection lost)."""

    def __init__(self, result: ExecResult | None) -> None:
        super().__init__("exec interrupted: its action was cancelled")
        self.result = result


class CallInterrupted(KeyboardInterrupt):
    """Ctrl-C while a blocking ``call`` waited: the call was cancelled and has ended (a
    sibling of :class:`ExecInterrupted`; catch ``KeyboardInterrupt`` for both).

    ``result`` is how it ended (outcome ``cancelled``, or its real outcome when it ended
    before the cancel reached it); None when that answer could not be read (a second
    Ctrl-C, the connection lost)."""

    def __init__(self, result: CallResult | None) -> None:
        super().__init__("call interrupted: the service call was cancelled")
        self.result = result


class Client(Ops):
    """Blocking client; one connection, one request at a time (thread-safe, serialized).

    ``timeout_s`` bounds the wait for each answer (None: wait as long as the action takes);
    when it passes, the connection is dropped and ``Timeout`` is raised.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        timeout_s: float | None = None,
        connect_timeout_s: float = 5.0,
        max_frame: int = DEFAULT_MAX_FRAME,
        job: str | None = None,
        cancel_interrupted: bool = True,
    ) -> None:
        self.path = os.fspath(path) if path is not None else default_socket_path()
        self.job = job or os.environ.get("TANGRAM_JOB") or None  # the actions' job
        # Ctrl-C during an exec or a call cancels its action (``_cancellable``); False: the
        # connection is dropped, so a waiting action is withdrawn and a running one runs on
        self.cancel_interrupted = cancel_interrupted
        self._refs = itertools.count(1)  # exec and call refs, unique on each connection
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_frame = max_frame
        self._sock: socket.socket | None = None
        self._decoder = FrameDecoder(max_frame)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    # -- connection

    def connect(self) -> None:
        """Connect now (calls connect lazily anyway); raise ConnectionFailed."""
        with self._lock:
            self._connect()

    def _connect(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.connect_timeout_s)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise ConnectionFailed(f"cannot connect to tangramd at {self.path}: {exc}") from exc
        sock.settimeout(self.timeout_s)
        self._sock = sock
        self._decoder = FrameDecoder(self.max_frame)
        return sock

    def _drop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def close(self) -> None:
        """Close the connection (a later call reconnects)."""
        with self._lock:
            self._drop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- requests

    def request(self, op: str, args: Mapping[str, Any]) -> Any:
        """Send one request and return its result; raise the typed error it failed with."""
        with self._lock:
            request_id = next(self._ids)
            frame = encode(make_request(request_id, op, args), max_frame=self.max_frame)
            try:
                self._send(frame)
                return self._receive(request_id, op).unwrap()
            except TangramError:
                raise  # typed: the connection is either fine or already dropped
            except BaseException:
                # Interrupted mid-request (KeyboardInterrupt, ...): the stream state is unknown.
                self._drop()
                raise

    def _send(self, frame: bytes) -> None:
        fresh = self._sock is None
        sock = self._connect()
        try:
            sock.sendall(frame)
            return
        except OSError as exc:
            self._drop()
            if fresh:
                raise ConnectionFailed(f"sending to tangramd failed: {exc}") from exc
        # The daemon closed an old connection (restart, idle timeout) before reading it.
        sock = self._connect()
        try:
            sock.sendall(frame)
        except OSError as exc:
            self._drop()
            raise ConnectionFailed(f"sending to tangramd failed: {exc}") from exc

    def _receive(self, request_id: int | set[int], op: str) -> Response:
        """The answer to ``request_id`` (or to any of a set of ids); others are skipped."""
        sock = self._sock
        assert sock is not None
        wanted = request_id if isinstance(request_id, set) else {request_id}
        while True:
            try:
                msg = self._decoder.next_message()
            except FrameError as exc:
                self._drop()
                raise MalformedResponse(f"bad frame from tangramd: {exc.message}") from None
            if msg is None:
                try:
                    data = sock.recv(_RECV_CHUNK)
                except TimeoutError:
                    self._drop()
                    raise Timeout(f"{op}: no answer within {self.timeout_s} s") from None
                except OSError as exc:
                    self._drop()
                    raise ConnectionFailed(f"{op}: connection to tangramd lost: {exc}") from exc
                if not data:
                    self._drop()
                    raise ConnectionFailed(f"{op}: tangramd closed the connection")
                self._decoder.feed(data)
                continue
            response = parse_response(msg)
            if response.id in wanted:
                return response
            if response.id is None:
                self._drop()  # a connection-level error: the daemon closes after it
                return response
            # An answer to an earlier, interrupted request: skip it.

    # -- the op methods (declared once, in tangram.client.ops)

    def _op(self, op: str, args: Mapping[str, Any], parse: Callable[[Any], T]) -> T:
        if op in ("exec", "call") and self.cancel_interrupted:
            return parse(self._cancellable(op, args))
        return parse(self.request(op, args))

    def _cancellable(self, op: str, args: Mapping[str, Any]) -> Any:
        """``request(op, args)`` for an ``exec`` or a ``call``, with a ``ref`` (unless the
        caller named one), so that a Ctrl-C while the daemon has it cancels the action
        (:meth:`_interrupted`)."""
        ref = args.get("ref")
        if ref is None:
            ref = f"sync-{next(self._refs)}"
            args = {**args, "ref": ref}
        with self._lock:
            request_id = next(self._ids)
            frame = encode(make_request(request_id, op, args), max_frame=self.max_frame)
            try:
                self._send(frame)
            except TangramError:
                raise
            except BaseException:
                self._drop()  # interrupted while sending: the stream state is unknown
                raise
            try:
                return self._receive(request_id, op).unwrap()
            except TangramError:
                raise
            except KeyboardInterrupt:
                raise self._interrupted(op, request_id, ref) from None
            except BaseException:
                self._drop()
                raise

    def _interrupted(self, op: str, request_id: int, ref: str) -> ExecInterrupted | CallInterrupted:
        """Ctrl-C while the exec or call ``request_id`` waited for its answer: send
        ``cancel`` by its ``ref`` on this connection and read both answers (the cancel's
        comes once a running exec is gone, or a running call's pass stopped). A second
        Ctrl-C, or a broken connection, stops the wait and drops the connection (a waiting
        action is withdrawn with it)."""
        result: Any = None
        try:
            cancel_id = next(self._ids)
            assert self._sock is not None
            self._sock.sendall(encode(make_request(cancel_id, "cancel", {"ref": ref})))
            waiting = {request_id, cancel_id}
            while waiting:
                response = self._receive(waiting, "cancel")
                if response.id is None:
                    break  # a connection-level error: the daemon closed it
                waiting.discard(response.id)
                if response.id == request_id and response.ok:
                    parse = CallResult.from_wire if op == "call" else ExecResult.from_wire
                    result = parse(response.result)
        except (TangramError, OSError, KeyboardInterrupt):
            self._drop()
        return CallInterrupted(result) if op == "call" else ExecInterrupted(result)

    @contextlib.contextmanager
    def env(
        self,
        image: str | None = None,
        mem: Size | None = None,
        trajectory: str | None = None,
        *,
        timeout_s: float | None = None,
    ) -> Iterator[Env]:
        """An environment open for the ``with`` block, closed after it (``timeout_s``
        bounds the open's wait for memory, as for ``env_open``)."""
        opened = self.env_open(image=image, mem=mem, trajectory=trajectory, timeout_s=timeout_s)
        handle = Env(self, opened)
        try:
            yield handle
        finally:
            with contextlib.suppress(NotFound, ConnectionFailed):
                self.env_close(handle.id)

    @contextlib.contextmanager
    def lease(
        self,
        api: str,
        ttl_s: float | None = None,
        policy: str | None = None,
        deadline_s: float | None = None,
        *,
        job: str | None = None,
    ) -> Iterator[str]:
        """A lease held for the ``with`` block (an expired lease is not an error on exit)."""
        lease_id = self.acquire_lease(
            api, ttl_s=ttl_s, policy=policy, deadline_s=deadline_s, job=job
        )
        try:
            yield lease_id
        finally:
            with contextlib.suppress(NotFound, ConnectionFailed):
                self.release_lease(lease_id)

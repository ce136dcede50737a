"""Clients of the daemon's Unix socket (design §6): ``Client`` (blocking) and ``AsyncClient``.

Both speak the framed msgpack protocol of :mod:`tangram.protocol`, turn error codes back
into the typed exceptions of :mod:`tangram.protocol.errors`, and connect lazily: the first
call connects, and a call after the daemon dropped the connection reconnects.

A request is resent on a fresh connection only when writing it failed outright (the daemon
cannot have read it); a connection lost while waiting for the answer raises
``ConnectionFailed``, since the action may or may not have run.

Outcomes of an ``exec`` (``failed``, ``timeout``, ``rejected``, ``infra_error``) are data in
:class:`ExecResult`, not exceptions: a rollout must tell a failed task from a broken cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import threading
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from tangram.model import TangramError
from tangram.protocol import (
    DEFAULT_MAX_FRAME,
    OUTCOMES,
    ConnectionFailed,
    FrameDecoder,
    FrameError,
    MalformedResponse,
    NotFound,
    Response,
    Timeout,
    encode,
    make_request,
    parse_response,
    parse_size,
)

SYSTEM_SOCKET = "/run/tangram/tangramd.sock"
SOCKET_ENV = "TANGRAM_SOCKET"
_RECV_CHUNK = 1 << 16

Outcome = Literal["ok", "failed", "timeout", "rejected", "infra_error"]
Cpus = int | tuple[int, int] | Sequence[int]
Size = int | str


def default_socket_path() -> str:
    """Where the daemon listens: ``$TANGRAM_SOCKET``, else ``/run/tangram/tangramd.sock``
    if it exists, else ``$XDG_RUNTIME_DIR/tangram/tangramd.sock``, else
    ``/tmp/tangram-$UID/tangramd.sock``."""
    from_env = os.environ.get(SOCKET_ENV)
    if from_env:
        return from_env
    if os.path.exists(SYSTEM_SOCKET):
        return SYSTEM_SOCKET
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir:
        return os.path.join(runtime_dir, "tangram", "tangramd.sock")
    return f"/tmp/tangram-{os.getuid()}/tangramd.sock"


# --------------------------------------------------------------------------- results


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, str):
        return value
    raise MalformedResponse(f"exec result: expected str, got {type(value).__name__}")


def _seconds(result: Mapping[str, Any], key: str) -> float:
    value = result.get(key, 0.0)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MalformedResponse(f"exec result: {key} must be a number")
    return float(value)


@dataclass(frozen=True, slots=True)
class ExecResult:
    """What happened to one exec action. Times in seconds; ``cores`` are host core ids."""

    action_id: str
    outcome: Outcome
    exit_code: int | None
    stdout: str
    stderr: str
    queue_s: float
    exec_s: float
    act_s: float
    cores: tuple[int, ...]
    truncated: bool

    @property
    def ok(self) -> bool:
        """The command ran and exited 0."""
        return self.outcome == "ok" and self.exit_code == 0

    @classmethod
    def from_wire(cls, result: Mapping[str, Any]) -> ExecResult:
        """Build from the ``exec`` result map; raise MalformedResponse if it is not one."""
        if not isinstance(result, Mapping):
            raise MalformedResponse(f"exec result must be a map, got {type(result).__name__}")
        outcome = result.get("outcome")
        if outcome not in OUTCOMES:
            raise MalformedResponse(f"exec result: unknown outcome {outcome!r}")
        exit_code = result.get("exit_code")
        if exit_code is not None and (
            isinstance(exit_code, bool) or not isinstance(exit_code, int)
        ):
            raise MalformedResponse("exec result: exit_code must be int or null")
        cores = result.get("cores") or ()
        if not isinstance(cores, list | tuple) or not all(
            isinstance(core, int) and not isinstance(core, bool) for core in cores
        ):
            raise MalformedResponse("exec result: cores must be a list of ints")
        return cls(
            action_id=str(result.get("action_id", "")),
            outcome=outcome,
            exit_code=exit_code,
            stdout=_text(result.get("stdout", "")),
            stderr=_text(result.get("stderr", "")),
            queue_s=_seconds(result, "queue_s"),
            exec_s=_seconds(result, "exec_s"),
            act_s=_seconds(result, "act_s"),
            cores=tuple(cores),
            truncated=bool(result.get("truncated", False)),
        )

    def to_wire(self) -> dict[str, Any]:
        """The result map (``cores`` as a list), e.g. for ``tangramctl exec --json``."""
        out = asdict(self)
        out["cores"] = list(self.cores)
        return out


# --------------------------------------------------------------------------- arg builders


def _drop_none(args: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in args.items() if value is not None}


def _dop_keys(table: Mapping[int | str, float] | None) -> dict[str, float] | None:
    """Profiles are keyed by dop; msgpack map keys must be str on this wire."""
    return None if table is None else {str(key): value for key, value in table.items()}


def _cpus(cpus: Cpus | None) -> int | list[int] | None:
    if cpus is None or isinstance(cpus, int):
        return cpus
    return list(cpus)


def _size(mem: Size | None) -> int | None:
    return None if mem is None else parse_size(mem)


def _exec_args(cmd: str | Sequence[str], **kw: Any) -> dict[str, Any]:
    args = dict(kw)
    args["cmd"] = cmd if isinstance(cmd, str) else list(cmd)
    args["cpus"] = _cpus(args.get("cpus"))
    args["mem"] = _size(args.get("mem"))
    args["eff"] = _dop_keys(args.get("eff"))
    if args.get("env_vars") is not None:
        args["env_vars"] = dict(args["env_vars"])
    return _drop_none(args)


def _profile_args(
    name: str,
    dop: Mapping[int | str, float],
    t1_s: float,
    eff: Mapping[int | str, float],
    speedup: Mapping[int | str, float],
    elastic: bool,
) -> dict[str, Any]:
    return {
        "name": name,
        "dop": _dop_keys(dop),
        "t1_s": t1_s,
        "eff": _dop_keys(eff),
        "speedup": _dop_keys(speedup),
        "elastic": elastic,
    }


def _lease_args(
    api: str, ttl_s: float | None, policy: str | None, deadline_s: float | None
) -> dict[str, Any]:
    return _drop_none({"api": api, "ttl_s": ttl_s, "policy": policy, "deadline_s": deadline_s})


def _env_id(result: Any) -> str:
    if not isinstance(result, Mapping) or not isinstance(result.get("id"), str):
        raise MalformedResponse("env.open result must be {'id': str}")
    return str(result["id"])


def _lease_id(result: Any) -> str:
    if not isinstance(result, Mapping) or not isinstance(result.get("lease_id"), str):
        raise MalformedResponse("lease.acquire result must contain a str 'lease_id'")
    return str(result["lease_id"])


def _items(result: Any, key: str) -> list[Any]:
    if not isinstance(result, Mapping) or not isinstance(result.get(key), list):
        raise MalformedResponse(f"result must contain a list {key!r}")
    return list(result[key])


# --------------------------------------------------------------------------- sync client


class Client:
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
    ) -> None:
        self.path = os.fspath(path) if path is not None else default_socket_path()
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

    def call(self, op: str, /, **args: Any) -> Any:
        """Send one request and return its result; raise the typed error it failed with."""
        return self.request(op, args)

    def request(self, op: str, args: Mapping[str, Any]) -> Any:
        """Like :meth:`call` with the args as a map (for arg names that are not identifiers)."""
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

    def _receive(self, request_id: int, op: str) -> Response:
        sock = self._sock
        assert sock is not None
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
            if response.id == request_id:
                return response
            if response.id is None:
                self._drop()  # a connection-level error: the daemon closes after it
                return response
            # An answer to an earlier, interrupted request: skip it.

    # -- typed ops

    def ping(self) -> dict[str, Any]:
        """``{"pong": True, "version": str}``."""
        return dict(self.call("ping"))

    def status(self) -> dict[str, Any]:
        """Daemon summary."""
        return dict(self.call("status"))

    def nodes(self) -> list[dict[str, Any]]:
        """Nodes with capacity and usage."""
        return _items(self.call("nodes"), "nodes")

    def queue(self) -> dict[str, Any]:
        """Waiting and running actions."""
        return dict(self.call("queue"))

    def story(self, action_id: str) -> dict[str, Any]:
        """The event log of one action."""
        return dict(self.call("story", action_id=action_id))

    def env_open(
        self, image: str | None = None, mem: Size | None = None, trajectory: str | None = None
    ) -> str:
        """Open an environment; return its id."""
        args = _drop_none({"image": image, "mem": _size(mem), "trajectory": trajectory})
        return _env_id(self.request("env.open", args))

    def env_close(self, id: str) -> None:
        """Close an environment."""
        self.call("env.close", id=id)

    def env_list(self) -> list[dict[str, Any]]:
        """Open environments."""
        return _items(self.call("env.list"), "envs")

    @contextlib.contextmanager
    def env(
        self, image: str | None = None, mem: Size | None = None, trajectory: str | None = None
    ) -> Iterator[Env]:
        """An environment open for the ``with`` block, closed after it."""
        handle = Env(self, self.env_open(image=image, mem=mem, trajectory=trajectory))
        try:
            yield handle
        finally:
            with contextlib.suppress(NotFound, ConnectionFailed):
                self.env_close(handle.id)

    def exec(
        self,
        cmd: str | Sequence[str],
        *,
        env: str | None = None,
        image: str | None = None,
        cpus: Cpus | None = 1,
        mem: Size | None = None,
        timeout_s: float | None = None,
        profile: str | None = None,
        elastic: bool | None = None,
        trajectory: str | None = None,
        task: str | None = None,
        t1_s: float | None = None,
        eff: Mapping[int | str, float] | None = None,
        env_vars: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """Run one command as an exec action; failures of the command are in the result."""
        args = _exec_args(
            cmd, env=env, image=image, cpus=cpus, mem=mem, timeout_s=timeout_s,
            profile=profile, elastic=elastic, trajectory=trajectory, task=task, t1_s=t1_s,
            eff=eff, env_vars=env_vars,
        )  # fmt: skip
        return ExecResult.from_wire(self.request("exec", args))

    def acquire_lease(
        self,
        api: str,
        ttl_s: float | None = None,
        policy: str | None = None,
        deadline_s: float | None = None,
    ) -> str:
        """Take one unit of an API quota; return the lease id."""
        return _lease_id(self.request("lease.acquire", _lease_args(api, ttl_s, policy, deadline_s)))

    def release_lease(self, lease_id: str) -> None:
        """Give a lease back."""
        self.call("lease.release", lease_id=lease_id)

    @contextlib.contextmanager
    def lease(
        self,
        api: str,
        ttl_s: float | None = None,
        policy: str | None = None,
        deadline_s: float | None = None,
    ) -> Iterator[str]:
        """A lease held for the ``with`` block (an expired lease is not an error on exit)."""
        lease_id = self.acquire_lease(api, ttl_s=ttl_s, policy=policy, deadline_s=deadline_s)
        try:
            yield lease_id
        finally:
            with contextlib.suppress(NotFound, ConnectionFailed):
                self.release_lease(lease_id)

    def api_list(self) -> list[dict[str, Any]]:
        """API endpoints with quotas."""
        return _items(self.call("api.list"), "apis")

    def profile_save(
        self,
        name: str,
        *,
        dop: Mapping[int | str, float],
        t1_s: float,
        eff: Mapping[int | str, float],
        speedup: Mapping[int | str, float],
        elastic: bool,
    ) -> None:
        """Store an elasticity profile."""
        self.request("profile.save", _profile_args(name, dop, t1_s, eff, speedup, elastic))

    def profile_get(self, name: str) -> dict[str, Any]:
        """One stored profile."""
        return dict(self.call("profile.get", name=name))

    def profile_list(self) -> list[dict[str, Any]]:
        """Stored profiles."""
        return _items(self.call("profile.list"), "profiles")

    def service_register(self, name: str, mem: Size, **config: Any) -> None:
        """Register a GPU service."""
        self.request("service.register", {**config, "name": name, "mem": _size(mem)})

    def service_list(self) -> list[dict[str, Any]]:
        """Registered services."""
        return _items(self.call("service.list"), "services")

    def service_remove(self, name: str) -> None:
        """Unregister a service."""
        self.call("service.remove", name=name)


@dataclass(frozen=True, slots=True)
class Env:
    """An open environment: ``exec`` runs in it."""

    client: Client
    id: str

    def exec(self, cmd: str | Sequence[str], **kw: Any) -> ExecResult:
        """``client.exec(cmd, env=self.id, **kw)``."""
        return self.client.exec(cmd, env=self.id, **kw)

    def close(self) -> None:
        """Close the environment."""
        self.client.env_close(self.id)


# --------------------------------------------------------------------------- async client


class _ClientProtocol(asyncio.Protocol):
    """One connection of an AsyncClient: answers are matched to waiting futures by id."""

    def __init__(self, max_frame: int) -> None:
        self.decoder = FrameDecoder(max_frame)
        self.pending: dict[int, asyncio.Future[Response]] = {}
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self._drained: asyncio.Event | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

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


class AsyncClient:
    """asyncio client: any number of concurrent calls pipelined over one connection."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        connect_timeout_s: float = 5.0,
        max_frame: int = DEFAULT_MAX_FRAME,
    ) -> None:
        self.path = os.fspath(path) if path is not None else default_socket_path()
        self.connect_timeout_s = connect_timeout_s
        self.max_frame = max_frame
        self._protocol: _ClientProtocol | None = None
        self._connecting: asyncio.Lock | None = None
        self._ids = itertools.count(1)

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

    async def call(self, op: str, /, **args: Any) -> Any:
        """Send one request and await its result; raise the typed error it failed with."""
        return await self.request(op, args)

    async def request(self, op: str, args: Mapping[str, Any]) -> Any:
        """Like :meth:`call` with the args as a map."""
        request_id = next(self._ids)
        frame = encode(make_request(request_id, op, args), max_frame=self.max_frame)
        protocol = await self._connected()
        transport = protocol.transport
        if transport is None or transport.is_closing():
            # Closed between connecting and writing: nothing was sent, reconnect once.
            self._protocol = None
            protocol = await self._connected()
            transport = protocol.transport
            assert transport is not None
        future: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        protocol.pending[request_id] = future
        try:
            transport.write(frame)
            await protocol.drain()
            response = await future
        finally:
            protocol.pending.pop(request_id, None)
        return response.unwrap()

    # -- typed ops

    async def ping(self) -> dict[str, Any]:
        """``{"pong": True, "version": str}``."""
        return dict(await self.call("ping"))

    async def status(self) -> dict[str, Any]:
        """Daemon summary."""
        return dict(await self.call("status"))

    async def nodes(self) -> list[dict[str, Any]]:
        """Nodes with capacity and usage."""
        return _items(await self.call("nodes"), "nodes")

    async def queue(self) -> dict[str, Any]:
        """Waiting and running actions."""
        return dict(await self.call("queue"))

    async def story(self, action_id: str) -> dict[str, Any]:
        """The event log of one action."""
        return dict(await self.call("story", action_id=action_id))

    async def env_open(
        self, image: str | None = None, mem: Size | None = None, trajectory: str | None = None
    ) -> str:
        """Open an environment; return its id."""
        args = _drop_none({"image": image, "mem": _size(mem), "trajectory": trajectory})
        return _env_id(await self.request("env.open", args))

    async def env_close(self, id: str) -> None:
        """Close an environment."""
        await self.call("env.close", id=id)

    async def env_list(self) -> list[dict[str, Any]]:
        """Open environments."""
        return _items(await self.call("env.list"), "envs")

    @contextlib.asynccontextmanager
    async def env(
        self, image: str | None = None, mem: Size | None = None, trajectory: str | None = None
    ) -> AsyncIterator[AsyncEnv]:
        """An environment open for the ``async with`` block, closed after it."""
        handle = AsyncEnv(self, await self.env_open(image=image, mem=mem, trajectory=trajectory))
        try:
            yield handle
        finally:
            with contextlib.suppress(NotFound, ConnectionFailed):
                await self.env_close(handle.id)

    async def exec(
        self,
        cmd: str | Sequence[str],
        *,
        env: str | None = None,
        image: str | None = None,
        cpus: Cpus | None = 1,
        mem: Size | None = None,
        timeout_s: float | None = None,
        profile: str | None = None,
        elastic: bool | None = None,
        trajectory: str | None = None,
        task: str | None = None,
        t1_s: float | None = None,
        eff: Mapping[int | str, float] | None = None,
        env_vars: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """Run one command as an exec action; failures of the command are in the result."""
        args = _exec_args(
            cmd, env=env, image=image, cpus=cpus, mem=mem, timeout_s=timeout_s,
            profile=profile, elastic=elastic, trajectory=trajectory, task=task, t1_s=t1_s,
            eff=eff, env_vars=env_vars,
        )  # fmt: skip
        return ExecResult.from_wire(await self.request("exec", args))

    async def acquire_lease(
        self,
        api: str,
        ttl_s: float | None = None,
        policy: str | None = None,
        deadline_s: float | None = None,
    ) -> str:
        """Take one unit of an API quota; return the lease id."""
        args = _lease_args(api, ttl_s, policy, deadline_s)
        return _lease_id(await self.request("lease.acquire", args))

    async def release_lease(self, lease_id: str) -> None:
        """Give a lease back."""
        await self.call("lease.release", lease_id=lease_id)

    @contextlib.asynccontextmanager
    async def lease(
        self,
        api: str,
        ttl_s: float | None = None,
        policy: str | None = None,
        deadline_s: float | None = None,
    ) -> AsyncIterator[str]:
        """A lease held for the ``async with`` block (an expired lease is fine on exit)."""
        lease_id = await self.acquire_lease(api, ttl_s=ttl_s, policy=policy, deadline_s=deadline_s)
        try:
            yield lease_id
        finally:
            with contextlib.suppress(NotFound, ConnectionFailed):
                await self.release_lease(lease_id)

    async def api_list(self) -> list[dict[str, Any]]:
        """API endpoints with quotas."""
        return _items(await self.call("api.list"), "apis")

    async def profile_save(
        self,
        name: str,
        *,
        dop: Mapping[int | str, float],
        t1_s: float,
        eff: Mapping[int | str, float],
        speedup: Mapping[int | str, float],
        elastic: bool,
    ) -> None:
        """Store an elasticity profile."""
        await self.request("profile.save", _profile_args(name, dop, t1_s, eff, speedup, elastic))

    async def profile_get(self, name: str) -> dict[str, Any]:
        """One stored profile."""
        return dict(await self.call("profile.get", name=name))

    async def profile_list(self) -> list[dict[str, Any]]:
        """Stored profiles."""
        return _items(await self.call("profile.list"), "profiles")

    async def service_register(self, name: str, mem: Size, **config: Any) -> None:
        """Register a GPU service."""
        await self.request("service.register", {**config, "name": name, "mem": _size(mem)})

    async def service_list(self) -> list[dict[str, Any]]:
        """Registered services."""
        return _items(await self.call("service.list"), "services")

    async def service_remove(self, name: str) -> None:
        """Unregister a service."""
        await self.call("service.remove", name=name)


@dataclass(frozen=True, slots=True)
class AsyncEnv:
    """An open environment of an AsyncClient."""

    client: AsyncClient
    id: str

    async def exec(self, cmd: str | Sequence[str], **kw: Any) -> ExecResult:
        """``await client.exec(cmd, env=self.id, **kw)``."""
        return await self.client.exec(cmd, env=self.id, **kw)

    async def close(self) -> None:
        """Close the environment."""
        await self.client.env_close(self.id)

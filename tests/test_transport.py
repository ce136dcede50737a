"""A real UnixServer on a temp socket, driven by raw sockets, Client and AsyncClient."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import stat
import struct
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import msgpack
import pytest

from tangram import (
    AsyncClient,
    BadRequest,
    Client,
    ConnectionFailed,
    ExecResult,
    InternalError,
    NotFound,
    ShuttingDown,
    UnknownOp,
)
from tangram.client import SYSTEM_SOCKET, default_socket_path
from tangram.protocol import FrameDecoder, encode, make_request
from tangram.testing import wait_for, wait_for_async
from tangramd.transport import ConnInfo, UnixServer

pytestmark = pytest.mark.timeout(30)

EXEC_RESULT = {
    "action_id": "a1", "outcome": "ok", "exit_code": 0, "stdout": "hi\n", "stderr": "",
    "queue_s": 0.01, "exec_s": 0.5, "act_s": 0.51, "cores": [2, 3], "truncated": False,
    "detail": "", "node": "local", "files": {},
}  # fmt: skip


class Daemon:
    """A toy handler recording what it saw."""

    def __init__(self) -> None:
        self.finished: list[int] = []
        self.started = asyncio.Event()
        self.conns: list[ConnInfo] = []

    async def __call__(self, op: str, args: dict[str, Any], conn: ConnInfo) -> Any:
        self.conns.append(conn)
        if op == "ping":
            return {"pong": True, "version": "test"}
        if op == "sleep":
            self.started.set()
            await asyncio.sleep(args["s"])
            self.finished.append(args.get("tag", 0))
            return {"slept": args["s"]}
        if op == "boom":
            raise ZeroDivisionError("division by zero")
        if op == "env.close":
            raise NotFound(f"environment {args['id']!r}")
        if op == "exec":
            return EXEC_RESULT
        if op == "big":
            return {"blob": b"x" * args["n"]}
        raise UnknownOp(f"unknown op {op!r}")


@contextlib.contextmanager
def short_tmpdir() -> Iterator[str]:
    """A directory short enough for AF_UNIX paths (108 bytes)."""
    path = tempfile.mkdtemp(prefix="tg-", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.asynccontextmanager
async def serving(handler: Any = None, **kw: Any) -> AsyncIterator[tuple[UnixServer, Daemon]]:
    daemon = Daemon()
    with short_tmpdir() as tmp:
        server = UnixServer(os.path.join(tmp, "d.sock"), handler or daemon, **kw)
        await server.start()
        try:
            yield server, daemon
        finally:
            await server.close()


def run_async_test(coro: Callable[[], Awaitable[None]]) -> None:
    """Run the async test body ``coro()`` on a fresh event loop, failing after 20 s."""
    asyncio.run(asyncio.wait_for(coro(), 20))


class Raw:
    """A bare stream connection that speaks frames, for protocol-level assertions."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = FrameDecoder()

    @classmethod
    async def open(cls, path: str) -> Raw:
        return cls(*await asyncio.open_unix_connection(path))

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def recv(self) -> dict[str, Any] | None:
        """The next message, or None at EOF."""
        while (msg := self.decoder.next_message()) is None:
            data = await self.reader.read(65536)
            if not data:
                return None
            self.decoder.feed(data)
        return msg

    def close(self) -> None:
        self.writer.close()


# --------------------------------------------------------------------------- pipelining


def test_pipelined_responses_out_of_order() -> None:
    """Requests on one connection run concurrently; faster ones are answered first."""

    async def main() -> None:
        async with serving() as (server, _):
            raw = await Raw.open(server.path)
            for request_id, seconds in ((1, 0.3), (2, 0.15), (3, 0.0)):
                raw.send(encode(make_request(request_id, "sleep", {"s": seconds})))
            order = [(await raw.recv() or {}).get("id") for _ in range(3)]
            assert order == [3, 2, 1]
            raw.close()

    run_async_test(main)


def test_async_client_pipelines_many_calls() -> None:
    """Many concurrent AsyncClient calls share one connection and get their own answers."""

    async def main() -> None:
        async with serving() as (server, daemon), AsyncClient(server.path) as client:
            delays = [0.01 * (i % 5) for i in range(50)]
            results = await asyncio.gather(*(client.request("sleep", {"s": s}) for s in delays))
            assert [r["slept"] for r in results] == delays
            assert len({id(c) for c in daemon.conns}) == 1
            assert server.connections == 1

    run_async_test(main)


# --------------------------------------------------------------------------- bad input


def test_malformed_frame_answered_and_closed_others_unaffected() -> None:
    """Garbage gets a bad_request with id null and a close; a good client keeps working."""

    async def main() -> None:
        async with serving() as (server, _), AsyncClient(server.path) as good:
            assert (await good.ping())["pong"] is True
            bad = await Raw.open(server.path)
            bad.send(struct.pack(">I", 1) + b"\xc1")
            answer = await bad.recv()
            assert answer is not None
            assert answer["id"] is None and answer["ok"] is False
            assert answer["error"]["code"] == "bad_request"
            assert await bad.recv() is None  # closed
            bad.close()
            assert (await good.ping())["pong"] is True

    run_async_test(main)


def test_bad_key_answered_with_its_id() -> None:
    """A frame whose id is readable is answered with that id before the close."""

    async def main() -> None:
        async with serving() as (server, _):
            raw = await Raw.open(server.path)
            body = msgpack.packb({"id": 41, "op": "ping", "args": {1: 1}})
            raw.send(struct.pack(">I", len(body)) + body)
            answer = await raw.recv()
            assert answer is not None and answer["id"] == 41
            assert answer["error"]["code"] == "bad_request"
            assert await raw.recv() is None
            raw.close()

    run_async_test(main)


def test_oversized_frame_rejected_and_closed() -> None:
    """A length prefix above max_frame is refused at once, without waiting for the body."""

    async def main() -> None:
        async with serving(max_frame=1024) as (server, _):
            raw = await Raw.open(server.path)
            raw.send(struct.pack(">I", 10_000_000))
            answer = await raw.recv()
            assert answer is not None and answer["error"]["code"] == "bad_request"
            assert "exceeds" in answer["error"]["message"]
            assert await raw.recv() is None
            raw.close()

    run_async_test(main)


def test_bad_envelope_with_id_keeps_connection() -> None:
    """A request with a valid id but a bad op is answered; the connection stays usable."""

    async def main() -> None:
        async with serving() as (server, _):
            raw = await Raw.open(server.path)
            raw.send(encode({"id": 5, "op": 7}))
            raw.send(encode(make_request(6, "ping")))
            first, second = await raw.recv(), await raw.recv()
            assert first is not None and first["id"] == 5
            assert first["error"]["code"] == "bad_request"
            assert second is not None and second["id"] == 6 and second["ok"] is True
            raw.close()

    run_async_test(main)


def test_response_too_large_becomes_internal() -> None:
    """A result larger than max_frame is answered with internal, not a broken frame."""

    async def main() -> None:
        async with (
            serving(max_frame=4096) as (server, _),
            AsyncClient(server.path) as client,
        ):
            with pytest.raises(InternalError, match="could not be encoded"):
                await client.request("big", {"n": 10_000})
            assert (await client.ping())["pong"]

    run_async_test(main)


# --------------------------------------------------------------------------- typed errors


def test_typed_errors_reach_async_client() -> None:
    """UnknownOp, NotFound and crashes (internal) come back as typed exceptions."""

    async def main() -> None:
        async with serving() as (server, _), AsyncClient(server.path) as client:
            with pytest.raises(UnknownOp, match="frob"):
                await client.request("frob", {})
            with pytest.raises(NotFound, match="e9"):
                await client.env_close("e9")
            with pytest.raises(InternalError, match="ZeroDivisionError"):
                await client.request("boom", {})
            assert (await client.ping())["pong"] is True  # the server survived

    run_async_test(main)


def test_sync_client_calls_and_errors() -> None:
    """The blocking Client gets results, typed errors and an ExecResult."""

    async def main() -> None:
        async with serving() as (server, _):

            def work() -> None:
                with Client(server.path) as client:
                    assert client.ping() == {"pong": True, "version": "test"}
                    with pytest.raises(UnknownOp):
                        client.request("nope", {})
                    with pytest.raises(InternalError):
                        client.request("boom", {})
                    result = client.exec(["echo", "hi"], cpus=(1, 2), mem="1G")
                    assert isinstance(result, ExecResult)
                    assert result.ok and result.cores == (2, 3) and result.stdout == "hi\n"
                    assert result.to_wire() == EXEC_RESULT

            await asyncio.to_thread(work)

    run_async_test(main)


def test_sync_client_reconnects_after_idle_close() -> None:
    """A Client whose connection the server closed reconnects on the next call."""

    async def main() -> None:
        async with serving(idle_timeout_s=0.1) as (server, _):

            def work() -> None:
                with Client(server.path) as client:
                    client.ping()
                    wait_for(lambda: server.connections == 0, 5, "the idle connection closed")
                    assert client.ping()["pong"] is True

            await asyncio.to_thread(work)

    run_async_test(main)


def test_async_client_reconnects_after_idle_close() -> None:
    """An AsyncClient reconnects lazily after the server dropped the connection."""

    async def main() -> None:
        async with (
            serving(idle_timeout_s=0.1) as (server, _),
            AsyncClient(server.path) as client,
        ):
            await client.ping()
            await wait_for_async(lambda: server.connections == 0, 5, "the idle connection closed")
            # and the client has read the close (a request written before it reads the EOF
            # fails ConnectionFailed: the client cannot know whether the server took it)
            lost = lambda: client._protocol is None or client._protocol.lost  # noqa: E731
            await wait_for_async(lost, 5, "the client saw the close")
            assert (await client.ping())["pong"] is True

    run_async_test(main)


def test_a_request_racing_the_idle_close_is_answered_or_resent() -> None:
    """Requests written just as the server closes the connection as idle (each client
    waits 0.9-1.1 x the idle timeout between pings) all get answered: the server shuts
    its reading before it decides, so a request that came in before is read and answered,
    and one written after fails to send, which the client resends on a new connection.
    (Before, about one in six of the AsyncClient's failed ConnectionFailed.)"""
    idle_s, rounds = 0.05, 100
    pauses = [idle_s * (0.9 + 0.2 * i / rounds) for i in range(rounds)]

    async def main() -> None:
        async with serving(idle_timeout_s=idle_s) as (server, _):
            async with AsyncClient(server.path) as client:
                for pause in pauses:
                    await asyncio.sleep(pause)
                    assert (await client.ping())["pong"] is True

            def work() -> None:
                with Client(server.path) as client:
                    for pause in pauses:
                        time.sleep(pause)
                        assert client.ping()["pong"] is True

            await asyncio.to_thread(work)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_no_daemon_is_connection_failed() -> None:
    """Connecting to a missing socket raises ConnectionFailed (an infra_error)."""
    with short_tmpdir() as tmp:
        with pytest.raises(ConnectionFailed) as info:
            Client(os.path.join(tmp, "none.sock")).ping()
        assert info.value.code == "infra_error"

        async def main() -> None:
            with pytest.raises(ConnectionFailed):
                await AsyncClient(os.path.join(tmp, "none.sock")).ping()

        run_async_test(main)


# --------------------------------------------------------------------------- lifecycle


def test_client_disconnect_mid_request() -> None:
    """A client leaving mid-request fires on_close; the handler is not cancelled."""

    async def main() -> None:
        async with serving() as (server, daemon):
            raw = await Raw.open(server.path)
            raw.send(encode(make_request(1, "sleep", {"s": 0.2, "tag": 77})))
            await daemon.started.wait()
            conn = daemon.conns[-1]
            closed: list[int] = []
            conn.on_close(lambda c: closed.append(c.id))
            raw.close()
            await asyncio.wait_for(conn.closed.wait(), 2)
            assert closed == [conn.id]
            await wait_for_async(lambda: daemon.finished == [77], 5, "the handler ran to its end")
            async with AsyncClient(server.path) as client:
                assert (await client.ping())["pong"] is True

    run_async_test(main)


def test_idle_connection_closed() -> None:
    """A connection without frames for idle_timeout_s is closed."""

    async def main() -> None:
        async with serving(idle_timeout_s=0.2) as (server, _):
            raw = await Raw.open(server.path)
            assert await asyncio.wait_for(raw.recv(), 3) is None
            assert server.connections == 0
            raw.close()

    run_async_test(main)


def test_in_flight_request_is_not_idle() -> None:
    """A connection waiting on a long request is not closed as idle."""

    async def main() -> None:
        async with (
            serving(idle_timeout_s=0.1) as (server, _),
            AsyncClient(server.path) as client,
        ):
            assert (await client.request("sleep", {"s": 0.4}))["slept"] == 0.4

    run_async_test(main)


def test_close_removes_socket_and_answers_in_flight() -> None:
    """close() removes the socket file and answers running requests with shutting_down."""

    async def main() -> None:
        async with serving() as (server, daemon):
            assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o660
            client = AsyncClient(server.path)
            call = asyncio.ensure_future(client.request("sleep", {"s": 10}))
            await daemon.started.wait()
            await server.close()
            assert not os.path.exists(server.path)
            with pytest.raises((ShuttingDown, ConnectionFailed)):
                await call
            await client.close()

    run_async_test(main)


def test_stale_socket_replaced_live_socket_refused() -> None:
    """A dead socket file is replaced; a live one (or a regular file) is left alone."""

    async def main() -> None:
        with short_tmpdir() as tmp:
            path = os.path.join(tmp, "d.sock")
            stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            stale.bind(path)
            stale.close()  # the file stays, nobody listens
            async with UnixServer(path, Daemon()) as server:
                with pytest.raises(FileExistsError):
                    await UnixServer(path, Daemon()).start()
                async with AsyncClient(path) as client:
                    assert (await client.ping())["pong"] is True
                assert server.connections >= 0
            assert not os.path.exists(path)
            with open(path, "w") as regular:
                regular.write("not a socket")
            with pytest.raises(FileExistsError):
                await UnixServer(path, Daemon()).start()
            assert os.path.exists(path)

    run_async_test(main)


def test_inflight_limit_pauses_reading() -> None:
    """Past max_inflight_per_conn the server stops reading but still answers everything."""

    async def main() -> None:
        async with (
            serving(max_inflight_per_conn=2) as (server, _),
            AsyncClient(server.path) as client,
        ):
            results = await asyncio.gather(
                *(client.request("sleep", {"s": 0.01}) for _ in range(20))
            )
            assert len(results) == 20

    run_async_test(main)


def test_default_socket_path_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """One rule for daemon and clients: TANGRAM_SOCKET; else the system socket as root (or
    when it exists); else the XDG runtime dir; else /tmp/tangram-UID."""
    monkeypatch.setenv("TANGRAM_SOCKET", "/x/y.sock")
    assert default_socket_path() == "/x/y.sock"
    monkeypatch.delenv("TANGRAM_SOCKET")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert default_socket_path() == "/run/tangram/tangramd.sock"
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    real_exists = os.path.exists
    for system_socket_exists in (True, False):
        monkeypatch.setattr(
            os.path,
            "exists",
            lambda p, e=system_socket_exists: e if p == SYSTEM_SOCKET else real_exists(p),
        )
        want = SYSTEM_SOCKET if system_socket_exists else "/run/user/1000/tangram/tangramd.sock"
        assert default_socket_path() == want
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_socket_path() == "/tmp/tangram-1000/tangramd.sock"


def test_daemon_listens_where_clients_look(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's default socket is the clients' default socket (one rule, one place)."""
    from tangramd.config import default_socket

    monkeypatch.delenv("TANGRAM_SOCKET", raising=False)
    for euid in (0, 1000):
        monkeypatch.setattr(os, "geteuid", lambda e=euid: e)
        assert default_socket() == default_socket_path()


def test_bad_request_from_handler() -> None:
    """A BadRequest raised by the handler reaches the client with its message."""

    async def handler(op: str, args: dict[str, Any], conn: ConnInfo) -> Any:
        raise BadRequest("exec: cpus: expected int >= 1, got 0")

    async def main() -> None:
        async with serving(handler) as (server, _), AsyncClient(server.path) as client:
            with pytest.raises(BadRequest, match="cpus"):
                await client.exec("true", cpus=0)

    run_async_test(main)


# --------------------------------------------------------------------------- issue 9 limits


def test_frame_deadline_closes_a_trickling_sender() -> None:
    """A frame not received whole within frame_timeout_s of its first byte closes the conn."""

    async def main() -> None:
        async with serving(frame_timeout_s=0.3, idle_timeout_s=5) as (server, _):
            raw = await Raw.open(server.path)
            payload = encode(make_request(1, "ping", {}))
            for byte in payload[:-1]:
                raw.send(bytes([byte]))
                await asyncio.sleep(0.05)
                if server.connections == 0:
                    break
            msg = await asyncio.wait_for(raw.recv(), 3)
            assert msg is not None and "not received whole" in msg["error"]["message"]
            assert await asyncio.wait_for(raw.recv(), 3) is None
            assert server.buffered_bytes == 0
            raw.close()

    run_async_test(main)


def test_frame_deadline_does_not_count_while_we_stopped_reading() -> None:
    """A half frame waiting behind a full in-flight queue is not the sender's slowness."""

    async def main() -> None:
        async with serving(frame_timeout_s=0.3, max_inflight_per_conn=1) as (server, _):
            raw = await Raw.open(server.path)
            second = encode(make_request(2, "ping", {}))
            raw.send(encode(make_request(1, "sleep", {"s": 1.0})) + second[:3])
            await asyncio.sleep(0.6)  # past the deadline, but we are the ones not reading
            raw.send(second[3:])
            answers = {(await raw.recv())["id"], (await raw.recv())["id"]}  # type: ignore[index]
            assert answers == {1, 2}
            raw.close()

    run_async_test(main)


def test_buffer_budget_sheds_the_largest_holder_and_serves_the_rest() -> None:
    """Past max_buffered_bytes the connection holding most is closed; small ones go on."""

    async def main() -> None:
        async with serving(max_buffered_bytes=256 << 10) as (server, _):
            hog = await Raw.open(server.path)
            hog.send(struct.pack(">I", 1 << 20) + b"\x80" + b"x" * (300 << 10))
            assert await asyncio.wait_for(hog.recv(), 3) is not None  # the refusal
            assert await asyncio.wait_for(hog.recv(), 3) is None
            assert server.buffered_bytes == 0
            async with AsyncClient(server.path) as client:
                assert (await client.ping())["pong"] is True
            hog.close()

    run_async_test(main)


def test_connection_cap() -> None:
    """Connections past max_connections are refused with a reason; the others keep working."""

    async def main() -> None:
        async with serving(max_connections=2) as (server, _):
            a, b = await Raw.open(server.path), await Raw.open(server.path)
            c = await Raw.open(server.path)
            msg = await asyncio.wait_for(c.recv(), 3)
            assert msg is not None and "too many connections" in msg["error"]["message"]
            a.send(encode(make_request(5, "ping", {})))
            assert (await a.recv())["id"] == 5  # type: ignore[index]
            for raw in (a, b, c):
                raw.close()

    run_async_test(main)


def test_conn_info_carries_the_peer_credentials() -> None:
    """The handler sees the connecting process's uid/gid (SO_PEERCRED) as ConnInfo.peer."""

    async def main() -> None:
        async with serving() as (server, daemon), AsyncClient(server.path) as client:
            await client.ping()
            conn = daemon.conns[-1]
            assert conn.peer == (os.getuid(), os.getgid()) and conn.pid == os.getpid()

    run_async_test(main)


# --------------------------------------------------------------------------- answers owed


def test_later_answers_in_the_turn_it_is_resolved_and_at_close() -> None:
    """A sync handler may owe an answer (``Later``): it is written when resolved (out of
    order with others), a failure is a typed error, one still owed at close is answered
    ``shutting_down``, and an owed answer keeps the connection from idling out."""
    from tangramd.transport import Later

    async def main() -> None:
        loop = asyncio.get_running_loop()
        owed: list[Later] = []

        def sync(op: str, args: dict[str, Any], conn: ConnInfo) -> Any:
            later = Later()
            if op == "soon":
                loop.call_later(args["s"], later.resolve, {"after": args["s"]})
            elif op == "bad":
                loop.call_soon(later.fail, NotFound("no such thing"))
            else:
                owed.append(later)
            return later

        daemon = Daemon()
        with short_tmpdir() as tmp:
            server = UnixServer(
                os.path.join(tmp, "d.sock"), daemon, sync_handler=sync, idle_timeout_s=0.2
            )
            await server.start()
            raw = await Raw.open(server.path)
            for request_id, seconds in ((1, 0.3), (2, 0.0)):
                raw.send(encode(make_request(request_id, "soon", {"s": seconds})))
            first, second = await raw.recv(), await raw.recv()
            assert first is not None and second is not None
            assert (first["id"], second["id"]) == (2, 1)
            assert second["result"] == {"after": 0.3}
            raw.send(encode(make_request(3, "bad", {})))
            answer = await raw.recv()
            assert answer is not None and answer["error"]["code"] == "not_found"
            raw.send(encode(make_request(4, "never", {})))
            await asyncio.sleep(0.5)  # past the idle timeout: still open, an answer is owed
            assert server.connections == 1
            await server.close()
            answer = await raw.recv()
            assert answer is not None and answer["id"] == 4
            assert answer["error"]["code"] == "shutting_down"
            assert owed[0].done()
            raw.close()

    run_async_test(main)


def test_an_answer_resolved_in_a_turn_is_written_at_the_end_of_that_turn() -> None:
    """A ``Later`` resolved during a turn of the loop is written after that turn's other
    callbacks (writing it wakes the client, which takes the daemon's core: the rest of the
    turn, e.g. the spawn for a core another exec freed, must not wait for it), and before
    the next turn's."""
    import select

    from tangramd.transport import Later

    async def main() -> None:
        loop = asyncio.get_running_loop()
        owed: list[Later] = []

        def sync(op: str, args: dict[str, Any], conn: ConnInfo) -> Any:
            owed.append(Later())
            return owed[-1]

        with short_tmpdir() as tmp:
            server = UnixServer(os.path.join(tmp, "d.sock"), Daemon(), sync_handler=sync)
            await server.start()
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.connect(server.path)
            client.setblocking(False)
            client.sendall(encode(make_request(1, "x", {})) + encode(make_request(2, "x", {})))
            await wait_for_async(lambda: len(owed) == 2, 5, "both requests read", every_s=0.001)

            def readable() -> bool:
                return bool(select.select([client], [], [], 0)[0])

            seen: list[tuple[str, bool]] = []

            def in_a_turn() -> None:
                owed[1].resolve({"n": 2})
                owed[0].resolve({"n": 1})
                seen.append(("after resolving", readable()))
                loop.call_soon(lambda: seen.append(("next turn", readable())))

            loop.call_soon(in_a_turn)
            for _ in range(3):
                await asyncio.sleep(0)
            decoder = FrameDecoder()
            decoder.feed(client.recv(65536))
            answers = [decoder.next_message(), decoder.next_message()]
            client.close()
            await server.close()
        assert seen == [("after resolving", False), ("next turn", True)]
        assert [(a or {}).get("result") for a in answers] == [{"n": 2}, {"n": 1}]

    run_async_test(main)


# --------------------------------------------------------------------------- in-process


def test_local_connection_takes_the_socket_path_without_the_socket() -> None:
    """``UnixServer.local_connection`` (the in-process gateway's client): results and typed
    errors as over the socket, wire types for the handler (tuples arrive as lists), the
    sync handler's ``Later`` and ``NOT_SYNC`` paths, a caller that stops waiting does not
    cancel its request, and ``close`` answers what is owed with ``shutting_down`` and fires
    the connection's ``on_close`` callbacks."""
    from tangramd.gateway.local import InProcessClient
    from tangramd.transport import NOT_SYNC, Later

    async def main() -> None:
        loop = asyncio.get_running_loop()
        owed: list[Later] = []

        def sync(op: str, args: dict[str, Any], conn: ConnInfo) -> Any:
            if op == "soon":
                later = Later()
                loop.call_later(0.05, later.resolve, {"args": args})
                return later
            if op == "owed":
                owed.append(Later())
                return owed[-1]
            if op == "inline":
                return {"inline": True, "peer": list(conn.peer or ())}
            if op == "bug":
                raise KeyError("sync bug")
            return NOT_SYNC

        daemon = Daemon()
        with short_tmpdir() as tmp:
            server = UnixServer(os.path.join(tmp, "never-bound.sock"), daemon, sync_handler=sync)
            client = InProcessClient(server)
            assert await client.request("inline", {}) == {
                "inline": True,
                "peer": [os.geteuid(), os.getegid()],
            }
            assert server.connections == 1  # counted as a client, without a socket
            got = await client.request("soon", {"cores": (1, 2), "blob": b"\x00"})
            assert got == {"args": {"cores": [1, 2], "blob": b"\x00"}}  # as msgpack has it
            assert await client.request("ping", {}) == {"pong": True, "version": "test"}
            with pytest.raises(NotFound):
                await client.request("env.close", {"id": "e9"})
            with pytest.raises(InternalError):
                await client.request("boom", {})
            with pytest.raises(InternalError):
                await client.request("bug", {})
            with pytest.raises(UnknownOp):
                await client.request("nope", {})
            with pytest.raises(BadRequest):  # the envelope is checked as on the wire
                await client.request("", {})
            # a caller that gives up does not cancel the daemon's work
            waiting = loop.create_task(client.request("sleep", {"s": 0.2, "tag": 7}))
            await daemon.started.wait()
            waiting.cancel()
            await wait_for_async(lambda: daemon.finished == [7], 5, "the handler ran to its end")
            conn = daemon.conns[-1]
            closed: list[int] = []
            conn.on_close(lambda c: closed.append(c.id))
            pending = loop.create_task(client.request("owed", {}))
            await wait_for_async(lambda: owed, 5, "the request reached the handler")
            await server.close()  # never started: only the in-process connection to close
            with pytest.raises(ShuttingDown):
                await pending
            assert closed == [conn.id] and server.connections == 0
            local = client._local
            assert local is not None and local.closed
            with pytest.raises(ShuttingDown):  # a closed connection takes no request
                await local.request("ping", {})

    run_async_test(main)

"""The node <-> coordinator link's framing over a real loopback TCP connection: deferred
messages (acknowledgements) leave with the next message, on their own a little later, or
before a goodbye; never out of order, never lost."""

from __future__ import annotations

import asyncio
from typing import Any

from tangramd.cluster.link import Link


async def _pair() -> tuple[Link, Link, asyncio.AbstractServer]:
    accepted: asyncio.Future[Link] = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set_result(Link(reader, writer))

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    return Link(reader, writer), await asyncio.wait_for(accepted, 10), server


async def _recv(link: Link, n: int) -> list[dict[str, Any]]:
    return [await asyncio.wait_for(link.recv(), 10) for _ in range(n)]


def test_deferred_messages_ride_with_the_next_one_in_order() -> None:
    async def scenario() -> list[list[dict[str, Any]]]:
        a, b, server = await _pair()
        try:
            a.defer({"t": "ack", "key": "x:1"})
            a.defer({"t": "ack", "key": "x:2"})
            a.send({"t": "run_exec", "action_id": "3"})
            first = await _recv(b, 3)
            a.defer({"t": "ack", "key": "x:4"})  # alone: it leaves after a short while
            second = await _recv(b, 1)
            a.cork()
            a.send({"t": "resp", "id": 5})
            a.defer({"t": "ack", "key": "x:6"})
            a.uncork()  # one write: what was deferred first, then what was corked
            a.send({"t": "hb"})
            third = await _recv(b, 3)
            a.defer({"t": "ack", "key": "x:7"})
            await a.wait_closed()  # a goodbye carries what was deferred
            fourth = await _recv(b, 1)
            return [first, second, third, fourth]
        finally:
            server.close()

    first, second, third, fourth = asyncio.run(scenario())
    assert [m.get("key", m["t"]) for m in first] == ["x:1", "x:2", "run_exec"]
    assert second == [{"t": "ack", "key": "x:4"}]
    assert [m.get("key", m["t"]) for m in third] == ["x:6", "resp", "hb"]
    assert fourth == [{"t": "ack", "key": "x:7"}]


def test_deferring_on_a_closed_link_sends_nothing() -> None:
    async def scenario() -> bool:
        a, b, server = await _pair()
        try:
            a.abort()
            return a.defer({"t": "ack", "key": "x:1"})
        finally:
            await b.wait_closed()
            server.close()

    assert asyncio.run(scenario()) is False

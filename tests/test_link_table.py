"""The node <-> coordinator link table (tangram/protocol/link.py) and the two ends held to
it: each end dispatches exactly the messages the table says it receives, builds only
declared messages with declared fields, and drops what it cannot read; what a real
coordinator and node exchange (in this process) passes the table's check."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import os
import socket
import ssl
import time
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast
from unittest.mock import MagicMock

import pytest
from cluster_harness import InProcessCluster, off_the_table, record_links
from structlog.testing import capture_logs

from tangram import Client
from tangram.protocol.errors import BadRequest, InfraError, NotFound
from tangram.protocol.link import (
    LINK_MESSAGES,
    PEER_MESSAGES,
    End,
    check_message,
    make_message,
    received_by,
    sent_by,
)
from tangram.testing import wait_for
from tangramd.backends.base import Backend
from tangramd.cluster import coordinator, node

ROOT = Path(__file__).resolve().parent.parent
# what a node with GPUs and the coordinator exchange about services (test_cluster_services)
GPU_MESSAGES = frozenset(
    {
        "load_service",
        "unload_service",
        "run_call",
        "warm_service",
        "service_loaded",
        "service_unloaded",
        "call_done",
        "services_state",
        "stop_call",  # (a call past its deadline: test_cluster_services_stop.py)
        "call_stopped",
    }
)
LINK_CONFIG = """
[cluster]
heartbeat_s = 0.05
heartbeat_timeout_s = 5.0
"""
# The sources of each end's messages: the coordinator's commands leave through its
# effects (tangramd/run/remote.py), the rest of its messages from coordinator.py.
SOURCES: dict[End, tuple[Path, ...]] = {
    "node": (ROOT / "tangramd" / "cluster" / "node.py",),
    "coordinator": (
        ROOT / "tangramd" / "cluster" / "coordinator.py",
        ROOT / "tangramd" / "run" / "remote.py",
    ),
}


def _tree(end: End) -> ast.Module:
    body: list[ast.stmt] = []
    for path in SOURCES[end]:
        body += ast.parse(path.read_text()).body
    return ast.Module(body=body, type_ignores=[])


def _built(end: End) -> list[ast.Call]:
    """Every ``make_message(...)`` call in one end's source."""
    return [
        n
        for n in ast.walk(_tree(end))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "make_message"
    ]


def _read_in_join(end: End) -> set[str]:
    """The names an end compares a message's ``"t"`` with (``msg.get("t") == "ca"``): the
    handshake, read in order rather than dispatched."""
    names = set()
    for n in ast.walk(_tree(end)):
        if not isinstance(n, ast.Compare):
            continue
        sides = [n.left, *n.comparators]
        reads_t = any(
            isinstance(s, ast.Call)
            and isinstance(s.func, ast.Attribute)
            and s.func.attr == "get"
            and s.args
            and isinstance(s.args[0], ast.Constant)
            and s.args[0].value == "t"
            for s in sides
        )
        if reads_t:
            names |= {
                s.value for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)
            }
    return names


# ---------------------------------------------------------------------- the table


def test_every_message_and_field_is_documented() -> None:
    """Each message and each of its fields has a doc line for docs/protocol.md."""
    for m in LINK_MESSAGES.values():
        assert m.doc, m.name
        assert "t" not in m.field_names, m.name  # "t" names the message itself
        for f in m.fields:
            assert f.doc, f"{m.name}.{f.name}"


def test_every_message_has_one_sender_and_a_receiver() -> None:
    """Each message is sent by one end (or both) and received by the other."""
    for m in LINK_MESSAGES.values():
        assert m.sender in ("coordinator", "node", "both"), m.name
    assert sent_by("node") | sent_by("coordinator") == set(LINK_MESSAGES)
    assert received_by("node") == sent_by("coordinator")
    assert received_by("coordinator") == sent_by("node")


def test_make_message_refuses_what_is_not_declared() -> None:
    """A typo in a message's name or field, or a required field left out, fails where
    the message is built."""
    assert make_message("ack", key="x:1") == {"t": "ack", "key": "x:1"}
    with pytest.raises(ValueError, match="undeclared"):
        make_message("akc", key="x:1")
    with pytest.raises(ValueError, match="unknown fields \\['kye'\\]"):
        make_message("ack", key="x:1", kye="x:1")
    with pytest.raises(ValueError, match="missing \\['key'\\]"):
        make_message("ack")


def test_check_message_accepts_the_messages_the_ends_send() -> None:
    """Messages shaped as the ends send them pass the full check."""
    samples = [
        make_message("hb"),
        make_message("ca", pem="", version="1.0"),
        make_message(
            "welcome",
            name="n1",
            credential=None,
            heartbeat_s=1.0,
            heartbeat_timeout_s=10,
            keep=["e1"],
            cancel=[],
        ),
        make_message("req", id=3, conn=1, op="exec", args={"cmd": ["true"]}),
        make_message("resp", id=3, ok=False, error={"code": "not_found", "message": "m"}),
        make_message(
            "run_exec",
            action_id="a1",
            env_id="e1",
            cores=[0, 1],
            spec={"cmd": ["true"]},
            max_output=1 << 20,
            run_as=None,
            reply={"id": 3, "queue_s": 0.001},
        ),
        make_message(
            "transfer",
            tid="t1",
            env_id="e1",
            direction="put",
            path="a.txt",
            data=b"x",
            tar=False,
            max_bytes=8 << 20,
        ),
        make_message(
            "exec_done",
            key="x:a1",
            action_id="a1",
            result={"outcome": "ok"},
            env_lost=False,
            answered=True,
        ),
        make_message("transfer_done", key="t:t1", tid="t1", result=None, error=["bad", "m"]),
    ]
    for msg in samples:
        assert check_message(msg).name == msg["t"]


@pytest.mark.parametrize(
    ("msg", "why"),
    [
        ({"t": "nope"}, "unknown link message 'nope'"),
        ({"key": "x"}, "unknown link message 'None'"),
        ({"t": "ack"}, "ack: missing field 'key'"),
        ({"t": "ack", "key": 7}, "ack: key: expected non-empty str"),
        ({"t": "ack", "key": "k", "extra": 1}, "unknown field"),
        ({"t": "transfer_done", "key": "t:1", "tid": "1", "error": "x"}, "error: expected list"),
        (
            {"t": "run_exec", "action_id": "a", "env_id": "e", "cores": [-1], "spec": {}},
            "cores[0]: expected int >= 0",
        ),
    ],
)
def test_check_message_names_what_is_wrong(msg: dict[str, Any], why: str) -> None:
    """A malformed message is a BadRequest that names the message and the field."""
    with pytest.raises(BadRequest, match=why.replace("[", "\\[").replace("]", "\\]")):
        check_message(msg)


# ---------------------------------------------------------------------- the ends


@pytest.mark.parametrize("end", ["node", "coordinator"])
def test_each_end_dispatches_exactly_what_it_receives(end: End) -> None:
    """An end's dispatch table covers every message the link table says it receives after
    the join, and nothing else; the join's messages it reads in order."""
    table = node.RECEIVES if end == "node" else coordinator.RECEIVES
    assert set(table) == received_by(end, join=False)
    assert _read_in_join(end) == received_by(end, join=True)


@pytest.mark.parametrize("end", ["node", "coordinator"])
def test_each_end_sends_only_declared_messages(end: End) -> None:
    """Every message an end builds names a message that end sends, with declared fields
    and every required one; every message the table gives it is built somewhere; and no
    message is written as a bare dict (which would bypass the table)."""
    built = _built(end)
    names = set()
    for call in built:
        where = f"{end}:{call.lineno}"
        assert call.args and isinstance(call.args[0], ast.Constant), f"{where}: name not literal"
        name = call.args[0].value
        assert isinstance(name, str) and name in LINK_MESSAGES, f"{where}: {name!r} undeclared"
        spec = LINK_MESSAGES[name]
        assert spec.sent_by(end), f"{where}: {end} does not send {name!r}"
        given = {k.arg for k in call.keywords if k.arg is not None}
        assert given <= spec.field_names, f"{where}: {name}: unknown {given - spec.field_names}"
        spread = any(k.arg is None for k in call.keywords)
        assert spread or spec.required <= given, f"{where}: {name}: missing required fields"
        names.add(name)
    assert names == sent_by(end)
    for n in ast.walk(_tree(end)):
        if isinstance(n, ast.Dict):
            keys = {k.value for k in n.keys if isinstance(k, ast.Constant)}
            assert "t" not in keys, f"{end}:{n.lineno}: a message as a bare dict"


class _Backend:
    """Just enough backend for a node that is never started."""

    name = "fake"

    def env_exists(self, env_id: str) -> bool:
        return False


MALFORMED: list[dict[str, Any]] = [
    {"t": "no_such_message"},
    {"t": 7},
    {"key": "no type"},
]


def _garbled(name: str) -> list[dict[str, Any]]:
    """A message with every field missing, and one with every field of a wrong type."""
    fields = LINK_MESSAGES[name].field_names
    return [{"t": name}, {"t": name, **{f: {"wrong": [None]} for f in fields}}]


def test_node_drops_unknown_and_malformed_messages(tmp_path: Path) -> None:
    """The node logs and drops a coordinator message it does not know or cannot read; it
    never raises out of its dispatch."""
    agent = node.NodeAgent(
        name="n1",
        coordinator=("127.0.0.1", 1),
        token=None,
        ca_sha256=None,
        insecure=True,
        backend=cast(Backend, _Backend()),
        socket_path=str(tmp_path / "sock"),
        state_dir=str(tmp_path),
        cores_by_numa=((0,),),
        mem_bytes=1 << 30,
    )
    agent._report = lambda msg: None  # type: ignore[method-assign]  # nothing to report to

    async def scenario() -> None:
        for name in node.RECEIVES:
            if name == "run_exec":
                continue  # a malformed placement is answered, not dropped: see below
            for msg in _garbled(name):
                agent._on_message(msg)
        for msg in MALFORMED:
            agent._on_message(msg)
        await asyncio.sleep(0)

    with capture_logs() as logs:
        asyncio.run(scenario())
    events = [e["event"] for e in logs]
    assert events.count("coordinator_message_unknown") == len(MALFORMED)
    assert "coordinator_message_bad" in events


def _agent(tmp_path: Path, name: str, *, insecure: bool = True) -> node.NodeAgent:
    """A node that is never started (no backend behind it), its outcomes kept in a list."""
    agent = node.NodeAgent(
        name=name,
        coordinator=("127.0.0.1", 1),
        token=None,
        ca_sha256=None,
        insecure=insecure,
        backend=cast(Backend, _Backend()),
        socket_path=str(tmp_path / f"{name}.sock"),
        state_dir=str(tmp_path / name),
        cores_by_numa=((0,),),
        mem_bytes=1 << 30,
    )
    reported: list[dict[str, Any]] = []
    agent._report = reported.append  # type: ignore[method-assign]
    agent.reported = reported  # type: ignore[attr-defined]
    return agent


def test_a_placement_whose_input_cannot_be_pulled_ends_infra_error(tmp_path: Path) -> None:
    """A run_exec whose fetch is malformed, names a port where nothing listens, a holder
    whose TLS key is not the one pinned, or a ticket the holder does not know: the exec
    ends infra_error (an exec_done), never runs (the effects are never asked), and the
    node raises nothing. A put's transfer likewise fails, and writes nothing."""
    holder = _agent(tmp_path, "a", insecure=False)
    puller = _agent(tmp_path, "b", insecure=False)
    ran: list[Any] = []
    puller.effects.run_exec = ran.append  # type: ignore[method-assign]
    puller.effects.run_transfer = ran.append  # type: ignore[method-assign]

    async def scenario() -> list[str]:
        await holder._open_input_port("127.0.0.1")
        assert holder.input_addr is not None and holder.input_pin is not None
        good = {"node": "a", "addr": holder.input_addr, "pin": holder.input_pin}
        fetches: list[Any] = [
            {"wrong": [None]},
            {**good, "addr": "no port"},
            {**good, "ticket": 7},
            {**good, "ticket": "t", "pin": 5},
            {**good, "ticket": "t", "addr": "127.0.0.1:1"},
            {**good, "ticket": "t", "pin": "sha256:" + "0" * 64},
            {**good, "ticket": "t", "pin": None},  # plain TCP off --insecure: refused
            {**good, "ticket": "no such ticket"},
        ]
        for k, fetch in enumerate(fetches):
            puller._on_message(
                make_message(
                    "run_exec",
                    action_id=f"x{k}",
                    env_id="e1",
                    cores=[0],
                    spec={"cmd": ["true"]},
                    max_output=1 << 20,
                    fetch=fetch,
                )
            )
        for k, fetch in enumerate((fetches[0], fetches[-1])):
            puller._on_message(
                make_message(
                    "transfer",
                    tid=f"t{k}",
                    env_id="e1",
                    direction="put",
                    path="f",
                    data=b"",
                    tar=False,
                    max_bytes=1 << 20,
                    fetch=fetch,
                )
            )
        deadline = time.monotonic() + 10
        while len(puller.reported) < len(fetches) + 2 and time.monotonic() < deadline:  # type: ignore[attr-defined]
            await asyncio.sleep(0.01)
        await holder._close_input_port()
        by_action = {
            m["action_id"]: m["result"]["detail"]
            for m in puller.reported  # type: ignore[attr-defined]
            if m["t"] == "exec_done"
        }
        puts = [m["error"] for m in puller.reported if m["t"] == "transfer_done"]  # type: ignore[attr-defined]
        assert [e[0] for e in puts] == ["infra_error", "infra_error"], puts
        assert any("no input is kept here" in e[1] for e in puts), puts
        return [by_action.get(f"x{k}", "") for k in range(len(fetches))]

    details = asyncio.run(scenario())
    assert len(puller.reported) == 10 and all(details) and not ran, details  # type: ignore[attr-defined]
    done = [m for m in puller.reported if m["t"] == "exec_done"]  # type: ignore[attr-defined]
    assert all(m["result"]["outcome"] == "infra_error" for m in done)
    assert "not the one pinned" in details[5], details
    assert "plain TCP refused" in details[6], details
    assert "no input is kept here under that ticket" in details[7], details


def test_pulls_reuse_a_connection_and_redial_when_the_holder_closed_it(tmp_path: Path) -> None:
    """Two pulls from one holder share a connection (one TLS handshake); when the holder
    has closed it meanwhile, the next pull dials anew and still gets its input."""
    holder = _agent(tmp_path, "a", insecure=False)
    puller = _agent(tmp_path, "b", insecure=False)
    for k in (1, 2, 3):
        holder._held[k] = {"stdin": f"in{k}".encode()}
        holder._offers[f"t{k}"] = k
        holder._tickets[k] = f"t{k}"

    async def scenario() -> list[Any]:
        await holder._open_input_port("127.0.0.1")
        host, _, port = str(holder.input_addr).rpartition(":")
        got = []
        for k in (1, 2, 3):
            fetch = node._Fetch("a", host, int(port), holder.input_pin, f"t{k}")
            got.append((await puller._pull(fetch))["stdin"])
            got.append(len(holder._input_conns))
            if k == 2:  # the holder lets go of the kept connection (idle, restarted)
                for writer in list(holder._input_conns):
                    writer.transport.abort()
                await asyncio.sleep(0.05)
        await puller._close_input_port()
        await holder._close_input_port()
        return got

    with capture_logs() as logs:
        got = asyncio.run(scenario())
    assert got == [b"in1", 1, b"in2", 1, b"in3", 1], got
    peers = [e["peer"] for e in logs if e["event"] == "input_pulled"]
    assert len(peers) == 3 and peers[0] == peers[1] != peers[2], peers


def test_a_hello_with_a_malformed_input_port_has_none() -> None:
    """A hello whose input port is not host:port (or absurdly long) is kept without it:
    that node's large inputs then go with its requests; nothing is refused."""
    read = coordinator._input_port
    assert read({"input_addr": "10.0.0.1:7001", "input_pin": "sha256:ab"}) == (
        "10.0.0.1:7001",
        "sha256:ab",
    )
    for hello in (
        {"input_addr": "nonsense"},
        {"input_addr": 7},
        {"input_addr": "h:" + "1" * 400},
        {"input_addr": "h:99999"},
        {"input_addr": "h:1", "input_pin": "x" * 200},
        {},
    ):
        assert read(hello) == (None, None), hello


def test_coordinator_drops_unknown_and_malformed_messages() -> None:
    """The coordinator logs and drops a node message it does not know or cannot read; it
    never raises out of its dispatch (each handler reads the message before it touches
    any state)."""
    link, ex = MagicMock(), MagicMock()  # what a handler does with them is not at stake
    rec = types.SimpleNamespace(name="n1", remote_conns={})
    with capture_logs() as logs:
        for name in coordinator.RECEIVES:
            if name in ("hb", "bye", "req"):
                continue  # no fields to garble; req is answered (test_cluster.py)
            for msg in _garbled(name):
                coordinator.CoordinatorExecutor._on_message(ex, rec, link, msg)  # type: ignore[arg-type]
        for msg in MALFORMED:
            coordinator.CoordinatorExecutor._on_message(ex, rec, link, msg)  # type: ignore[arg-type]
    events = [e["event"] for e in logs]
    assert events.count("node_message_unknown") == len(MALFORMED)
    assert "node_message_bad" in events


# ---------------------------------------------------------------------- real traffic


def test_real_link_traffic_matches_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every message a real coordinator and node exchange (a join, execs, transfers, a
    session and its interrupt, a cancel, a goodbye) passes the table's full check, types included;
    together they use every message but the two that turn a join down."""
    seen = record_links(monkeypatch)
    with InProcessCluster(tmp_path) as here:
        coord = here.coordinator(LINK_CONFIG)
        a = here.node(coord, "a")
        with a.client() as c, a.client() as c2:
            assert c.exec(["cat"], stdin=b"in").stdout == "in"
            env = c.request("env.open", {})["id"]
            c.request("env.put", {"id": env, "path": "f.txt", "data": b"x"})
            assert c.request("env.get", {"id": env, "path": "f.txt"})["data"] == b"x"
            session = c.request("session.open", {"env": env})["id"]
            with ThreadPoolExecutor(1) as pool:  # a session's command runs: interrupt it
                sleeping = pool.submit(c2.exec, "sleep 30", session=session)
                deadline = time.monotonic() + 20
                while not sleeping.done():  # (an interrupt may beat the command to the shell)
                    assert time.monotonic() < deadline, "the session's command was not stopped"
                    c.request("session.interrupt", {"id": session})
                    time.sleep(0.05)
                assert sleeping.result().exec_s < 20
            with ThreadPoolExecutor(1) as pool:  # a running exec cancelled: cancel_exec
                running = pool.submit(c2.exec, "sleep 30")
                rows = wait_for(lambda: c.queue()["running"], 20, "the exec running")
                # the node says it started (exec_started) DEFER_S after the start, unless it
                # ended by then: cancelled only once that was said, or the traffic may lack it
                said = rows[0]["action_id"]
                wait_for(
                    lambda: any(m["t"] == "exec_started" and said in m["action_ids"] for m in seen),
                    20,
                    "the node's exec_started",
                )
                assert c.cancel(said)["outcome"] == "cancelled"
                assert running.result().outcome == "cancelled"
            c.request("session.close", {"id": session})
            c.request("env.close", {"id": env})
            with pytest.raises(NotFound):
                c.request("env.get", {"id": "no-such-env", "path": "f.txt"})
        here.stop_all()
    bad = off_the_table(seen)
    assert not bad, "\n".join(bad)
    unseen = set(LINK_MESSAGES) - {msg["t"] for msg in seen}
    # a join turned down: test_cluster*.py; the GPU services' messages (a node with GPUs):
    # test_cluster_services.py's own real traffic
    assert unseen == {"refused", "reject"} | GPU_MESSAGES


@pytest.fixture
def sent_on_links(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every message any link sends during the test (``Link.send``), in order."""
    return record_links(monkeypatch, deferred=False)


def test_an_exec_input_crosses_the_link_once(
    tmp_path: Path, sent_on_links: list[dict[str, Any]]
) -> None:
    """An exec's stdin and files from a node's own client into an environment on that node
    never cross the link (the node withholds them from its req and puts them back for
    run_exec's held); from another node's client, they are in the run_exec of the node
    that runs it; the command gets them either way."""
    seen = sent_on_links
    with _clients_of_a_and_b(tmp_path) as (on_a, on_b):
        env = _env_on(on_a, "a")
        args = {"env": env, "stdin": b"in", "files": {"f.txt": b"file"}}
        local = on_a.request("exec", {"cmd": ["sh", "-c", "cat; cat f.txt"], **args})
        remote = on_b.request("exec", {"cmd": ["sh", "-c", "cat; cat f.txt"], **args})
    assert local["stdout"] == remote["stdout"] == "infile"
    run = {m["action_id"]: m for m in seen if m["t"] == "run_exec"}
    held = run[local["action_id"]]
    assert held["held"] is True and not {"stdin", "files"} & set(held["spec"])
    shipped = run[remote["action_id"]]
    assert shipped["held"] is None
    assert shipped["spec"]["stdin"] == b"in" and shipped["spec"]["files"] == {"f.txt": b"file"}
    reqs = [m for m in seen if m["t"] == "req" and m["op"] == "exec"]
    assert [m["held"] for m in reqs] == [True, True]
    # from a's own client into a's environment: the input never left a (withheld)
    assert reqs[0]["withheld"] is True and not {"stdin", "files"} & set(reqs[0]["args"])
    # from b's client: b has no copy to keep for a, so the input goes with the request
    assert reqs[1]["withheld"] is None and reqs[1]["args"]["stdin"] == b"in"


def _bytes_in(value: Any) -> Iterator[bytes]:
    """Every bytes value inside a message, at any depth."""
    if isinstance(value, bytes):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _bytes_in(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _bytes_in(item)


BIG_FILE = os.urandom(1 << 20)  # 1 MiB: above PULL_MIN_BYTES, so it stays on a
BIG_STDIN = os.urandom(100 << 10)
DIGEST_CMD = ["sh", "-c", "sha256sum big.bin | cut -c1-64; head -c 1000000000 | sha256sum"]


def test_a_large_input_goes_node_to_node_never_through_the_coordinator(
    tmp_path: Path, sent_on_links: list[dict[str, Any]]
) -> None:
    """An exec from a's client with 1 MiB of files and 100 KiB of stdin, into an
    environment on b: a keeps the input (the req is withheld, with a ticket), the
    coordinator places it from its demand and tells b where to pull it (run_exec's fetch),
    b pulls it from a's input port and the command reads it intact; throwaway execs with
    the same input, placed on a (held) or b (pulled), read it intact too; no message on
    any link to or from the coordinator carries its bytes."""
    import hashlib

    seen = sent_on_links
    with _clients_of_a_and_b(tmp_path) as (on_a, on_b):
        env = _env_on(on_b, "b")
        args = {"env": env, "stdin": BIG_STDIN, "files": {"big.bin": BIG_FILE}}
        ran = on_a.request("exec", {"cmd": DIGEST_CMD, **args})
        placed = len(seen)
        # the most an exec may carry: all of it arrives (the holder flushes, then closes)
        most = os.urandom((8 << 20) - 1)
        biggest = on_a.request(
            "exec", {"cmd": "sha256sum f | cut -c1-64", "env": env, "files": {"f": most}}
        )
        assert biggest["stdout"].strip() == hashlib.sha256(most).hexdigest(), biggest
        # throwaway execs (no environment) go where the pass puts them: a or b
        throwaways = [
            on_a.request("exec", {"cmd": DIGEST_CMD, "stdin": BIG_STDIN, "files": args["files"]})
            for _ in range(4)
        ]
    digests = [hashlib.sha256(BIG_FILE).hexdigest(), hashlib.sha256(BIG_STDIN).hexdigest()]
    assert ran["outcome"] == "ok" and ran["node"] == "b", ran
    assert ran["stdout"].split()[:2] == digests
    for other in throwaways:
        assert other["outcome"] == "ok" and other["stdout"].split()[:2] == digests, other
    on_the_links = [m for m in seen if m["t"] in LINK_MESSAGES]
    assert not any(len(b) >= 1000 for m in on_the_links for b in _bytes_in(m))
    for msg in seen:  # every message sent passes its table's full check, types included
        check_message(msg, PEER_MESSAGES if msg["t"] in PEER_MESSAGES else LINK_MESSAGES)
    seen = seen[:placed]
    (req,) = [m for m in seen if m["t"] == "req" and m["op"] == "exec"]
    assert req["withheld"] is True and isinstance(req["ticket"], str)
    assert not {"stdin", "files"} & set(req["args"])
    (run,) = [m for m in seen if m["t"] == "run_exec"]
    assert run["fetch"]["node"] == "a" and run["fetch"]["ticket"] == req["ticket"]
    assert run["fetch"]["pin"].startswith("sha256:")  # TLS, a's key pinned
    assert not {"stdin", "files"} & set(run["spec"])
    assert [m["t"] for m in seen if m["t"] in PEER_MESSAGES] == ["pull"]  # b's, to a


def test_a_large_put_into_another_nodes_environment_goes_node_to_node(
    tmp_path: Path, sent_on_links: list[dict[str, Any]]
) -> None:
    """env.put of 1 MiB from a's client into an environment on b: a keeps the data (the
    req's data is empty, with a ticket), the transfer tells b to pull it (fetch), and the
    file on b is intact; no link message carries the bytes (a put whose data cannot be
    pulled: test_a_placement_whose_input_cannot_be_pulled_ends_infra_error)."""
    import hashlib

    seen = sent_on_links
    with _clients_of_a_and_b(tmp_path) as (on_a, on_b):
        env = _env_on(on_b, "b")
        on_a.request("env.put", {"id": env, "path": "big.bin", "data": BIG_FILE})
        ran = on_b.request("exec", {"cmd": "sha256sum big.bin | cut -c1-64", "env": env})
        (put,) = [m for m in seen if m["t"] == "req" and m["op"] == "env.put"]
        assert put["withheld"] is True and put["args"]["data"] == b"" and put["ticket"]
        (sent,) = [m for m in seen if m["t"] == "transfer" and m["direction"] == "put"]
        assert sent["fetch"]["ticket"] == put["ticket"] and sent["fetch"]["node"] == "a"
        assert not sent["data"] and sent["held"] is None
        on_the_links = [m for m in seen if m["t"] in LINK_MESSAGES]
        assert not any(len(b) >= 1000 for m in on_the_links for b in _bytes_in(m))
    assert ran["stdout"].strip() == hashlib.sha256(BIG_FILE).hexdigest()


def test_a_node_that_dies_holding_an_input_ends_its_exec_infra_error(
    tmp_path: Path, sent_on_links: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """a keeps a large input for an exec placed on b and dies just as b comes to pull it:
    the exec ends infra_error on b, naming a; it never runs without its input (the
    command would have left a file behind)."""
    pull = node.NodeAgent._pull
    holders: dict[str, Any] = {}

    async def die_then_pull(self: node.NodeAgent, fetch: Any) -> Any:
        await asyncio.create_task(holders["a"].halted(-9))  # as SIGKILL, in a's context
        return await pull(self, fetch)

    monkeypatch.setattr(node.NodeAgent, "_pull", die_then_pull)
    cores = sorted(os.sched_getaffinity(0))
    with InProcessCluster(tmp_path) as here:
        coord = here.coordinator(LINK_CONFIG)
        holders["a"] = a = here.node(coord, "a", cpus=str(cores[0]))
        b = here.node(coord, "b", cpus=str(cores[-1]))
        with a.client() as on_a, b.client() as on_b:
            env = _env_on(on_b, "b")
            with pytest.raises((InfraError, OSError)):  # a is gone, its clients with it
                on_a.request(
                    "exec", {"cmd": ["touch", "ran"], "env": env, "files": {"f": BIG_FILE}}
                )
            assert a.wait(10) != 0
            deadline = time.monotonic() + 10
            while not [m for m in sent_on_links if m["t"] == "exec_done"]:
                assert time.monotonic() < deadline, "b never reported the exec's end"
                time.sleep(0.02)
            with pytest.raises(NotFound):
                on_b.request("env.get", {"id": env, "path": "ran"})
        here.stop_all()
    (done,) = [m for m in sent_on_links if m["t"] == "exec_done"]
    assert done["result"]["outcome"] == "infra_error", done
    assert "could not be pulled from node a" in done["result"]["detail"], done
    assert "input_pull_failed" in b.log()


def _input_port_of(seen: list[dict[str, Any]], name: str) -> tuple[str, int]:
    """A node's input port, as its hello told the coordinator."""
    (hello,) = [m for m in seen if m["t"] == "hello" and m["name"] == name]
    host, _, port = str(hello["input_addr"]).rpartition(":")
    return host, int(port)


def _pull_raw(addr: tuple[str, int], payload: bytes, wait_s: float = 10.0) -> dict[str, Any] | None:
    """Connect to an input port over TLS, send raw bytes: the first message that comes
    back within ``wait_s``, None if the holder closes (or says nothing) first."""
    from tangram.protocol.codec import FrameDecoder

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    decoder = FrameDecoder(64 << 20)
    with socket.create_connection(addr, timeout=wait_s) as raw, ctx.wrap_socket(raw) as tls:
        tls.sendall(payload)
        with contextlib.suppress(OSError):
            while chunk := tls.recv(1 << 16):
                decoder.feed(chunk)
                msg = decoder.next_message()
                if msg is not None:
                    return msg
        return None


def test_the_input_port_refuses_bad_pulls_and_serves_on(
    tmp_path: Path, sent_on_links: list[dict[str, Any]]
) -> None:
    """Garbage, an oversized frame, a malformed or unknown message, a wrong or unknown
    ticket, a stolen ticket used twice: each is refused (``gone``, or the connection
    closed) and the node serves on; a real cross-node exec then still gets its input.
    The coordinator's and the node's link handlers drop a malformed ``fetch`` or
    ``ticket`` (an exec ends infra_error; test_node_drops_...: run_exec)."""
    from tangram.protocol.codec import encode

    with _clients_of_a_and_b(tmp_path) as (on_a, on_b):
        port = _input_port_of(sent_on_links, "a")
        assert _pull_raw(port, b"\x00\x00\x00\x05garbage") is None
        assert _pull_raw(port, b"\xff\xff\xff\xff") is None  # oversized
        assert _pull_raw(port, b"\x00\x00\x00", wait_s=0.3) is None  # cut short
        for bad in (
            {"t": "pull"},
            {"t": "pull", "ticket": 7},
            {"t": "pull", "ticket": "x", "more": 1},
            {"t": "input", "stdin": b"x"},
            {"t": "nope"},
            {"t": "pull", "ticket": "not-a-ticket"},
        ):
            got = _pull_raw(port, encode(bad))
            assert got is not None and got["t"] == "gone", (bad, got)
        env = _env_on(on_b, "b")
        args = {"env": env, "stdin": BIG_STDIN, "files": {"big.bin": BIG_FILE}}
        ran = on_a.request("exec", {"cmd": DIGEST_CMD, **args})
        assert ran["outcome"] == "ok" and ran["node"] == "b", ran
        (run,) = [m for m in sent_on_links if m["t"] == "run_exec"]
        replay = _pull_raw(port, encode({"t": "pull", "ticket": run["fetch"]["ticket"]}))
        assert replay is not None and replay["t"] == "gone"  # each ticket once
        assert on_a.request("ping", {}) is not None


def test_the_input_port_caps_its_connections(
    tmp_path: Path, sent_on_links: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connections held open without a pull take a place each, up to ``PULL_CONNS_MAX``;
    one more is closed at once (no fd per attacker's socket); once they go, pulls work."""
    from tangram.protocol.codec import encode

    monkeypatch.setattr(node, "PULL_CONNS_MAX", 2)
    pull = encode({"t": "pull", "ticket": "x"})
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with _clients_of_a_and_b(tmp_path) as (on_a, on_b):
        port = _input_port_of(sent_on_links, "a")
        with contextlib.ExitStack() as held:
            for _ in range(2):
                raw = held.enter_context(socket.create_connection(port, timeout=5))
                held.enter_context(ctx.wrap_socket(raw))
            # (the held ones count once the node has taken them: until then one may pass)
            wait_for(
                lambda: _pull_raw(port, pull, wait_s=2) is None,
                20,
                "a third connection refused",
                ignore=(OSError,),
            )

        def answered() -> bool:
            got = _pull_raw(port, pull, wait_s=2)
            return got is not None and got["t"] == "gone"

        wait_for(answered, 20, "pulls answered once the held ones are gone", ignore=(OSError,))
        env = _env_on(on_b, "b")
        args = {"env": env, "stdin": BIG_STDIN, "files": {"big.bin": BIG_FILE}}
        ran = on_a.request("exec", {"cmd": DIGEST_CMD, **args})
        assert ran["outcome"] == "ok" and ran["node"] == "b", ran


@contextlib.contextmanager
def _clients_of_a_and_b(tmp_path: Path) -> Iterator[tuple[Client, Client]]:
    """Clients of two nodes, a and b, of one in-process cluster, each node on a core of
    its own; the cluster is stopped after the block."""
    cores = sorted(os.sched_getaffinity(0))
    with InProcessCluster(tmp_path) as here:
        coord = here.coordinator(LINK_CONFIG)
        a = here.node(coord, "a", cpus=str(cores[0]))
        b = here.node(coord, "b", cpus=str(cores[-1]))
        with a.client() as on_a, b.client() as on_b:
            yield on_a, on_b
        here.stop_all()


def _env_on(c: Client, node_name: str, tries: int = 8) -> str:
    """Open environments until one lands on ``node_name`` (placement balances memory)."""
    for _ in range(tries):
        env = c.request("env.open", {})
        if env["node"] == node_name:
            return str(env["id"])
    raise AssertionError(f"no environment landed on {node_name} in {tries} tries")


def test_a_put_into_an_environment_on_the_clients_node_keeps_its_data_there(
    tmp_path: Path, sent_on_links: list[dict[str, Any]]
) -> None:
    """env.put from a node's own client into an environment on that node: the req carries
    an empty data (withheld) and the transfer takes the node's copy (held), so the file's
    bytes never cross the link; from another node's client they go with the request; the
    file is written either way."""
    seen = sent_on_links
    with _clients_of_a_and_b(tmp_path) as (on_a, on_b):
        env = _env_on(on_a, "a")
        on_a.request("env.put", {"id": env, "path": "mine.txt", "data": b"local bytes"})
        on_b.request("env.put", {"id": env, "path": "theirs.txt", "data": b"remote bytes"})
        got = {
            name: on_a.request("env.get", {"id": env, "path": name})["data"]
            for name in ("mine.txt", "theirs.txt")
        }
    assert got == {"mine.txt": b"local bytes", "theirs.txt": b"remote bytes"}
    puts = [m for m in seen if m["t"] == "req" and m["op"] == "env.put"]
    assert puts[0]["withheld"] is True and puts[0]["args"]["data"] == b""
    assert puts[1]["withheld"] is None and puts[1]["args"]["data"] == b"remote bytes"
    sent = [m for m in seen if m["t"] == "transfer" and m["direction"] == "put"]
    assert sent[0]["held"] == puts[0]["id"] and not sent[0]["data"]
    assert sent[1]["held"] is None and sent[1]["data"] == b"remote bytes"
    assert b"local bytes" not in b"".join(
        m.get("data") or b"" for m in seen if isinstance(m.get("data"), bytes)
    )


def test_a_session_commands_input_stays_on_its_node(
    tmp_path: Path, sent_on_links: list[dict[str, Any]]
) -> None:
    """A command in a session opened on the client's node (named by its session alone)
    keeps its stdin on that node too, and reads it."""
    seen = sent_on_links
    with InProcessCluster(tmp_path) as here:
        coord = here.coordinator(LINK_CONFIG)
        a = here.node(coord, "a")
        with a.client() as c:
            env = _env_on(c, "a")
            session = c.request("session.open", {"env": env})["id"]
            ran = c.request("exec", {"cmd": "cat", "session": session, "stdin": b"typed"})
            c.request("session.close", {"id": session})
        here.stop_all()
    assert ran["stdout"].strip() == "typed"
    (req,) = [m for m in seen if m["t"] == "req" and m["op"] == "exec"]
    assert req["withheld"] is True and "stdin" not in req["args"]

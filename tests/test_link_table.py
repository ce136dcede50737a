"""The node <-> coordinator link table (tangram/protocol/link.py) and the two ends held to
it: each end dispatches exactly the messages the table says it receives, builds only
declared messages with declared fields, and drops what it cannot read."""

from __future__ import annotations

import ast
import asyncio
import types
from pathlib import Path
from typing import Any, cast
from unittest.mock import MagicMock

import pytest
from structlog.testing import capture_logs

from tangram.protocol.errors import BadRequest
from tangram.protocol.link import (
    LINK_MESSAGES,
    End,
    check_message,
    make_message,
    received_by,
    sent_by,
)
from tangramd.backends.base import Backend
from tangramd.cluster import coordinator, node

ROOT = Path(__file__).resolve().parent.parent
SOURCES: dict[End, Path] = {
    "node": ROOT / "tangramd" / "cluster" / "node.py",
    "coordinator": ROOT / "tangramd" / "cluster" / "coordinator.py",
}


def _tree(end: End) -> ast.Module:
    return ast.parse(SOURCES[end].read_text())


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
        where = f"{SOURCES[end].name}:{call.lineno}"
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
            assert "t" not in keys, f"{SOURCES[end].name}:{n.lineno}: a message as a bare dict"


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

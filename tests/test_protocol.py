"""Sans-IO protocol tests: codec, envelopes, op table, error codes (no sockets)."""

from __future__ import annotations

import itertools
import math
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tangram.model import InvalidDemand, TangramError, Unschedulable
from tangram.protocol import (
    ERROR_CLASSES,
    ERROR_CODES,
    OPS,
    BadRequest,
    FrameDecoder,
    FrameError,
    InternalError,
    MalformedResponse,
    NotFound,
    QuotaExceeded,
    UnknownOp,
    encode,
    error_from_wire,
    error_response,
    error_to_wire,
    make_request,
    ok_response,
    parse_request,
    parse_response,
    parse_size,
    render_markdown,
    validate_args,
)
from tangram.protocol import link as link_table


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


# --------------------------------------------------------------------------- codec


def test_round_trip() -> None:
    """A message encodes into one frame and decodes back equal."""
    msg = {"id": 7, "op": "exec", "args": {"cmd": ["echo", "hi"], "cpus": [1, 4], "x": b"\0"}}
    decoder = FrameDecoder()
    decoder.feed(encode(msg))
    assert decoder.next_message() == msg
    assert decoder.next_message() is None
    assert decoder.buffered == 0


def test_split_feeds_byte_by_byte() -> None:
    """Messages fed one byte at a time come out whole, in order, exactly once."""
    msgs = [make_request(i, "ping", {"pad": "x" * i}) for i in range(5)]
    data = b"".join(encode(m) for m in msgs)
    decoder = FrameDecoder()
    out: list[dict[str, Any]] = []
    for byte in data:
        decoder.feed(bytes([byte]))
        out.extend(decoder.messages())
    assert out == msgs


def test_many_frames_in_one_feed() -> None:
    """Several frames arriving in one read are all returned."""
    msgs = [make_request(i, "ping") for i in range(100)]
    decoder = FrameDecoder()
    decoder.feed(b"".join(encode(m) for m in msgs))
    assert decoder.messages() == msgs


def test_oversized_prefix_rejected_before_body() -> None:
    """A length prefix above max_frame fails on the 4 header bytes, with no body buffered."""
    decoder = FrameDecoder(max_frame=1024)
    with pytest.raises(FrameError, match="exceeds the limit"):
        decoder.feed(struct.pack(">I", 1025))
    assert decoder.buffered == 0
    with pytest.raises(FrameError):  # the decoder stays broken: the stream is unusable
        decoder.feed(b"more")


def test_prefix_at_limit_accepted() -> None:
    """A frame exactly max_frame bytes long is accepted."""
    body = msgpack.packb({"k": "x" * 100})
    decoder = FrameDecoder(max_frame=len(body))
    decoder.feed(frame(body))
    assert decoder.next_message() == {"k": "x" * 100}


def test_huge_prefix_with_default_limit() -> None:
    """A 4 GiB prefix is refused under the 16 MiB default."""
    decoder = FrameDecoder()
    with pytest.raises(FrameError):
        decoder.feed(b"\xff\xff\xff\xff")


def test_encode_refuses_oversized_body() -> None:
    """encode() will not produce a frame the peer must reject."""
    with pytest.raises(FrameError):
        encode({"blob": b"x" * 100}, max_frame=50)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        pytest.param(b"\xc1", "undecodable", id="reserved-byte"),
        pytest.param(b"\x92\x01", "undecodable", id="truncated-array"),
        pytest.param(msgpack.packb({"a": 1}) + b"\x01", "undecodable", id="trailing-bytes"),
        pytest.param(msgpack.packb([1, 2]), "expected a map", id="array-payload"),
        pytest.param(msgpack.packb("hello"), "expected a map", id="str-payload"),
        pytest.param(msgpack.packb(None), "expected a map", id="nil-payload"),
        pytest.param(msgpack.packb({1: "x"}), "expected str", id="int-key"),
        pytest.param(msgpack.packb({b"id": 1}, use_bin_type=True), "expected str", id="bin-key"),
        pytest.param(msgpack.packb({"a": {2: 1}}), r"\$\.a", id="nested-int-key"),
        pytest.param(msgpack.packb({"a": [{None: 1}]}), r"\$\.a\[0\]", id="key-in-list"),
        pytest.param(msgpack.packb(msgpack.ExtType(5, b"xx")), "ext type", id="ext-type"),
        pytest.param(b"", "undecodable", id="empty-body"),
    ],
)
def test_bad_payloads(body: bytes, match: str) -> None:
    """Garbage, non-map payloads, non-str keys and ext types raise FrameError."""
    decoder = FrameDecoder()
    decoder.feed(frame(body))
    with pytest.raises(FrameError, match=match):
        decoder.next_message()


def test_bad_key_error_carries_request_id() -> None:
    """A frame with a bad key deep inside still reports the request id so it can be answered."""
    decoder = FrameDecoder()
    decoder.feed(frame(msgpack.packb({"id": 9, "op": "x", "args": {1: 2}})))
    with pytest.raises(FrameError) as info:
        decoder.next_message()
    assert info.value.request_id == 9
    assert info.value.code == "bad_request"


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=30,
)


# Two properties, not one: what a frame holds (every msgpack type, nested) and how a stream
# of frames is cut are independent (the decoder finds a frame by its length prefix alone),
# and drawing five large nested maps per example made one combined property take 5-30 s.
# The example counts come from the hypothesis profile (tests/conftest.py).


@given(value=msgpack_values, key=st.text(max_size=8))
def test_any_value_round_trips(value: Any, key: str) -> None:
    """Any msgpack value (nested lists and str-keyed maps included) under any str key
    survives encode + decode."""
    decoder = FrameDecoder()
    decoder.feed(encode({key: value}))
    assert decoder.messages() == [{key: value}]


@given(
    msgs=st.lists(
        st.dictionaries(st.text(max_size=8), st.binary(max_size=300) | st.text(max_size=40)),
        max_size=6,
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=8),
)
def test_a_stream_decodes_however_it_is_split(msgs: list[dict[str, Any]], cuts: list[int]) -> None:
    """A stream of str-keyed maps decodes to the same maps, however the stream is split."""
    data = b"".join(encode(m) for m in msgs)
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    decoder = FrameDecoder()
    out: list[dict[str, Any]] = []
    for start, end in itertools.pairwise(points):
        decoder.feed(data[start:end])
        out.extend(decoder.messages())
    assert out == msgs


# --------------------------------------------------------------------------- envelopes


@pytest.mark.parametrize(
    ("msg", "match", "request_id"),
    [
        pytest.param({"op": "ping", "args": {}}, "missing field 'id'", None, id="no-id"),
        pytest.param({"id": "1", "op": "ping"}, "'id' must be int, got str", None, id="str-id"),
        pytest.param({"id": True, "op": "ping"}, "'id' must be int, got bool", None, id="bool-id"),
        pytest.param({"id": 1.0, "op": "ping"}, "'id' must be int, got float", None, id="float-id"),
        pytest.param({"id": 3, "args": {}}, "missing field 'op'", 3, id="no-op"),
        pytest.param({"id": 3, "op": 5}, "'op' must be a non-empty str, got int", 3, id="int-op"),
        pytest.param({"id": 3, "op": ""}, "'op' must be a non-empty str", 3, id="empty-op"),
        pytest.param({"id": 3, "op": "x", "args": []}, "'args' must be a map, got list", 3,
                     id="list-args"),
        pytest.param({"id": 3, "op": "x", "extra": 1}, "unknown field", 3, id="extra-field"),
    ],
)  # fmt: skip
def test_parse_request_rejects(msg: dict[str, Any], match: str, request_id: int | None) -> None:
    """Malformed envelopes raise BadRequest naming the field, carrying the id when valid."""
    with pytest.raises(BadRequest, match=match) as info:
        parse_request(msg)
    assert info.value.request_id == request_id


def test_parse_request_accepts() -> None:
    """A well-formed request parses; missing or null args mean no args."""
    assert parse_request({"id": 1, "op": "ping"}).args == {}
    assert parse_request({"id": 1, "op": "ping", "args": None}).args == {}
    request = parse_request(make_request(2, "story", {"action_id": "a"}))
    assert (request.id, request.op, request.args) == (2, "story", {"action_id": "a"})


def test_responses_round_trip() -> None:
    """ok and error responses parse back into results and typed errors."""
    assert parse_response(ok_response(1, {"pong": True})).unwrap() == {"pong": True}
    response = parse_response(error_response(2, NotFound("env e1")))
    assert response.id == 2 and not response.ok
    with pytest.raises(NotFound, match="env e1"):
        response.unwrap()
    assert parse_response(error_response(None, BadRequest("x"))).id is None


@pytest.mark.parametrize(
    "msg",
    [
        pytest.param({"ok": True, "result": 1}, id="no-id"),
        pytest.param({"id": 1, "ok": "yes"}, id="str-ok"),
        pytest.param({"id": 1, "ok": True}, id="no-result"),
        pytest.param({"id": 1, "ok": False, "error": "boom"}, id="str-error"),
        pytest.param({"id": 1, "ok": False, "error": {"code": 1, "message": "m"}}, id="int-code"),
    ],
)
def test_parse_response_rejects(msg: dict[str, Any]) -> None:
    """A frame that is not a response raises MalformedResponse."""
    with pytest.raises(MalformedResponse):
        parse_response(msg)


# --------------------------------------------------------------------------- errors


def test_every_code_maps_to_its_class() -> None:
    """Each wire code turns back into an exception with the same code."""
    assert set(ERROR_CODES) == set(ERROR_CLASSES)
    for code in ERROR_CODES:
        exc = error_from_wire(code, "m")
        assert isinstance(exc, TangramError)
        assert exc.code == code and exc.message == "m"
        assert error_to_wire(exc) == {"code": code, "message": "m"}


def test_model_errors_travel() -> None:
    """The model's own errors keep their codes on the wire."""
    assert error_to_wire(InvalidDemand("cpu", "negative"))["code"] == "bad_request"
    assert isinstance(error_from_wire("unschedulable", "no gpu"), Unschedulable)


def test_unknown_code_and_untyped_exception() -> None:
    """Untyped exceptions become internal; an unknown code keeps its code on the client."""
    assert error_to_wire(KeyError("k")) == {"code": "internal", "message": "KeyError: 'k'"}
    assert error_to_wire(RuntimeError()) == {"code": "internal", "message": "RuntimeError"}
    exc = error_from_wire("teapot", "short and stout")
    assert exc.code == "teapot" and not isinstance(exc, InternalError)


# --------------------------------------------------------------------------- op table

VALID_ARGS: dict[str, dict[str, Any]] = {
    "ping": {},
    "story": {"action_id": "a1"},
    "env.open": {"image": "python:3.11", "mem": 1 << 30, "trajectory": "t"},
    "env.close": {"id": "e1"},
    "exec": {
        "cmd": ["python", "-c", "print(1)"], "env": "e1", "cpus": [1, 8], "mem": 0,
        "timeout_s": 2.5, "profile": "p", "elastic": True, "trajectory": "t", "task": "k",
        "t1_s": 10, "eff": {"1": 1.0, "2": 0.9}, "env_vars": {"A": ""},
    },
    "lease.acquire": {"api": "openai", "ttl_s": 30, "policy": "deadline", "deadline_s": 0},
    "lease.release": {"lease_id": "l1"},
    "profile.save": {
        "name": "p", "dop": {"1": 10.0, "2": 5.5}, "t1_s": 10.0, "eff": {"1": 1.0, "2": 0.91},
        "speedup": {"1": 1.0, "2": 1.82}, "elastic": True,
    },
}  # fmt: skip


@pytest.mark.parametrize("op", sorted(VALID_ARGS))
def test_valid_args_accepted(op: str) -> None:
    """A fully specified, valid call of each op passes validation."""
    validate_args(op, VALID_ARGS[op])


@pytest.mark.parametrize(
    ("op", "args", "match"),
    [
        ("exec", {}, "missing required arg 'cmd'"),
        ("exec", {"cmd": []}, "cmd: expected non-empty list"),
        ("exec", {"cmd": ["ls", 1]}, "cmd"),
        ("exec", {"cmd": ""}, "cmd"),
        ("exec", {"cmd": "ls", "cpus": 0}, "cpus"),
        ("exec", {"cmd": "ls", "cpus": [4, 2]}, "cpus"),
        ("exec", {"cmd": "ls", "cpus": [1, 2, 3]}, "cpus"),
        ("exec", {"cmd": "ls", "cpus": True}, "cpus"),
        ("exec", {"cmd": "ls", "mem": -1}, "mem: expected int >= 0"),
        ("exec", {"cmd": "ls", "mem": 1.5}, "mem: expected int"),
        ("exec", {"cmd": "ls", "timeout_s": -1}, "timeout_s"),
        ("exec", {"cmd": "ls", "timeout_s": 0}, "timeout_s"),
        ("exec", {"cmd": "ls", "timeout_s": math.nan}, "timeout_s"),
        ("exec", {"cmd": "ls", "timeout_s": math.inf}, "timeout_s"),
        ("exec", {"cmd": "ls", "timeout_s": "5"}, "timeout_s: expected finite number"),
        ("exec", {"cmd": "ls", "elastic": 1}, "elastic: expected bool"),
        ("exec", {"cmd": "ls", "eff": {"one": 1.0}}, "eff"),
        ("exec", {"cmd": "ls", "eff": {"1": -0.5}}, r"eff\.1"),
        ("exec", {"cmd": "ls", "env_vars": {"A": 1}}, r"env_vars\.A"),
        ("exec", {"cmd": "ls", "timeout": 5}, r"unknown arg\(s\) \['timeout'\]"),
        ("lease.acquire", {"api": "x", "policy": "maybe"}, "policy: expected one of"),
        ("lease.acquire", {"api": "x", "ttl_s": -5}, "ttl_s"),
        ("lease.acquire", {"api": "x", "deadline_s": -1, "policy": "deadline"}, "deadline_s"),
        ("lease.acquire", {"api": "x", "policy": "deadline"}, "deadline_s: required"),
        ("lease.acquire", {"api": "x", "policy": "wait", "deadline_s": 1}, "only allowed"),
        ("lease.acquire", {"api": 3}, "api: expected non-empty str, got int"),
        ("env.open", {"mem": -(2**40)}, "mem"),
        ("env.close", {}, "missing required arg 'id'"),
        ("profile.save", {**VALID_ARGS["profile.save"], "t1_s": math.nan}, "t1_s"),
        ("profile.save", {**VALID_ARGS["profile.save"], "dop": {"0": 1.0}}, "dop"),
        ("ping", {"x": 1}, "unknown arg"),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_invalid_args_rejected(op: str, args: dict[str, Any], match: str) -> None:
    """Wrong types, bad enum values, negatives and NaN are bad_request naming the field."""
    with pytest.raises(BadRequest, match=match) as info:
        validate_args(op, args)
    assert info.value.code == "bad_request"
    assert op in info.value.message


def test_null_optional_args_mean_absent() -> None:
    """An optional arg sent as null is treated as not given."""
    validate_args("exec", {"cmd": "ls", "mem": None, "timeout_s": None})


def test_unknown_op() -> None:
    """An op outside the table raises UnknownOp."""
    with pytest.raises(UnknownOp, match="frobnicate"):
        validate_args("frobnicate", {})


def test_op_table_is_documented() -> None:
    """Every op has a doc line, and the rendered docs mention every op and arg once."""
    text = render_markdown()
    for op in OPS.values():
        assert op.doc
        assert text.count(f"### `{op.name}`") == 1
        for arg in op.args:
            assert f"`{arg.name}`" in text


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0", 0), ("512", 512), ("512M", 512 << 20), ("2GiB", 2 << 30), ("1.5g", 3 << 29),
     ("4k", 4096), (1024, 1024)],
)  # fmt: skip
def test_parse_size(text: str | int, expected: int) -> None:
    """Sizes with binary suffixes parse to bytes."""
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["-1", "1X", "", "nan", -5, "1e9"])
def test_parse_size_rejects(text: str | int) -> None:
    """Negative, unknown-suffix and non-numeric sizes are bad_request."""
    with pytest.raises(BadRequest):
        parse_size(text)


def test_quota_error_class() -> None:
    """QuotaExceeded carries the quota_exceeded code."""
    assert QuotaExceeded("m").code == "quota_exceeded"


def _doc_section(section: str) -> str:
    """The text of one ``## `` section of docs/protocol.md ("" when it is missing)."""
    docs = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
    if section not in docs:
        return ""
    return docs.split(section, 1)[1].split("\n## ", 1)[0]


def test_docs_match_op_table() -> None:
    """docs/protocol.md's Ops section holds the op table exactly as ops.py renders it."""
    assert render_markdown().strip() in _doc_section("\n## Ops\n"), (
        "docs/protocol.md's op table is stale: paste in `python -m tangram.protocol ops`"
    )


def test_docs_match_link_table() -> None:
    """docs/protocol.md's Link messages section holds the link table exactly as link.py
    renders it."""
    assert link_table.render_markdown().strip() in _doc_section("\n## Link messages\n"), (
        "docs/protocol.md's link table is stale: paste in `python -m tangram.protocol link`"
    )


def test_protocol_tables_print_without_a_warning() -> None:
    """``python -m tangram.protocol ops|link`` prints each generated section, as the docs
    hold it, with nothing on stderr; anything else is a usage error (exit 2)."""
    import subprocess
    import sys

    for name, render in (("ops", render_markdown), ("link", link_table.render_markdown)):
        done = subprocess.run(
            [sys.executable, "-W", "error", "-m", "tangram.protocol", name],
            capture_output=True,
            text=True,
            check=True,
        )
        assert done.stderr == "" and done.stdout.strip() == render().strip()
    bad = subprocess.run(
        [sys.executable, "-m", "tangram.protocol", "nope"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "usage" in bad.stderr

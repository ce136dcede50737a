"""Bad input never crashes `tangramd up` nor leaks a core or a lease."""

from __future__ import annotations

import socket
import struct

import pytest
from harness import frame

from tangram.protocol.codec import FrameDecoder
from tangram.testing import wait_for


def raw(daemon) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(daemon.socket)
    return s


def read_reply(s: socket.socket) -> dict | None:
    dec = FrameDecoder()
    while True:
        try:
            data = s.recv(65536)
        except TimeoutError:
            return None
        if not data:
            return None
        dec.feed(data)
        msg = dec.next_message()
        if msg is not None:
            return msg


def assert_healthy(daemon) -> None:
    with daemon.client() as c:
        assert c.exec("true").outcome == "ok"
        st = c.status()
        assert st["pools"]["cpu:local"]["free"] == 2
        assert st["leases"] == 0


CASES = [
    ("garbage_body", struct.pack(">I", 4) + b"\xc1\xc1\xc1\xc1", True),
    ("non_map_message", frame([1, 2, 3]), True),
    ("oversized_prefix", struct.pack(">I", 1 << 31), True),
    ("unknown_op", frame({"id": 1, "op": "rm_rf", "args": {}}), False),
    ("wrong_arg_type", frame({"id": 2, "op": "exec", "args": {"cmd": 5}}), False),
    ("args_not_map", frame({"id": 3, "op": "status", "args": [1]}), False),
    (
        "nan_cpus",
        frame({"id": 4, "op": "exec", "args": {"cmd": "true", "cpus": float("nan")}}),
        False,
    ),
    ("absurd_mem", frame({"id": 5, "op": "env.open", "args": {"mem": -1}}), False),
]


@pytest.mark.parametrize(("name", "payload", "closes"), CASES, ids=[c[0] for c in CASES])
def test_bad_frames_get_typed_errors(daemon, name, payload, closes):
    """Each bad frame gets a typed error (and a closed connection when unframeable)."""
    s = raw(daemon)
    s.sendall(payload)
    reply = read_reply(s)
    assert reply is not None, name
    assert reply["ok"] is False
    assert reply["error"]["code"] in ("bad_request", "unknown_op"), reply
    if closes:
        assert s.recv(1) == b""
    s.close()
    assert_healthy(daemon)


def test_disconnect_mid_request_leaks_nothing(daemon):
    """A client that sends an exec and a lease request then vanishes leaks no core/lease."""
    s = raw(daemon)
    s.sendall(frame({"id": 1, "op": "exec", "args": {"cmd": "sleep 0.5", "cpus": 2}}))
    s.sendall(frame({"id": 2, "op": "lease.acquire", "args": {"api": "search"}}))
    with daemon.client() as c:
        # the lease request comes after the exec on the connection: both have been read
        wait_for(lambda: c.status()["leases"] == 1, 10, "the lease held")
        s.close()
        wait_for(lambda: c.status()["leases"] == 0, 10, "the lease returned")
        wait_for(lambda: c.status()["pools"]["cpu:local"]["free"] == 2, 10, "the cores freed")
    assert_healthy(daemon)


def test_half_frame_then_silence_does_not_block_others(daemon):
    """A slow client stuck mid-frame does not stop well-behaved clients being served."""
    s = raw(daemon)
    s.sendall(struct.pack(">I", 100) + b"\x80")
    assert_healthy(daemon)
    s.close()

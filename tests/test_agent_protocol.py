"""The in-container agent's protocol, served here on the host (it is stdlib Python): one
connection carries request after request; a frame that cannot be read is answered with an
error and the connection closed, and the agent goes on serving other connections."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tangramd.backends import agent


@pytest.fixture
def agent_sock(tmp_path: Path) -> Iterator[str]:
    path = str(tmp_path / "agent.sock")
    server = agent._Server(path, agent._Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield path
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _call(sock: socket.socket, frame: object) -> object:
    sock.sendall(agent.encode_frame(frame))
    return agent.recv_frame(sock)


def _exec(cmd: list[str]) -> dict[str, object]:
    return {"op": "exec", "cmd": cmd, "env": {}, "cores": None, "timeout_s": 5,
            "max_output": 1 << 16, "exec_id": "t", "cwd": None}  # fmt: skip


def test_one_connection_carries_many_requests(agent_sock: str) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(agent_sock)
        ping = _call(s, {"op": "ping"})
        assert isinstance(ping, dict) and ping["ok"] and ping["keepalive"] is True
        for i in range(3):
            reply = _call(s, _exec(["sh", "-c", f"echo {i}; exit {i}"]))
            assert isinstance(reply, dict), reply
            assert (reply["exit_code"], reply["stdout"]) == (i, f"{i}\n")
        bad = _call(s, ["not", "an", "object"])  # a whole frame, a bad request: keep serving
        assert bad == {"ok": False, "error": "ValueError: request must be a JSON object"}
        assert _call(s, {"op": "nope"}) == {"ok": False, "error": "unknown op 'nope'"}


def test_a_broken_frame_is_answered_and_its_connection_closed(agent_sock: str) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(agent_sock)
        s.sendall(struct.pack(">I", agent.MAX_FRAME + 1))
        reply = agent.recv_frame(s)
        assert isinstance(reply, dict) and reply["ok"] is False
        assert "frame too large" in str(reply["error"])
        assert s.recv(1) == b""  # closed: what follows on this stream cannot be framed
    with socket.socket(socket.AF_UNIX) as s:  # the agent still serves
        s.connect(agent_sock)
        reply = _call(s, {"op": "ping"})
        assert isinstance(reply, dict) and reply["ok"] is True

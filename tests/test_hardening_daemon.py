"""Issue 9 hardening of the daemon process and its transport, against a real `tangramd up`."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

import msgpack
import psutil
import pytest
from click.testing import CliRunner
from harness import running_daemon
from hostile_user import in_child_as, local_user

from tangram.protocol.codec import FrameDecoder
from tangram.testing import spawn_daemon, wait_for
from tangramd.main import cli as tangramd_cli

MIB = 1 << 20


def frame(obj: object) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def connect(path: str, timeout: float = 5.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    return s


def reply_or_eof(s: socket.socket) -> dict | None:
    """The first answer on ``s``, or None when the daemon closed without one."""
    dec = FrameDecoder()
    while True:
        try:
            data = s.recv(65536)
        except (TimeoutError, ConnectionResetError):
            return None
        if not data:
            return None
        dec.feed(data)
        if (msg := dec.next_message()) is not None:
            return msg


def closed_by_peer(s: socket.socket, within: float) -> bool:
    """Whether the daemon closes ``s`` within ``within`` seconds (answers are read past)."""
    s.settimeout(within)
    deadline = time.monotonic() + within
    try:
        while time.monotonic() < deadline:
            if not s.recv(65536):
                return True
    except (TimeoutError, ConnectionResetError):
        return False
    return False


def unread(s: socket.socket) -> int:
    """Bytes ``s`` sent that its peer has not read yet (SIOCOUTQ on a Unix socket)."""
    return int(struct.unpack("i", fcntl.ioctl(s.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0])


def ping(path: str) -> bool:
    s = connect(path)
    try:
        s.sendall(frame({"id": 1, "op": "ping", "args": {}}))
        msg = reply_or_eof(s)
        return bool(msg and msg.get("ok"))
    finally:
        s.close()


# --- item 7: one daemon per state dir


def test_second_daemon_on_the_same_state_dir_exits_naming_the_holder(tmp_path):
    """A second daemon (other socket, same state dir) exits 1 naming the first's pid."""
    with running_daemon(tmp_path / "a") as first:
        with first.client() as c:
            env = c.env_open()
            assert c.exec("echo kept > f", env=env).outcome == "ok"
        second = subprocess.run(
            [sys.executable, "-m", "tangramd.main", "up", "--socket", str(tmp_path / "b.sock"),
             "--state-dir", first.state_dir],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert second.returncode == 1
        assert f"in use by another tangramd (pid {first.proc.pid})" in second.stderr
        assert "Traceback" not in second.stderr
        with first.client() as c:  # the first daemon and its environment are untouched
            assert c.exec("cat f", env=env).stdout == "kept\n"


# --- item 14: clear start-up errors, -h


def test_socket_in_use_is_a_clear_message(tmp_path):
    """Starting on a socket another daemon serves prints one line, no traceback."""
    with running_daemon(tmp_path / "a") as first:
        second = subprocess.run(
            [sys.executable, "-m", "tangramd.main", "up", "--socket", first.socket,
             "--state-dir", str(tmp_path / "other")],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert second.returncode == 1
        assert "Traceback" not in second.stderr
        assert second.stderr.strip().splitlines()[-1] == (
            f"tangramd: cannot serve {first.socket}: another daemon is listening on it"
        )
        assert "exec_cgroups" not in second.stderr  # refused before building anything
        assert ping(first.socket)


def test_dash_h_is_help():
    """`tangramd -h` and `tangramd up -h` print help like `--help`."""
    for args in (["-h"], ["up", "-h"]):
        result = CliRunner().invoke(tangramd_cli, args)
        assert result.exit_code == 0 and "Usage:" in result.output


# --- item 4: private state


def test_state_dir_and_environments_are_private(tmp_path):
    """State dir 0711 (root: traversable, not listable), env dirs 0700, files 0600."""
    with running_daemon(tmp_path) as d:
        with d.client() as c:
            env = c.env_open()
            assert c.exec("echo secret > f", env=env).outcome == "ok"
        state = Path(d.state_dir)
        env_dir = state / "process" / "envs" / env
        assert stat.S_IMODE(state.stat().st_mode) == 0o711
        assert stat.S_IMODE(env_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE((env_dir / "f").stat().st_mode) == 0o600
        assert stat.S_IMODE((state / "tangramd.lock").stat().st_mode) == 0o600


# --- item 9: a frame has a deadline once its first byte arrives

SLOW_CONFIG = """
[daemon]
idle_timeout_s = 2
frame_timeout_s = 1
"""


def test_slow_sender_is_closed_at_the_frame_deadline(tmp_path):
    """A sender trickling one byte every 0.3 s is closed after frame_timeout_s."""
    with running_daemon(tmp_path, config=SLOW_CONFIG) as d:
        s = connect(d.socket)
        payload = frame({"id": 1, "op": "ping", "args": {"pad": "x" * 100}})
        started = time.monotonic()
        closed_at = None
        for byte in payload[:-1]:
            try:
                s.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed_at = time.monotonic()
                break
            if closed_by_peer(s, 0.3):
                closed_at = time.monotonic()
                break
        s.close()
        assert closed_at is not None and closed_at - started < 3.0
        assert ping(d.socket)


# --- item 10: caps on connections and buffered bytes

CAP_CONFIG = """
[daemon]
max_buffered_bytes = "64MiB"
max_connections = 400
"""


def test_hostile_half_frames_keep_memory_under_the_cap(tmp_path):
    """300 connections each holding 1 MiB of a 15 MiB frame stay under a 64 MiB buffer cap."""
    with running_daemon(tmp_path, config=CAP_CONFIG) as d:
        proc = psutil.Process(d.proc.pid)
        assert ping(d.socket)
        before = proc.memory_info().rss
        hostile: list[socket.socket] = []
        peak = before
        for i in range(300):
            s = connect(d.socket)
            hostile.append(s)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                s.sendall(struct.pack(">I", 15 * MIB) + b"\x80" + b"x" * (MIB - 1))
            if i % 25 == 0:
                peak = max(peak, proc.memory_info().rss)
                assert ping(d.socket), "a well-behaved client must be served meanwhile"
        wait_for(lambda: not any(map(unread, hostile)), 30, "the daemon read or dropped every byte")
        peak = max(peak, proc.memory_info().rss)
        assert ping(d.socket)
        for s in hostile:
            s.close()
        assert peak - before < 64 * MIB + 48 * MIB, (before, peak)
        assert "conn_buffer_shed" in d.log()


def test_connections_past_the_cap_are_refused_and_others_served(tmp_path):
    """Past max_connections a new connection is answered and closed; old ones still work."""
    with running_daemon(tmp_path, config="[daemon]\nmax_connections = 4\n") as d:
        held = [connect(d.socket) for _ in range(4)]
        extra = connect(d.socket)
        msg = reply_or_eof(extra)
        assert msg is not None and "too many connections" in msg["error"]["message"]
        held[0].sendall(frame({"id": 7, "op": "ping", "args": {}}))
        assert reply_or_eof(held[0])["id"] == 7
        held.pop().close()
        wait_for(lambda: ping(d.socket), 5, "a new connection served in the freed slot")
        for s in [*held, extra]:
            s.close()


# --- item 3: a peer allowlist, enforced at accept


def _ping_as(path: str, uid: int, gid: int) -> dict | None:
    """Ping from a forked child running as uid/gid; the answer, or None if closed."""

    def ping_raw() -> bytes:
        s = connect(path)
        # a refused peer may be answered and closed before its request is even written
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(frame({"id": 1, "op": "ping", "args": {}}))
        return msgpack.packb(reply_or_eof(s))

    return msgpack.unpackb(in_child_as(uid, gid, ping_raw))


@pytest.mark.parametrize("allowed", [True, False], ids=["in-allowlist", "not-in-allowlist"])
def test_peer_allowlist_is_enforced_at_accept(allowed):
    """With an allowlist, a peer that may open the socket but is not listed is refused."""
    with local_user() as user, tempfile.TemporaryDirectory(prefix="tga-", dir="/tmp") as tmp:
        os.chmod(tmp, 0o755)
        uids = [user.uid] if allowed else [user.uid + 1]
        daemon = spawn_daemon(tmp, f"[daemon]\nallowed_uids = {uids}\n")
        try:
            os.chown(daemon.socket, 0, user.gid)  # the operator's chgrp: the socket opens
            msg = _ping_as(daemon.socket, user.uid, user.gid)
            if allowed:
                assert msg is not None and msg["ok"], msg
            else:
                assert msg is not None and not msg["ok"]
                assert f"uid {user.uid} is not allowed" in msg["error"]["message"]
                assert "conn_refused" in daemon.log()
            assert ping(daemon.socket)  # root is always allowed
        finally:
            daemon.stop()


def test_a_shared_directory_is_refused_as_state_dir(tmp_path):
    """`--state-dir /tmp`-like directories are refused, never chmod'ed to 0700."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    result = subprocess.run(
        [sys.executable, "-m", "tangramd.main", "up", "--socket", str(tmp_path / "s.sock"),
         "--state-dir", str(shared)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 1 and "is shared" in result.stderr
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777

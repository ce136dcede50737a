"""In-container exec agent for the Docker backend (stdlib only; runs inside the container).

Started as the container's main process (under docker-init) as
``python3 agent.py /run/tangram-agent/agent.sock``; the directory is bind-mounted from the
host, which is the only way the daemon reaches it (containers have no network).

Protocol, one request per connection: a frame is a 4-byte big-endian length followed by
that many bytes of UTF-8 JSON (never pickle).

    {"op": "ping"}                                  -> {"ok": true, "pid": ..., "python": ...}
    {"op": "exec", "cmd": [..] | "sh string", "env": {..}, "cores": [0, 1],
     "timeout_s": 1.5 | null, "max_output": 1048576, "exec_id": "..", "cwd": null,
     "stdin_b64": null | "<base64 of the command's input>"}
        -> {"ok": true, "exit_code": 0, "stdout": "..", "stderr": "..",
            "timed_out": false, "truncated": false, "exec_s": 0.01}
    any failure of the agent itself                 -> {"ok": false, "error": "..."}

Each exec runs in its own session (process group), pinned to `cores` with sched_setaffinity
(the container's cpuset, updated by the daemon just before, restricts it too). The exec ends
when its main process exits; anything left in its group, or carrying its TANGRAM_EXEC_ID in
its environment, is killed then. A timeout sends SIGTERM to the group, SIGKILL 0.5 s later,
and returns the partial output. Must stay importable by Python 3.7+ and free of
third-party imports.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import selectors
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time

MAX_FRAME = 64 << 20
TRUNCATION_MARKER = "\n[tangram: output truncated, {dropped} bytes dropped]\n"
SIGTERM_GRACE_S = 0.5
DRAIN_AFTER_EXIT_S = 1.0
MARKER_VAR = "TANGRAM_EXEC_ID"
_HEADER = struct.Struct(">I")


# --- framing (shared with the host side, which imports these two functions) ----------


def encode_frame(obj: object) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return _HEADER.pack(len(body)) + body


def decode_header(header: bytes) -> int:
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME:
        raise ValueError(f"frame too large: {size} bytes")
    return size


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError("peer closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> object:
    size = decode_header(_recv_exact(sock, _HEADER.size))
    return json.loads(_recv_exact(sock, size))


# --- running one command -----------------------------------------------------------------


class _Capped:
    def __init__(self, limit: int) -> None:
        self.limit, self.data, self.dropped = limit, bytearray(), 0

    def feed(self, chunk: bytes) -> None:
        room = self.limit - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        self.dropped += max(0, len(chunk) - max(room, 0))

    def text(self) -> str:
        out = bytes(self.data).decode("utf-8", errors="replace")
        if self.dropped:
            out += TRUNCATION_MARKER.format(dropped=self.dropped)
        return out


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def kill_marked(exec_id: str) -> int:
    """SIGKILL every process whose environment carries this exec's marker; returns count."""
    needle = (f"{MARKER_VAR}={exec_id}").encode()
    killed = 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    os.kill(int(name), signal.SIGKILL)
                    killed += 1
        except OSError:
            pass
    return killed


def run_command(req: dict) -> dict:
    cmd = req["cmd"]
    argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else [str(a) for a in cmd]
    exec_id = str(req.get("exec_id") or f"{os.getpid()}-{time.time()}")
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in (req.get("env") or {}).items()})
    env[MARKER_VAR] = exec_id
    timeout_s = req.get("timeout_s")
    out, err = _Capped(int(req["max_output"])), _Capped(int(req["max_output"]))
    cores = req.get("cores")
    if cores:
        # Pin this handler thread: the child forked from it inherits the mask.
        os.sched_setaffinity(0, [int(c) for c in cores])
    data = base64.b64decode(req["stdin_b64"]) if req.get("stdin_b64") else b""
    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if data else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=req.get("cwd") or None,
            env=env,
            start_new_session=True,
        )
    except OSError as e:
        code = 127 if isinstance(e, FileNotFoundError) else 126
        msg = f"tangram: cannot run {argv[0]}: {e.strerror}\n"
        return _result(code, "", msg, False, False, time.monotonic() - started)
    if data:  # a thread: the command may never read its input
        threading.Thread(target=_feed, args=(proc.stdin, data), daemon=True).start()
    deadline = None if timeout_s is None else started + float(timeout_s)
    streams = {proc.stdout: out, proc.stderr: err}
    sel = selectors.DefaultSelector()
    for stream in streams:
        sel.register(stream, selectors.EVENT_READ)
    timed_out = False
    kill_at = None  # SIGKILL deadline after SIGTERM
    drain_until = None
    while sel.get_map():
        now = time.monotonic()
        if proc.poll() is not None and drain_until is None:
            _killpg(proc.pid, signal.SIGKILL)  # leftovers of a finished command
            kill_marked(exec_id)
            drain_until = now + DRAIN_AFTER_EXIT_S
        if deadline is not None and not timed_out and now >= deadline and drain_until is None:
            timed_out = True
            _killpg(proc.pid, signal.SIGTERM)
            kill_at = now + SIGTERM_GRACE_S
        if kill_at is not None and now >= kill_at:
            _killpg(proc.pid, signal.SIGKILL)
            kill_marked(exec_id)
            kill_at = None
        if drain_until is not None and now >= drain_until:
            break  # an escaped descendant holds a pipe open
        waits = [t - now for t in (deadline, kill_at, drain_until) if t is not None and t > now]
        for key, _ in sel.select(timeout=min([*waits, 0.05])):
            chunk = os.read(key.fd, 1 << 16)
            if chunk:
                streams[key.fileobj].feed(chunk)
            else:
                sel.unregister(key.fileobj)
    sel.close()
    returncode = proc.wait()
    exec_s = time.monotonic() - started
    if timed_out:
        exec_s = min(exec_s, float(timeout_s) + SIGTERM_GRACE_S)
    _killpg(proc.pid, signal.SIGKILL)
    kill_marked(exec_id)
    for stream in streams:
        stream.close()
    code = 128 - returncode if returncode < 0 else returncode
    truncated = bool(out.dropped or err.dropped)
    return _result(code, out.text(), err.text(), timed_out, truncated, exec_s)


def _feed(stream, data: bytes) -> None:
    with contextlib.suppress(OSError, ValueError):
        stream.write(data)
    with contextlib.suppress(OSError, ValueError):
        stream.close()


def _result(code, stdout, stderr, timed_out, truncated, exec_s) -> dict:
    return {
        "ok": True,
        "exit_code": code,
        "stdout": stdout,
        "stderr": stderr,
        "timed_out": timed_out,
        "truncated": truncated,
        "exec_s": exec_s,
    }


# --- server -------------------------------------------------------------------------------


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        try:
            req = recv_frame(self.request)
            if not isinstance(req, dict):
                raise ValueError("request must be a JSON object")
            op = req.get("op")
            if op == "ping":
                reply = {"ok": True, "pid": os.getpid(), "python": sys.version.split()[0]}
            elif op == "exec":
                reply = run_command(req)
            else:
                reply = {"ok": False, "error": f"unknown op {op!r}"}
        except EOFError:
            return
        except Exception as e:  # report, keep serving
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        with contextlib.suppress(OSError):
            self.request.sendall(encode_frame(reply))


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    request_queue_size = 64


def serve(path: str) -> None:
    tmp = path + ".tmp"
    for p in (path, tmp):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
    server = _Server(tmp, _Handler)
    os.rename(tmp, path)  # the socket appears only once it is listening
    server.serve_forever(poll_interval=3600)


if __name__ == "__main__":
    serve(sys.argv[1] if len(sys.argv) > 1 else "/run/tangram-agent/agent.sock")

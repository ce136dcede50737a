"""In-container exec agent for the Docker backend (stdlib only; runs inside the container).

Started as the container's main process (under docker-init) as
``python3 agent.py /run/tangram-agent/agent.sock``; the directory is bind-mounted from the
host, which is the only way the daemon reaches it (containers have no network).

Protocol: requests answered in turn on one connection, which stays open until the host
closes it (the host keeps an idle one for its next exec); a frame is a 4-byte big-endian
length followed by that many bytes of UTF-8 JSON (never pickle). A frame that cannot be
read is answered with an error and the connection closed.

    {"op": "ping"}               -> {"ok": true, "pid": ..., "python": ..., "keepalive": true}
    {"op": "exec", "cmd": [..] | "sh string", "env": {..}, "cores": [0, 1],
     "timeout_s": 1.5 | null, "max_output": 1048576, "exec_id": "..", "cwd": null,
     "stdin_b64": null | "<base64 of the command's input>"}
        -> {"ok": true, "exit_code": 0, "stdout": "..", "stderr": "..",
            "timed_out": false, "truncated": false, "exec_s": 0.01}
    {"op": "session_open", "id": ".."}              -> {"ok": true}
    {"op": "session_run", "id": "..", "script": "..", "token": "..", "cores": [0],
     "timeout_s": 1.5 | null, "max_output": 1048576}
        -> the exec reply (exit_code null and "ended": true if the shell itself ended)
    {"op": "session_interrupt", "id": ".."}         -> {"ok": true, "interrupted": bool}
    {"op": "session_close", "id": ".."}             -> {"ok": true}
    any failure of the agent itself                 -> {"ok": false, "error": "..."}

Sessions are persistent interactive bash shells (the daemon's ``shell.py`` writes the
script of each run: the command, then a line printing ``\n<token>:<status>:<token>\n`` on
stdout and stderr). A run ends when both markers arrived; a timeout sends SIGINT to the
shell and to what the run started (SIGKILL to those 0.5 s later), so the shell survives.

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
import re
import selectors
import shutil
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
from typing import IO, Any

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
    size: int = _HEADER.unpack(header)[0]
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


def run_command(req: dict[str, Any]) -> dict[str, Any]:
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
    timeout = None if timeout_s is None else float(timeout_s)
    deadline = None if timeout is None else started + timeout
    stdout, stderr = proc.stdout, proc.stderr
    assert stdout is not None and stderr is not None  # both are pipes (Popen above)
    streams = (stdout, stderr)
    buffers = {stdout.fileno(): out, stderr.fileno(): err}  # fd -> its capped buffer
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
                buffers[key.fd].feed(chunk)
            else:
                sel.unregister(key.fileobj)
    sel.close()
    returncode = proc.wait()
    exec_s = time.monotonic() - started
    if timed_out and timeout is not None:  # timed_out implies a timeout
        exec_s = min(exec_s, timeout + SIGTERM_GRACE_S)
    _killpg(proc.pid, signal.SIGKILL)
    kill_marked(exec_id)
    for stream in streams:
        stream.close()
    code = 128 - returncode if returncode < 0 else returncode
    truncated = bool(out.dropped or err.dropped)
    return _result(code, out.text(), err.text(), timed_out, truncated, exec_s)


def _feed(stream: IO[bytes], data: bytes) -> None:
    with contextlib.suppress(OSError, ValueError):
        stream.write(data)
    with contextlib.suppress(OSError, ValueError):
        stream.close()


def _result(
    code: int, stdout: str, stderr: str, timed_out: bool, truncated: bool, exec_s: float
) -> dict[str, Any]:
    return {
        "ok": True,
        "exit_code": code,
        "stdout": stdout,
        "stderr": stderr,
        "timed_out": timed_out,
        "truncated": truncated,
        "exec_s": exec_s,
    }


# --- persistent shell sessions ------------------------------------------------------------

MARKER_WAIT_S = 2.0
_SESSIONS: dict[str, _Session] = {}  # id -> _Session
_SESSIONS_LOCK = threading.Lock()


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    return kids


def _descendants(pid: int) -> list[int]:
    kids, out, todo = _children_map(), [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class _SessionStream:
    """One pipe of a shell: bytes up to the run's marker go to the run's capped buffer."""

    def __init__(self) -> None:
        self.pending = b""
        self.buffer: _Capped | None = None
        self.marker: re.Pattern[bytes] | None = None
        self.status: int | None = None
        self.done = False

    def start(self, buffer: _Capped, marker: re.Pattern[bytes]) -> None:
        self.pending, self.buffer, self.marker, self.status, self.done = (
            b"",
            buffer,
            marker,
            None,
            False,
        )

    def feed(self, data: bytes) -> None:
        if self.buffer is None or self.marker is None:
            return  # a background job's output between runs (start sets both)
        self.pending += data
        match = self.marker.search(self.pending)
        if match is not None:
            self.buffer.feed(self.pending[: match.start()])
            self.status = int(match.group(1))
            self.pending, self.buffer, self.done = b"", None, True
            return
        if len(self.pending) > 96:
            self.buffer.feed(self.pending[:-96])
            self.pending = self.pending[-96:]

    def eof(self) -> None:
        if self.buffer is not None:
            self.buffer.feed(self.pending)
        self.pending, self.buffer, self.done = b"", None, True


class _Session:
    def __init__(self, session_id: str) -> None:
        bash = shutil.which("bash") or "/bin/bash"
        self.proc = subprocess.Popen(
            [bash, "--noprofile", "--norc", "--noediting", "-i"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(os.environ, **{MARKER_VAR: "session-" + session_id}),
            start_new_session=True,
        )
        stdin = self.proc.stdin
        assert stdin is not None  # a pipe (Popen above)
        self.stdin: IO[bytes] = stdin
        self.cond = threading.Condition()
        self.streams = (_SessionStream(), _SessionStream())
        self.run_lock = threading.Lock()
        self.older: set[int] | None = None  # pids the shell had before the current run
        self.ended = False
        for pipe, stream in (
            (self.proc.stdout, self.streams[0]),
            (self.proc.stderr, self.streams[1]),
        ):
            threading.Thread(target=self._pump, args=(pipe, stream), daemon=True).start()

    def _pump(self, pipe: IO[bytes], stream: _SessionStream) -> None:
        while True:
            try:
                chunk = os.read(pipe.fileno(), 1 << 16)
            except OSError:
                chunk = b""
            with self.cond:
                if chunk:
                    stream.feed(chunk)
                else:
                    stream.eof()
                    self.ended = True
                self.cond.notify_all()
            if not chunk:
                return

    def _wait(self, seconds: float | None) -> bool:
        deadline = None if seconds is None else time.monotonic() + seconds
        with self.cond:
            while not all(s.done for s in self.streams):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cond.wait(left)
        return True

    def interrupt(self, sig: int = signal.SIGINT) -> int:
        older = self.older
        if older is None:
            return 0
        hit = 0
        if sig == signal.SIGINT:
            with contextlib.suppress(OSError):
                os.kill(self.proc.pid, sig)
        for pid in _descendants(self.proc.pid):
            if pid not in older:
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
                    hit += 1
        return hit

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        with self.run_lock:
            if self.ended or self.proc.poll() is not None:
                return {"ok": False, "error": "the session's shell has ended"}
            cores = [int(c) for c in req.get("cores") or []]
            if cores:  # re-pin the shell and every job it left to this run's cores
                for pid in [self.proc.pid, *_descendants(self.proc.pid)]:
                    with contextlib.suppress(OSError):
                        os.sched_setaffinity(pid, cores)
            token = str(req["token"]).encode()
            marker = re.compile(b"\n" + token + b":(-?[0-9]+):" + token + b"\n")
            out, err = _Capped(int(req["max_output"])), _Capped(int(req["max_output"]))
            with self.cond:
                self.streams[0].start(out, marker)
                self.streams[1].start(err, marker)
            self.older = set(_descendants(self.proc.pid))
            started = time.monotonic()
            try:
                self.stdin.write(str(req["script"]).encode())
                self.stdin.flush()
            except OSError as e:
                self.older = None
                return {"ok": False, "error": f"cannot write to the shell: {e}"}
            timeout_s = req.get("timeout_s")
            timed_out = not self._wait(None if timeout_s is None else float(timeout_s))
            if timed_out:
                self.interrupt(signal.SIGINT)
                if not self._wait(SIGTERM_GRACE_S):
                    self.interrupt(signal.SIGKILL)
                    if not self._wait(MARKER_WAIT_S):
                        self.close()
                        self._wait(MARKER_WAIT_S)
            exec_s = time.monotonic() - started
            self.older = None
            status = self.streams[0].status
            ended = status is None
            if status is None:
                returncode = self.proc.wait()
                status = 128 - returncode if returncode < 0 else returncode
            truncated = bool(out.dropped or err.dropped)
            reply = _result(status, out.text(), err.text(), timed_out, truncated, exec_s)
            reply["ended"] = ended
            return reply

    def close(self) -> None:
        procs = _descendants(self.proc.pid)
        _killpg(self.proc.pid, signal.SIGKILL)
        for pid in procs:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(OSError):
            self.stdin.close()


def session_op(op: str, req: dict[str, Any]) -> dict[str, Any]:
    sid = str(req["id"])
    if op == "session_open":
        opened = _Session(sid)
        with _SESSIONS_LOCK:
            _SESSIONS[sid] = opened
        return {"ok": True}
    with _SESSIONS_LOCK:
        session = _SESSIONS.pop(sid, None) if op == "session_close" else _SESSIONS.get(sid)
    if session is None:
        return {"ok": False, "error": f"no such session {sid}"}
    if op == "session_run":
        return session.run(req)
    if op == "session_interrupt":
        return {"ok": True, "interrupted": session.interrupt() > 0}
    session.close()
    return {"ok": True}


# --- server -------------------------------------------------------------------------------


class _Handler(socketserver.BaseRequestHandler):
    """One connection: requests answered in turn until the host closes it (the host keeps
    an idle connection for its next exec, ``keepalive`` in the ping reply)."""

    def handle(self) -> None:
        while True:
            try:
                req = recv_frame(self.request)
            except (EOFError, OSError):
                return
            except Exception as e:  # a broken frame: answer, then close (the stream is lost)
                self._send({"ok": False, "error": f"{type(e).__name__}: {e}"})
                return
            try:
                reply = self._answer(req)
            except Exception as e:  # report, keep serving
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            if not self._send(reply):
                return

    @staticmethod
    def _answer(req: object) -> dict[str, Any]:
        if not isinstance(req, dict):
            raise ValueError("request must be a JSON object")
        op = req.get("op")
        if op == "ping":
            return {
                "ok": True, "pid": os.getpid(), "python": sys.version.split()[0],
                "keepalive": True,
            }  # fmt: skip
        if op == "exec":
            return run_command(req)
        if op in ("session_open", "session_run", "session_interrupt", "session_close"):
            return session_op(op, req)
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _send(self, reply: dict[str, Any]) -> bool:
        try:
            self.request.sendall(encode_frame(reply))
        except OSError:
            return False
        return True


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

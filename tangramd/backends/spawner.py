"""The process backend's fork server: spawns exec commands already in place.

Spawning from the daemon itself cost a thread hop per exec (a v1 cgroup join may wait for
an RCU grace period, which must not stall the event loop) and a ``/bin/sh`` wrapper per
exec (the only way to raise the command's ``oom_score_adj`` before it can fork, without a
``preexec_fn``). Both together were most of a lone action's overhead. The fork server does
the same work in a small single-threaded helper process instead:

- for each request it joins the exec's cgroup (``cgroup.procs``: it is one thread, so the
  whole helper moves), pins itself to the exec's cores, raises its own ``oom_score_adj``,
  spawns the command (``posix_spawn``; ``subprocess`` when it must switch user), then
  returns home: its own cgroup, its affinity, its score. The child inherits all three at
  the fork, so the command never runs anywhere else and needs no gate and no wrapper;
- it is the command's parent: it watches each child by pidfd, reaps it and reports the
  exit status;
- it holds the daemon's protection while idle (the score is raised only around the
  fork); if it cannot go home (cgroup or score), it exits rather than stay there, and the
  daemon starts a new one on the next exec.

The daemon side (:class:`Spawner`) talks to it over a private socket pair: frames of a
4-byte length and a JSON map, the child's pipe ends passed with ``SCM_RIGHTS``. It is
callback-based: the request leaves in the caller's turn of the event loop, and the pid and
the exit status reach the backend within the turn that reads them. When the
helper dies, what it had in flight fails (the backend ends those actions with
``infra_error`` and kills what they left by cgroup and process group) and the next exec
starts a new one.

This file runs as ``python -I -S spawner.py FD`` for the helper: the helper half imports
the standard library only.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

_HEADER = struct.Struct(">I")
_MAX_FDS = 3


# --- the helper (runs in its own process) --------------------------------------------


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes | None:
    """Read ``n`` bytes (None at EOF), collecting any passed descriptors into ``fds``."""
    buf = b""
    while len(buf) < n:
        data, anc, _flags, _addr = sock.recvmsg(
            n - len(buf), socket.CMSG_SPACE(_MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC
        )
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                fds.extend(got)
        if not data:
            return None
        buf += data
    return buf


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    body = json.dumps(msg).encode()
    sock.sendall(_HEADER.pack(len(body)) + body)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


class _CannotStart(Exception):
    """Not the command's fault (e.g. its working directory is gone): no exit code."""


def _posix_spawn(msg: dict[str, Any], stdio: dict[str, int]) -> int:
    """Spawn as the helper's own user with ``posix_spawn`` (vfork and exec, no Python in
    the child: about 0.15 ms less than ``subprocess`` here). The helper is single-threaded,
    so it may lend the child its cwd and umask for the call. Every descriptor of the helper
    is close-on-exec, so the child gets exactly its three."""
    argv, env = msg["argv"], msg["env"]
    path = argv[0] if "/" in argv[0] else shutil.which(argv[0], path=env.get("PATH", os.defpath))
    if path is None:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", argv[0])
    actions: list[tuple[Any, ...]] = []
    if "stdin" in stdio:
        actions.append((os.POSIX_SPAWN_DUP2, stdio["stdin"], 0))
    else:
        actions.append((os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0))
    actions += [
        (os.POSIX_SPAWN_DUP2, stdio["stdout"], 1),
        (os.POSIX_SPAWN_DUP2, stdio["stderr"], 2),
    ]
    try:
        os.chdir(msg["cwd"])
    except OSError as e:
        raise _CannotStart(f"cwd {msg['cwd']}: {e.strerror}") from None
    old_umask = os.umask(msg["umask"])
    try:
        return os.posix_spawn(
            path,
            argv,
            env,
            file_actions=actions,
            setsid=True,
            setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),  # ignored here; defaults for it
        )
    finally:
        os.umask(old_umask)
        os.chdir("/")


def _popen(msg: dict[str, Any], stdio: dict[str, int]) -> subprocess.Popen[bytes]:
    """Spawn as another user (``subprocess`` switches uid, gid and drops groups)."""
    user = msg["user"]
    return subprocess.Popen(
        msg["argv"],
        stdin=stdio.get("stdin", subprocess.DEVNULL),
        stdout=stdio["stdout"],
        stderr=stdio["stderr"],
        cwd=msg["cwd"],
        env=msg["env"],
        start_new_session=True,
        umask=msg["umask"],
        user=user[0],
        group=user[1],
        extra_groups=[],  # drop root's groups
    )


class _Helper:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sel = selectors.DefaultSelector()
        # pidfd -> (pid, its Popen when spawned by one)
        self.children: dict[int, tuple[int, subprocess.Popen[bytes] | None]] = {}
        self.lock = threading.Lock()
        self.affinity = os.sched_getaffinity(0)
        with open("/proc/self/oom_score_adj") as f:
            self.score = f.read().strip()

    def run(self) -> None:
        self.sel.register(self.sock, selectors.EVENT_READ)
        while True:
            for key, _ in self.sel.select():
                if key.fileobj is self.sock:
                    if not self._request():
                        return  # the daemon is gone: its commands are its business
                else:
                    self._reap(key.fd)

    def _request(self) -> bool:
        fds: list[int] = []
        head = _recv_exact(self.sock, _HEADER.size, fds)
        body = None if head is None else _recv_exact(self.sock, _HEADER.unpack(head)[0], fds)
        if body is None:
            return False
        msg = json.loads(body)
        try:
            reply = self._spawn(msg, fds)
        finally:
            for fd in fds:
                os.close(fd)
        self._send(reply)
        if reply.get("fatal"):
            sys.exit(reply["fatal"])
        return True

    def _spawn(self, msg: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        rid = msg["id"]
        if len(fds) != len(msg["fds"]):
            return {"id": rid, "error": "descriptors lost in transit"}
        stdio = dict(zip(msg["fds"], fds, strict=True))
        cgroup, home = msg.get("cgroup"), msg.get("home")
        try:
            if cgroup:
                _write(os.path.join(cgroup, "cgroup.procs"), "0")  # 0: the writer itself
            os.sched_setaffinity(0, msg["cores"])
        except OSError as e:
            why = f"cannot pin the command to cores {msg['cores']}: {e}"
            return {"id": rid, "error": why, **self._home(home)}
        try:
            _write("/proc/self/oom_score_adj", str(msg["oom_score_adj"]))
            if msg.get("user") is None:
                pid, popen = _posix_spawn(msg, stdio), None
            else:
                popen = _popen(msg, stdio)
                pid = popen.pid
        except _CannotStart as e:
            return {"id": rid, "error": str(e), **self._home(home)}
        except OSError as e:
            return {"id": rid, "errno": e.errno or 0, "error": str(e), **self._home(home)}
        except subprocess.SubprocessError as e:
            return {"id": rid, "error": str(e), **self._home(home)}
        back = self._home(home)
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # no pidfd (Linux < 5.3): a thread waits for this child
            threading.Thread(target=self._wait, args=(pid, popen), daemon=True).start()
        else:
            self.children[pidfd] = (pid, popen)
            self.sel.register(pidfd, selectors.EVENT_READ)
        return {"id": rid, "pid": pid, **back}

    def _home(self, home: str | None) -> dict[str, Any]:
        """Back to our own cgroup, affinity and score; ``fatal`` if that fails."""
        try:
            if home:
                _write(os.path.join(home, "cgroup.procs"), "0")
            os.sched_setaffinity(0, self.affinity)
            _write("/proc/self/oom_score_adj", self.score)
        except OSError as e:
            return {"fatal": f"tangram spawner cannot return home: {e}"}
        return {}

    def _reap(self, pidfd: int) -> None:
        pid, popen = self.children.pop(pidfd)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        self._wait(pid, popen)

    def _wait(self, pid: int, popen: subprocess.Popen[bytes] | None) -> None:
        # A Popen child is reaped by its Popen (which would otherwise reap it itself).
        rc = popen.wait() if popen else os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        with contextlib.suppress(ConnectionError):  # the loop then reads EOF and exits
            self._send({"exit": pid, "rc": rc})

    def _send(self, msg: dict[str, Any]) -> None:
        with self.lock:  # waiting threads (no pidfd) answer too
            try:
                _send(self.sock, msg)
            except ConnectionError:  # the daemon is gone: stop serving
                self.sock.shutdown(socket.SHUT_RDWR)
                raise


def _serve(fd: int) -> None:
    os.set_inheritable(fd, False)  # the commands get their three descriptors, nothing else
    os.chdir("/")
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    # The daemon gone (killed, or closed its end): its commands are its business; exit
    # quietly.
    with contextlib.suppress(ConnectionError):
        _Helper(sock).run()


# --- the daemon side ----------------------------------------------------------------


class SpawnError(Exception):
    """The helper could not spawn: ``errno`` set when exec itself failed (e.g. ENOENT)."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class SpawnerGone(SpawnError):
    """The helper died: what it had in flight has no answer."""


SpawnReply = Callable[[int | SpawnError], None]
"""Called once with the spawned pid, or the error that prevented the spawn."""
ExitWatch = Callable[[int | None], None]
"""Called once with a watched pid's returncode (as ``Popen.returncode``: -N for a signal),
or None when the helper died before reporting it."""


class Spawner:
    """The daemon's end of one helper process; started on first use, restarted if it dies.

    Callback-based, so that a spawn request leaves within the caller's turn of the event
    loop and an exit report reaches its watcher within the turn that reads it (no task
    wake-ups on the exec path). Callbacks run on the loop thread, never inside ``submit``.
    """

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = 0
        self._pending: dict[int, SpawnReply] = {}
        self._watch: dict[int, ExitWatch] = {}
        self._inbuf = bytearray()
        self._out: deque[tuple[bytes, list[int]]] = deque()  # unsent frames (and fds)
        self._sent = 0  # bytes of _out[0] already sent

    @property
    def pid(self) -> int | None:
        """The helper's pid while it runs."""
        return self._proc.pid if self._proc is not None else None

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", __file__, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a ^C to the daemon's terminal is not for it
            )
        finally:
            theirs.close()
        ours.setblocking(False)
        loop.add_reader(ours.fileno(), self._on_readable)
        self._sock, self._loop = ours, loop

    def submit(self, request: dict[str, Any], stdio: dict[str, int], reply: SpawnReply) -> None:
        """Ask for one command to be spawned; ``reply(pid or SpawnError)`` follows. ``stdio``
        maps "stdin"/"stdout"/"stderr" to descriptors the helper gets copies of: the caller
        closes its own once ``reply`` is called (they travel when the request is sent)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self.close()  # a helper of an earlier event loop (tests run one per call)
            self._start(loop)
        self._ids += 1
        rid = self._ids
        names = list(stdio)
        body = json.dumps({**request, "id": rid, "fds": names}).encode()
        self._pending[rid] = reply
        self._out.append((_HEADER.pack(len(body)) + body, [stdio[n] for n in names]))
        self._flush()

    async def spawn(self, request: dict[str, Any], stdio: dict[str, int]) -> int:
        """``submit`` as a coroutine: the pid (raises SpawnError)."""
        fut: asyncio.Future[int | SpawnError] = asyncio.get_running_loop().create_future()

        def reply(got: int | SpawnError) -> None:
            if not fut.done():
                fut.set_result(got)

        self.submit(request, stdio, reply)
        got = await fut
        if isinstance(got, SpawnError):
            raise got
        return got

    def watch(self, pid: int, on_exit: ExitWatch) -> None:
        """Call ``on_exit`` when the helper reports ``pid``'s exit (register it from the
        spawn's reply: the exit report comes after it)."""
        self._watch[pid] = on_exit

    def forget(self, pid: int) -> None:
        self._watch.pop(pid, None)

    def _flush(self) -> None:
        sock = self._sock
        assert sock is not None and self._loop is not None
        while self._out:
            frame, fds = self._out[0]
            try:
                if self._sent == 0:
                    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                    n = sock.sendmsg([frame], anc if fds else [])
                else:
                    n = sock.send(frame[self._sent :])
            except (BlockingIOError, InterruptedError):
                self._loop.add_writer(sock.fileno(), self._flush)
                return
            except OSError:
                self._gone()
                return
            self._sent += n
            if self._sent < len(frame):
                self._loop.add_writer(sock.fileno(), self._flush)
                return
            self._out.popleft()
            self._sent = 0
        self._loop.remove_writer(sock.fileno())

    def _on_readable(self) -> None:
        sock = self._sock
        assert sock is not None
        try:
            data = sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._gone()
            return
        buf = self._inbuf
        buf += data
        while len(buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(buf)
            if len(buf) < _HEADER.size + n:
                break
            msg = json.loads(bytes(buf[_HEADER.size : _HEADER.size + n]))
            del buf[: _HEADER.size + n]
            self._dispatch(msg)

    def _dispatch(self, msg: dict[str, Any]) -> None:
        if "exit" in msg:
            on_exit = self._watch.pop(msg["exit"], None)
            if on_exit is not None:
                on_exit(msg["rc"])
            return
        reply = self._pending.pop(msg["id"], None)
        if reply is None:
            return
        if "pid" in msg:
            reply(msg["pid"])
        else:
            reply(SpawnError(msg["error"], msg.get("errno")))

    def _gone(self) -> None:
        """The helper died or closed: fail what it had in flight; the next spawn restarts it."""
        self.close()

    def close(self) -> None:
        """Stop the helper (its running commands are the backend's to end). What it had in
        flight is answered on the next turn of the loop: spawns with ``SpawnerGone``, exit
        watchers with None."""
        sock, self._sock = self._sock, None
        loop, self._loop = self._loop, None
        if sock is not None and loop is not None:
            with contextlib.suppress(Exception):  # the loop may be closed already
                loop.remove_reader(sock.fileno())
                loop.remove_writer(sock.fileno())
        if sock is not None:
            sock.close()
        self._out.clear()
        self._sent = 0
        self._inbuf.clear()
        pending, self._pending = self._pending, {}
        watch, self._watch = self._watch, {}
        if loop is not None:
            gone = SpawnerGone("the spawner process died")
            with contextlib.suppress(RuntimeError):  # its loop is closed
                for reply in pending.values():
                    loop.call_soon(reply, gone)
                for on_exit in watch.values():
                    loop.call_soon(on_exit, None)
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1)  # it exits on EOF
            if proc.poll() is None:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))

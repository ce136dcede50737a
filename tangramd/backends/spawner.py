"""The daemon's end of the process backend's fork server (``forkserver.py``, the helper
program that spawns exec commands already in place; it imports the standard library only).

The daemon side (:class:`Spawner`) talks to it over a private socket pair: frames of a
4-byte length and a JSON map, the child's pipe ends passed with ``SCM_RIGHTS`` (the wire
constants are the fork server's). It is callback-based: the request leaves in the caller's
turn of the event loop, and the pid and the exit status reach the backend within the turn
that reads them. When the helper dies, what it had in flight fails (the backend ends those
actions with ``infra_error`` and kills what they left by cgroup and process group) and the
next exec starts a new one.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from typing import Any

from tangramd.backends import forkserver
from tangramd.backends.forkserver import HEADER, MAX_FDS, pack_frame

NATIVE_ENV = "TANGRAM_NATIVE_LODGER"  # "0": lodgers run their loop in Python


class SpawnError(Exception):
    """The helper could not spawn: ``errno`` set when exec itself failed (e.g. ENOENT);
    ``stage`` "cwd" when the working directory is missing inside an environment."""

    def __init__(self, message: str, errno: int | None = None, stage: str = "") -> None:
        super().__init__(message)
        self.errno = errno
        self.stage = stage


class SpawnerGone(SpawnError):
    """The helper died: what it had in flight has no answer."""


SpawnReply = Callable[[int | SpawnError], None]
"""Called once with the spawned pid, or the error that prevented the spawn."""
ExitWatch = Callable[[int | None, bool], None]
"""Called once with a watched pid's returncode (as ``Popen.returncode``: -N for a signal),
or None when the helper died before reporting it; and ``alone``: True when the helper (a
subreaper lodger) saw nothing the command started left alive."""


class _Channel:
    """One socket to a helper process (the fork server or a lodger) and its frame buffers."""

    __slots__ = (
        "cgroup", "fd", "fds", "inbuf", "key", "native", "out", "pid", "ready", "sent", "sock",
        "used",
    )  # fmt: skip

    def __init__(
        self, sock: socket.socket, pid: int | None, cgroup: str | None, key: str | None = None
    ) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.pid = pid
        self.cgroup = cgroup  # a lodger's cgroup (None: the fork server)
        self.key = key or cgroup  # what it serves: its cgroup, or its cgroup in one environment
        self.used = 0  # (a lodger) the spawn counter when it last served
        self.ready = cgroup is None  # a lodger takes spawns once it has joined
        self.native = False  # a lodger running its loop in C (``_lodger.c``)
        self.inbuf = bytearray()
        self.fds: list[int] = []  # descriptors received and not yet claimed by a frame
        self.out: deque[tuple[bytes, list[int]]] = deque()  # unsent frames (and fds)
        self.sent = 0  # bytes of out[0] already sent


class Spawner:
    """The daemon's end of the fork server; started on first use, restarted if it dies.

    With ``lodgers`` > 0 (cgroup v1) it also keeps up to that many *lodgers*: copies of
    the fork server that each live in one exec cgroup for good, pinned to its cores at the
    exec OOM score. A spawn for a cgroup with a lodger goes to the lodger, whose child is
    born in place: no cgroup move on the exec's path. (A v1 move waits for an RCU grace
    period when no move happened in the last few tens of milliseconds: 5-15 ms here, most
    of a lone action's latency after an idle gap.) The first spawn for a cgroup takes the
    fork server's path (join, spawn, go home) and asks for a lodger there for the next one.
    A lodger's pid is in ``lodger_pids`` before it enters its cgroup, so the backend never
    takes it for a command's leftover; it exits when its socket closes.

    Callback-based, so that a spawn request leaves within the caller's turn of the event
    loop and an exit report reaches its watcher within the turn that reads it (no task
    wake-ups on the exec path). Callbacks run on the loop thread, never inside ``submit``.
    """

    def __init__(
        self,
        *,
        lodgers: int = 0,
        base_env: dict[str, str] | None = None,
        native: bool | None = None,
    ) -> None:
        self.max_lodgers = lodgers
        # lodgers run their loop in C where it was built (None: unless the environment
        # says TANGRAM_NATIVE_LODGER=0, to compare with the Python loop)
        self.native = os.environ.get(NATIVE_ENV, "1") != "0" if native is None else native
        self.base_env = dict(base_env or {})
        self._proc: subprocess.Popen[bytes] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._helper: _Channel | None = None
        # lodge key (a cgroup, or a cgroup in one isolated environment) -> its lodger
        self._lodgers: dict[str, _Channel] = {}
        self._asked: dict[int, dict[str, Any]] = {}  # request id -> a lodger's join order
        self._refused: set[str] = set()  # cgroups a lodger could not join: not asked again
        self._ids = 0
        # request id -> (reply, the channel it went to, the frame and descriptors it sent)
        self._pending: dict[int, tuple[SpawnReply, _Channel, bytes, list[int]]] = {}
        self._origin: dict[int, _Channel] = {}  # spawned pid -> the channel that spawned it
        self._watch: dict[int, ExitWatch] = {}
        self.lodger_pids: set[int] = set()
        """Pids of the lodgers (live or starting): not leftovers of any command."""
        self._generation = 0

    @property
    def generation(self) -> int:
        """How many fork servers this spawner has started (the current one's number)."""
        return self._generation

    def serves(self, loop: asyncio.AbstractEventLoop, generation: int | None) -> bool:
        """Whether the fork server of ``generation`` is still the one serving ``loop``."""
        return self._loop is loop and self._helper is not None and generation == self._generation

    def lodged(self) -> set[str]:
        """The cgroups that have a lodger (live or joining)."""
        return {chan.cgroup for chan in self._lodgers.values() if chan.cgroup is not None}

    def release(self, prefix: str) -> None:
        """End the lodgers whose lodge key starts with ``prefix`` (an environment's, when
        it closes): each exits when its socket closes."""
        for key, chan in list(self._lodgers.items()):
            if key.startswith(prefix):
                self._gone(chan)

    def native_lodgers(self) -> int:
        """How many lodgers run their loop in C."""
        return sum(chan.native for chan in self._lodgers.values())

    @property
    def pid(self) -> int | None:
        """The fork server's pid while it runs."""
        return self._proc.pid if self._proc is not None else None

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", forkserver.__file__, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a ^C to the daemon's terminal is not for it
            )
        finally:
            theirs.close()
        self._loop = loop
        self._generation += 1
        self._helper = self._open(ours, self._proc.pid, None)
        if self.base_env:  # the helper's first message: every spawn's env is laid over it
            self._send(self._helper, {"op": "base_env", "env": self.base_env}, [])

    def _open(
        self, sock: socket.socket, pid: int | None, cgroup: str | None, key: str | None = None
    ) -> _Channel:
        assert self._loop is not None
        sock.setblocking(False)
        chan = _Channel(sock, pid, cgroup, key)
        self._loop.add_reader(chan.fd, self._on_readable, chan)
        return chan

    def submit(self, request: dict[str, Any], stdio: dict[str, int], reply: SpawnReply) -> None:
        """Ask for one command to be spawned; ``reply(pid or SpawnError)`` follows. The
        request's ``env`` is laid over ``base_env`` (sent to the helper once). ``stdio``
        maps "stdin"/"stdout"/"stderr" to descriptors the helper gets copies of: the caller
        closes its own once ``reply`` is called (they travel when the request is sent)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self.close()  # a helper of an earlier event loop (tests run one per call)
            self._start(loop)
        # ``lodge``: an isolated environment's spawns have lodgers of their own, inside it;
        # ``lodge`` False: the fork server's path only (a lodger would not do what it asks)
        lodge = request.get("lodge")
        key = None if lodge is False else lodge or request.get("cgroup")
        chan = self._lodgers.get(key) if key else None
        ask = False
        self._ids += 1
        if chan is None or not chan.ready:
            chan = self._helper
            assert chan is not None
            ask = (
                bool(key)
                and self.max_lodgers > 0
                and key not in self._lodgers
                and key not in self._refused
            )
        else:
            chan.used = self._ids
        rid = self._ids
        names = list(stdio)
        fds = [stdio[n] for n in names]
        frame = pack_frame({**request, "id": rid, "fds": names})
        self._pending[rid] = (reply, chan, frame, fds)
        chan.out.append((frame, fds))
        self._flush(chan)
        if ask:
            self._ask_lodger(request)

    def _ask_lodger(self, request: dict[str, Any]) -> None:
        """Ask the fork server for a lodger in ``request``'s cgroup (after its spawn)."""
        key = request.get("lodge") or request["cgroup"]
        if any(join["key"] == key for join in self._asked.values()):
            return
        if len(self._lodgers) + len(self._asked) >= self.max_lodgers:
            # an environment's lodger makes room by ending the least recently used idle one
            # (environments come and go; plain cgroups are few and fixed)
            idle = [
                c for c in self._lodgers.values()
                if c.ready and not any(e[1] is c for e in self._pending.values())
                and c not in self._origin.values()
            ]  # fmt: skip
            if "lodge" not in request or not idle:
                return
            self._gone(min(idle, key=lambda c: c.used))
        assert self._helper is not None
        self._ids += 1
        join = {k: request[k] for k in ("cgroup", "cores", "oom_score_adj")}
        if "sandbox" in request:
            join["sandbox"] = request["sandbox"]
        self._asked[self._ids] = {**join, "key": key}
        self._send(self._helper, {"op": "lodger", "id": self._ids, "native": self.native}, [])

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
        self._origin.pop(pid, None)

    def _send(self, chan: _Channel, msg: dict[str, Any], fds: list[int]) -> None:
        chan.out.append((pack_frame(msg), fds))
        self._flush(chan)

    def _flush(self, chan: _Channel) -> None:
        loop = self._loop
        assert loop is not None
        sock = chan.sock
        while chan.out:
            frame, fds = chan.out[0]
            try:
                if chan.sent == 0:
                    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                    n = sock.sendmsg([frame], anc if fds else [])
                else:
                    n = sock.send(frame[chan.sent :])
            except (BlockingIOError, InterruptedError):
                loop.add_writer(chan.fd, self._flush, chan)
                return
            except OSError:
                loop.call_soon(self._gone, chan)  # never a callback inside ``submit``
                return
            chan.sent += n
            if chan.sent < len(frame):
                loop.add_writer(chan.fd, self._flush, chan)
                return
            chan.out.popleft()
            chan.sent = 0
        loop.remove_writer(chan.fd)

    def _on_readable(self, chan: _Channel) -> None:
        fds = chan.fds
        try:
            data, anc, _flags, _addr = chan.sock.recvmsg(
                1 << 16, socket.CMSG_SPACE(MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC
            )
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, anc = b"", []
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                fds.extend(got)
        if not data:
            self._gone(chan)
            return
        buf = chan.inbuf
        buf += data
        while len(buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(buf)
            if len(buf) < HEADER.size + n:
                break
            msg = json.loads(bytes(buf[HEADER.size : HEADER.size + n]))
            del buf[: HEADER.size + n]
            self._dispatch(chan, msg, fds)

    def _dispatch(self, chan: _Channel, msg: dict[str, Any], fds: list[int]) -> None:
        if "id" not in msg:
            self._exited(msg)
            return
        rid = msg["id"]
        if rid in self._asked:
            self._lodger_born(rid, msg, fds)
            return
        if "joined" in msg:
            chan.ready = True
            chan.native = msg.get("native") is True
            return
        if "fatal" in msg and chan.cgroup is not None:
            # A lodger that cannot join exits (its EOF ends the channel); the fork
            # server's path keeps serving that cgroup, without asking again.
            self._refused.add(chan.key or chan.cgroup)
            return
        entry = self._pending.pop(rid, None)
        if entry is None:
            return
        reply = entry[0]
        if "pid" in msg:
            self._origin[msg["pid"]] = chan
            reply(msg["pid"])
            if "exit" in msg:  # a quick command: its exit came with its pid
                self._exited(msg)
        else:
            reply(SpawnError(msg["error"], msg.get("errno"), msg.get("stage", "")))

    def _exited(self, msg: dict[str, Any]) -> None:
        self._origin.pop(msg["exit"], None)
        on_exit = self._watch.pop(msg["exit"], None)
        if on_exit is not None:
            on_exit(msg["rc"], msg.get("alone") is True)

    def _lodger_born(self, rid: int, msg: dict[str, Any], fds: list[int]) -> None:
        join = self._asked.pop(rid)
        pid = msg.get("lodger")
        if pid is None or not fds:
            return  # the fork server could not fork one: the fork server's path serves
        sock = socket.socket(fileno=fds.pop(0))
        if self._loop is None:
            sock.close()
            return
        self.lodger_pids.add(pid)
        key = join.pop("key")
        chan = self._lodgers[key] = self._open(sock, pid, join["cgroup"], key)
        self._ids += 1
        self._send(chan, {"op": "join", "id": self._ids, **join}, [])

    def _gone(self, chan: _Channel) -> None:
        """A helper died or closed: fail what it had in flight. The fork server's end closes
        everything (the next spawn restarts it); a lodger's only its own."""
        if chan is self._helper or self._helper is None:
            self.close()
            return
        self._drop(chan)
        # Spawns it had not answered never started: the fork server's path takes them
        # (their descriptors are still the caller's until the reply).
        helper = self._helper
        for rid, (reply, via, frame, fds) in list(self._pending.items()):
            if via is chan:
                self._pending[rid] = (reply, helper, frame, fds)
                helper.out.append((frame, fds))
        self._flush(helper)
        self._fail(chan)

    def _drop(self, chan: _Channel) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(Exception):  # the loop may be closed already
                loop.remove_reader(chan.fd)
                loop.remove_writer(chan.fd)
        chan.sock.close()
        chan.out.clear()
        for fd in chan.fds:
            os.close(fd)
        chan.fds.clear()
        if chan.key is not None and self._lodgers.get(chan.key) is chan:
            del self._lodgers[chan.key]
        if chan.pid is not None:
            self.lodger_pids.discard(chan.pid)

    def _fail(self, chan: _Channel | None) -> None:
        """Answer what ``chan`` (None: every channel) had in flight, on the next turn of
        the loop: spawns with ``SpawnerGone``, exit watchers with None."""
        loop = self._loop
        pending = [rid for rid, entry in self._pending.items() if chan is None or entry[1] is chan]
        replies = [self._pending.pop(rid)[0] for rid in pending]
        pids = [pid for pid, c in self._origin.items() if chan is None or c is chan]
        watchers = []
        for pid in pids:
            del self._origin[pid]
            on_exit = self._watch.pop(pid, None)
            if on_exit is not None:
                watchers.append(on_exit)
        if chan is None:  # watchers registered for pids of no known channel
            watchers.extend(self._watch.values())
            self._watch.clear()
        if loop is None:
            return
        gone = SpawnerGone("the spawner process died")
        with contextlib.suppress(RuntimeError):  # its loop is closed
            for reply in replies:
                loop.call_soon(reply, gone)
            for on_exit in watchers:
                loop.call_soon(on_exit, None, False)

    def close(self) -> None:
        """Stop the fork server and the lodgers (their running commands are the backend's
        to end). What they had in flight is answered on the next turn of the loop: spawns
        with ``SpawnerGone``, exit watchers with None."""
        chans = [c for c in (self._helper, *self._lodgers.values()) if c is not None]
        for chan in chans:
            self._drop(chan)
        self._helper = None
        self._lodgers.clear()
        self._asked.clear()
        self._fail(None)
        self._loop = None
        self.lodger_pids.clear()
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1)  # it exits on EOF
            if proc.poll() is None:
                proc.kill()
                proc.wait()

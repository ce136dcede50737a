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
import ctypes
import functools
import json
import os
import select
import selectors
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
# How long a lodger waits for a command it has just spawned to exit before it answers the
# spawn request; a command that is done by then has its exit in that same answer.
QUICK_EXIT_S = 0.002
NATIVE_ENV = "TANGRAM_NATIVE_LODGER"  # "0": lodgers run their loop in Python


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


def _frame(msg: dict[str, Any]) -> bytes:
    """One message as the fork server's protocol frames it (both directions)."""
    body = json.dumps(msg).encode()
    return _HEADER.pack(len(body)) + body


def _send(sock: socket.socket, msg: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    frame = _frame(msg)
    if fds:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        sent = sock.sendmsg([frame], anc)
        if sent < len(frame):
            sock.sendall(frame[sent:])
    else:
        sock.sendall(frame)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


@functools.cache
def _load_native() -> Any:
    """The lodger loop in C (``_lodger.c``, built at install when a C compiler is there),
    or None. Loaded by file: the helper runs as a script, with no package to import from.
    Loaded once, in the fork server: every lodger forked since has it."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(here, "_lodger" + suffix)
        if not os.path.exists(path):
            continue
        spec = importlib.util.spec_from_file_location("_lodger", path)
        if spec is None or spec.loader is None:
            continue
        try:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except (ImportError, OSError):
            continue
        return module
    return None


def _has_pidfd() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


class _CannotStart(Exception):
    """Not the command's fault (e.g. its working directory is gone): no exit code."""


def _posix_spawn(msg: dict[str, Any], stdio: dict[str, int]) -> int:
    """Spawn as the helper's own user with ``posix_spawn`` (vfork and exec, no Python in
    the child: about 0.15 ms less than ``subprocess`` here). The helper is single-threaded,
    so it may lend the child its cwd, its umask and its ``PATH`` for the call: a bare
    command name is looked up by the C library in the child's ``PATH`` (``posix_spawnp``
    reads the caller's environment), which costs a twentieth of ``shutil.which``. Every
    descriptor of the helper is close-on-exec, so the child gets exactly its three."""
    argv, env = msg["argv"], msg["env"]
    spawn = os.posix_spawn
    if "/" not in argv[0]:
        spawn = os.posix_spawnp
        path = env.get("PATH", os.defpath)
        if os.environ.get("PATH") != path:
            os.environ["PATH"] = path
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
        return spawn(
            argv[0],
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


_PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> bool:
    """``prctl(PR_SET_CHILD_SUBREAPER)``: orphaned descendants are re-parented to us, not
    to init, so "no child left" means "nothing the commands started is alive"."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


class _Helper:
    """The fork server, or (``lodger``) one of its pre-joined copies: a lodger lives in one
    exec cgroup, pinned to its cores at the exec OOM score, and spawns there without moving.

    A lodger is also a child subreaper: whatever its commands leave behind stays its
    descendant (a double fork or ``setsid`` does not leave the tree), and it reaps those
    orphans on ``SIGCHLD``. It runs one command at a time (its cgroup's cores are one
    exec's), so when it has reaped that command and has no child left, nothing the command
    started is alive: its exit report says ``alone`` and the daemon skips the sweep of the
    process group and the cgroup (on every exec's path otherwise)."""

    def __init__(self, sock: socket.socket, *, lodger: bool = False) -> None:
        self.sock = sock
        self.lodger = lodger
        self.sel = selectors.DefaultSelector()
        # pidfd -> (pid, its Popen when spawned by one)
        self.children: dict[int, tuple[int, subprocess.Popen[bytes] | None]] = {}
        self.lock = threading.Lock()
        self.affinity = os.sched_getaffinity(0)
        with open("/proc/self/oom_score_adj") as f:
            self.score = f.read().strip()
        self.base_env: dict[str, str] = {}  # what each request's ``env`` is laid over
        self.joined_score: str | None = None  # a lodger's: the exec score it joined at
        self.native: Any = None  # a lodger's loop in C, run once it has joined
        self.wake: int | None = None  # a subreaper lodger's SIGCHLD wake-up pipe
        if lodger and _become_subreaper():
            self.wake, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)  # both ends
            signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
            signal.signal(signal.SIGCHLD, lambda _sig, _frame: None)

    def run(self) -> None:
        self.sel.register(self.sock, selectors.EVENT_READ)
        if self.wake is not None:
            self.sel.register(self.wake, selectors.EVENT_READ)
        while True:
            for key, _ in self.sel.select():
                if key.fileobj is self.sock:
                    if not self._request():
                        return  # the daemon is gone: its commands are its business
                elif key.fd == self.wake:
                    with contextlib.suppress(OSError):
                        while os.read(self.wake, 512):
                            pass
                    self._reap_orphans()
                else:
                    self._reap(key.fd)

    def _request(self) -> bool:
        fds: list[int] = []
        head = _recv_exact(self.sock, _HEADER.size, fds)
        body = None if head is None else _recv_exact(self.sock, _HEADER.unpack(head)[0], fds)
        if body is None:
            return False
        msg = json.loads(body)
        op = msg.get("op")
        if op == "lodger":
            self._fork_lodger(msg)
            return True
        if op == "base_env":
            self.base_env = msg["env"]
            return True
        try:
            reply = self._join(msg) if op == "join" else self._spawn(msg, fds)
        finally:
            for fd in fds:
                os.close(fd)
        if self.lodger and "pid" in reply and msg.get("quick"):
            self._quick_exit(reply)
        self._send(reply)
        if reply.get("fatal"):
            sys.exit(reply["fatal"])
        if reply.get("native"):  # joined: the same loop goes on in C, this one ends
            assert self.joined_score is not None and not self.children
            self.native.serve(
                self.sock.fileno(), self.base_env, int(self.joined_score), QUICK_EXIT_S
            )
            return False
        return True

    def _spawn(self, msg: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        rid = msg["id"]
        if len(fds) != len(msg["fds"]):
            return {"id": rid, "error": "descriptors lost in transit"}
        stdio = dict(zip(msg["fds"], fds, strict=True))
        msg["env"] = {**self.base_env, **msg["env"]}
        cgroup, home = msg.get("cgroup"), msg.get("home")
        if self.lodger:  # already in the cgroup, at the exec score: no move, no way home
            cgroup = home = None
        try:
            if cgroup:
                _write(os.path.join(cgroup, "cgroup.procs"), "0")  # 0: the writer itself
            os.sched_setaffinity(0, msg["cores"])
        except OSError as e:
            why = f"cannot pin the command to cores {msg['cores']}: {e}"
            return {"id": rid, "error": why, **self._home(home)}
        try:
            score = str(msg["oom_score_adj"])
            if score != self.joined_score:  # a lodger is there already
                _write("/proc/self/oom_score_adj", score)
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

    def _quick_exit(self, reply: dict[str, Any]) -> None:
        """(A lodger) wait up to ``QUICK_EXIT_S`` for the command just spawned to exit, and
        if it does, put its exit report in the spawn's reply: one message instead of two,
        and one turn of the daemon's loop less, for the short commands that are most execs.
        The daemon asks for it (``quick``) only while other execs are in flight: a lone
        exec's answer would then come later, and the daemon's handling of the pid, which
        overlaps the command, would move after it (~0.1 ms more per lone exec). A lodger
        serves one exec at a time (its cgroup's cores are that exec's), so nothing else
        waits meanwhile. (The daemon registers output readers ``READ_LATER_S`` after the
        spawn request, so a command still running then gets them at once.)"""
        pid = reply["pid"]
        pidfd = next((fd for fd, (p, _) in self.children.items() if p == pid), None)
        if pidfd is None or len(self.children) != 1:
            return
        poll = select.poll()
        poll.register(pidfd, select.POLLIN)
        if not poll.poll(QUICK_EXIT_S * 1e3):
            return
        pid, popen = self._release(pidfd)
        reply.update(self._exit_report(pid, popen, pidfd=True))

    def _home(self, home: str | None) -> dict[str, Any]:
        """Back to our own cgroup, affinity and score; ``fatal`` if that fails."""
        if self.lodger:
            return {}
        try:
            if home:
                _write(os.path.join(home, "cgroup.procs"), "0")
            os.sched_setaffinity(0, self.affinity)
            _write("/proc/self/oom_score_adj", self.score)
        except OSError as e:
            return {"fatal": f"tangram spawner cannot return home: {e}"}
        return {}

    def _fork_lodger(self, msg: dict[str, Any]) -> None:
        """Fork a lodger for one exec cgroup and pass the daemon its end of a new socket
        pair. The lodger enters the cgroup only when the daemon says ``join`` (by then the
        daemon knows its pid, so cleaning the cgroup never mistakes it for a leftover)."""
        native = _load_native() if msg.get("native") else None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            pid = os.fork()
        except OSError as e:
            ours.close()
            theirs.close()
            self._send({"id": msg["id"], "error": f"cannot fork a lodger: {e}"})
            return
        if pid == 0:  # the lodger: nothing of the fork server's but the code
            code = 0
            try:
                theirs.close()
                self.sock.close()
                self.sel.close()
                for pidfd in self.children:
                    os.close(pidfd)
                lodger = _Helper(ours, lodger=True)
                lodger.base_env = self.base_env
                lodger.native = native
                with contextlib.suppress(ConnectionError):
                    lodger.run()
            except BaseException:  # never back into the fork server's loop
                code = 1
            finally:
                os._exit(code)
        ours.close()
        try:
            self._send({"id": msg["id"], "lodger": pid}, (theirs.fileno(),))
        finally:
            theirs.close()
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            threading.Thread(target=self._wait, args=(pid, None), daemon=True).start()
        else:
            self.children[pidfd] = (pid, None)
            self.sel.register(pidfd, selectors.EVENT_READ)

    def _join(self, msg: dict[str, Any]) -> dict[str, Any]:
        """(A lodger) enter the exec cgroup, its cores and the exec OOM score, for good."""
        try:
            _write(os.path.join(msg["cgroup"], "cgroup.procs"), "0")
            os.sched_setaffinity(0, msg["cores"])
            _write("/proc/self/oom_score_adj", str(msg["oom_score_adj"]))
        except OSError as e:
            return {"id": msg["id"], "fatal": f"tangram lodger cannot join: {e}"}
        self.joined_score = str(msg["oom_score_adj"])
        if self.native is not None and (self.wake is None or not _has_pidfd()):
            self.native = None  # the C loop counts on being a subreaper, with pidfds
        if self.native is not None:
            return {"id": msg["id"], "joined": os.getpid(), "native": True}
        return {"id": msg["id"], "joined": os.getpid()}

    def _reap(self, pidfd: int) -> None:
        pid, popen = self._release(pidfd)
        self._wait(pid, popen, pidfd=True)

    def _release(self, pidfd: int) -> tuple[int, subprocess.Popen[bytes] | None]:
        """Stop watching an exited child's pidfd; the child (pid, its Popen), to reap."""
        pid, popen = self.children.pop(pidfd)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        return pid, popen

    def _wait(
        self, pid: int, popen: subprocess.Popen[bytes] | None, *, pidfd: bool = False
    ) -> None:
        report = self._exit_report(pid, popen, pidfd=pidfd)
        with contextlib.suppress(ConnectionError):  # the loop then reads EOF and exits
            self._send(report)

    def _exit_report(
        self, pid: int, popen: subprocess.Popen[bytes] | None, *, pidfd: bool
    ) -> dict[str, Any]:
        """Reap ``pid``; its exit report (``alone``: a subreaper with no child left)."""
        # A Popen child is reaped by its Popen (which would otherwise reap it itself).
        rc = popen.wait() if popen else os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        report: dict[str, Any] = {"exit": pid, "rc": rc}
        if pidfd and self.wake is not None and not self.children and self._reap_orphans():
            report["alone"] = True
        return report

    def _reap_orphans(self) -> bool:
        """(A subreaper) reap the orphans that have exited; a command's own exit is its
        pidfd's (the first zombie found being one of those, the rest wait for it). True
        when no child at all is left."""
        tracked = {pid for pid, _ in self.children.values()}
        while True:
            try:
                found = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return True
            if found is None or found.si_pid in tracked:
                return False
            with contextlib.suppress(ChildProcessError):
                os.waitpid(found.si_pid, 0)

    def _send(self, msg: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
        with self.lock:  # waiting threads (no pidfd) answer too
            try:
                _send(self.sock, msg, fds)
            except ConnectionError:  # the daemon is gone: stop serving
                self.sock.shutdown(socket.SHUT_RDWR)
                raise


def _serve(fd: int) -> None:
    os.set_inheritable(fd, False)  # the commands get their three descriptors, nothing else
    os.chdir("/")
    # SCHED_BATCH for the helper, its lodgers and (inherited) every command: a woken helper
    # never preempts the daemon on its core. Without it, the daemon sending a spawn
    # request lost its core to the lodger it woke (sendmsg took 0.36 ms on average under
    # a flood, against 0.045 ms) and the other core idled meanwhile.
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
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
ExitWatch = Callable[[int | None, bool], None]
"""Called once with a watched pid's returncode (as ``Popen.returncode``: -N for a signal),
or None when the helper died before reporting it; and ``alone``: True when the helper (a
subreaper lodger) saw nothing the command started left alive."""


class _Channel:
    """One socket to a helper process (the fork server or a lodger) and its frame buffers."""

    __slots__ = ("cgroup", "fd", "fds", "inbuf", "native", "out", "pid", "ready", "sent", "sock")

    def __init__(self, sock: socket.socket, pid: int | None, cgroup: str | None) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.pid = pid
        self.cgroup = cgroup  # a lodger's cgroup (None: the fork server)
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
        self._lodgers: dict[str, _Channel] = {}  # cgroup -> its lodger
        self._asked: dict[int, dict[str, Any]] = {}  # request id -> a lodger's join order
        self._refused: set[str] = set()  # cgroups a lodger could not join: not asked again
        self._ids = 0
        # request id -> (reply, the channel it went to, the frame and descriptors it sent)
        self._pending: dict[int, tuple[SpawnReply, _Channel, bytes, list[int]]] = {}
        self._origin: dict[int, _Channel] = {}  # spawned pid -> the channel that spawned it
        self._watch: dict[int, ExitWatch] = {}
        self.lodger_pids: set[int] = set()
        """Pids of the lodgers (live or starting): not leftovers of any command."""

    def lodged(self) -> set[str]:
        """The cgroups that have a lodger (live or joining)."""
        return set(self._lodgers)

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
                [sys.executable, "-I", "-S", __file__, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a ^C to the daemon's terminal is not for it
            )
        finally:
            theirs.close()
        self._loop = loop
        self._helper = self._open(ours, self._proc.pid, None)
        if self.base_env:  # the helper's first message: every spawn's env is laid over it
            self._send(self._helper, {"op": "base_env", "env": self.base_env}, [])

    def _open(self, sock: socket.socket, pid: int | None, cgroup: str | None) -> _Channel:
        assert self._loop is not None
        sock.setblocking(False)
        chan = _Channel(sock, pid, cgroup)
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
        cgroup = request.get("cgroup")
        chan = self._lodgers.get(cgroup) if cgroup else None
        ask = False
        if chan is None or not chan.ready:
            chan = self._helper
            assert chan is not None
            ask = (
                bool(cgroup)
                and self.max_lodgers > 0
                and cgroup not in self._lodgers
                and cgroup not in self._refused
            )
        self._ids += 1
        rid = self._ids
        names = list(stdio)
        fds = [stdio[n] for n in names]
        frame = _frame({**request, "id": rid, "fds": names})
        self._pending[rid] = (reply, chan, frame, fds)
        chan.out.append((frame, fds))
        self._flush(chan)
        if ask:
            self._ask_lodger(request)

    def _ask_lodger(self, request: dict[str, Any]) -> None:
        """Ask the fork server for a lodger in ``request``'s cgroup (after its spawn)."""
        if len(self._lodgers) + len(self._asked) >= self.max_lodgers:
            return
        cgroup = request["cgroup"]
        if any(join["cgroup"] == cgroup for join in self._asked.values()):
            return
        assert self._helper is not None
        self._ids += 1
        self._asked[self._ids] = {k: request[k] for k in ("cgroup", "cores", "oom_score_adj")}
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
        chan.out.append((_frame(msg), fds))
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
                1 << 16, socket.CMSG_SPACE(_MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC
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
        while len(buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(buf)
            if len(buf) < _HEADER.size + n:
                break
            msg = json.loads(bytes(buf[_HEADER.size : _HEADER.size + n]))
            del buf[: _HEADER.size + n]
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
            self._refused.add(chan.cgroup)
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
            reply(SpawnError(msg["error"], msg.get("errno")))

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
        chan = self._lodgers[join["cgroup"]] = self._open(sock, pid, join["cgroup"])
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
        if chan.cgroup is not None and self._lodgers.get(chan.cgroup) is chan:
            del self._lodgers[chan.cgroup]
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


if __name__ == "__main__":
    _serve(int(sys.argv[1]))

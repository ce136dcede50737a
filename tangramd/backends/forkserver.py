"""The process backend's fork server: the helper program that spawns exec commands
already in place. It runs as ``python -I -S forkserver.py FD``, started by the daemon's end
(:class:`tangramd.backends.spawner.Spawner`), and imports the standard library only
(``tests/test_spawner.py`` checks it): under ``-I -S`` nothing else is on its path.

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

The wire, both ways, over a private socket pair: frames of a 4-byte length (``HEADER``)
and a JSON map (``pack_frame``), with up to ``MAX_FDS`` descriptors passed by
``SCM_RIGHTS`` (a command's pipe ends; a new lodger's socket). The daemon's end imports
these three from here.
"""

from __future__ import annotations

import array
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
from typing import Any

HEADER = struct.Struct(">I")
MAX_FDS = 4  # a command's three, and (an isolated environment's lodger) its cgroup's tasks
# How long a lodger waits for a command it has just spawned to exit before it answers the
# spawn request; a command that is done by then has its exit in that same answer.
QUICK_EXIT_S = 0.002


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes | None:
    """Read ``n`` bytes (None at EOF), collecting any passed descriptors into ``fds``."""
    buf = b""
    while len(buf) < n:
        data, anc, _flags, _addr = sock.recvmsg(
            n - len(buf), socket.CMSG_SPACE(MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC
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


def pack_frame(msg: dict[str, Any]) -> bytes:
    """One message as the fork server's protocol frames it (both directions)."""
    body = json.dumps(msg).encode()
    return HEADER.pack(len(body)) + body


def _send(sock: socket.socket, msg: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    frame = pack_frame(msg)
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


@functools.cache
def _load_module(name: str) -> Any:
    """A module of this directory (stdlib only), loaded by file like the lodger loop."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_tangram_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_nsbox() -> Any:
    """``nsbox.py`` (environments in namespaces)."""
    return _load_module("nsbox")


def _has_pidfd() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


class _CannotStart(Exception):
    """Not the command's fault (e.g. its working directory is gone): no exit code.
    ``extra`` goes into the reply (``stage``: what failed)."""

    def __init__(self, message: str, extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.extra = extra or {}


def _posix_spawn(msg: dict[str, Any], stdio: dict[str, int]) -> int:
    """Spawn as the helper's own user with ``posix_spawn`` (vfork and exec, no Python in
    the child: cheaper than ``subprocess``). The helper is single-threaded,
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
        why = f"cwd {msg['cwd']}: {e.strerror}"
        raise _CannotStart(why, {"stage": "cwd", "errno": e.errno or 0}) from None
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
        # commands spawned in an environment's pid namespace: their orphans go to its
        # keeper, not to us, so having no child left says nothing about them
        self.boxed: set[int] = set()
        # (a lodger) inside an isolated environment for good, root there with no capability:
        # it spawns there as it would on the host (``posix_spawn``)
        self.inside = False
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
        head = _recv_exact(self.sock, HEADER.size, fds)
        body = None if head is None else _recv_exact(self.sock, HEADER.unpack(head)[0], fds)
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
        if op == "keeper":
            self._send(self._keeper(msg))
            return True
        if op == "files":
            try:
                reply = self._files(msg, fds)
            finally:
                for fd in fds:
                    os.close(fd)
            self._send(reply)
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
                self.sock.fileno(),
                self.base_env,
                int(self.joined_score),
                QUICK_EXIT_S,
                self.inside,
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
            elif self.inside and "cgroup_tasks" in stdio:
                # (an environment's lodger serves all its core sets) into this exec's cpuset
                # cgroup: the daemon opened its tasks file, so root outside may move us;
                # moving oneself, one thread, waits for no RCU grace period
                os.write(stdio["cgroup_tasks"], b"0")
            os.sched_setaffinity(0, msg["cores"])
        except OSError as e:
            why = f"cannot pin the command to cores {msg['cores']}: {e}"
            return {"id": rid, "error": why, **self._home(home)}
        try:
            score = str(msg["oom_score_adj"])
            if score != self.joined_score:  # a lodger is there already
                _write("/proc/self/oom_score_adj", score)
            if msg.get("sandbox") and not self.inside:
                pid, popen = _load_nsbox().spawn(msg, stdio), None
            elif msg.get("user") is None:
                pid, popen = _posix_spawn(msg, stdio), None
            else:
                popen = _popen(msg, stdio)
                pid = popen.pid
        except _CannotStart as e:
            return {"id": rid, "error": str(e), **e.extra, **self._home(home)}
        except OSError as e:
            if e.filename == "cwd":  # (in an environment) its working directory is missing
                why = f"cwd {msg['cwd']}: {os.strerror(e.errno or 0)}"
                return {
                    "id": rid,
                    "error": why,
                    "errno": e.errno or 0,
                    "stage": "cwd",
                    **self._home(home),
                }
            return {"id": rid, "errno": e.errno or 0, "error": str(e), **self._home(home)}
        except subprocess.SubprocessError as e:
            return {"id": rid, "error": str(e), **self._home(home)}
        back = self._home(home)
        if msg.get("sandbox"):
            self.boxed.add(pid)
        self._watch(pid, popen)
        return {"id": rid, "pid": pid, **back}

    def _quick_exit(self, reply: dict[str, Any]) -> None:
        """(A lodger) wait up to ``QUICK_EXIT_S`` for the command just spawned to exit, and
        if it does, put its exit report in the spawn's reply: one message instead of two,
        and one turn of the daemon's loop less, for the short commands that are most execs.
        The daemon asks for it (``quick``) only while other execs are in flight: a lone
        exec's answer would then come later, and the daemon's handling of the pid, which
        overlaps the command, would move after it (measured slower: docs/notebook.md,
        "the gateway in the daemon's process", tried and not kept). A lodger
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

    def _keeper(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Start an environment's keeper (``nsbox.py``): its pid, watched as a child."""
        try:
            pid = _load_nsbox().open_keeper(msg["box"])
        except OSError as e:
            return {"id": msg["id"], "error": f"cannot build the environment: {e.strerror or e}"}
        self._watch(pid, None)
        return {"id": msg["id"], "pid": pid}

    def _files(self, msg: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """Fork a file helper (``nsfiles.serve``) for one put or get: it enters the
        environment (or becomes its user) and talks to the daemon on the socket passed."""
        rid = msg["id"]
        if len(fds) != 1:
            return {"id": rid, "error": "descriptors lost in transit"}
        nsfiles = _load_module("nsfiles")
        nsbox = _load_nsbox() if msg.get("sandbox") else None
        try:
            pid = os.fork()
        except OSError as e:
            return {"id": rid, "errno": e.errno or 0, "error": f"cannot fork a file helper: {e}"}
        if pid == 0:  # never back into the fork server's loop
            code = 0
            try:
                nsfiles.serve(msg, fds[0], nsbox)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        self._watch(pid, None)
        return {"id": rid, "pid": pid}

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
        self._watch(pid, None)

    def _join(self, msg: dict[str, Any]) -> dict[str, Any]:
        """(A lodger) enter the exec cgroup, its cores and the exec OOM score, for good; and
        with ``sandbox``, that environment (``nsbox.enter_for_good``)."""
        try:
            _write(os.path.join(msg["cgroup"], "cgroup.procs"), "0")
            os.sched_setaffinity(0, msg["cores"])
            _write("/proc/self/oom_score_adj", str(msg["oom_score_adj"]))
            if msg.get("sandbox"):
                _load_nsbox().enter_for_good(msg["sandbox"])
                self.inside = True
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

    def _watch(self, pid: int, popen: subprocess.Popen[bytes] | None) -> None:
        """Report ``pid``'s exit when it comes: its pidfd in the loop's selector, or where
        there is none (Linux < 5.3) a thread that waits for it."""
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            threading.Thread(target=self._wait, args=(pid, popen), daemon=True).start()
        else:
            self.children[pidfd] = (pid, popen)
            self.sel.register(pidfd, selectors.EVENT_READ)

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
        boxed = pid in self.boxed
        self.boxed.discard(pid)
        alone = pidfd and self.wake is not None and not self.children and self._reap_orphans()
        if alone and not boxed:
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
    # request lost its core to the lodger it woke (its sendmsg took several times longer
    # under a flood: docs/notebook.md, "where an exec's turnaround went under the flood")
    # and the other core idled meanwhile.
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    # The daemon gone (killed, or closed its end): its commands are its business; exit
    # quietly.
    with contextlib.suppress(ConnectionError):
        _Helper(sock).run()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))

"""The process backend: environments are directories, execs are pinned host processes.

No container engine needed; this is the embedded default (docs/design.md §5.2).

- An environment is a working directory ``<root_dir>/envs/<env_id>``, mode 0700 and owned by
  the environment's owner; every exec runs with that directory as cwd and as ``HOME``
  (umask 077), so files persist across execs of one environment and no other user reads
  them. The backend's directories are 0711 as root (commands running as other users reach
  their own environment, nobody lists the others) and 0700 otherwise.
- Commands run as ``req.run_as`` (the connecting peer, as wired by the daemon), else as the
  backend's ``default_user`` (a sandbox user), else as the daemon's own user. Running as
  another user drops every supplementary group.
- Each exec is a fresh session (its own process group) in the exec cgroup of its core set
  (``cgroups.py``: v1 cpuset, or v2 where delegated), pinned with ``sched_setaffinity``.
  The child starts as a tiny shell that first raises its own ``oom_score_adj`` to
  ``EXEC_OOM_SCORE_ADJ`` (before anything can fork), then runs the command. With v1 the
  child is born in its cgroup and mask (the daemon's thread holds both for the instant of
  the fork, on a small spawner thread pool: a v1 cgroup join can block for an RCU grace
  period, which must not stall the event loop); with v2 or no cgroup the shell waits at a
  *gate* (a line on its stdin) while the daemon moves it in and pins it by pid. Either way
  the command never runs elsewhere, no ``preexec_fn`` is needed, and no daemon thread
  stays in an exec's cgroup.
- The exec ends when its main process exits (watched through a pidfd, not through its
  pipes: a background descendant may hold them); whatever it left is killed then — its
  process group and its cgroup, or, without a usable cgroup, its session and every process
  carrying its ``TANGRAM_EXEC_ID`` — and the pipes are drained for at most 1 s. A core
  serves one action at a time.
- A timeout (counted from the spawn to the main process's exit) sends SIGTERM to the group,
  SIGKILL 0.5 s later, and returns the partial output.
- The environment's memory size is advisory only here: it is recorded but not enforced.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from tangramd.backends import cgroups as cg
from tangramd.backends import files
from tangramd.backends import shell as shell_mod
from tangramd.backends.base import (
    EXEC_OOM_SCORE_ADJ,
    SHUTDOWN_DETAIL,
    SIGTERM_GRACE_S,
    EnvError,
    ExecRequest,
    ExecResult,
    OutputBuffer,
    PathEscape,
    check_env_id,
    confine,
    exit_code_from_returncode,
    infra_error,
    outcome_for,
    rewrite_pytest,
)
from tangramd.backends.cgroups import CPUSET_ROOT, Cgroups

__all__ = ["CPUSET_ROOT", "ProcessBackend"]

log = structlog.get_logger(__name__)

DRAIN_AFTER_EXIT_S = 1.0  # how long to wait for pipes to close once the group is dead
MARKER_VAR = "TANGRAM_EXEC_ID"
EXEC_UMASK = 0o077
_READ_CHUNK = 1 << 16
_ENV_PASSTHROUGH = ("PATH", "LANG", "LC_ALL", "TZ", "TERM")
# The gate: wait for the daemon's go (one line on stdin), then run with stdin at /dev/null.
# Exit 125 if the daemon closed the gate without a go (it could not place the child).
_GATE = "read -r _ || exit 125; exec </dev/null; "
# With stdin: the bytes after the go line are the command's input (``read`` takes one
# byte at a time from a pipe, so it never eats into them).
_GATE_STDIN = "read -r _ || exit 125; "


def exec_argv(
    cmd: list[str] | str, *, oom_score_adj: int, gate: bool, stdin: bool = False
) -> list[str]:
    """The argv to spawn: a shell that raises its own OOM score (before anything can fork,
    so every descendant inherits it), waits at the gate if asked, then runs ``cmd`` (with
    the rest of its stdin as input when ``stdin``)."""
    prefix = f"echo {oom_score_adj} >/proc/self/oom_score_adj 2>/dev/null; "
    if gate:
        prefix += _GATE_STDIN if stdin else _GATE
    if isinstance(cmd, str):
        return ["/bin/sh", "-c", prefix + cmd]
    return ["/bin/sh", "-c", prefix + 'exec "$@"', "tangram-exec", *cmd]


class _Child:
    """One spawned command: its exit (by pidfd) and non-blocking readers of its pipes."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        loop: asyncio.AbstractEventLoop,
        out: OutputBuffer,
        err: OutputBuffer,
    ) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.loop = loop
        self.exited = asyncio.Event()
        self.pipes_closed = asyncio.Event()
        self._open: dict[int, object] = {}
        for stream, buf in ((popen.stdout, out), (popen.stderr, err)):
            assert stream is not None
            fd = stream.fileno()
            os.set_blocking(fd, False)
            self._open[fd] = stream
            loop.add_reader(fd, self._read, fd, buf)
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(self.pid)
            loop.add_reader(self._pidfd, self._reap)
        except (AttributeError, OSError):  # no pidfd (old kernel): one thread per child
            threading.Thread(target=self._wait_in_thread, daemon=True).start()

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def release_gate(self, data: bytes | None = None) -> None:
        """Let the command run (the child is placed and pinned), then feed it ``data``."""
        stdin = self.popen.stdin
        assert stdin is not None
        if data:
            self.feed(b"\n" + data)
            return
        with contextlib.suppress(OSError):  # it died already (e.g. a shell syntax error)
            os.write(stdin.fileno(), b"\n")
        with contextlib.suppress(OSError):
            stdin.close()

    def feed(self, data: bytes) -> None:
        """Write ``data`` to the child's stdin and close it, from a thread: a command that
        never reads its input must not block the loop (the thread ends when it exits)."""
        threading.Thread(target=_feed, args=(self.popen.stdin, data), daemon=True).start()

    def _read(self, fd: int, buf: OutputBuffer) -> None:
        try:
            data = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            buf.feed(data)
        else:
            self._close_pipe(fd)

    def _close_pipe(self, fd: int) -> None:
        stream = self._open.pop(fd, None)
        if stream is None:
            return
        self.loop.remove_reader(fd)
        with contextlib.suppress(OSError):
            stream.close()  # type: ignore[attr-defined]
        if not self._open:
            self.pipes_closed.set()

    def _reap(self) -> None:
        if self.popen.poll() is None:
            return
        if self._pidfd is not None:
            self.loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        self.exited.set()

    def _wait_in_thread(self) -> None:
        self.popen.wait()
        with contextlib.suppress(RuntimeError):  # the loop is closed
            self.loop.call_soon_threadsafe(self.exited.set)

    def close(self) -> None:
        """Stop reading (a descendant that escaped every sweep may hold the pipes)."""
        for fd in list(self._open):
            self._close_pipe(fd)


def _feed(stream: Any, data: bytes) -> None:
    """Write ``data`` to a child's stdin and close it (the child may stop reading)."""
    with contextlib.suppress(OSError, ValueError):
        stream.write(data)
    with contextlib.suppress(OSError, ValueError):
        stream.close()


@dataclass(slots=True, eq=False)
class _Running:
    child: _Child
    cgroup: Path | None
    marker: str
    killed_for_shutdown: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _session_and_marked(sid: int, marker: bytes) -> list[int]:
    """Pids in session ``sid`` or carrying ``marker`` in their environment (no cgroups)."""
    found: list[int] = []
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_bytes()
            fields = stat[stat.rindex(b")") + 2 :].split()
            if int(fields[3]) == sid or marker in Path(f"/proc/{name}/environ").read_bytes():
                found.append(int(name))
        except (OSError, ValueError, IndexError):
            continue
    return found


class ProcessBackend:
    """Environments as directories, execs as pinned subprocesses (see the module doc)."""

    name = "process"

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        *,
        use_cgroups: bool = True,
        cgroup_version: str = "auto",
        default_user: tuple[int, int] | None = None,
        oom_score_adj: int = EXEC_OOM_SCORE_ADJ,
    ) -> None:
        self.root = Path(root_dir)
        self.envs_dir = self.root / "envs"
        self._is_root = os.geteuid() == 0
        dir_mode = 0o711 if self._is_root else 0o700
        for path in (self.root, self.envs_dir):
            path.mkdir(parents=True, exist_ok=True)
            os.chmod(path, dir_mode)
        scope = "p-" + hashlib.sha1(str(self.root.resolve()).encode()).hexdigest()[:12]
        self.cgroups: Cgroups | None = (
            cg.probe(scope, prefer=cgroup_version) if use_cgroups else None
        )
        if self.cgroups is None:
            log.warning(
                "exec_cgroups_unavailable",
                detail="no usable cgroup (v1 cpuset as root, or a writable v2 subtree): "
                "commands are pinned by affinity alone and their leftovers are killed by "
                "session, process group and TANGRAM_EXEC_ID marker",
            )
        else:
            log.info("exec_cgroups", kind=self.cgroups.kind, base=str(self.cgroups.base))
        self.default_user = default_user
        self.oom_score_adj = oom_score_adj
        self._envs: dict[str, int | None] = {}  # env_id -> advisory memory bytes
        self._owners: dict[str, tuple[int, int] | None] = {}
        self._running: set[_Running] = set()
        self._closing = False
        self._token = f"{scope}.{os.getpid()}"
        self._shells: dict[str, shell_mod.Shell] = {}
        self._home_affinity = os.sched_getaffinity(0)
        # v1 spawns run here: joining a cgroup blocks in the kernel for up to an RCU grace
        # period, which must not stall the event loop (and every other client) meanwhile.
        self._spawner = ThreadPoolExecutor(
            max_workers=max(2, min(16, len(self._home_affinity))),
            thread_name_prefix="tangram-spawn",
        )
        self._exec_ids = itertools.count(1)

    # --- environments -----------------------------------------------------------------

    def env_dir(self, env_id: str) -> Path:
        return self.envs_dir / check_env_id(env_id)

    def env_exists(self, env_id: str) -> bool:
        return env_id in self._envs and self.env_dir(env_id).is_dir()

    async def create_env(
        self,
        env_id: str,
        image: str | None,
        mem_bytes: int | None,
        owner: tuple[int, int] | None = None,
    ) -> None:
        """Create the environment's directory (0700, owned by ``owner`` or the default user).

        `image` is ignored, `mem_bytes` advisory."""
        if self._closing:
            raise EnvError(SHUTDOWN_DETAIL)
        path = self.env_dir(env_id)
        if env_id in self._envs:
            raise EnvError(f"environment {env_id} exists")
        if path.exists():  # a leftover of a previous run that reconcile did not see
            shutil.rmtree(path)
        owner = owner or self.default_user
        path.mkdir(mode=0o700)
        os.chmod(path, 0o700)  # whatever the umask
        if owner is not None and self._is_root:
            os.chown(path, *owner)
        self._envs[env_id] = mem_bytes
        self._owners[env_id] = owner

    async def close_env(self, env_id: str) -> None:
        self._end_sessions(env_id)
        self._envs.pop(env_id, None)
        self._owners.pop(env_id, None)
        path = self.env_dir(env_id)
        await asyncio.to_thread(shutil.rmtree, path, True)

    async def reconcile(
        self, keep: Mapping[str, tuple[int, int] | None] | None = None
    ) -> list[str]:
        """Adopt the env directories in ``keep`` (env id -> owner) that a previous run left;
        remove every other env directory, and kill and remove leftover exec cgroups (what
        ran in them belonged to actions of a daemon that died)."""
        keep = keep or {}
        done: list[str] = []
        for path in sorted(self.envs_dir.iterdir()):
            if path.name in self._envs:
                continue
            if path.name in keep and path.is_dir() and not path.is_symlink():
                self._envs[path.name] = None
                self._owners[path.name] = keep[path.name] or self.default_user
                done.append(f"adopted env dir {path}")
                continue
            await asyncio.to_thread(shutil.rmtree, path, True)
            done.append(f"removed env dir {path}")
        if self.cgroups is not None:
            busy = {r.cgroup for r in self._running}
            for cgroup in self.cgroups.leftovers():
                if cgroup in busy:
                    continue
                left = self.cgroups.pids(cgroup)
                if left:
                    self.cgroups.kill_all(cgroup)
                    done.append(
                        f"killed {len(left)} process(es) of actions that were running when "
                        f"the previous daemon died ({cgroup.name})"
                    )
                if await self.cgroups.remove(cgroup):
                    done.append(f"removed cgroup {cgroup}")
        return done

    async def shutdown(self, keep: Collection[str] = ()) -> None:
        """End in-flight execs (infra_error), remove every environment not in ``keep``."""
        self._closing = True
        for run in list(self._running):
            run.killed_for_shutdown = True
            self._kill_leftovers(run)
        for run in list(self._running):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(run.done.wait(), 5)
        for env_id in list(self._envs):
            if env_id not in keep:
                await self.close_env(env_id)
        if self.cgroups is not None:
            with contextlib.suppress(OSError):
                for cgroup in self.cgroups.leftovers():
                    await self.cgroups.remove(cgroup)
            await self.cgroups.remove(self.cgroups.base)
        self._spawner.shutdown(wait=False)

    # --- execs ------------------------------------------------------------------------

    def _child_env(self, req: ExecRequest, home: Path, marker: str) -> dict[str, str]:
        env = {k: os.environ[k] for k in _ENV_PASSTHROUGH if k in os.environ}
        env.setdefault("PATH", os.defpath)
        # The daemon's interpreter first, so `python -m pytest` finds the same packages.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
        env.update(HOME=str(home), TMPDIR=str(home))
        env.update(req.env_vars)
        env["TANGRAM_CPUS"] = str(len(req.cores))
        env["TANGRAM_CORES"] = ",".join(map(str, req.cores))
        env[MARKER_VAR] = marker
        return env

    def _user_for(self, req: ExecRequest) -> tuple[int, int] | str | None:
        """(uid, gid) to switch to, None for the daemon's own user, or a refusal text."""
        user = req.run_as or self.default_user
        if user is None or user == (os.geteuid(), os.getegid()):
            return None
        if not self._is_root:
            return f"cannot run as uid {user[0]}: the daemon is not root"
        owner = self._owners.get(req.env_id)
        if owner is not None and user[0] not in (0, owner[0]):
            return f"environment {req.env_id} belongs to uid {owner[0]}, not uid {user[0]}"
        return user

    async def exec(self, req: ExecRequest) -> ExecResult:
        if self._closing:
            return infra_error(SHUTDOWN_DETAIL)
        if not self.env_exists(req.env_id):
            return infra_error(f"no such environment {req.env_id}")
        if req.session is not None:
            return await self._session_run(req)
        user = self._user_for(req)
        if isinstance(user, str):
            return infra_error(user)
        home = self.env_dir(req.env_id)
        try:
            cwd = confine(home, req.cwd) if req.cwd else home
        except PathEscape as e:
            return ExecResult("rejected", detail=f"cwd {e}")
        if not cwd.is_dir():
            return ExecResult("failed", 1, stderr=f"tangram: cwd {req.cwd}: not a directory\n")
        cgroup: Path | None = None
        if self.cgroups is not None:
            try:
                cgroup = self.cgroups.for_cores(req.cores)
            except OSError as e:
                return infra_error(f"cannot create cpuset cgroup: {e}")
        # v1: the child is born in its cgroup and mask (see _born_pinned), no gate needed.
        # v2 / no cgroup: it is placed by pid while it waits at the gate.
        gate = not (cgroup is not None and self.cgroups is not None and self.cgroups.by_thread)
        argv = exec_argv(
            rewrite_pytest(req.cmd, len(req.cores), req.elastic),
            oom_score_adj=self.oom_score_adj,
            gate=gate,
            stdin=bool(req.stdin),
        )
        marker = f"{self._token}.{next(self._exec_ids)}"
        out, err = OutputBuffer(req.max_output), OutputBuffer(req.max_output)

        def spawn() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if gate or req.stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=cwd,
                env=self._child_env(req, home, marker),
                start_new_session=True,
                umask=EXEC_UMASK,
                user=None if user is None else user[0],
                group=None if user is None else user[1],
                extra_groups=None if user is None else [],  # drop root's groups
            )

        started = time.monotonic()
        try:
            if gate:
                popen = spawn()
            else:  # the cgroup writes may wait for an RCU grace period: not on the loop
                popen = await asyncio.get_running_loop().run_in_executor(
                    self._spawner, self._born_pinned, spawn, req.cores, cgroup
                )
        except (OSError, subprocess.SubprocessError) as e:
            return infra_error(f"spawn failed: {e}")
        child = _Child(popen, asyncio.get_running_loop(), out, err)
        run = _Running(child, cgroup, marker)
        self._running.add(run)
        try:
            problem = self._place(child.pid, req.cores, cgroup) if gate else ""
            if problem or self._closing:
                run.killed_for_shutdown = self._closing
                self._kill_leftovers(run)
                if gate:
                    child.release_gate()
                elif req.stdin:
                    child.feed(b"")
                await child.exited.wait()
                child.close()
                return infra_error(problem or SHUTDOWN_DETAIL)
            if gate:
                child.release_gate(req.stdin)
            elif req.stdin:
                child.feed(req.stdin)
            return await self._supervise(req, run, started, out, err)
        finally:
            self._running.discard(run)
            run.done.set()

    def _born_pinned(
        self,
        spawn: Callable[[], subprocess.Popen[bytes]],
        cores: tuple[int, ...],
        cgroup: Path | None,
    ) -> subprocess.Popen[bytes]:
        """Spawn with the daemon's thread in the child's v1 cgroup and mask for the instant
        of the fork (a child inherits both), then return the thread home.

        Cheaper than moving the child afterwards (a v1 process migration waits for an RCU
        grace period) and needs no gate. Nothing else runs on this thread meanwhile, and
        no thread is created (the exit is watched by pidfd), so no daemon thread ever
        stays in an exec cgroup.
        """
        assert self.cgroups is not None and cgroup is not None
        tid = threading.get_native_id()
        self.cgroups.join_thread(cgroup, tid)
        try:
            os.sched_setaffinity(0, cores)
            return spawn()
        finally:
            self.cgroups.join_thread(self.cgroups.parent, tid)
            os.sched_setaffinity(0, self._home_affinity)

    def _place(self, pid: int, cores: tuple[int, ...], cgroup: Path | None) -> str:
        """Move the gated child into its cgroup and pin it; '' if done."""
        try:
            if cgroup is not None:
                Cgroups.place(cgroup, pid)
            os.sched_setaffinity(pid, cores)
        except OSError as e:
            return f"cannot pin the command to cores {list(cores)}: {e}"
        return ""

    def _kill_leftovers(self, run: _Running) -> None:
        """SIGKILL the exec's process group, and its cgroup or (without one) session."""
        _killpg(run.child.pid, signal.SIGKILL)
        if run.cgroup is not None and self.cgroups is not None:
            self.cgroups.kill_all(run.cgroup)
        else:
            # Scan until a pass finds nothing: a process in the middle of setsid/exec can be
            # unreadable in /proc for an instant, and one pass would miss it.
            marker = f"{MARKER_VAR}={run.marker}\0".encode()
            for _ in range(5):
                pids = _session_and_marked(run.child.pid, marker)
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                if not pids:
                    break

    async def _supervise(
        self,
        req: ExecRequest,
        run: _Running,
        started: float,
        out: OutputBuffer,
        err: OutputBuffer,
    ) -> ExecResult:
        child = run.child
        timed_out = False
        # The action ends when its main process exits (not when its pipes close: a
        # background descendant may hold them); the timeout counts to that exit.
        try:
            await asyncio.wait_for(child.exited.wait(), req.timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
            _killpg(child.pid, signal.SIGTERM)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(child.exited.wait(), SIGTERM_GRACE_S)
        exec_s = time.monotonic() - started
        # The main process is gone: end whatever it left behind, then drain the pipes.
        self._kill_leftovers(run)
        await child.exited.wait()
        if run.cgroup is not None and self.cgroups is not None:
            await self.cgroups.empty(run.cgroup)  # the cgroup is reused by the next exec
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(child.pipes_closed.wait(), DRAIN_AFTER_EXIT_S)
        held = not child.pipes_closed.is_set()
        child.close()  # our pipe ends: no fd outlives the exec
        detail = "output pipes held open by an escaped descendant" if held else ""
        if run.killed_for_shutdown:
            return infra_error(SHUTDOWN_DETAIL, stdout=out.text(), stderr=err.text())
        rc = child.returncode
        code = exit_code_from_returncode(rc if rc is not None else -9)
        return ExecResult(
            outcome_for(code, timed_out),
            code,
            out.text(),
            err.text(),
            exec_s,
            out.truncated or err.truncated,
            detail or (f"killed after {req.timeout_s} s" if timed_out else ""),
        )

    # --- file transfer ----------------------------------------------------------------

    def _env_root(self, env_id: str) -> Path:
        if not self.env_exists(env_id):
            raise EnvError(f"no such environment {env_id}")
        return self.env_dir(env_id)

    async def put(self, env_id: str, path: str, data: bytes, *, tar: bool = False) -> int:
        """Write a file (or extract a tar stream into a directory) inside the environment."""
        root = self._env_root(env_id)
        owner = self._owners.get(env_id) if self._is_root else None
        return await asyncio.to_thread(files.put_local, root, path, data, tar=tar, owner=owner)

    async def get(self, env_id: str, path: str, *, max_bytes: int) -> tuple[bytes, bool]:
        """A file's bytes, or a directory as a tar stream: ``(data, is_tar)``."""
        root = self._env_root(env_id)
        return await asyncio.to_thread(files.get_local, root, path, max_bytes=max_bytes)

    # --- shell sessions ---------------------------------------------------------------

    async def open_session(
        self, env_id: str, session_id: str, run_as: tuple[int, int] | None = None
    ) -> None:
        """Start a persistent shell in the environment (``shell.py``)."""
        if self._closing:
            raise EnvError(SHUTDOWN_DETAIL)
        root = self._env_root(env_id)
        user = self._user_for(ExecRequest(env_id, "true", (0,), run_as=run_as))
        if isinstance(user, str):
            raise EnvError(user)
        env = self._child_env(ExecRequest(env_id, "true", (0,)), root, f"{self._token}.s")
        for key in ("TANGRAM_CPUS", "TANGRAM_CORES"):
            env.pop(key, None)
        env[MARKER_VAR] = f"{self._token}.session.{session_id}"
        try:
            shell = await shell_mod.open_shell(session_id, env_id, root, env, user)
        except (OSError, subprocess.SubprocessError) as e:
            raise EnvError(f"cannot start the session's shell: {e}") from e
        with contextlib.suppress(OSError):  # what the shell forks inherits it, as an exec's
            Path(f"/proc/{shell.popen.pid}/oom_score_adj").write_text(str(self.oom_score_adj))
        self._shells[session_id] = shell

    async def _session_run(self, req: ExecRequest) -> ExecResult:
        shell = self._shells.get(req.session or "")
        if shell is None or shell.env_id != req.env_id:
            return infra_error(f"no such session {req.session} in {req.env_id}")
        async with shell.lock:
            return await shell_mod.run(shell, req)

    async def interrupt_session(self, session_id: str) -> bool:
        """Interrupt what the session runs now (SIGINT to what the run started)."""
        shell = self._shells.get(session_id)
        return shell is not None and shell_mod.interrupt(shell) > 0

    async def close_session(self, session_id: str) -> None:
        """End the session's shell and everything it started; unknown ids are ignored."""
        shell = self._shells.pop(session_id, None)
        if shell is not None:
            shell_mod.close(shell)

    def _end_sessions(self, env_id: str) -> None:
        for session_id, shell in list(self._shells.items()):
            if shell.env_id == env_id:
                del self._shells[session_id]
                shell_mod.close(shell)

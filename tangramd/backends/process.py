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
  (``cgroups.py``: v1 cpuset, or v2 where delegated), pinned with ``sched_setaffinity``,
  at ``EXEC_OOM_SCORE_ADJ``. It is spawned by the backend's fork server (``forkserver.py``),
  a small helper process that joins the cgroup, pins itself and raises its own score for
  the instant of the fork, so the child is born in place: the command never runs
  elsewhere, no wrapper shell, gate or ``preexec_fn`` is needed, the event loop never
  waits in the kernel for a cgroup join, and no daemon thread ever enters an exec's
  cgroup. On cgroup v1 the fork server also leaves a *lodger* in each exec cgroup it has
  served (up to ``MAX_LODGERS``): a copy of itself that stays there, so later execs on
  those cores are spawned with no cgroup move at all (a v1 move waits 5-15 ms for an RCU
  grace period after an idle gap). A list command is exec'd directly (a missing program
  is exit 127, as a shell reports it); a string runs under ``/bin/sh -c``.
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
import errno
import functools
import hashlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from tangramd.backends import cgroups as cg
from tangramd.backends import files, nsbox
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
from tangramd.backends.boxes import (
    DEFAULT_ENV_PIDS_MAX,
    ENV_NETWORKS,
    ISOLATION_MODES,
    SANDBOX_ID_BASE,
    Boxes,
    probe_isolation,
)
from tangramd.backends.cgroups import CPUSET_ROOT, Cgroups
from tangramd.backends.nsfork import Forks
from tangramd.backends.spawner import Spawner, SpawnError

__all__ = ["CPUSET_ROOT", "SANDBOX_ID_BASE", "ProcessBackend"]

log = structlog.get_logger(__name__)

DRAIN_AFTER_EXIT_S = 1.0  # how long to wait for pipes to close once the group is dead
MARKER_VAR = "TANGRAM_EXEC_ID"
EXEC_UMASK = 0o077
# The most lodgers (pre-joined copies of the fork server, one per exec cgroup: forkserver.py)
# kept at once; each costs a few MiB of memory not shared with the fork server.
MAX_LODGERS = 64
# (isolated) one lodger per environment in use, inside it (~1.6 MiB each), up to this many
MAX_BOX_LODGERS = 512
_READ_CHUNK = 1 << 16
# how long an exec's output waits in its pipes before the loop reads it as it comes (see
# _Child): a command that ends sooner is read once, at its end
READ_LATER_S = 0.002
INLINE_PUT_MAX = 64 << 10  # bytes a put writes on the event loop (more: in a thread)
INLINE_GET_MAX = 64 << 10  # bytes of a file a get reads on the event loop (more: in a thread)
TOMB = ".removing"  # in the envs dir: closed environments on their way out (not an env id)
# In the envs dir: empty directories (0700, the daemon's) made ahead by a thread, so that
# opening an environment is a rename on the event loop, not a mkdir: creating an inode cost
# ~1 ms of CPU on the VMs this was built on (ext4), and the loop served nobody meanwhile.
# Never reused: a closed environment's directory is removed (its owner may have left ACLs
# or extended attributes on it).
SPARE = ".spare"
SPARE_DIRS = 16  # how many are kept ready; a refill starts below half
SMALL_DIR_ENTRIES = 32  # a closed environment with at most this many files, no subdirectory,
# is removed without shutil.rmtree's walk
_ENV_PASSTHROUGH = ("PATH", "LANG", "LC_ALL", "TZ", "TERM")


def _base_env() -> dict[str, str]:
    """What every command's environment starts from: a few of the daemon's variables (read
    once, at start-up), its interpreter's directory first on ``PATH`` so `python -m pytest`
    finds the same packages."""
    env = {k: os.environ[k] for k in _ENV_PASSTHROUGH if k in os.environ}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', os.defpath)}"
    return env


def _make_private_dir(path: str) -> str:
    """(In a thread: ~1 ms of CPU here) a new empty directory, mode 0700."""
    os.mkdir(path, 0o700)
    os.chmod(path, 0o700)  # whatever the umask
    return path


def _make_dirs(parent: str, count: int) -> list[str]:
    """(In a thread) ``count`` spare directories under ``parent``."""
    os.makedirs(parent, 0o700, exist_ok=True)
    return [_make_private_dir(os.path.join(parent, os.urandom(8).hex())) for _ in range(count)]


def command_argv(cmd: list[str] | str) -> list[str]:
    """The argv to spawn: a list as it is, a string under ``/bin/sh -c``."""
    if isinstance(cmd, str):
        return ["/bin/sh", "-c", cmd]
    return list(cmd)


def _not_run(argv: list[str], e: SpawnError) -> ExecResult:
    """A command that could not be exec'd, reported as a shell would (127 / 126)."""
    code = 127 if e.errno == errno.ENOENT else 126
    why = "not found" if code == 127 else (os.strerror(e.errno) if e.errno else str(e))
    return ExecResult("failed", code, stderr=f"tangram: {argv[0]}: {why}\n")


class _Child:
    """One spawned command's pipes: non-blocking readers into capped buffers.

    The readers are registered lazily: most execs are short and have exited, their
    output waiting in the pipes, before ``READ_LATER_S`` is up; their end drains the
    pipes directly (``drain``), which spares the loop two reader registrations and
    removals per exec (each a poll handle and its ``epoll_ctl`` calls). A command
    still running then gets its readers (one writing more than a pipe holds waits for
    them at most that long), and so does one whose pipes outlive it (``watch``)."""

    __slots__ = ("_bufs", "_later", "_open", "_watching", "loop", "pid", "pipes_closed")

    def __init__(
        self,
        pid: int,
        pipes: tuple[int, int],
        loop: asyncio.AbstractEventLoop,
        out: OutputBuffer,
        err: OutputBuffer,
        delay: float = READ_LATER_S,
    ) -> None:
        self.pid = pid
        self.loop = loop
        self.pipes_closed = asyncio.Event()
        self._bufs = dict(zip(pipes, (out, err), strict=True))
        self._open: set[int] = set(pipes)
        self._watching = False
        self._later: asyncio.TimerHandle | None = loop.call_later(delay, self.watch)

    def watch(self) -> None:
        """Read the pipes as data comes (from now on, until they close)."""
        self._stop_timer()  # (when called before it fired: from drain)
        if self._watching:
            return
        self._watching = True
        for fd in self._open:
            self.loop.add_reader(fd, self._read, fd, self._bufs[fd])

    def _read(self, fd: int, buf: OutputBuffer) -> bool:
        """Read one chunk; False when nothing more is there now (EAGAIN) or at EOF."""
        try:
            data = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if data:
            buf.feed(data)
            return True
        self._close_pipe(fd)
        return False

    def drain(self, max_reads: int = 16) -> None:
        """Read what the pipes hold now (the command has exited), a bounded amount: a
        descendant still writing is left to the readers (registered if they were not)."""
        for fd in list(self._open):
            for _ in range(max_reads):
                if not self._read(fd, self._bufs[fd]):
                    break
        if self._open:
            self.watch()

    def _close_pipe(self, fd: int) -> None:
        if fd not in self._open:
            return
        self._open.discard(fd)
        if self._watching:
            self.loop.remove_reader(fd)
        with contextlib.suppress(OSError):
            os.close(fd)
        if not self._open:
            self.pipes_closed.set()
            self._stop_timer()

    def _stop_timer(self) -> None:
        if self._later is not None:
            self._later.cancel()
            self._later = None

    def close(self) -> None:
        """Stop reading (a descendant that escaped every sweep may hold the pipes); the
        last pipe's closing stops the timer."""
        for fd in list(self._open):
            self._close_pipe(fd)


def _feed(fd: int, data: bytes) -> None:
    """Write ``data`` to a child's stdin and close it, in a thread of its own: a command
    that never reads its input must not block the loop (the write ends when it exits)."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_env_dir(path: str, tomb: str) -> None:
    """``shutil.rmtree(path, ignore_errors=True)`` (in a thread), the directory moved into
    ``tomb`` first: an rmdir can hold its parent directory's lock for milliseconds (ext4
    with discard), and the next environment's mkdir in the envs directory, on the event
    loop, would wait for it. A directory of at most ``SMALL_DIR_ENTRIES`` entries and no
    subdirectory (a throwaway environment's source file) is emptied through its descriptor,
    without shutil.rmtree's walk; no link is followed."""
    gone = os.path.join(tomb, f"{os.path.basename(path)}.{threading.get_ident()}")
    for _ in range(2):
        try:
            os.rename(path, gone)
            path = gone
            break
        except FileNotFoundError:
            if not os.path.lexists(path):
                return
            try:  # the first removal: no tomb yet
                os.mkdir(tomb, 0o700)
            except OSError:
                break  # removed where it is
        except OSError:
            break
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        fd = None
        if os.path.islink(path):  # never made by us: the link goes, not what it points to
            with contextlib.suppress(OSError):
                os.unlink(path)
            return
    if fd is not None:
        try:
            with os.scandir(fd) as it:
                entries = list(itertools.islice(it, SMALL_DIR_ENTRIES + 1))
            if len(entries) <= SMALL_DIR_ENTRIES and not any(
                e.is_dir(follow_symlinks=False) for e in entries
            ):
                for entry in entries:
                    os.unlink(entry.name, dir_fd=fd)
                os.rmdir(path)
                return
        except OSError:
            pass  # what is left goes the long way
        finally:
            os.close(fd)
    shutil.rmtree(path, ignore_errors=True)


ExecDone = Callable[[ExecResult], None]


@dataclass(slots=True, eq=False)
class _Running:
    """One exec in flight, from the spawn request to its result (see ``start_exec``)."""

    req: ExecRequest
    argv: list[str]
    cgroup: Path | None
    marker: str
    done: ExecDone
    started: float
    stdio: dict[str, int]
    pipes: tuple[int, int]
    stdin_w: int | None
    out: OutputBuffer
    err: OutputBuffer
    child: _Child | None = None
    returncode: int | None = None
    exited: bool = False
    lost: bool = False  # the spawner died before reporting the exit
    timed_out: bool = False
    exec_s: float | None = None
    timer: asyncio.TimerHandle | None = None
    cancelled: bool = False  # by cancel(): killed as soon as it is spawned
    mem_cgroup: str | None = None  # its own memory cgroup (``mem_limit``), removed at its end
    killed_for_shutdown: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)


def _resolve(fut: asyncio.Future[ExecResult], result: ExecResult) -> None:
    if not fut.done():  # (a cancelled ``exec`` still ends its command)
        fut.set_result(result)


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
        lodgers: int | None = None,
        isolation: str = "none",
        env_pids_max: int = DEFAULT_ENV_PIDS_MAX,
        env_network: str = "none",
        hide: Sequence[str] = (),
    ) -> None:
        self._base_env = _base_env()
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
        # isolation (nsbox.py, boxes.py): each environment in its own namespaces
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"isolation: got {isolation!r} (allowed: {ISOLATION_MODES})")
        if env_network not in ENV_NETWORKS:
            raise ValueError(f"env_network: got {env_network!r} (allowed: {ENV_NETWORKS})")
        self.isolated = False
        if isolation != "none":
            why = probe_isolation(os.fspath(self.root))
            if why and isolation == "namespaces":
                raise EnvError(f'cpu.isolation = "namespaces", but this host refuses: {why}')
            self.isolated = not why
            if why:
                log.warning(
                    "env_isolation_off",
                    reason=why,
                    detail='cpu.isolation = "auto": environments are plain directories and '
                    "commands share the host's filesystem, processes and network",
                )
        self._envs: dict[str, int | None] = {}  # env_id -> advisory memory bytes
        self._owners: dict[str, tuple[int, int] | None] = {}
        self._running: set[_Running] = set()
        self._tasks: set[asyncio.Task[object]] = set()  # slow ends of execs, session runs
        self._closing = False
        self._token = f"{scope}.{os.getpid()}"
        self._shells: dict[str, shell_mod.Shell] = {}
        self._spares: list[str] = []  # empty directories made ahead (SPARE)
        self._refill: asyncio.Task[list[str]] | None = None
        # The fork server: started on the first exec (and again if it dies), with lodgers
        # in the exec cgroups where they pay (see forkserver.py).
        if lodgers is None:  # (isolated: one per environment and core set in use)
            cores = len(os.sched_getaffinity(0))
            lodgers = MAX_BOX_LODGERS if self.isolated else min(MAX_LODGERS, 2 * cores)
        self._spawner = Spawner(
            lodgers=lodgers if self.cgroups is not None and self.cgroups.lodgers else 0,
            base_env=self._base_env,
        )
        self._exec_ids = itertools.count(1)
        self._tasks_fds: dict[Path, int] = {}  # cpuset cgroup -> its tasks file (_cgroup_tasks)
        self.boxes: Boxes | None = None
        if self.isolated:
            self.boxes = Boxes(
                self.root, self._real_envs_path, scope, self._spawner,
                hide=hide, network=env_network, pids_max=env_pids_max,
            )  # fmt: skip
        # fork and reset (nsfork.py): overlay layers, or copies of plain directories
        self.forks = Forks(self.root, self._real_envs_path, self.boxes)
        if self.boxes is not None:
            self.boxes.forks = self.forks

    @property
    def lodger_pids(self) -> set[int]:
        """The fork server's lodgers (one per exec cgroup it keeps warm): not leftovers."""
        return self._spawner.lodger_pids

    # --- environments -----------------------------------------------------------------

    def env_dir(self, env_id: str) -> Path:
        return self.envs_dir / check_env_id(env_id)

    @functools.cached_property
    def _envs_path(self) -> str:
        return os.fspath(self.envs_dir)

    @functools.cached_property
    def _real_envs_path(self) -> str:
        """The envs directory as a real path, resolved once: an environment's files are
        confined to ``<this>/<env_id>`` (``base.confine_real``)."""
        return os.path.realpath(self.envs_dir)

    def env_exists(self, env_id: str) -> bool:
        # an id in ``_envs`` is a checked name (create_env) or an entry of the envs dir
        return env_id in self._envs and os.path.isdir(os.path.join(self._envs_path, env_id))

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
        path = os.path.join(self._envs_path, check_env_id(env_id))
        if env_id in self._envs:
            raise EnvError(f"environment {env_id} exists")
        owner = owner or self.default_user
        if os.path.lexists(path):  # a leftover of a previous run that reconcile did not see
            await asyncio.to_thread(shutil.rmtree, path, True)
        spare = self._spares.pop() if self._spares else None
        if spare is not None:
            try:
                os.rename(spare, path)  # tens of microseconds, against ~1 ms for a mkdir
            except OSError:
                spare = None
        if spare is None:
            await asyncio.to_thread(_make_private_dir, path)
        if self._closing:  # shut down during an await above: its removal passed this one by
            await asyncio.to_thread(shutil.rmtree, path, True)
            raise EnvError(SHUTDOWN_DETAIL)
        if self.boxes is not None:  # root inside is this host uid: its home is its own
            os.chown(path, *self.boxes.assign(env_id, owner, mem_bytes))
        elif owner is not None and self._is_root:
            os.chown(path, *owner)
        self._envs[env_id] = mem_bytes
        self._owners[env_id] = owner
        self._make_spares()
        if self.boxes is not None:
            self.forks.refill_soon()  # (nsfork.py: a fork's children take them)
            try:
                await self.boxes.open(env_id)
            except BaseException:
                await self.close_env(env_id)
                raise

    def _make_spares(self) -> None:
        """Start a refill of the spare directories when fewer than half are ready."""
        if self._refill is not None or self._closing or len(self._spares) >= SPARE_DIRS // 2:
            return
        parent = os.path.join(self._envs_path, SPARE)
        task = asyncio.get_running_loop().create_task(
            asyncio.to_thread(_make_dirs, parent, SPARE_DIRS - len(self._spares))
        )
        self._refill = task
        task.add_done_callback(self._spares_made)

    def _spares_made(self, task: asyncio.Task[list[str]]) -> None:
        self._refill = None
        if task.cancelled():
            return
        if task.exception() is not None:  # the next creation makes its own directory
            log.warning("spare_env_dirs_failed", error=str(task.exception()))
            return
        self._spares.extend(task.result())

    async def close_env(self, env_id: str) -> None:
        for shell in self._end_sessions(env_id):
            await self._drop_session_cgroup(shell)
        self._envs.pop(env_id, None)
        self._owners.pop(env_id, None)
        path = os.path.join(self._envs_path, check_env_id(env_id))
        await self.forks.close(env_id)  # (its home unmounted before its dirs go)
        if self.boxes is not None:
            await self.boxes.close(env_id)
        # in a thread: an rmdir can wait milliseconds for the filesystem (ext4 with discard)
        await asyncio.to_thread(_remove_env_dir, path, os.path.join(self._envs_path, TOMB))

    async def reconcile(
        self, keep: Mapping[str, tuple[int, int] | None] | None = None
    ) -> list[str]:
        """Adopt the env directories in ``keep`` (env id -> owner) that a previous run left;
        remove every other env directory, and kill and remove leftover exec cgroups (what
        ran in them belonged to actions of a daemon that died)."""
        keep = keep or {}
        done: list[str] = []
        await self.forks.reconcile(keep)
        for path in sorted(self.envs_dir.iterdir()):
            if path.name in self._envs:
                continue
            if path.name in keep and path.is_dir() and not path.is_symlink():
                self._envs[path.name] = None
                self._owners[path.name] = keep[path.name] or self.default_user
                if self.boxes is not None:  # its keeper is built again on its first exec
                    st = path.stat()
                    self.boxes.ids[path.name] = (st.st_uid, st.st_gid)
                done.append(f"adopted env dir {path}")
                continue
            await asyncio.to_thread(shutil.rmtree, path, True)
            if path.name != SPARE:  # (the spare directories are made again as needed)
                done.append(f"removed env dir {path}")
        if self.cgroups is not None:
            busy = {r.cgroup for r in self._running}
            lodged = self._spawner.lodged()
            for cgroup in self.cgroups.leftovers():
                if cgroup in busy or str(cgroup) in lodged:
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
        if self.boxes is not None:
            done += await self.boxes.reconcile(self._envs)
        return done

    async def shutdown(self, keep: Collection[str] = ()) -> None:
        """End in-flight execs (infra_error), remove every environment not in ``keep``."""
        self._closing = True
        for run in list(self._running):
            run.killed_for_shutdown = True
            self._kill_leftovers(run)
        for run in list(self._running):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(run.ended.wait(), 5)
        for env_id in list(self._envs):
            if env_id not in keep:
                await self.close_env(env_id)
            elif self.boxes is not None:  # its files stay; its processes end with the daemon
                await self.boxes.close(env_id, keep_layers=True)
                await self.forks.unmount(env_id)
        if self._refill is not None:
            with contextlib.suppress(Exception):
                await self._refill
        self._spares.clear()
        await asyncio.to_thread(shutil.rmtree, os.path.join(self._envs_path, SPARE), True)
        await self.forks.shutdown()
        if self.cgroups is not None:
            with contextlib.suppress(OSError):
                for cgroup in self.cgroups.leftovers():
                    await self.cgroups.remove(cgroup)
            await self.cgroups.remove(self.cgroups.base)
        self._spawner.close()
        for fd in self._tasks_fds.values():
            os.close(fd)
        self._tasks_fds.clear()
        if self.boxes is not None:
            self.boxes.remove_bases()

    # --- fork and reset (nsfork.py) ----------------------------------------------------

    def _refuse_busy(self, env_id: str, what: str) -> None:
        """Running processes are not copied: a fork or reset of an environment that runs
        an action or has a session open is refused, not waited for."""
        if not self.env_exists(env_id):
            raise EnvError(f"no such environment {env_id}")
        running = sum(1 for run in self._running if run.req.env_id == env_id)
        shells = sum(1 for shell in self._shells.values() if shell.env_id == env_id)
        if running or shells:
            raise EnvError(
                f"cannot {what} {env_id}: {running} action(s) running and {shells} "
                "session(s) open in it (processes are not copied: wait for them to end "
                "and close its sessions first)"
            )

    async def fork_env(self, env_id: str, children: Sequence[str]) -> None:
        """Make each of ``children`` (new ids) a copy-on-write copy of ``env_id``'s files
        as they are now (``nsfork.py``); each runs as ``env_id``'s user."""
        if self._closing:
            raise EnvError(SHUTDOWN_DETAIL)
        self._refuse_busy(env_id, "fork")
        for child in children:
            if check_env_id(child) in self._envs:
                raise EnvError(f"environment {child} exists")
        await self.forks.fork(env_id, children)
        mem = self._envs.get(env_id)
        for child in children:
            self._envs[child] = mem
            self._owners[child] = self._owners.get(env_id)
            if self.boxes is not None:
                self.boxes.ids[child] = self.boxes.ids[env_id]
                self.boxes.mem[child] = self.boxes.mem.get(env_id)

    async def reset_env(self, env_id: str) -> None:
        """Back to the files of ``env_id``'s fork point (or, never forked, of its
        opening); what ran in it is ended."""
        if self._closing:
            raise EnvError(SHUTDOWN_DETAIL)
        self._refuse_busy(env_id, "reset")
        await self.forks.reset(env_id)

    # --- execs ------------------------------------------------------------------------

    def _child_env(self, req: ExecRequest, home: Path, marker: str) -> dict[str, str]:
        return {**self._base_env, **self._env_over_base(req, home, marker)}

    @staticmethod
    def _env_over_base(req: ExecRequest, home: Path, marker: str) -> dict[str, str]:
        """What one exec's environment sets over the base environment (the fork server has
        the base once, so a spawn request carries only this)."""
        env = {"HOME": str(home), "TMPDIR": str(home)}
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
        """Run one command to its end (``start_exec`` as a coroutine)."""
        fut: asyncio.Future[ExecResult] = asyncio.get_running_loop().create_future()
        self.start_exec(req, functools.partial(_resolve, fut))
        return await fut

    def start_exec(self, req: ExecRequest, done: ExecDone) -> None:
        """Start one command now; ``done(result)`` is called once when it has ended.

        The spawn request leaves before this returns, and on the usual path the result is
        handed over within the loop turn that reads the exit report (the command's pipes
        are drained then and its cgroup found empty): no task, no wake-up in between. What
        takes longer (a timeout, leftovers still dying, pipes held by a descendant) goes on
        in a task. ``done`` is never called from inside this method.
        """
        loop = asyncio.get_running_loop()
        early = self._refusal(req)
        if early is not None:
            loop.call_soon(done, early)
            return
        if req.session is not None:
            task = loop.create_task(self._session_run(req))
            self._tasks.add(task)
            task.add_done_callback(lambda t: self._session_done(t, done))
            return
        user = self._user_for(req)
        if isinstance(user, str):
            loop.call_soon(done, infra_error(user))
            return
        home = self.env_dir(req.env_id)
        box: dict[str, Any] | None = None
        boxes = self.boxes
        if boxes is not None:  # any path inside is the environment's own: no confinement
            keeper = boxes.keeper(req.env_id, loop)
            if keeper is None:  # (built again: its keeper died, or a restart adopted it)
                opening = loop.create_task(self._exec_when_open(req, done))
                self._tasks.add(opening)
                opening.add_done_callback(self._tasks.discard)
                return
            if req.cwd and "\0" in req.cwd:
                loop.call_soon(done, ExecResult("rejected", detail="cwd: NUL is not allowed"))
                return
            cwd = home / req.cwd if req.cwd else home
            box = boxes.exec_box(req.env_id, keeper)
            user = None  # root inside, mapped to the environment's host uid
        else:
            try:
                cwd = confine(home, req.cwd) if req.cwd else home
            except PathEscape as e:
                loop.call_soon(done, ExecResult("rejected", detail=f"cwd {e}"))
                return
            if req.cwd and not cwd.is_dir():
                why = "not a directory" if cwd.exists() else "no such directory"
                msg = f"tangram: cwd {req.cwd}: {why}\n"
                loop.call_soon(done, ExecResult("failed", 1, stderr=msg))
                return
        cgroup: Path | None = None
        if self.cgroups is not None:
            try:
                cgroup = self.cgroups.for_cores(req.cores)
            except OSError as e:
                loop.call_soon(done, infra_error(f"cannot create cpuset cgroup: {e}"))
                return
        argv = command_argv(rewrite_pytest(req.cmd, len(req.cores), req.elastic))
        marker = f"{self._token}.{next(self._exec_ids)}"
        request = {
            "argv": argv,
            "cwd": str(cwd),
            "env": self._env_over_base(req, home, marker),
            "umask": EXEC_UMASK,
            "user": user,
            "cores": list(req.cores),
            "cgroup": None if cgroup is None else str(cgroup),
            "home": None if self.cgroups is None or cgroup is None else str(self.cgroups.home),
            "oom_score_adj": self.oom_score_adj,
            # other execs in flight: the lodger may hold its answer for a quick exit
            # (one message less per exec under load; a lone exec's pid overlaps it)
            "quick": bool(self._running),
        }
        mem_cgroup = None
        if box is not None:
            request["sandbox"] = box
            limits = None if boxes is None else boxes.limits
            if req.mem_limit is not None and limits is not None:
                # its own memory cgroup below the environment's: the fork server's path
                mem_cgroup = f"x-{marker}"
                try:
                    tasks = limits.exec_memory(req.env_id, mem_cgroup, req.mem_limit)
                except OSError as e:
                    loop.call_soon(done, infra_error(f"cannot limit the exec's memory: {e}"))
                    return
                box["cgroups"] = [*box["cgroups"], tasks]
                request["lodge"] = False  # (a lodger has joined its own cgroups for good)
            elif cgroup is not None:  # its lodger lives inside it (forkserver.py)
                request["lodge"] = f"{req.env_id}#{box['pid']}"
        out_r, out_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        err_r, err_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        os.set_blocking(out_w, True)
        os.set_blocking(err_w, True)
        stdio = {"stdout": out_w, "stderr": err_w}
        if request.get("lodge") and cgroup is not None:  # (its lodger moves itself there)
            stdio["cgroup_tasks"] = os.dup(self._cgroup_tasks(cgroup))
        in_w = None
        if req.stdin:
            in_r, in_w = os.pipe2(os.O_CLOEXEC)
            stdio["stdin"] = in_r
        run = _Running(
            req=req,
            argv=argv,
            cgroup=cgroup,
            marker=marker,
            done=done,
            started=time.monotonic(),
            stdio=stdio,
            pipes=(out_r, err_r),
            stdin_w=in_w,
            out=OutputBuffer(req.max_output),
            err=OutputBuffer(req.max_output),
            mem_cgroup=mem_cgroup,
        )
        self._running.add(run)
        self._spawner.submit(request, stdio, lambda got: self._spawned(run, got))

    def _cgroup_tasks(self, cgroup: Path) -> int:
        """A descriptor of the cpuset cgroup's ``tasks`` file, opened once by the daemon:
        what an isolated environment's lodger writes to move itself there."""
        fd = self._tasks_fds.get(cgroup)
        if fd is None:
            fd = self._tasks_fds[cgroup] = os.open(cgroup / "tasks", os.O_WRONLY | os.O_CLOEXEC)
        return fd

    async def _exec_when_open(self, req: ExecRequest, done: ExecDone) -> None:
        """Build the environment's namespaces again, then start the exec."""
        assert self.boxes is not None
        try:
            await self.boxes.open(req.env_id)
        except Exception as e:
            done(infra_error(f"cannot open environment {req.env_id}: {e}"))
            return
        if req.env_id not in self.boxes.keepers:
            done(infra_error(f"environment {req.env_id} has no keeper"))
            return
        self.start_exec(req, done)

    def _refusal(self, req: ExecRequest) -> ExecResult | None:
        if self._closing:
            return infra_error(SHUTDOWN_DETAIL)
        if not self.env_exists(req.env_id):
            return infra_error(f"no such environment {req.env_id}")
        return None

    def _session_done(self, task: asyncio.Task[ExecResult], done: ExecDone) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            done(infra_error("the session run was cancelled"))
        elif task.exception() is not None:
            exc = task.exception()
            done(infra_error(f"{type(exc).__name__}: {exc}"))
        else:
            done(task.result())

    def _spawned(self, run: _Running, got: int | SpawnError) -> None:
        """The helper's answer to a spawn request (a loop callback)."""
        for fd in run.stdio.values():  # the helper passed its copies to the child
            os.close(fd)
        if isinstance(got, SpawnError):
            for fd in run.pipes:
                os.close(fd)
            if run.stdin_w is not None:
                os.close(run.stdin_w)
            boxes = self.boxes
            if boxes is not None and got.errno == errno.ESRCH and run.req.env_id in boxes.keepers:
                # its keeper died unseen (killed by hand, or its fork server was replaced):
                # build the environment again and run the command there
                boxes.lost(run.req.env_id)
                self._running.discard(run)
                task = asyncio.get_running_loop().create_task(
                    self._exec_when_open(run.req, run.done)
                )
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            elif got.stage == "cwd":  # (in an environment) its working directory is missing
                why = {errno.ENOENT: "no such directory", errno.ENOTDIR: "not a directory"}
                text = why.get(got.errno or 0, str(got))
                msg = f"tangram: cwd {run.req.cwd or '~'}: {text}\n"
                self._end(run, ExecResult("failed", 1, stderr=msg))
            elif got.errno in (errno.ENOENT, errno.EACCES, errno.ENOEXEC, errno.ENOTDIR):
                self._end(run, _not_run(run.argv, got))
            else:
                self._end(run, infra_error(f"spawn failed: {got}"))
            return
        loop = asyncio.get_running_loop()
        # the readers' delay counts from the spawn request (a lodger answers a command
        # still running only after ``QUICK_EXIT_S``: its readers are then due at once)
        delay = max(0.0, READ_LATER_S - (time.monotonic() - run.started))
        run.child = _Child(got, run.pipes, loop, run.out, run.err, delay)
        self._spawner.watch(got, lambda rc, alone: self._exited(run, rc, alone))
        if run.stdin_w is not None:
            args = (run.stdin_w, run.req.stdin)
            threading.Thread(target=_feed, args=args, daemon=True).start()
        if self._closing or run.cancelled:
            run.killed_for_shutdown = self._closing
            self._kill_leftovers(run)  # its exit report ends it
        elif run.req.timeout_s is not None:
            run.timer = loop.call_later(run.req.timeout_s, self._timed_out, run)

    def _timed_out(self, run: _Running) -> None:
        """The timeout (counted from the spawn to the main process's exit): SIGTERM to the
        group, SIGKILL to everything ``SIGTERM_GRACE_S`` later."""
        run.timer = None
        if run.exited or run.child is None:
            return
        run.timed_out = True
        _killpg(run.child.pid, signal.SIGTERM)
        run.timer = asyncio.get_running_loop().call_later(SIGTERM_GRACE_S, self._grace_over, run)

    def _grace_over(self, run: _Running) -> None:
        run.timer = None
        if run.exited:
            return
        run.exec_s = time.monotonic() - run.started
        self._kill_leftovers(run)  # SIGKILL; the exit report follows

    def _exited(self, run: _Running, rc: int | None, alone: bool = False) -> None:
        """The main process exited (``rc``; None: the spawner died before saying how).

        The action ends now (not when its pipes close: a background descendant may hold
        them): whatever it left is killed, then the pipes are drained. When the cgroup is
        empty and the pipes closed at once, the result goes out in this turn. ``alone``
        (the lodger, a subreaper, has no child left: nothing the command started lives)
        spares the sweep of its process group and cgroup."""
        run.exited = True
        if run.timer is not None:
            run.timer.cancel()
            run.timer = None
        if rc is None:
            run.lost = True
        else:
            run.returncode = rc
        if run.exec_s is None:
            run.exec_s = time.monotonic() - run.started
        child = run.child
        assert child is not None
        try:
            left = False if alone else self._kill_leftovers(run)
            child.drain()
            if child.pipes_closed.is_set() and not (left and self._busy(run.cgroup)):
                self._end(run, self._result(run))
                return
        except Exception as exc:  # never leave an action without an answer
            log.exception("exec_end_failed", marker=run.marker)
            child.close()
            self._end(run, infra_error(f"{type(exc).__name__}: {exc}"))
            return
        task = asyncio.get_running_loop().create_task(self._settle(run))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _busy(self, cgroup: Path | None) -> bool:
        if cgroup is None or self.cgroups is None:
            return False
        return bool(self.cgroups.others(cgroup, self._spawner.lodger_pids))

    async def _settle(self, run: _Running) -> None:
        """The slow end of an exec: leftovers still dying, or pipes held open."""
        child = run.child
        assert child is not None
        try:
            if run.cgroup is not None and self.cgroups is not None:
                # the cgroup is reused by the next exec (and its lodger stays)
                await self.cgroups.empty(run.cgroup, self._spawner.lodger_pids)
            if not child.pipes_closed.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(child.pipes_closed.wait(), DRAIN_AFTER_EXIT_S)
            result = self._result(run)
        except Exception as exc:
            log.exception("exec_end_failed", marker=run.marker)
            child.close()
            result = infra_error(f"{type(exc).__name__}: {exc}")
        self._end(run, result)

    def _result(self, run: _Running) -> ExecResult:
        child = run.child
        assert child is not None
        held = not child.pipes_closed.is_set()
        child.close()  # our pipe ends: no fd outlives the exec
        out, err = run.out, run.err
        exec_s = run.exec_s if run.exec_s is not None else time.monotonic() - run.started
        detail = "output pipes held open by an escaped descendant" if held else ""
        if run.killed_for_shutdown:
            return infra_error(SHUTDOWN_DETAIL, stdout=out.text(), stderr=err.text())
        if run.lost:
            return infra_error(
                "the spawner process died: the command's exit status is unknown",
                stdout=out.text(),
                stderr=err.text(),
                exec_s=exec_s,
            )
        rc = run.returncode
        code = exit_code_from_returncode(rc if rc is not None else -9)
        timeout = run.req.timeout_s
        return ExecResult(
            outcome_for(code, run.timed_out),
            code,
            out.text(),
            err.text(),
            exec_s,
            out.truncated or err.truncated,
            detail or (f"killed after {timeout} s" if run.timed_out else ""),
        )

    def _end(self, run: _Running, result: ExecResult) -> None:
        if run.ended.is_set():
            return
        if run.child is not None:
            self._spawner.forget(run.child.pid)
        self._running.discard(run)
        limits = None if self.boxes is None else self.boxes.limits
        if run.mem_cgroup is not None and limits is not None:
            task = asyncio.get_running_loop().create_task(
                limits.remove_exec(run.req.env_id, run.mem_cgroup)
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        try:
            run.done(result)
        except Exception:
            log.exception("exec_done_callback_failed", marker=run.marker)
        finally:
            run.ended.set()

    async def cancel(self, action_id: str) -> bool:
        """SIGKILL the running exec of ``action_id`` and what it left (see Backend)."""
        runs = [run for run in self._running if run.req.action_id == action_id]
        for run in runs:
            run.cancelled = True
            self._kill_leftovers(run)
        return bool(runs)

    def _kill_leftovers(self, run: _Running) -> bool:
        """SIGKILL the exec's process group, and its cgroup or (without one) session.
        False when its cgroup was found empty (nothing left to wait for)."""
        if run.child is None:
            return True  # not spawned yet: the spawn's answer sees ``_closing``
        _killpg(run.child.pid, signal.SIGKILL)
        if run.cgroup is not None and self.cgroups is not None:
            return self.cgroups.kill_all(run.cgroup, self._spawner.lodger_pids)
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
            return True

    # --- file transfer ----------------------------------------------------------------

    def _env_root(self, env_id: str) -> Path:
        if not self.env_exists(env_id):
            raise EnvError(f"no such environment {env_id}")
        return self.env_dir(env_id)

    def _env_base(self, env_id: str) -> str:
        """The environment's directory as a real path, for ``files`` (which confine to it)."""
        if not self.env_exists(env_id):
            raise EnvError(f"no such environment {env_id}")
        return os.path.join(self._real_envs_path, env_id)

    async def put(self, env_id: str, path: str, data: bytes, *, tar: bool = False) -> int:
        """Write a file (or extract a tar stream into a directory) inside the environment:
        isolated, by a file helper inside it as its user, at its own paths (``nsfiles``);
        otherwise beneath its directory (a tar stream extracted as its user)."""
        base = self._env_base(env_id)
        if self.boxes is not None:
            return int(await self._inside(env_id, files.put_by_helper, path, data, tar=tar))
        owner = self._file_owner(env_id)
        if tar and owner is not None:
            request = {"user": owner, "cwd": base, "oom_score_adj": self.oom_score_adj}
            return await files.put_by_helper(self._spawner, request, path, data, tar=True)
        if not tar and len(data) <= INLINE_PUT_MAX:  # a source file: a thread hop costs more
            return files.put_local(base, path, data, tar=False, owner=owner)
        return await asyncio.to_thread(files.put_local, base, path, data, tar=tar, owner=owner)

    async def get(self, env_id: str, path: str, *, max_bytes: int) -> tuple[bytes, bool]:
        """A file's bytes, or a directory as a tar stream: ``(data, is_tar)`` (where
        :meth:`put` writes)."""
        base = self._env_base(env_id)
        if self.boxes is not None:
            got = await self._inside(env_id, files.get_by_helper, path, max_bytes=max_bytes)
            return got  # type: ignore[no-any-return]
        got = files.get_small(base, path, max_bytes=max_bytes, limit=INLINE_GET_MAX)
        if got is not None:  # a small file, read at once: a thread hop costs more
            return got
        owner = self._file_owner(env_id)
        # a root daemon reads a file here; a directory's walk (which follows what it finds)
        # is the environment's user's
        if owner is not None:
            small: tuple[bytes, bool] | None = await asyncio.to_thread(
                files.get_small, base, path, max_bytes=max_bytes, limit=max_bytes
            )
            if small is not None:
                return small
            request = {"user": owner, "cwd": base, "oom_score_adj": self.oom_score_adj}
            return await files.get_by_helper(self._spawner, request, path, max_bytes=max_bytes)
        return await asyncio.to_thread(files.get_local, base, path, max_bytes=max_bytes)

    def _file_owner(self, env_id: str) -> tuple[int, int] | None:
        """(Not isolated) whom a root daemon's file operations act for: the environment's
        user, unless that is root (None: the daemon's own user)."""
        owner = self._owners.get(env_id) if self._is_root else None
        return None if owner is None or owner[0] == 0 else owner

    async def _inside(self, env_id: str, op: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """(Isolated) ``op`` (``files.put_by_helper`` or ``get_by_helper``) inside the
        environment, built again first when its keeper is gone."""
        assert self.boxes is not None
        loop = asyncio.get_running_loop()
        for _ in range(2):
            keeper = self.boxes.keeper(env_id, loop)
            if keeper is None:
                keeper = await self.boxes.open(env_id)
            request = {
                # (not in its cgroups: a v1 join waits milliseconds for an RCU grace
                # period; what a helper holds is bounded by the transfer's own cap)
                "sandbox": {"pid": keeper, "cgroups": []},
                "cwd": os.path.join(self._real_envs_path, env_id),  # its home, inside too
                "oom_score_adj": self.oom_score_adj,
            }
            try:
                return await op(self._spawner, request, *args, **kw)
            except files.HelperLost:
                self.boxes.lost(env_id)
        raise EnvError(f"environment {env_id}: its namespaces are gone")

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
        if self.isolated:
            shell = await self._open_boxed_session(env_id, session_id, root, env)
            self._shells[session_id] = shell
            return
        try:
            shell = await shell_mod.open_shell(session_id, env_id, root, env, user)
        except (OSError, subprocess.SubprocessError) as e:
            raise EnvError(f"cannot start the session's shell: {e}") from e
        with contextlib.suppress(OSError):  # what the shell forks inherits it, as an exec's
            Path(f"/proc/{shell.popen.pid}/oom_score_adj").write_text(str(self.oom_score_adj))
        self._shells[session_id] = shell

    async def _open_boxed_session(
        self, env_id: str, session_id: str, home: Path, env: dict[str, str]
    ) -> shell_mod.Shell:
        """A session's shell inside its environment (``nsbox.py enter``): root inside, in
        the environment's namespaces and cgroups, and in a cpuset cgroup of its own that
        each run's cores are written to; everything in that cgroup dies with the session."""
        assert self.boxes is not None
        keeper = await self.boxes.open(env_id)
        cpuset = None
        join = list(self.boxes.joins.get(env_id, []))
        if self.cgroups is not None and self.cgroups.pins:
            name = "s-" + hashlib.sha1(f"{env_id}/{session_id}".encode()).hexdigest()[:16]
            cpuset = self.cgroups.base / name
            await asyncio.to_thread(self.cgroups.make_session, cpuset)
            join.append(str(cpuset / "tasks"))
        request = {
            "sandbox": {"pid": keeper, "cgroups": []},
            "join": join,
            "env": env,
            "cwd": str(home),
            "umask": EXEC_UMASK,
            "setsid": False,  # (in the wrapper's process group: the session's signals reach it)
            "oom_score_adj": self.oom_score_adj,
        }

        def wrap(argv: list[str]) -> list[str]:
            req = json.dumps({**request, "argv": argv})
            return [sys.executable, "-I", "-S", nsbox.__file__, "enter", req]

        try:
            return await shell_mod.open_shell(
                session_id, env_id, home, env, None, wrap=wrap,
                cpuset=None if cpuset is None else str(cpuset),
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError) as e:
            if cpuset is not None and self.cgroups is not None:
                await self.cgroups.remove(cpuset)
            raise EnvError(f"cannot start the session's shell: {e}") from e

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
            await self._drop_session_cgroup(shell)

    async def _drop_session_cgroup(self, shell: shell_mod.Shell) -> None:
        """(An isolated session) kill what its shell left, wherever it went, and remove
        its cpuset cgroup."""
        if shell.cpuset is not None and self.cgroups is not None:
            await self.cgroups.remove(Path(shell.cpuset))

    def _end_sessions(self, env_id: str) -> list[shell_mod.Shell]:
        ended = []
        for session_id, shell in list(self._shells.items()):
            if shell.env_id == env_id:
                del self._shells[session_id]
                shell_mod.close(shell)
                ended.append(shell)
        return ended

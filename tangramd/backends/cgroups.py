"""Per-exec cgroups of the process backend: cgroup v1 cpuset, or cgroup v2 where delegated.

Each exec runs in the cgroup of its core set ``<parent>/tangram/<scope>/c<cores>`` (created
once, reused: the scheduler never gives a core to two running actions). The cgroup does two
jobs: it pins (``cpuset.cpus``, so a command cannot widen its affinity with ``taskset``) and
it tracks (every descendant, ``setsid`` or double-forked, stays in it, so the exec's end
kills them all). A command is born inside: the fork server (``forkserver.py``) enters the
cgroup for the instant of the spawn, or, on v1, a *lodger* of the fork server that lives in
the cgroup spawns it without any move (a v1 move waits for an RCU grace period after an
idle gap). Lodgers are not leftovers: cleaning a cgroup spares their pids.

- **v1** (``cpuset`` hierarchy mounted, root): pins and tracks.
- **v2** (a ``cgroup2`` mount whose subtree under our own cgroup is writable: root, or a
  delegated subtree such as systemd's ``Delegate=yes``): tracks always; pins too where the
  ``cpuset`` controller is available to us (then the daemon moves itself to a ``daemon``
  leaf, as v2 allows no processes in a cgroup whose controllers are delegated).
- Neither: :func:`probe` returns None; the backend logs it at start-up, pins with
  ``sched_setaffinity`` alone and kills by session and process group.

Before each exec, :meth:`Cgroups.for_cores` checks the cgroup's ``cpuset.cpus`` and rewrites
it if a previous command changed it, so the next action gets exactly its allocation.
The cgroup files belong to root (or the daemon's user) and are not writable by the
unprivileged users that commands run as, so a sandboxed command cannot change its cgroup.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Collection
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
CPUSET_ROOT = CGROUP_ROOT / "cpuset"


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, fs type, options) of every mount."""
    out: list[tuple[str, str, str]] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 4:
                out.append((parts[1], parts[2], parts[3]))
    return out


def _own_path(match: str) -> str | None:
    """Our cgroup path in the hierarchy whose controller list is ``match`` ('' for v2)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hid, controllers, path = line.split(":", 2)
            if match == "" and hid == "0" and controllers == "":
                return path
            if match and match in controllers.split(","):
                return path
    return None


def own_cpuset_dir(root: Path = CPUSET_ROOT) -> Path:
    """The v1 cpuset cgroup this process lives in (the parent for per-exec cgroups)."""
    path = _own_path("cpuset")
    return root / path.lstrip("/") if path is not None else root


def _read(path: str) -> bytes:
    """A small kernel file's bytes (plain ``os`` calls: this is on every exec's path)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 1 << 16)
    finally:
        os.close(fd)


def parse_cpulist(text: str) -> tuple[int, ...]:
    """``"0-2,5"`` → ``(0, 1, 2, 5)``; an empty file is the empty tuple."""
    cores: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(sorted(cores))


class Cgroups:
    """Exec cgroups under ``<parent>/tangram/<scope>``; subclasses say how to pin."""

    kind = "none"
    pins = False  # whether the cgroup restricts cores (else affinity alone pins)
    by_thread = False  # whether one thread may join (v1 ``tasks``): children are born in it
    # Whether the fork server keeps lodgers in the exec cgroups: v1 (where a move is slow
    # after an idle gap); not v2, whose ``cgroup.kill`` would take them with the leftovers.
    lodgers = False

    def __init__(self, parent: Path, scope: str) -> None:
        self.parent = parent
        self.home = parent  # where the daemon (and its spawner between spawns) lives
        self.base = parent / "tangram" / scope
        self._paths: dict[tuple[int, ...], Path] = {}

    def _make(self, path: Path, cores: tuple[int, ...] | None) -> None:
        """Create one level; ``cores`` None for the intermediate levels."""
        path.mkdir(exist_ok=True)

    def _write_cpus(self, path: Path, cores: tuple[int, ...]) -> None:
        (path / "cpuset.cpus").write_text(",".join(map(str, cores)))

    def for_cores(self, cores: tuple[int, ...]) -> Path:
        """The cgroup of one core set, created once and reused, its cores verified.

        Reuse is safe because the scheduler never gives a core to two actions at once. A
        command running as root could have rewritten ``cpuset.cpus``: reset it here.
        """
        cores = tuple(sorted(cores))
        path = self._paths.get(cores)
        if path is None:
            path = self._paths[cores] = self.base / ("c" + "_".join(map(str, cores)))
        try:
            if not self.pins:
                if not os.path.isdir(path):
                    raise FileNotFoundError(path)
                return path
            seen = parse_cpulist(_read(f"{path}/cpuset.cpus").decode())
        except FileNotFoundError:  # not made yet (or removed meanwhile): make it
            with contextlib.suppress(FileExistsError):
                self._make(path, cores)
            return path
        if seen != cores:
            log.warning("cpuset_reset", cgroup=str(path), found=list(seen), want=list(cores))
            self._write_cpus(path, cores)
        return path

    def make_session(self, path: Path) -> None:
        """A session's cgroup, on every core of ours until its first run pins it."""
        cores = parse_cpulist(_read(f"{self.base}/cpuset.cpus").decode())
        if not cores:  # (v2: an empty cpuset.cpus means the parent's)
            cores = parse_cpulist(_read(f"{self.base}/cpuset.cpus.effective").decode())
        with contextlib.suppress(FileExistsError):
            self._make(path, cores)

    @staticmethod
    def place(path: Path, pid: int) -> None:
        """Move a whole process (not yet running its command) into the cgroup."""
        with open(path / "cgroup.procs", "w") as f:
            f.write(str(pid))

    @staticmethod
    def pids(path: Path) -> list[int]:
        with contextlib.suppress(OSError, ValueError):
            return [int(p) for p in _read(f"{path}/cgroup.procs").split()]
        return []

    def others(self, path: Path, spare: Collection[int] = ()) -> list[int]:
        """The processes in the cgroup but the daemon (which never enters an exec cgroup
        anyway) and ``spare`` (the fork server's lodgers, which live there between execs)."""
        me = os.getpid()
        return [pid for pid in self.pids(path) if pid != me and pid not in spare]

    def kill_all(self, path: Path, spare: Collection[int] = ()) -> bool:
        """SIGKILL every process in the cgroup but the daemon and ``spare``; False when
        there was none (the cgroup is empty then: only a member can add one)."""
        found = self.others(path, spare)
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        return bool(found)

    async def empty(self, path: Path, spare: Collection[int] = ()) -> bool:
        """Kill everything left in the cgroup (but ``spare``) and wait until it is gone;
        False on a hang."""
        for _ in range(200):
            if not self.others(path, spare):
                return True
            self.kill_all(path, spare)
            await asyncio.sleep(0.005)
        return False

    async def remove(self, path: Path) -> bool:
        """Kill what is left in the cgroup and remove it; False if it stayed busy."""
        for _ in range(50):
            self.kill_all(path)
            try:
                path.rmdir()
                return True
            except FileNotFoundError:
                return True
            except OSError:
                await asyncio.sleep(0.02)
        return False

    def leftovers(self) -> list[Path]:
        with contextlib.suppress(OSError):
            return [p for p in self.base.iterdir() if p.is_dir()]
        return []

    def _prepare(self) -> None:
        for level in (self.parent / "tangram", self.base):
            self._make(level, None)


class CpusetV1(Cgroups):
    """cgroup v1 cpuset hierarchy: pins and tracks (root only)."""

    kind = "v1-cpuset"
    pins = True
    by_thread = True
    lodgers = True

    def __init__(self, parent: Path, scope: str) -> None:
        super().__init__(parent, scope)
        self.mems = (parent / "cpuset.mems").read_text().strip()
        self.cpus = (parent / "cpuset.cpus").read_text().strip()
        self._prepare()

    def _make(self, path: Path, cores: tuple[int, ...] | None) -> None:
        path.mkdir(exist_ok=cores is None)
        # cpuset v1: a cgroup needs cpus and mems before a task may join
        if cores is not None:
            self._write_cpus(path, cores)
        elif not (path / "cpuset.cpus").read_text().strip():
            (path / "cpuset.cpus").write_text(self.cpus)
        if not (path / "cpuset.mems").read_text().strip():
            (path / "cpuset.mems").write_text(self.mems)


class CgroupV2(Cgroups):
    """A cgroup v2 subtree we may write: tracks always, pins where ``cpuset`` is ours."""

    kind = "v2"

    def __init__(self, parent: Path, scope: str, *, want_cpuset: bool = True) -> None:
        super().__init__(parent, scope)
        controllers = (parent / "cgroup.controllers").read_text().split()
        if want_cpuset and "cpuset" in controllers:
            self._enable_cpuset()
        self._prepare()

    def _enable_cpuset(self) -> None:
        """Delegate ``cpuset`` below us: the daemon moves to a leaf first (v2 rule)."""
        leaf = self.parent / "daemon"
        leaf.mkdir(exist_ok=True)
        for pid in self.pids(self.parent):  # the daemon (threads move with it in v2)
            with contextlib.suppress(OSError):
                self.place(leaf, pid)
        self.home = leaf
        try:
            (self.parent / "cgroup.subtree_control").write_text("+cpuset")
            tangram = self.parent / "tangram"
            tangram.mkdir(exist_ok=True)
            (tangram / "cgroup.subtree_control").write_text("+cpuset")
        except OSError as exc:
            log.warning("cgroup_v2_cpuset_unavailable", error=str(exc))
            return
        self.kind, self.pins = "v2-cpuset", True

    def _make(self, path: Path, cores: tuple[int, ...] | None) -> None:
        path.mkdir(exist_ok=cores is None)
        if cores is None and self.pins and path == self.base:
            with contextlib.suppress(OSError):
                (path / "cgroup.subtree_control").write_text("+cpuset")
        if cores is not None and self.pins:
            self._write_cpus(path, cores)

    def kill_all(self, path: Path, spare: Collection[int] = ()) -> bool:
        kill = path / "cgroup.kill"  # Linux >= 5.14: atomic, forks cannot race it
        if not spare and kill.exists():
            with contextlib.suppress(OSError):
                kill.write_text("1")
                return True  # (whether there was anyone is not known)
        return super().kill_all(path, spare)


def probe(scope: str, *, prefer: str = "auto") -> Cgroups | None:
    """The usable exec-cgroup manager of this host, or None (then say so at start-up).

    ``prefer``: "auto" (v1 cpuset, else v2), "v1", "v2" or "none".
    """
    if prefer == "none":
        return None
    mounts = _mounts()
    if prefer in ("auto", "v1") and os.geteuid() == 0:
        v1 = next((m for m, t, o in mounts if t == "cgroup" and "cpuset" in o.split(",")), None)
        if v1 is not None:
            with contextlib.suppress(OSError):
                return CpusetV1(own_cpuset_dir(Path(v1)), scope)
    if prefer in ("auto", "v2"):
        v2 = next((m for m, t, _ in mounts if t == "cgroup2"), None)
        own = _own_path("")
        if v2 is not None and own is not None:
            parent = Path(v2) / own.lstrip("/")
            if os.access(parent, os.W_OK):
                with contextlib.suppress(OSError):
                    return CgroupV2(parent, scope)
    return None


# The mode of the directories EnvLimits makes, whatever the umask (the daemon's is 077): an
# environment's processes may cross them to read their own limits by the path
# /proc/self/cgroup names (as a JVM or Node sizes its heap), but may not list them, so no
# environment sees the others' cgroups
CROSSABLE = 0o711


class EnvLimits:
    """Per-environment limits of isolated environments, on cgroup v1: ``memory`` (its
    ``mem_bytes``, swap included where accounted) and ``pids`` (``env_pids_max``). Every
    process of the environment (its keeper, its execs, its session shells) joins
    ``<controller>/<own path>/tangram/<scope>/e-<env>`` of each before it enters the
    environment; the files are the host root's, read-only inside, and the directories
    ``CROSSABLE``."""

    CONTROLLERS = ("memory", "pids")

    def __init__(self, bases: dict[str, Path]) -> None:
        self.bases = bases

    @classmethod
    def probe(cls, scope: str) -> EnvLimits | None:
        """The manager, or None where cgroup v1 ``memory`` and ``pids`` are not ours."""
        if os.geteuid() != 0:
            return None
        mounts = _mounts()
        bases: dict[str, Path] = {}
        for ctrl in cls.CONTROLLERS:
            point = next((m for m, t, o in mounts if t == "cgroup" and ctrl in o.split(",")), None)
            own = _own_path(ctrl)
            if point is None or own is None:
                return None
            base = Path(point) / own.lstrip("/") / "tangram" / scope
            try:
                base.mkdir(parents=True, exist_ok=True)
                for level in (base.parent, base):
                    os.chmod(level, CROSSABLE)
            except OSError:
                return None
            bases[ctrl] = base
        return cls(bases)

    def paths(self, env_id: str) -> list[Path]:
        return [base / f"e-{env_id}" for base in self.bases.values()]

    def create(self, env_id: str, mem_bytes: int | None, pids_max: int) -> list[str]:
        """Make the environment's cgroups with their limits; the ``tasks`` files to join."""
        mem, pids = self.paths(env_id)
        for path in (mem, pids):
            path.mkdir(exist_ok=True)
            os.chmod(path, CROSSABLE)
        if mem_bytes is not None:
            (mem / "memory.limit_in_bytes").write_text(str(mem_bytes))
            swap = mem / "memory.memsw.limit_in_bytes"
            if swap.exists():  # (swap accounted) no way around the limit through swap
                swap.write_text(str(mem_bytes))
        (pids / "pids.max").write_text(str(pids_max))
        return [str(mem / "tasks"), str(pids / "tasks")]

    def exec_memory(self, env_id: str, name: str, mem_bytes: int) -> str:
        """A cgroup for one exec below the environment's memory cgroup, limited to
        ``mem_bytes``; its ``tasks`` file (joined after the environment's)."""
        path = self.paths(env_id)[0] / name
        path.mkdir(exist_ok=True)
        os.chmod(path, CROSSABLE)
        (path / "memory.limit_in_bytes").write_text(str(mem_bytes))
        return str(path / "tasks")

    def kill_all(self, env_id: str) -> bool:
        """SIGKILL every process of the environment; False when there was none."""
        found = False
        for path in self.paths(env_id):
            for sub in (path, *_subdirs(path)):
                found |= _kill_members(sub)
        return found

    async def remove(self, env_id: str) -> None:
        """Kill what is left and remove the environment's cgroups (and any exec's)."""
        for path in self.paths(env_id):
            for sub in (*_subdirs(path), path):
                for _ in range(100):
                    _kill_members(sub)
                    try:
                        sub.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        await asyncio.sleep(0.01)

    async def remove_exec(self, env_id: str, name: str) -> None:
        path = self.paths(env_id)[0] / name
        for _ in range(100):
            try:
                path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                _kill_members(path)
                await asyncio.sleep(0.01)

    def remove_bases(self) -> None:
        """Remove the (empty) per-backend directories; one still holding an environment
        (kept across a restart) stays."""
        for base in self.bases.values():
            with contextlib.suppress(OSError):
                base.rmdir()

    def leftovers(self) -> list[str]:
        """Env ids of the environment cgroups found (a previous daemon's)."""
        found: set[str] = set()
        for base in self.bases.values():
            found.update(p.name[2:] for p in _subdirs(base) if p.name.startswith("e-"))
        return sorted(found)


def _kill_members(path: Path) -> bool:
    """SIGKILL every process in the cgroup ``path`` but this one; False when none."""
    me = os.getpid()
    found = [pid for pid in Cgroups.pids(path) if pid != me]
    for pid in found:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return bool(found)


def _subdirs(path: Path) -> list[Path]:
    with contextlib.suppress(OSError):
        return [p for p in path.iterdir() if p.is_dir()]
    return []

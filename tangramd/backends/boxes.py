"""The isolated environments of one process backend (``[cpu] isolation``): each one's
keeper (``nsbox.py``, started through the fork server), its host uid, its cgroup limits and
its overlay layers. :class:`ProcessBackend` asks this book for an environment's keeper on
every exec, and it builds, rebuilds and removes them (docs/design.md §5.2).

A keeper is *stale* once its fork server is no longer the one serving (it died, or it was of
another event loop): the keeper lives on, so the next exec finds it by the environment's
cgroups, kills it with whatever it ran, and builds the namespaces again over the same layers
(the environment's files stay).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any, Protocol

import structlog

import tangramd
from tangramd.backends import cgroups as cg
from tangramd.backends import nsbox
from tangramd.backends.base import EnvError, check_env_id
from tangramd.backends.spawner import Spawner, SpawnError

log = structlog.get_logger(__name__)

ISOLATION_MODES = ("auto", "namespaces", "none")
ENV_NETWORKS = ("none", "host")
DEFAULT_ENV_PIDS_MAX = 4096
# Where the host uids of isolated environments begin (root inside each maps to one of them,
# when the environment has no unprivileged owner): far above any account's uid.
SANDBOX_ID_BASE = 1_000_000_000
BOX = "sandbox"  # in the backend's root dir: each isolated environment's overlay layers
LAYERS = ".layers"  # in BOX: the frozen layers of forked environments (nsfork.py)


class ForkLayers(Protocol):
    """What a keeper's box takes from the forked environments' book (nsfork.Forks)."""

    def box_keys(self, env_id: str) -> dict[str, Any]: ...


def traversable(paths: Sequence[str]) -> list[str]:
    """The directories on the way to ``paths`` (the interpreter's, the homes') that others
    may not cross, such as ``/root`` under pyenv: an environment may cross them, not list
    them."""
    found: list[str] = []
    for path in paths:
        here = "/"
        for part in Path(os.path.realpath(path)).parts[1:]:
            here = os.path.join(here, part)
            with contextlib.suppress(OSError):
                st = os.stat(here)
                if stat.S_ISDIR(st.st_mode) and not st.st_mode & 0o001 and here not in found:
                    found.append(here)
    return found


def probe_isolation(scratch_parent: str) -> str:
    """'' when this host can run environments in namespaces, else why not (a keeper is
    built and killed by a child process, as the fork server would)."""
    if os.geteuid() != 0:
        return "the daemon is not root"
    scratch = tempfile.mkdtemp(prefix=".probe-", dir=scratch_parent)
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-S", nsbox.__file__, "probe", scratch],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if done.returncode == 0:
        return ""
    lines = (done.stdout.strip() or done.stderr.strip()).splitlines()
    return lines[-1] if lines else f"the probe exited {done.returncode}"


def _make_layers(path: str) -> None:
    """(In a thread) an isolated environment's overlay directories (kept if there)."""
    for sub in ("upper", "work", "merged"):
        os.makedirs(os.path.join(path, sub), 0o700, exist_ok=True)


def own_code_binds() -> list[str]:
    """The daemon's interpreter (its venv and base prefix) and the tree its ``tangramd``
    package comes from, where they lie under a directory an environment gets empty of its
    own (``/tmp``, ``/var/tmp``, ``/run``): bound back read-only at their paths, so that
    ``sys.executable`` and a checkout's files (a project cloned under ``/tmp``) work inside
    as they do outside. Anywhere else the read-only lower layer already shows them."""
    code = os.path.dirname(os.path.dirname(os.path.abspath(tangramd.__file__)))
    paths = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, code)}
    private = tuple(os.path.realpath(d) for d in nsbox.PRIVATE_DIRS)
    under = [p for p in paths if any(p == d or p.startswith(d + "/") for d in private)]
    # a path inside another one listed is bound with it
    return sorted(p for p in under if not any(p != q and p.startswith(q + "/") for q in under))


class Boxes:
    """The keepers, host uids, cgroups and layers of a backend's isolated environments."""

    def __init__(
        self,
        root: Path,
        envs_path: str,
        scope: str,
        spawner: Spawner,
        *,
        hide: Sequence[str],
        network: str,
        pids_max: int,
    ) -> None:
        self.dir = root / BOX
        self.dir.mkdir(exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.envs_path = envs_path  # real path of the envs dir: homes are <this>/<env id>
        self.spawner = spawner
        self.network = network
        self.pids_max = pids_max
        self.limits = cg.EnvLimits.probe(scope)
        self.hide = sorted({os.path.realpath(p) for p in (*hide, os.fspath(root))})
        # (the way to the interpreter, and to the homes: a state dir under /root)
        self.traverse = traversable([sys.executable, sys.prefix, sys.base_prefix, envs_path])
        self.binds = own_code_binds()
        self.keepers: dict[str, int] = {}  # env id -> its keeper's pid (nsbox.py)
        self.joins: dict[str, list[str]] = {}  # env id -> cgroup tasks files to join
        self.ids: dict[str, tuple[int, int]] = {}  # env id -> host (uid, gid) of root inside
        self.mem: dict[str, int | None] = {}  # env id -> its memory limit
        self._gen: dict[str, int] = {}  # env id -> the fork server that started its keeper
        self._stale: dict[str, int] = {}  # env id -> a keeper of an earlier fork server
        self._opening: dict[str, asyncio.Task[int]] = {}
        self.forks: ForkLayers | None = None  # its forked environments' layers (nsfork.py)
        log.info(
            "env_isolation",
            network=network,
            pids_max=pids_max,
            limits="cgroup v1 memory+pids" if self.limits else "none (no v1 memory/pids)",
        )

    def assign(
        self, env_id: str, owner: tuple[int, int] | None, mem: int | None
    ) -> tuple[int, int]:
        """A new environment's host (uid, gid) for root inside: its owner's when that is
        not root, else the first free one from ``SANDBOX_ID_BASE``."""
        if owner is not None and owner[0] != 0:
            ids = owner
        else:
            used = {uid for uid, _ in self.ids.values()}
            uid = next(u for u in itertools.count(SANDBOX_ID_BASE) if u not in used)
            ids = (uid, uid)
        self.ids[env_id] = ids
        self.mem[env_id] = mem
        return ids

    def keeper(self, env_id: str, loop: asyncio.AbstractEventLoop) -> int | None:
        """The environment's live keeper, or None (then :meth:`open`): one of a fork
        server that no longer serves is stale."""
        pid = self.keepers.get(env_id)
        if pid is not None and not self.spawner.serves(loop, self._gen.get(env_id)):
            self.lost(env_id)
            return None
        return pid

    def lost(self, env_id: str) -> None:
        """Its keeper is gone or unreachable (a spawn found no such process)."""
        pid = self.keepers.pop(env_id, None)
        if pid is not None:
            self._stale[env_id] = pid

    def exec_box(self, env_id: str, keeper: int) -> dict[str, Any]:
        """What a spawn request carries to enter the environment."""
        return {"pid": keeper, "cgroups": list(self.joins.get(env_id, []))}

    async def open(self, env_id: str) -> int:
        """The environment's keeper: started once, again if it died; its pid."""
        pid = self.keepers.get(env_id)
        if pid is not None:
            return pid
        task = self._opening.get(env_id)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._build(env_id))
            self._opening[env_id] = task
            task.add_done_callback(lambda _t: self._opening.pop(env_id, None))
        return await asyncio.shield(task)

    async def _build(self, env_id: str) -> int:
        layers = self.dir / check_env_id(env_id)
        await asyncio.to_thread(_make_layers, os.fspath(layers))
        uid, gid = self.ids[env_id]
        joins: list[str] = []
        stale = self._stale.pop(env_id, None)
        if stale is not None and self.limits is None:  # (no cgroup to find it by)
            with contextlib.suppress(ProcessLookupError):
                os.kill(stale, signal.SIGKILL)
        if self.limits is not None:
            # a keeper of an earlier fork server (and what ran in it) must not share the
            # layers with the new one
            if self.limits.kill_all(env_id):
                await self.limits.remove(env_id)
            joins = await asyncio.to_thread(
                self.limits.create, env_id, self.mem.get(env_id), self.pids_max
            )
        box = {
            "upper": os.fspath(layers / "upper"),
            "work": os.fspath(layers / "work"),
            "merged": os.fspath(layers / "merged"),
            "home": os.path.join(self.envs_path, env_id),
            "hide": self.hide,
            "uid": uid,
            "gid": gid,
            "net": self.network,
            "hostname": env_id[:64],
            "traverse": self.traverse,
            "binds": self.binds,
            "cgroups": joins,
            **(self.forks.box_keys(env_id) if self.forks is not None else {}),
        }
        try:
            pid = await self.spawner.spawn({"op": "keeper", "box": box}, {})
        except SpawnError as e:
            raise EnvError(str(e)) from None
        if env_id not in self.ids:  # closed meanwhile
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            raise EnvError(f"no such environment {env_id}")
        self.keepers[env_id] = pid
        self._gen[env_id] = self.spawner.generation
        self.joins[env_id] = joins
        self.spawner.watch(pid, lambda _rc, _alone: self._gone(env_id, pid))
        log.debug("env_keeper", env_id=env_id, pid=pid, uid=uid)
        return pid

    def _gone(self, env_id: str, pid: int) -> None:
        """A keeper died (killed, or its fork server did): the next exec builds the
        environment's namespaces again over the same layers (its files are kept)."""
        if self.keepers.get(env_id) == pid:
            del self.keepers[env_id]

    async def close(self, env_id: str, *, keep_layers: bool = False) -> None:
        """Kill the environment's keeper (and so everything in its pid namespace), remove
        its cgroups and (unless kept) its layers."""
        opening = self._opening.get(env_id)
        if opening is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(opening)
        self.spawner.release(f"{env_id}#")  # its lodger (process.py names it so)
        for pid in (self.keepers.pop(env_id, None), self._stale.pop(env_id, None)):
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.joins.pop(env_id, None)
        if self.limits is not None:
            await self.limits.remove(env_id)
        if not keep_layers:
            self.ids.pop(env_id, None)
            self.mem.pop(env_id, None)
            await asyncio.to_thread(shutil.rmtree, self.dir / env_id, True)

    def remove_bases(self) -> None:
        """(At shutdown, every environment closed or kept) remove this backend's cgroup
        directories that hold no environment."""
        if self.limits is not None:
            self.limits.remove_bases()

    async def reconcile(self, known: Collection[str]) -> list[str]:
        """Remove the layers of environments not in ``known``; end what a previous
        daemon's keepers ran (kept environments too: their files stay, their namespaces
        are built again on their first exec)."""
        done: list[str] = []
        for path in sorted(self.dir.iterdir()):
            if path.name not in known and path.name != LAYERS:  # (nsfork.py's)
                await asyncio.to_thread(shutil.rmtree, path, True)
        if self.limits is not None:
            for env_id in self.limits.leftovers():
                if env_id not in self.keepers:
                    await self.limits.remove(env_id)
                    done.append(f"ended what environment {env_id} ran for the previous daemon")
        return done

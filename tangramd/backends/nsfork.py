"""Fork and reset of the process backend's environments (issue 30 item 3; docs/design.md
§5.3): G environments that start from a copy-on-write snapshot of one, and a reset back to
an environment's fork point (or to its opening).

Isolated environments (``nsbox.py``) fork through overlay *layers*, at a cost that does not
grow with the environment's size. An environment's files are two trees: its root (the
overlay of its upper dir over the host's root, built by its keeper) and its home (a host
directory bound in at its path). A fork *freezes* the source: its upper dir and its home
become one read-only layer (``<root>/sandbox/.layers/<id>/{root,home}``, two renames), and
the source and each child get fresh empty uppers over [that layer, older layers...]. The
root's lower layers are mounted by the keeper (``nsbox._lowers``); the home of a forked
environment is an overlay mounted on the host at its path (``envs/<id>``), so that the
daemon's file transfers see what the environment sees. Running processes are not copied:
a fork (or reset) of an environment with an action or a session running is refused, and
the source's keeper is ended so that its next exec builds its namespaces over the new
layers. A child runs as its source's host uid (the layers' files are that uid's).

A reset drops an environment's uppers and starts fresh empty ones over its layers (its fork
point); one never forked gets an empty home and root back, as it was opened. Layers are
counted by the environments whose stack holds them and removed with the last one. At most
``MAX_LAYERS`` layers stack up (a fork of an environment at that depth is refused).

With ``isolation = "none"`` an environment is a plain directory: a fork copies it
(``cp -a --reflink=auto``: a copy-on-write clone where the filesystem has one, else a full
copy, whose cost grows with the environment's size) once as the fork point and once per
child; a reset copies the fork point back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from tangramd.backends import nsbox
from tangramd.backends.base import EnvError, check_env_id
from tangramd.backends.boxes import LAYERS, Boxes

MAX_LAYERS = 16  # frozen layers under one environment (kernel: 500, mount data: 4 KiB)
MAX_FORK = 256  # children of one fork (env.fork's n)
PLAIN = ".forks"  # in the backend root: plain snapshots (isolation = "none")
STACK_FILE = "stack.json"  # in an environment's sandbox dir: its layers, for a restart
MAX_MOUNT_DATA = 4000  # a mount's option string must fit a page
SUBS = ("upper", "work", "merged", "hupper", "hwork", "base", "empty")  # an env's sandbox dir
SPARES = 32  # child directory trees made ahead (a fork renames one per child: no mkdirs)


def _umount(path: str) -> None:
    nsbox._libc.umount2(path.encode(), nsbox.MNT_DETACH)


def _is_mount(path: str) -> bool:
    return os.path.ismount(path)


def _check_path(path: str) -> str:
    if any(c in path for c in ",:\\\n"):
        raise EnvError(f"cannot fork under {path!r}: overlay layer paths may not hold , : or \\")
    return path


class Forks:
    """The layers (or plain snapshots) of one process backend's forked environments."""

    def __init__(self, root: Path, envs_path: str, boxes: Boxes | None) -> None:
        self.boxes = boxes
        self.envs_path = envs_path
        self.dir = (boxes.dir / LAYERS) if boxes is not None else (root / PLAIN)
        self.dir.mkdir(exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.tomb = self.dir / ".tomb"
        self.stacks: dict[str, tuple[str, ...]] = {}  # env id -> its layers, newest first
        self.refs: dict[str, int] = {}  # layer -> environments whose stack holds it
        self._locks: dict[str, asyncio.Lock] = {}
        self._spares: list[Path] = []  # ready child trees (SUBS and "home")
        self._refilling = False
        self._refill: asyncio.Future[None] | None = None

    # --- what the keeper needs ---------------------------------------------------------

    def box_keys(self, env_id: str) -> dict[str, Any]:
        """What :meth:`Boxes._build` adds to a keeper's box for a forked environment."""
        stack = self.stacks.get(env_id)
        if not stack or self.boxes is None:
            return {}
        own = self.boxes.dir / env_id
        return {
            "lowers": [os.fspath(self.dir / layer / "root") for layer in stack],
            "base": os.fspath(own / "base"),
            "empty": os.fspath(own / "empty"),
        }

    def depth(self, env_id: str) -> int:
        return len(self.stacks.get(env_id, ()))

    # --- fork, reset, close -------------------------------------------------------------

    def _lock(self, env_id: str) -> asyncio.Lock:
        return self._locks.setdefault(env_id, asyncio.Lock())

    async def fork(self, src: str, children: Sequence[str]) -> None:
        """Make each of ``children`` (new ids: their home path must not exist) a copy of
        ``src``'s files as they are now."""
        async with self._lock(src):
            if self.boxes is None:
                await asyncio.to_thread(self._plain_fork, src, children)
                return
            stack = self.stacks.get(src, ())
            if await asyncio.to_thread(self._changed, src):
                if len(stack) >= MAX_LAYERS:
                    raise EnvError(
                        f"cannot fork {src}: it already stands on {len(stack)} layers, the "
                        f"most an environment may (MAX_LAYERS = {MAX_LAYERS}); fork its "
                        "source again, or open a fresh environment"
                    )
                # its keeper's namespaces hold its uppers: ended (rebuilt on its next exec)
                self._end_keeper(src)
                layer = await asyncio.to_thread(self._freeze, src, stack)
                stack = (layer, *stack)
                self._hold(src, stack)
            try:
                for child in children:
                    self._hold(child, stack)
                await asyncio.to_thread(self._make_children, src, children, stack)
            except BaseException:
                for child in children:
                    await self.close(child)
                raise
            self.refill_soon()
        self._bury_soon()

    async def reset(self, env_id: str) -> None:
        """Back to the fork point (an empty upper over its layers), or, never forked, to
        an empty home and root."""
        async with self._lock(env_id):
            if self.boxes is None:
                await asyncio.to_thread(self._plain_reset, env_id)
                return
            self._end_keeper(env_id)
            await asyncio.to_thread(self._reset, env_id)
        self._bury_soon()

    async def close(self, env_id: str) -> None:
        """(Before the backend removes ``env_id``'s directories) unmount its home and let
        go of its layers; those no environment holds any more are removed."""
        stack = self.stacks.pop(env_id, None)
        self._locks.pop(env_id, None)
        if self.boxes is not None:
            home = os.path.join(self.envs_path, env_id)
            if _is_mount(home):
                await asyncio.to_thread(_umount, home)
        if stack is None:
            return
        dead = []
        for layer in stack:
            self.refs[layer] -= 1
            if self.refs[layer] <= 0:
                del self.refs[layer]
                dead.append(layer)
        for layer in dead:
            await asyncio.to_thread(shutil.rmtree, self.dir / layer, True)

    async def unmount(self, env_id: str) -> None:
        """(At shutdown, ``env_id`` kept) unmount its home: no mount outlives the daemon;
        a restarted one mounts it again over the same layers (:meth:`reconcile`)."""
        home = os.path.join(self.envs_path, env_id)
        if self.boxes is not None and _is_mount(home):
            await asyncio.to_thread(_umount, home)

    def _end_keeper(self, env_id: str) -> None:
        """End the environment's keeper and lodger (everything in its namespaces: nothing
        runs there, :meth:`ProcessBackend._refuse_busy`); its next exec builds them again
        over its new layers, and ends first whatever is left in its cgroups."""
        assert self.boxes is not None
        self.boxes.spawner.release(f"{env_id}#")  # its lodger (process.py names it so)
        pid = self.boxes.keepers.get(env_id)
        self.boxes.lost(env_id)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def refill_soon(self) -> None:
        """Make child trees ahead, in a thread, when fewer than half are ready."""
        if self._refilling or len(self._spares) >= SPARES // 2:
            return
        self._refilling = True

        def refill() -> None:
            try:
                while len(self._spares) < SPARES:
                    self._spares.append(self._make_spare())
            except OSError:
                pass
            finally:
                self._refilling = False

        self._refill = asyncio.get_running_loop().run_in_executor(None, refill)

    async def shutdown(self) -> None:
        """(The backend shutting down) wait for a refill under way, remove the spares."""
        if self._refill is not None:
            with contextlib.suppress(Exception):
                await self._refill
        self._spares.clear()
        await asyncio.to_thread(shutil.rmtree, self.dir / ".spare", True)
        self._empty_tomb()

    def _make_spare(self) -> Path:
        path = self.dir / ".spare" / os.urandom(8).hex()
        for sub in (*SUBS, "home"):
            os.makedirs(path / sub, 0o700)
        return path

    def _take_spare(self, env_id: str) -> None:
        """``env_id``'s sandbox dir (SUBS) and home mount point, renamed from a spare."""
        try:
            spare = self._spares.pop()
        except IndexError:
            spare = self._make_spare()
        os.rename(spare / "home", os.path.join(self.envs_path, env_id))
        os.rename(spare, self._own(env_id))

    def _hold(self, env_id: str, stack: tuple[str, ...]) -> None:
        old = self.stacks.get(env_id, ())
        for layer in stack:
            self.refs[layer] = self.refs.get(layer, 0) + 1
        for layer in old:
            self.refs[layer] -= 1  # (a source's old stack is the tail of its new one)
        self.stacks[env_id] = stack
        self._save(env_id)

    def _save(self, env_id: str) -> None:
        """Write the environment's stack where a restarted daemon reads it back."""
        if self.boxes is not None and (self.boxes.dir / env_id).is_dir():
            with contextlib.suppress(OSError):
                text = json.dumps(list(self.stacks.get(env_id, ())))
                (self.boxes.dir / env_id / STACK_FILE).write_text(text)

    # --- isolated: layers (in a thread) -------------------------------------------------

    def _own(self, env_id: str) -> Path:
        assert self.boxes is not None
        return self.boxes.dir / check_env_id(env_id)

    def _changed(self, env_id: str) -> bool:
        """Whether the environment has files of its own above its layers (always, when it
        was never forked: its home and upper are all it has)."""
        if env_id not in self.stacks:
            return True
        own = self._own(env_id)
        return any(os.listdir(own / sub) for sub in ("upper", "hupper"))

    def _bury(self, path: Path) -> None:
        self.tomb.mkdir(exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.rename(path, self.tomb / f"{path.parent.name}.{path.name}.{os.urandom(4).hex()}")

    def _bury_soon(self) -> None:
        if self.tomb.exists():
            loop = asyncio.get_running_loop()
            loop.run_in_executor(None, self._empty_tomb)

    def _empty_tomb(self) -> None:
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.tomb):
                shutil.rmtree(entry.path, ignore_errors=True)

    def _freeze(self, env_id: str, stack: tuple[str, ...]) -> str:
        """The environment's uppers (or, never forked, its upper and home) become a new
        read-only layer; it gets fresh ones over it. The layer's name."""
        layer = os.urandom(8).hex()
        path = self.dir / layer
        os.mkdir(path, 0o700)
        own = self._own(env_id)
        home = os.path.join(self.envs_path, env_id)
        st = os.stat(home)
        if stack:
            _umount(home)
            os.rename(own / "hupper", path / "home")
        else:
            os.rename(home, path / "home")
            os.mkdir(home, 0o700)
        os.rename(own / "upper", path / "root")
        for sub in ("work", "hwork"):
            self._bury(own / sub)
        self._fresh(env_id, (layer, *stack), st)
        return layer

    def _fresh(
        self, env_id: str, stack: tuple[str, ...], st: os.stat_result, made: bool = False
    ) -> None:
        """Empty uppers for ``env_id`` over ``stack``, its home mounted at its path
        (``made``: its directories are there, empty)."""
        own = self._own(env_id)
        home = os.path.join(self.envs_path, env_id)
        if not made:
            for sub in SUBS:
                os.makedirs(own / sub, 0o700, exist_ok=True)
            os.makedirs(home, 0o700, exist_ok=True)
        os.chown(own / "hupper", st.st_uid, st.st_gid)
        os.chmod(own / "hupper", st.st_mode & 0o7777)
        lowers = ":".join(_check_path(os.fspath(self.dir / layer / "home")) for layer in stack)
        data = (
            f"lowerdir={lowers},upperdir={_check_path(os.fspath(own / 'hupper'))},"
            f"workdir={_check_path(os.fspath(own / 'hwork'))}"
        )
        if len(data) > MAX_MOUNT_DATA:
            raise EnvError(f"cannot fork: {len(stack)} layers make too long a mount ({self.dir})")
        nsbox._mount("overlay", home, "overlay", nsbox.MS_NOSUID | nsbox.MS_NODEV, data)

    def _make_children(self, src: str, children: Sequence[str], stack: tuple[str, ...]) -> None:
        st = os.stat(os.path.join(self.envs_path, src))
        for child in children:
            home = os.path.join(self.envs_path, check_env_id(child))
            if os.path.lexists(home) or os.path.lexists(self._own(child)):
                raise EnvError(f"environment {child} exists")
            self._take_spare(child)
            self._fresh(child, stack, st, made=True)
            self._save(child)

    def _reset(self, env_id: str) -> None:
        own = self._own(env_id)
        home = os.path.join(self.envs_path, env_id)
        st = os.stat(home)
        stack = self.stacks.get(env_id)
        if stack:
            _umount(home)
            subs: tuple[str, ...] = ("upper", "work", "hupper", "hwork")
        else:  # never forked: an empty home and an empty upper (prepared by its keeper)
            self._bury(Path(home))
            os.mkdir(home, 0o700)
            os.chown(home, st.st_uid, st.st_gid)
            os.chmod(home, st.st_mode & 0o7777)
            subs = ("upper", "work")
        for sub in subs:
            self._bury(own / sub)
        if stack:
            self._fresh(env_id, stack, st)
        else:
            for sub in subs:
                os.makedirs(own / sub, 0o700, exist_ok=True)

    # --- isolation = "none": copies -----------------------------------------------------

    def _copy(self, src: str, dst: str, st: os.stat_result) -> None:
        os.mkdir(dst, 0o700)
        done = subprocess.run(
            ["cp", "-a", "--reflink=auto", "--", f"{src}/.", dst],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise EnvError(f"cannot copy the environment: {done.stderr.strip()}")
        with contextlib.suppress(OSError):
            os.chown(dst, st.st_uid, st.st_gid)
        os.chmod(dst, st.st_mode & 0o7777)

    def _plain_fork(self, src: str, children: Sequence[str]) -> None:
        home = os.path.join(self.envs_path, src)
        st = os.stat(home)
        snap = os.urandom(8).hex()
        self._copy(home, os.fspath(self.dir / snap), st)  # the fork point, for resets
        made: list[str] = []
        try:
            for child in children:
                path = os.path.join(self.envs_path, check_env_id(child))
                self._copy(os.fspath(self.dir / snap), path, st)
                made.append(path)
        except BaseException:
            for path in made:
                shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(self.dir / snap, ignore_errors=True)
            raise
        self._hold(src, (snap,))
        for child in children:
            self._hold(child, (snap,))
        for layer in [name for name, n in self.refs.items() if n <= 0]:
            del self.refs[layer]
            shutil.rmtree(self.dir / layer, ignore_errors=True)

    def _plain_reset(self, env_id: str) -> None:
        home = os.path.join(self.envs_path, env_id)
        st = os.stat(home)
        self._bury(Path(home))
        stack = self.stacks.get(env_id)
        if stack:
            self._copy(os.fspath(self.dir / stack[0]), home, st)
        else:
            os.mkdir(home, 0o700)
            with contextlib.suppress(OSError):
                os.chown(home, st.st_uid, st.st_gid)
            os.chmod(home, st.st_mode & 0o7777)
        self._empty_tomb()

    # --- restart ------------------------------------------------------------------------

    async def reconcile(self, keep: Collection[str]) -> None:
        """(Before the backend's other reconciling) unmount the homes of environments
        not in ``keep``; take back the stacks of those kept (mounting their homes again
        where the mounts did not survive); remove the layers no environment holds."""
        await asyncio.to_thread(self._reconcile, set(keep))

    def _reconcile(self, keep: set[str]) -> None:
        if self.boxes is not None:
            with contextlib.suppress(OSError):
                for point in nsbox.host_mounts():
                    parent, name = os.path.split(point)
                    if parent == self.envs_path and name not in keep:
                        _umount(point)
            for env_id in keep:
                with contextlib.suppress(OSError, ValueError, EnvError):
                    own = self._own(env_id)
                    stack = tuple(json.loads((own / STACK_FILE).read_text()))
                    if not stack or not all((self.dir / layer).is_dir() for layer in stack):
                        continue
                    self._hold(env_id, stack)
                    home = os.path.join(self.envs_path, env_id)
                    if not _is_mount(home):
                        self._fresh_mount_only(env_id, stack)
        held = set(self.refs)
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.dir):
                if entry.name not in held:
                    shutil.rmtree(entry.path, ignore_errors=True)

    def _fresh_mount_only(self, env_id: str, stack: tuple[str, ...]) -> None:
        own = self._own(env_id)
        home = os.path.join(self.envs_path, env_id)
        lowers = ":".join(os.fspath(self.dir / layer / "home") for layer in stack)
        data = f"lowerdir={lowers},upperdir={own / 'hupper'},workdir={own / 'hwork'}"
        nsbox._mount("overlay", home, "overlay", nsbox.MS_NOSUID | nsbox.MS_NODEV, data)

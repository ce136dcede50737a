"""The process backend: environments are directories, execs are pinned host processes.

No container engine needed; this is the embedded default (design §5.2).

- An environment is a working directory ``<root_dir>/envs/<env_id>``; every exec runs with
  that directory as cwd and as ``HOME``, so files persist across execs of one environment
  and environments do not see each other's files (this is not a security sandbox: the
  commands run as the daemon's user).
- Each exec is a fresh session (its own process group) pinned to exactly ``req.cores`` with
  ``sched_setaffinity`` and, when running as root with a writable cgroup-v1 cpuset
  hierarchy, also placed in the cpuset cgroup of its core set
  ``<cpuset>/tangram/<scope>/c<cores>`` (created once, reused: a core set never serves two
  execs at once), which also catches descendants that leave the process group. The child is
  spawned without a ``preexec_fn`` (see ``ProcessBackend._spawn``); cgroups are removed at
  shutdown.
- The exec ends when its main process exits (not when its output pipes close: a background
  descendant may hold them); whatever it left running in its process group
  (or cgroup) is killed then, so a core serves one action at a time.
- A timeout sends SIGTERM to the group, SIGKILL 0.5 s later, and returns the partial output.
- The environment's memory size is advisory only here: it is recorded but not enforced.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tangramd.backends.base import (
    SHUTDOWN_DETAIL,
    SIGTERM_GRACE_S,
    EnvError,
    ExecRequest,
    ExecResult,
    OutputBuffer,
    check_env_id,
    exit_code_from_returncode,
    infra_error,
    outcome_for,
    rewrite_pytest,
    shell_argv,
)

CPUSET_ROOT = Path("/sys/fs/cgroup/cpuset")
DRAIN_AFTER_EXIT_S = 1.0  # how long to wait for pipes to close once the group is dead
_READ_CHUNK = 1 << 16
_ENV_PASSTHROUGH = ("PATH", "LANG", "LC_ALL", "TZ", "TERM")


def own_cpuset_dir(root: Path = CPUSET_ROOT) -> Path:
    """The cpuset cgroup this process lives in (the parent for per-exec cgroups)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "cpuset" in controllers.split(","):
                return root / path.lstrip("/")
    return root


class CpusetCgroups:
    """Per-exec cgroup-v1 cpusets under ``<parent>/tangram/<scope>`` (root only).

    The scope is derived from the backend's state directory, so a restarted daemon finds
    its own leftovers and two backends on one host never touch each other's cgroups.
    """

    def __init__(self, parent: Path, scope: str) -> None:
        self.mems = (parent / "cpuset.mems").read_text().strip()
        cpus = (parent / "cpuset.cpus").read_text().strip()
        self.base = parent / "tangram" / scope
        for level in (parent / "tangram", self.base):
            level.mkdir(exist_ok=True)  # cpuset v1: a child needs cpus and mems set
            if not (level / "cpuset.cpus").read_text().strip():
                (level / "cpuset.cpus").write_text(cpus)
            if not (level / "cpuset.mems").read_text().strip():
                (level / "cpuset.mems").write_text(self.mems)

    @classmethod
    def probe(cls, scope: str) -> CpusetCgroups | None:
        """A manager if we are root and the cpuset hierarchy is writable, else None."""
        if os.geteuid() != 0 or not (CPUSET_ROOT / "cpuset.cpus").exists():
            return None
        try:
            return cls(own_cpuset_dir(), scope)
        except OSError:
            return None

    def create(self, name: str, cores: tuple[int, ...]) -> Path:
        path = self.base / name
        path.mkdir()
        (path / "cpuset.cpus").write_text(",".join(map(str, cores)))
        (path / "cpuset.mems").write_text(self.mems)
        return path

    def for_cores(self, cores: tuple[int, ...]) -> Path:
        """The cgroup of one core set, created once and reused.

        Reuse is safe because the scheduler never gives a core to two actions at once, so
        one core set is never used by two running execs.
        """
        path = self.base / ("c" + "_".join(map(str, sorted(cores))))
        if not path.is_dir():
            with contextlib.suppress(FileExistsError):
                self.create(path.name, tuple(sorted(cores)))
        return path

    @staticmethod
    def join(path: Path, tid: int) -> None:
        """Move one thread (cgroup v1 ``tasks``) into the cgroup."""
        with open(path / "tasks", "w") as f:
            f.write(str(tid))

    @staticmethod
    def pids(path: Path) -> list[int]:
        with contextlib.suppress(OSError):
            return [int(p) for p in (path / "cgroup.procs").read_text().split()]
        return []

    async def empty(self, path: Path) -> bool:
        """Kill everything left in the cgroup and wait until it is gone; False on a hang."""
        me = os.getpid()
        for _ in range(100):
            if not [p for p in self.pids(path) if p != me]:
                return True
            self.kill_all(path)
            await asyncio.sleep(0.01)
        return False

    def kill_all(self, path: Path) -> None:
        for pid in self.pids(path):
            if pid == os.getpid():  # the daemon itself, mid-spawn: never
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

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
        return [p for p in self.base.iterdir() if p.is_dir()]


class _ExitProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """The stream protocol plus an event set when the main process exits.

    ``Process.wait()`` also waits for the output pipes to close, so a background descendant
    that keeps them open would hold the action (and its cores) until it exits.
    """

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=limit, loop=loop)
        self.exited = asyncio.Event()

    def process_exited(self) -> None:
        self.exited.set()
        super().process_exited()


@dataclass(slots=True, eq=False)
class _Running:
    proc: asyncio.subprocess.Process
    exited: asyncio.Event
    cgroup: Path | None
    killed_for_shutdown: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class ProcessBackend:
    """Environments as directories, execs as pinned subprocesses (see the module doc)."""

    name = "process"

    def __init__(self, root_dir: str | os.PathLike[str], *, use_cgroups: bool = True) -> None:
        self.root = Path(root_dir)
        self.envs_dir = self.root / "envs"
        self.envs_dir.mkdir(parents=True, exist_ok=True)
        scope = "p-" + hashlib.sha1(str(self.root.resolve()).encode()).hexdigest()[:12]
        self.cgroups = CpusetCgroups.probe(scope) if use_cgroups else None
        self._envs: dict[str, int | None] = {}  # env_id -> advisory memory bytes
        self._running: set[_Running] = set()
        self._closing = False
        # where the daemon's thread returns after each spawn (see _spawn)
        self._home_affinity = os.sched_getaffinity(0)
        self._home_cgroup = own_cpuset_dir() if self.cgroups is not None else None

    # --- environments -----------------------------------------------------------------

    def env_dir(self, env_id: str) -> Path:
        return self.envs_dir / check_env_id(env_id)

    def env_exists(self, env_id: str) -> bool:
        return env_id in self._envs and self.env_dir(env_id).is_dir()

    async def create_env(self, env_id: str, image: str | None, mem_bytes: int | None) -> None:
        """Create the environment's directory; `image` is ignored, `mem_bytes` advisory."""
        if self._closing:
            raise EnvError(SHUTDOWN_DETAIL)
        path = self.env_dir(env_id)
        if env_id in self._envs:
            raise EnvError(f"environment {env_id} exists")
        if path.exists():  # a leftover of a previous run that reconcile did not see
            shutil.rmtree(path)
        path.mkdir()
        self._envs[env_id] = mem_bytes

    async def close_env(self, env_id: str) -> None:
        self._envs.pop(env_id, None)
        path = self.env_dir(env_id)
        await asyncio.to_thread(shutil.rmtree, path, True)

    async def reconcile(self) -> list[str]:
        """Remove env directories and exec cgroups that a previous run left behind."""
        done: list[str] = []
        for path in sorted(self.envs_dir.iterdir()):
            if path.name not in self._envs:
                await asyncio.to_thread(shutil.rmtree, path, True)
                done.append(f"removed env dir {path}")
        if self.cgroups is not None:
            busy = {r.cgroup for r in self._running}
            for cg in self.cgroups.leftovers():
                if cg not in busy and await self.cgroups.remove(cg):
                    done.append(f"removed cgroup {cg}")
        return done

    async def shutdown(self) -> None:
        self._closing = True
        for run in list(self._running):
            run.killed_for_shutdown = True
            _killpg(run.proc.pid, signal.SIGKILL)
            if run.cgroup is not None and self.cgroups is not None:
                self.cgroups.kill_all(run.cgroup)
        for run in list(self._running):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(run.done.wait(), 5)
        for env_id in list(self._envs):
            await self.close_env(env_id)
        if self.cgroups is not None:
            with contextlib.suppress(OSError):
                for cg in self.cgroups.leftovers():
                    await self.cgroups.remove(cg)
            await self.cgroups.remove(self.cgroups.base)

    # --- execs ------------------------------------------------------------------------

    def _child_env(self, req: ExecRequest, home: Path) -> dict[str, str]:
        env = {k: os.environ[k] for k in _ENV_PASSTHROUGH if k in os.environ}
        env.setdefault("PATH", os.defpath)
        # The daemon's interpreter first, so `python -m pytest` finds the same packages.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
        env.update(HOME=str(home), TMPDIR=str(home))
        env.update(req.env_vars)
        env["TANGRAM_CPUS"] = str(len(req.cores))
        env["TANGRAM_CORES"] = ",".join(map(str, req.cores))
        return env

    async def exec(self, req: ExecRequest) -> ExecResult:
        if self._closing:
            return infra_error(SHUTDOWN_DETAIL)
        if not self.env_exists(req.env_id):
            return infra_error(f"no such environment {req.env_id}")
        cwd = self.env_dir(req.env_id)
        argv = shell_argv(rewrite_pytest(req.cmd, len(req.cores), req.elastic))
        cgroup: Path | None = None
        if self.cgroups is not None:
            try:
                cgroup = self.cgroups.for_cores(req.cores)
            except OSError as e:
                return infra_error(f"cannot create cpuset cgroup: {e}")
        started = time.monotonic()
        try:
            proc = await self._spawn(argv, cwd, self._child_env(req, cwd), req.cores, cgroup)
        except (FileNotFoundError, PermissionError) as e:
            msg = f"tangram: cannot run {argv[0]}: {e.strerror}\n"
            code = 127 if isinstance(e, FileNotFoundError) else 126
            return ExecResult("failed", code, "", msg, time.monotonic() - started, False)
        except (OSError, subprocess.SubprocessError) as e:
            return infra_error(f"spawn failed: {e}")
        run = _Running(proc, proc._protocol.exited, cgroup)  # type: ignore[attr-defined]
        self._running.add(run)
        if self._closing:  # shutdown began while we were spawning
            run.killed_for_shutdown = True
            _killpg(proc.pid, signal.SIGKILL)
        try:
            return await self._supervise(req, run, started)
        finally:
            self._running.discard(run)
            run.done.set()

    async def _spawn(
        self,
        argv: list[str],
        cwd: Path,
        env: dict[str, str],
        cores: tuple[int, ...],
        cgroup: Path | None,
    ) -> asyncio.subprocess.Process:
        """Start the child already pinned, without a ``preexec_fn``.

        A ``preexec_fn`` forces a full fork that runs Python in the child (~3 ms here).
        Instead the daemon's own thread takes the child's cpuset cgroup and affinity for the
        instant of the spawn (a child inherits both at fork, so it never runs elsewhere) and
        then returns to the cgroup and mask it had at start-up. ``Popen`` runs synchronously
        inside ``create_subprocess_exec`` before its first suspension; restoring to the
        *start-up* state (not "the previous one") keeps interleaved spawns correct.
        """
        tid = threading.get_native_id()
        if cgroup is not None:
            CpusetCgroups.join(cgroup, tid)
        os.sched_setaffinity(0, cores)
        loop = asyncio.get_running_loop()
        try:
            transport, protocol = await loop.subprocess_exec(
                lambda: _ExitProtocol(_READ_CHUNK, loop),
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=cwd,
                env=env,
                start_new_session=True,
            )
            return asyncio.subprocess.Process(transport, protocol, loop)
        finally:
            if cgroup is not None and self._home_cgroup is not None:
                CpusetCgroups.join(self._home_cgroup, tid)
            os.sched_setaffinity(0, self._home_affinity)

    async def _supervise(self, req: ExecRequest, run: _Running, started: float) -> ExecResult:
        proc = run.proc
        assert proc.stdout is not None and proc.stderr is not None
        out, err = OutputBuffer(req.max_output), OutputBuffer(req.max_output)
        readers = [
            asyncio.create_task(_pump(proc.stdout, out)),
            asyncio.create_task(_pump(proc.stderr, err)),
        ]
        timed_out = False
        # The action ends when its main process exits (not when its pipes close: a
        # background descendant may hold them open); the timeout counts to that exit.
        try:
            await asyncio.wait_for(run.exited.wait(), req.timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
            _killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(run.exited.wait(), SIGTERM_GRACE_S)
        exec_s = time.monotonic() - started
        # The main process is gone: end whatever it left behind, then drain the pipes.
        _killpg(proc.pid, signal.SIGKILL)
        await run.exited.wait()
        if run.cgroup is not None and self.cgroups is not None:
            await self.cgroups.empty(run.cgroup)  # the cgroup is reused by the next exec
        _, pending = await asyncio.wait(readers, timeout=DRAIN_AFTER_EXIT_S)
        for task in pending:  # a descendant that escaped every sweep holds a pipe open
            task.cancel()
        if pending:
            proc._transport.close()  # type: ignore[attr-defined]  # our pipe ends, no fd leak
        detail = "output pipes held open by an escaped descendant" if pending else ""
        if run.killed_for_shutdown:
            return infra_error(SHUTDOWN_DETAIL, stdout=out.text(), stderr=err.text())
        code = exit_code_from_returncode(proc.returncode if proc.returncode is not None else -9)
        return ExecResult(
            outcome_for(code, timed_out),
            code,
            out.text(),
            err.text(),
            exec_s,
            out.truncated or err.truncated,
            detail or (f"killed after {req.timeout_s} s" if timed_out else ""),
        )


async def _pump(stream: asyncio.StreamReader, buf: OutputBuffer) -> None:
    while chunk := await stream.read(_READ_CHUNK):
        buf.feed(chunk)

"""The Docker backend: environments are long-lived containers (docs/design.md §5.2).

- An environment is a container started from its image with ``network_mode="none"``,
  ``no-new-privileges``, every capability dropped but ``CONTAINER_CAPS``, the exec OOM
  score (``oom_score_adj`` 1000), a memory limit reserved for its whole life, our owner
  label, and docker-init as PID 1. Its
  main process is the exec agent (``agent.py``, stdlib only) when the image has python3,
  else ``sleep infinity``. The agent listens on a Unix socket in a host directory
  bind-mounted at ``/run/tangram-agent``: the only way in, since there is no network.
- Cores are not reserved between execs. Before each exec the container is pinned to the
  exact allocated cores (``update(cpuset_cpus=..., cpu_quota=100000*n)``); the cgroup change
  rewrites the affinity of everything inside, and the agent pins the child as well. After
  the exec the pinning is left as it is: the scheduler's bookkeeping returns the cores.
- Exec goes through the agent (fast path) or, when the image has no python3 or the agent
  cannot be reached, through ``docker exec``. Every exec's processes carry a
  ``TANGRAM_EXEC_ID`` marker in their environment; on timeout everything carrying it is
  killed (SIGTERM, then SIGKILL 0.5 s later), so nothing strays, and the partial output is
  returned.
- A container that died or was removed behind our back gives ``infra_error`` and the
  environment is forgotten (`env_exists` false) so the daemon makes a fresh one. An
  unreachable dockerd gives ``infra_error`` fast (short client timeouts) and the backend
  works again when it returns.
- One tangramd owns the containers carrying its label key on a dockerd: `reconcile()`
  adopts running ones labelled with our own owner id and removes all others.

- Files go in and out through the engine's archive API (``put_archive`` / ``get_archive``,
  tar streams), paths relative to the working directory (a tar stream put is refused, as
  on the process backend, when its headers declare over 1 GiB or 100,000 members); an
  exec's input goes to the agent (or, with ``docker exec``, through a file it reads
  first).
- Shell sessions live in the agent (persistent interactive bash, ``agent.py``); the daemon
  writes each run's script (``shell.py``), and the container's cpuset pinning before the
  run re-pins the shell with it. Without the agent there are no sessions.

All SDK calls run in a dedicated thread pool; the agent is spoken to with asyncio directly.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import json
import os
import posixpath
import re
import secrets
import shutil
import tempfile
import time
import uuid
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors
import requests.exceptions

from tangramd.backends import agent as agent_mod
from tangramd.backends import files, nsfiles
from tangramd.backends import shell as shell_mod
from tangramd.backends.base import (
    EXEC_OOM_SCORE_ADJ,
    SHUTDOWN_DETAIL,
    SIGTERM_GRACE_S,
    EnvError,
    ExecRequest,
    ExecResult,
    OutputBuffer,
    check_env_id,
    infra_error,
    outcome_for,
    rewrite_pytest,
)

DEFAULT_IMAGE = "tangram-test:bookworm"
DEFAULT_LABEL = "org.arl-tangram.owner"
ENV_LABEL = "org.arl-tangram.env"
INSTANCE_LABEL = "org.arl-tangram.instance"
AGENT_MOUNT = "/run/tangram-agent"
AGENT_SOCK = "agent.sock"
MAX_IDLE_AGENT_CONNS = 1  # per environment: an exec at a time is the common case (one fd)
NO_AGENT_MARK = "no-agent"
WORKDIR = "/work"
CPU_PERIOD_US = 100_000
REPLY_MARGIN_S = 10.0  # how much longer than the exec timeout we wait for the agent
# What a root command inside an environment keeps (docker's default set minus NET_RAW,
# NET_BIND_SERVICE, MKNOD, SETFCAP, SETPCAP, SYS_CHROOT, AUDIT_WRITE): enough for package
# managers (chown, setuid to a build user), nothing for raw devices or network tricks.
CONTAINER_CAPS = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID")

_ENGINE_ERRORS = (requests.exceptions.RequestException, ConnectionError, OSError)

_MAIN_SCRIPT = f"""\
if [ "$TANGRAM_AGENT" = 1 ] && command -v python3 >/dev/null 2>&1; then
  exec python3 {AGENT_MOUNT}/agent.py {AGENT_MOUNT}/{AGENT_SOCK}
fi
touch {AGENT_MOUNT}/{NO_AGENT_MARK}
exec sleep infinity 2>/dev/null || while :; do sleep 86400; done
"""

# Signal every process whose environment carries the marker ($2, a whole line: a grep basic
# regular expression, so cancel() can match any exec of one action) with $1. They are all
# stopped first, so a shell cannot run on between its child's death and its own; SIGKILL
# takes a few rounds to catch processes forked during the scan.
_KILL_SCRIPT = """\
for round in 1 2 3; do
  pids=
  for d in /proc/[0-9]*; do
    if tr '\\0' '\\n' < "$d/environ" 2>/dev/null | grep -qx "$2"; then
      pids="$pids ${d#/proc/}"
    fi
  done
  [ -n "$pids" ] || break
  kill -STOP $pids 2>/dev/null; kill -"$1" $pids 2>/dev/null; kill -CONT $pids 2>/dev/null
  [ "$1" = KILL ] || break
done
"""


# action ids that cancel() puts in a grep pattern (the daemon's own ids are hex)
_SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")

# agents_dir + "/" + 32-hex env dir + "/agent.sock" must fit a Unix socket path (107 bytes)
_MAX_AGENTS_DIR = 107 - 1 - 32 - len("/agent.sock")


@dataclass(slots=True, eq=False)
class _Env:
    env_id: str
    container_id: str
    agent_dir: Path
    use_agent: bool
    alive: bool = True
    cpuset_dir: Path | None = None  # the container's cgroup-v1 dirs, for direct pinning
    cpu_dir: Path | None = None
    pinned: tuple[int, ...] = ()  # cores the container's cgroup is set to now
    keepalive: bool = False  # its agent answers many requests on one connection
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = field(default_factory=list)
    idle_loop: asyncio.AbstractEventLoop | None = None  # the loop the idle connections use

    def drop_idle(self) -> None:
        """Close the idle agent connections (those of another, finished event loop are
        only let go: their loop cannot close them)."""
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.idle_loop:
            for _, writer in self.idle:
                writer.close()
        self.idle.clear()


def container_cgroup_dirs(pid: int) -> tuple[Path | None, Path | None]:
    """cgroup-v1 cpuset and cpu directories of a process (None where not writable)."""
    cpuset = cpu = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, rel = line.split(":", 2)
            names = controllers.split(",")
            if "cpuset" in names:
                cpuset = Path("/sys/fs/cgroup/cpuset") / rel.lstrip("/")
            if "cpu" in names:
                cpu = Path("/sys/fs/cgroup") / controllers / rel.lstrip("/")
    ok = [
        d if d is not None and os.access(d, os.W_OK) and d != d.parent else None
        for d in (cpuset, cpu)
    ]
    return ok[0], ok[1]


class DockerBackend:
    """Containers as environments, the in-container agent as the exec fast path."""

    name = "docker"

    def __init__(
        self,
        client: docker.DockerClient | None = None,
        default_image: str = DEFAULT_IMAGE,
        label: str = DEFAULT_LABEL,
        owner_id: str | None = None,
        *,
        state_dir: str | os.PathLike[str] | None = None,
        use_agent: bool = True,
        api_timeout_s: float = 10.0,
        agent_start_timeout_s: float = 20.0,
    ) -> None:
        self._client = client
        self.default_image = default_image
        self.label = label
        # One owner id per state dir, so the next daemon on it recognises (and re-adopts) the
        # containers of its persistent environments; without a state dir, one per backend.
        stable = hashlib.sha1(str(Path(state_dir or ".").resolve()).encode()).hexdigest()[:12]
        self.owner_id = owner_id or (
            f"tangramd-{stable}" if state_dir is not None else f"tangramd-{uuid.uuid4().hex[:12]}"
        )
        self.instance_id = uuid.uuid4().hex[:12]
        self.state_dir = Path(state_dir or Path(tempfile.gettempdir()) / "tangramd-docker")
        self.agents_dir = self.state_dir / "agents"
        if len(str(self.agents_dir)) > _MAX_AGENTS_DIR:
            # agent sockets live under this dir and a Unix socket path has at most 107 bytes
            digest = hashlib.sha1(str(self.state_dir.resolve()).encode()).hexdigest()[:12]
            self.agents_dir = Path(tempfile.gettempdir()) / f"tangram-agents-{digest}"
        self.agents_dir.mkdir(parents=True, exist_ok=True)
        self.use_agent = use_agent
        self.api_timeout_s = api_timeout_s
        self.agent_start_timeout_s = agent_start_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="tangram-docker")
        self._envs: dict[str, _Env] = {}
        self._sessions: dict[str, str] = {}  # session id -> env id (the agent holds the shell)
        self._inflight: set[asyncio.Future[Any]] = set()
        self._actions: dict[str, _Env] = {}  # running execs by action id, for cancel()
        self._closing = False
        self._first_core = min(os.sched_getaffinity(0))
        # fork and reset: each environment's (image, memory) to recreate it from, the image
        # committed at its fork point, and how many environments stand on each such image
        self._origin: dict[str, tuple[str, int | None]] = {}
        self._forks: dict[str, str] = {}
        self._fork_refs: dict[str, int] = {}

    # --- plumbing -------------------------------------------------------------------------

    @property
    def client(self) -> docker.DockerClient:
        if self._client is None:
            self._client = docker.from_env(timeout=int(self.api_timeout_s), max_pool_size=32)
        return self._client

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def _container_name(self, env_id: str) -> str:
        return f"tangram-{self.owner_id}-{env_id}"[:200]

    def _agent_dir(self, env_id: str) -> Path:
        # Short on purpose: a Unix socket path must stay under 108 bytes.
        return self.agents_dir / uuid.uuid5(uuid.NAMESPACE_URL, f"{self.owner_id}/{env_id}").hex

    def env_exists(self, env_id: str) -> bool:
        env = self._envs.get(env_id)
        return env is not None and env.alive

    def uses_agent(self, env_id: str) -> bool:
        """Whether execs in this environment go through the agent (else docker exec)."""
        return self._envs[env_id].use_agent

    # --- environments ---------------------------------------------------------------------

    async def create_env(
        self,
        env_id: str,
        image: str | None,
        mem_bytes: int | None,
        owner: tuple[int, int] | None = None,
    ) -> None:
        """Start the environment's container. `owner` is recorded by the daemon only: the
        container is its own user namespace of files, reached through the daemon alone."""
        check_env_id(env_id)
        if self._closing:
            raise EnvError(SHUTDOWN_DETAIL)
        if self.env_exists(env_id):
            raise EnvError(f"environment {env_id} exists")
        stale = self._envs.pop(env_id, None)
        if stale is not None:
            await self._remove_container(stale.container_id)
        agent_dir = self._agent_dir(env_id)
        shutil.rmtree(agent_dir, ignore_errors=True)
        agent_dir.mkdir(parents=True)
        shutil.copyfile(agent_mod.__file__, agent_dir / "agent.py")
        kwargs: dict[str, Any] = {
            "command": ["/bin/sh", "-c", _MAIN_SCRIPT],
            "name": self._container_name(env_id),
            "detach": True,
            "init": True,
            "network_mode": "none",
            # Hardening: no setuid escalation inside, a small capability set, and the
            # first victim of the OOM killer (never the daemon or dockerd).
            "security_opt": ["no-new-privileges"],
            "cap_drop": ["ALL"],
            "cap_add": list(CONTAINER_CAPS),
            "oom_score_adj": EXEC_OOM_SCORE_ADJ,
            "labels": {
                self.label: self.owner_id,
                ENV_LABEL: env_id,
                INSTANCE_LABEL: self.instance_id,
            },
            "environment": {"TANGRAM_AGENT": "1" if self.use_agent else "0"},
            "working_dir": WORKDIR,
            "volumes": {str(agent_dir): {"bind": AGENT_MOUNT, "mode": "rw"}},
            # Parked on one core between execs; each exec re-pins. One core's quota rather
            # than less, so the agent's own start-up is not throttled.
            "cpuset_cpus": str(self._first_core),
            "cpu_period": CPU_PERIOD_US,
            "cpu_quota": CPU_PERIOD_US,
        }
        if mem_bytes is not None:
            kwargs.update(mem_limit=mem_bytes, memswap_limit=mem_bytes)
        try:
            container = await self._call(
                self.client.containers.run, image or self.default_image, **kwargs
            )
        except docker.errors.ImageNotFound as e:
            raise EnvError(f"image not found: {image or self.default_image}") from e
        except docker.errors.APIError as e:
            if e.status_code == 409:  # a leftover with our name: remove and retry once
                await self._remove_container(self._container_name(env_id))
                container = await self._call(
                    self.client.containers.run, image or self.default_image, **kwargs
                )
            else:
                raise EnvError(f"cannot create container: {e.explanation or e}") from e
        except _ENGINE_ERRORS as e:
            raise EnvError(f"docker engine unreachable: {e}") from e
        env = _Env(env_id, container.id, agent_dir, use_agent=False)
        with contextlib.suppress(Exception):
            await self._call(container.reload)
            env.cpuset_dir, env.cpu_dir = container_cgroup_dirs(
                int(container.attrs["State"]["Pid"])
            )
        try:
            env.use_agent = await self._wait_for_main(env)
        except BaseException:
            await self._remove_container(container.id)
            shutil.rmtree(agent_dir, ignore_errors=True)
            raise
        self._envs[env_id] = env
        self._origin[env_id] = (image or self.default_image, mem_bytes)

    async def _wait_for_main(self, env: _Env) -> bool:
        """Wait until the agent answers (True) or the container said it has none (False)."""
        sock = env.agent_dir / AGENT_SOCK
        deadline = time.monotonic() + self.agent_start_timeout_s
        next_check = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            if sock.exists():
                try:
                    reply = await _agent_call(sock, {"op": "ping"}, timeout_s=5)
                except (OSError, EOFError, asyncio.IncompleteReadError, asyncio.TimeoutError):
                    reply = None
                if reply and reply.get("ok"):
                    env.keepalive = bool(reply.get("keepalive"))
                    return True
            if (env.agent_dir / NO_AGENT_MARK).exists():
                return False
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + 0.5
                if await self._container_state(env.container_id) != "running":
                    raise EnvError("container exited during start-up")
            await asyncio.sleep(0.01)
        raise EnvError(f"agent did not start within {self.agent_start_timeout_s} s")

    async def close_env(self, env_id: str) -> None:
        for session_id in [s for s, e in self._sessions.items() if e == env_id]:
            del self._sessions[session_id]  # its shell goes with the container
        env = self._envs.pop(env_id, None)
        self._origin.pop(env_id, None)
        if env is not None:
            env.alive = False
            env.drop_idle()
            await self._remove_container(env.container_id)
            shutil.rmtree(env.agent_dir, ignore_errors=True)
        await self._release_fork(env_id)  # (once its container no longer uses the image)

    # --- fork and reset (issue 30 item 3; docs/design.md §5.3) ------------------------------

    def _refuse_busy(self, env_id: str, what: str) -> _Env:
        env = self._live(env_id)
        running = sum(1 for e in self._actions.values() if e is env)
        sessions = sum(1 for e in self._sessions.values() if e == env_id)
        if running or sessions:
            raise EnvError(
                f"cannot {what} {env_id}: {running} action(s) running and {sessions} "
                "session(s) open in it (processes are not copied: wait for them to end "
                "and close its sessions first)"
            )
        return env

    async def fork_env(self, env_id: str, children: Sequence[str]) -> None:
        """``docker commit`` the source's container to an image (the fork point of the
        source and of each child), then start a container per child from it: the commit
        copies the container's writable layer, so its cost grows with what the environment
        wrote; each child costs a container start."""
        env = self._refuse_busy(env_id, "fork")
        for child in children:
            if self.env_exists(check_env_id(child)):
                raise EnvError(f"environment {child} exists")
        _, mem = self._origin.get(env_id, (self.default_image, None))
        repo, tag = "tangram-fork", uuid.uuid4().hex[:16]
        try:
            made = await self._call(
                self.client.api.commit, env.container_id, repository=repo, tag=tag,
                conf={"Labels": {self.label: self.owner_id}},
            )  # fmt: skip
        except (docker.errors.APIError, *_ENGINE_ERRORS) as e:
            raise EnvError(f"cannot commit {env_id}: {e}") from e
        image = str(made["Id"])
        await self._hold_fork(env_id, image)
        results = await asyncio.gather(
            *(self.create_env(child, image, mem) for child in children), return_exceptions=True
        )
        for child, result in zip(children, results, strict=True):
            if not isinstance(result, BaseException):
                await self._hold_fork(child, image)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for child, result in zip(children, results, strict=True):
                if not isinstance(result, BaseException):
                    await self.close_env(child)
            raise EnvError(f"cannot fork {env_id}: {failed[0]}")

    async def reset_env(self, env_id: str) -> None:
        """A new container from the environment's fork point (the image committed when it
        was forked), or from its image when never forked."""
        env = self._refuse_busy(env_id, "reset")
        image, mem = self._origin.get(env_id, (self.default_image, None))
        image = self._forks.get(env_id, image)
        del self._envs[env_id]
        env.alive = False
        env.drop_idle()
        await self._remove_container(env.container_id)
        shutil.rmtree(env.agent_dir, ignore_errors=True)
        await self.create_env(env_id, image, mem)

    async def _hold_fork(self, env_id: str, image: str) -> None:
        await self._release_fork(env_id)
        self._forks[env_id] = image
        self._fork_refs[image] = self._fork_refs.get(image, 0) + 1

    async def _release_fork(self, env_id: str) -> None:
        """The environment no longer stands on its fork image: removed with the last one."""
        image = self._forks.pop(env_id, None)
        if image is None:
            return
        self._fork_refs[image] -= 1
        if self._fork_refs[image] > 0:
            return
        del self._fork_refs[image]

        def remove() -> None:
            with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                self.client.api.remove_image(image, force=True)

        with contextlib.suppress(*_ENGINE_ERRORS):
            await self._call(remove)

    async def _remove_container(self, ref: str) -> None:
        def remove() -> None:
            with contextlib.suppress(docker.errors.NotFound):
                self.client.api.remove_container(ref, force=True, v=True)

        with contextlib.suppress(docker.errors.APIError, *_ENGINE_ERRORS):
            await self._call(remove)

    async def _container_state(self, container_id: str) -> str:
        """'running', 'exited', ..., 'gone' if removed, 'unknown' if the engine is down."""
        try:
            info = await self._call(self.client.api.inspect_container, container_id)
        except docker.errors.NotFound:
            return "gone"
        except (docker.errors.APIError, *_ENGINE_ERRORS):
            return "unknown"
        return str(info["State"]["Status"])

    async def _settled_state(self, container_id: str, wait_s: float = 1.0) -> str:
        """The container's state, giving dockerd `wait_s` to notice that it is going down."""
        deadline = time.monotonic() + wait_s
        while True:
            state = await self._container_state(container_id)
            if state not in ("running", "unknown") or time.monotonic() >= deadline:
                return state
            await asyncio.sleep(0.1)

    async def reconcile(
        self, keep: Mapping[str, tuple[int, int] | None] | None = None
    ) -> list[str]:
        """Adopt our own running containers of the environments in ``keep``; remove every
        other container with our label."""
        keep = keep or {}
        done: list[str] = []
        try:
            leftovers = await self._call(
                self.client.api.containers, all=True, filters={"label": self.label}
            )
        except (docker.errors.APIError, *_ENGINE_ERRORS) as e:
            return [f"cannot list containers: {e}"]
        for info in leftovers:
            labels, cid = info.get("Labels") or {}, info["Id"]
            env_id = labels.get(ENV_LABEL, "")
            if env_id in self._envs and self._envs[env_id].container_id == cid:
                continue
            if (
                labels.get(self.label) == self.owner_id
                and info.get("State") == "running"
                and env_id in keep
                and env_id not in self._envs
            ):
                env = _Env(env_id, cid, self._agent_dir(env_id), use_agent=False)
                sock = env.agent_dir / AGENT_SOCK
                with contextlib.suppress(Exception):
                    reply = await _agent_call(sock, {"op": "ping"}, timeout_s=2)
                    env.use_agent = bool(reply.get("ok"))
                    env.keepalive = bool(reply.get("keepalive"))
                self._envs[env_id] = env
                done.append(f"adopted {env_id} ({cid[:12]})")
                continue
            await self._remove_container(cid)
            done.append(f"removed {env_id or '?'} ({cid[:12]})")
        known = {env.agent_dir for env in self._envs.values()}
        for path in self.agents_dir.iterdir():
            if path not in known:
                shutil.rmtree(path, ignore_errors=True)
        return done

    async def shutdown(self, keep: Collection[str] = ()) -> None:
        """End in-flight execs (infra_error), remove every container not in ``keep``."""
        self._closing = True
        envs = [e for e in self._envs if e not in keep]
        await asyncio.gather(*(self.close_env(e) for e in envs), return_exceptions=True)
        if self._inflight:
            await asyncio.wait(list(self._inflight), timeout=10)

    # --- execs ------------------------------------------------------------------------------

    async def exec(self, req: ExecRequest) -> ExecResult:
        if self._closing:
            return infra_error(SHUTDOWN_DETAIL)
        env = self._envs.get(req.env_id)
        if env is None or not env.alive:
            return infra_error(f"no such environment {req.env_id}")
        task = asyncio.ensure_future(self._exec(env, req))
        self._inflight.add(task)
        if req.action_id:
            self._actions[req.action_id] = env
        try:
            result = await asyncio.shield(task)
        finally:
            self._inflight.discard(task)
            if req.action_id:
                self._actions.pop(req.action_id, None)
        if self._closing and result.outcome != "ok":
            return infra_error(SHUTDOWN_DETAIL, stdout=result.stdout, stderr=result.stderr)
        return result

    async def _exec(self, env: _Env, req: ExecRequest) -> ExecResult:
        cores = ",".join(map(str, req.cores))
        try:
            await self._pin(env, req.cores, cores)
        except docker.errors.NotFound:
            return await self._lost(env, "container removed behind our back")
        except docker.errors.APIError as e:
            return await self._failed(env, f"cannot pin cores: {e.explanation or e}")
        except _ENGINE_ERRORS as e:
            return infra_error(f"docker engine unreachable: {e}")
        if req.session is not None:
            return await self._session_exec(env, req)
        cmd = rewrite_pytest(req.cmd, len(req.cores), req.elastic)
        env_vars = {**req.env_vars, "TANGRAM_CPUS": str(len(req.cores)), "TANGRAM_CORES": cores}
        if env.use_agent:
            result = await self._exec_agent(env, req, cmd, env_vars)
            if result is not None:
                return result
            env.use_agent = False  # the agent refused the connection: fall back for good
        return await self._exec_docker(env, req, cmd, env_vars)

    async def _pin(self, env: _Env, cores: tuple[int, ...], text: str) -> None:
        """Set the container's cpuset and CPU quota to exactly ``cores``.

        Fast path: write the container's cgroup-v1 files directly (what ``docker update``
        does through dockerd, at the cost docs/results.md gives under
        ``bench/exec_backends.py``), and skip it when the container is already pinned to
        these cores. Fallback: the SDK's ``update_container``.
        """
        if env.pinned == cores:
            return
        if env.cpuset_dir is not None and env.cpu_dir is not None:
            try:
                quota = CPU_PERIOD_US * len(cores)
                if len(cores) > len(env.pinned):  # widen quota before cpuset, narrow after
                    (env.cpu_dir / "cpu.cfs_quota_us").write_text(str(quota))
                    (env.cpuset_dir / "cpuset.cpus").write_text(text)
                else:
                    (env.cpuset_dir / "cpuset.cpus").write_text(text)
                    (env.cpu_dir / "cpu.cfs_quota_us").write_text(str(quota))
                env.pinned = cores
                return
            except OSError:
                env.cpuset_dir = env.cpu_dir = None  # gone or not ours: use the engine
        env.pinned = ()
        await self._update_via_engine(env, text, len(cores))
        env.pinned = cores

    async def _update_via_engine(self, env: _Env, cores: str, n: int) -> None:
        await self._call(
            self.client.api.update_container,
            env.container_id,
            cpuset_cpus=cores,
            cpu_period=CPU_PERIOD_US,
            cpu_quota=CPU_PERIOD_US * n,
        )

    async def _exec_agent(
        self, env: _Env, req: ExecRequest, cmd: list[str] | str, env_vars: dict[str, str]
    ) -> ExecResult | None:
        """Run through the agent; None if it could not be reached (nothing was started)."""
        frame = {
            "op": "exec",
            "cmd": cmd,
            "env": env_vars,
            "cores": list(req.cores),
            "timeout_s": req.timeout_s,
            "max_output": req.max_output,
            "exec_id": f"{req.action_id or 'exec'}-{uuid.uuid4().hex[:8]}",
            "cwd": container_cwd(req.cwd),
            "stdin_b64": base64.b64encode(req.stdin).decode() if req.stdin else None,
        }
        wait = None if req.timeout_s is None else req.timeout_s + REPLY_MARGIN_S
        try:
            reader, writer = await self._agent_conn(env)
        except OSError:
            state = await self._container_state(env.container_id)
            if state not in ("running", "unknown"):
                return await self._lost(env, f"container is {state}")
            return None
        try:
            reply = await _exchange(
                reader, writer, frame, wait, keep=env.idle if env.keepalive else None
            )
        except (OSError, EOFError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
            return await self._agent_failed(env, e)
        finally:
            if not env.alive:
                env.drop_idle()  # closed while this exec ran
        if not reply.get("ok"):
            return infra_error(f"agent error: {reply.get('error')}")
        code = int(reply["exit_code"])
        return ExecResult(
            outcome_for(code, bool(reply["timed_out"])),
            code,
            reply["stdout"],
            reply["stderr"],
            float(reply["exec_s"]),
            bool(reply["truncated"]),
            f"killed after {req.timeout_s} s" if reply["timed_out"] else "",
        )

    async def _exec_docker(
        self, env: _Env, req: ExecRequest, cmd: list[str] | str, env_vars: dict[str, str]
    ) -> ExecResult:
        """Run through `docker exec`; the marker lets a second exec kill strays on timeout."""
        marker = f"{agent_mod.MARKER_VAR}={req.action_id or 'exec'}-{uuid.uuid4().hex[:8]}"
        # Through sh so that a missing program is exit 127 as in the other paths. Input
        # goes in as a file first (docker exec's attach protocol is not worth it here).
        stdin_file = f"/tmp/.tangram-stdin-{uuid.uuid4().hex[:12]}" if req.stdin else ""
        redirect = f"exec <{stdin_file}; rm -f {stdin_file}; " if stdin_file else ""
        argv = (
            ["/bin/sh", "-c", redirect + cmd]
            if isinstance(cmd, str)
            else ["/bin/sh", "-c", redirect + 'exec "$@"', "sh", *cmd]
        )
        api = self.client.api
        try:
            if stdin_file:
                await self.put_bytes(env, stdin_file, req.stdin or b"")
            exec_id = (
                await self._call(
                    api.exec_create,
                    env.container_id,
                    argv,
                    environment=[f"{k}={v}" for k, v in env_vars.items()] + [marker],
                    workdir=container_cwd(req.cwd),
                )
            )["Id"]
        except docker.errors.NotFound:
            return await self._lost(env, "container removed behind our back")
        except docker.errors.APIError as e:
            return await self._failed(env, f"docker exec failed: {e.explanation or e}")
        except _ENGINE_ERRORS as e:
            return infra_error(f"docker engine unreachable: {e}")
        out, err = OutputBuffer(req.max_output), OutputBuffer(req.max_output)

        def pump() -> None:
            stream = api.exec_start(exec_id, stream=True, demux=True)
            try:
                for chunk_out, chunk_err in stream:
                    if chunk_out:
                        out.feed(chunk_out)
                    if chunk_err:
                        err.feed(chunk_err)
            finally:
                stream.close()

        started = time.monotonic()
        pumping = asyncio.ensure_future(self._call(pump))
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(pumping), req.timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
            await self._kill_marked(env, "TERM", marker)
            try:
                await asyncio.wait_for(asyncio.shield(pumping), SIGTERM_GRACE_S)
            except asyncio.TimeoutError:
                await self._kill_marked(env, "KILL", marker)
        except (*_ENGINE_ERRORS, docker.errors.APIError) as e:
            return infra_error(f"docker exec stream failed: {e}", stdout=out.text())
        exec_s = time.monotonic() - started
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(pumping, 5)
            info = await self._call(api.exec_inspect, exec_id)
        except (docker.errors.APIError, *_ENGINE_ERRORS) as e:
            return infra_error(f"docker exec inspect failed: {e}", stdout=out.text())
        code = info.get("ExitCode")
        if code is None or info.get("Running"):
            state = await self._container_state(env.container_id)
            if state != "running":
                return await self._lost(env, f"container is {state}")
            return infra_error("docker exec did not finish", stdout=out.text())
        if code in (137, 143) and not timed_out:
            # Killed by a signal from outside: the container itself may be going down, and
            # dockerd reports that a little after the exec's end.
            state = await self._settled_state(env.container_id)
            if state not in ("running", "unknown"):
                return await self._lost(env, f"container is {state}")
        return ExecResult(
            outcome_for(code, timed_out),
            code,
            out.text(),
            err.text(),
            exec_s,
            out.truncated or err.truncated,
            f"killed after {req.timeout_s} s" if timed_out else "",
        )

    # --- file transfer ----------------------------------------------------------------------

    def _live(self, env_id: str) -> _Env:
        env = self._envs.get(env_id)
        if env is None or not env.alive:
            raise EnvError(f"no such environment {env_id}")
        return env

    async def put_bytes(self, env: _Env, path: str, data: bytes) -> None:
        """Write one file in the container through the engine's archive API."""
        parent, name = posixpath.split(path)
        await self._call(
            self.client.api.put_archive, env.container_id, parent, files.single_file_tar(name, data)
        )

    async def put(self, env_id: str, path: str, data: bytes, *, tar: bool = False) -> int:
        """Write a file (or extract a tar stream into a directory) inside the container.

        Paths are relative to the working directory; the container is the confinement. A
        tar stream is checked as the process backend checks one (``nsfiles.check_tar``:
        its headers declare at most 1 GiB and 100,000 members, TooLarge otherwise) before
        any engine call, off the event loop (a gzip stream is inflated to read them)."""
        env = self._live(env_id)
        target = container_cwd(path)
        if tar:
            await asyncio.to_thread(nsfiles.check_tar, data, path)
        mkdir = posixpath.dirname(target) if not tar else target
        result = await self._call(
            env_container(self.client, env).exec_run, ["mkdir", "-p", "--", mkdir]
        )
        if result.exit_code != 0:
            raise EnvError(f"cannot create {mkdir}: {result.output.decode(errors='replace')}")
        if tar:
            await self._call(self.client.api.put_archive, env.container_id, target, data)
        else:
            await self.put_bytes(env, target, data)
        return len(data)

    async def get(self, env_id: str, path: str, *, max_bytes: int) -> tuple[bytes, bool]:
        """A file's bytes, or a directory as a tar stream of its contents."""
        env = self._live(env_id)
        try:
            stream, stat = await self._call(
                self.client.api.get_archive, env.container_id, container_cwd(path)
            )
        except docker.errors.NotFound as e:
            raise FileNotFoundError(f"{path}: no such file or directory") from e
        if int(stat.get("size", 0)) > max_bytes:
            raise files.TooLarge(f"{path}: more than {max_bytes} bytes")

        def collect() -> bytes:
            chunks, total = [], 0
            for chunk in stream:
                total += len(chunk)
                if total > 2 * max_bytes + (1 << 20):  # tar headers and padding included
                    raise files.TooLarge(f"{path}: more than {max_bytes} bytes")
                chunks.append(chunk)
            return b"".join(chunks)

        data = await self._call(collect)
        single = files.only_file(data)
        if single is not None:
            return single
        tree = files.strip_top_dir(data)
        if len(tree) > max_bytes:
            raise files.TooLarge(f"{path}: more than {max_bytes} bytes as a tar stream")
        return tree, True

    # --- shell sessions ---------------------------------------------------------------------

    async def open_session(
        self, env_id: str, session_id: str, run_as: tuple[int, int] | None = None
    ) -> None:
        """Start a persistent shell in the container, hosted by its agent (``agent.py``)."""
        env = self._live(env_id)
        if not env.use_agent:
            raise EnvError("shell sessions need the in-container agent (an image with python3)")
        await self._session_call(env, {"op": "session_open", "id": session_id}, 10.0)
        self._sessions[session_id] = env_id
        token = secrets.token_hex(8)
        hello = ExecRequest(env_id, "true", (self._first_core,))
        reply = await self._session_call(
            env,
            {
                "op": "session_run", "id": session_id, "token": token, "cores": [],
                "script": shell_mod.script(hello, token, setup=shell_mod.SETUP),
                "timeout_s": shell_mod.OPEN_TIMEOUT_S, "max_output": 4096,
            },
            shell_mod.OPEN_TIMEOUT_S + REPLY_MARGIN_S,
        )  # fmt: skip
        if reply.get("exit_code") != 0:
            await self.close_session(session_id)
            raise EnvError(f"the session's shell did not start: {reply.get('stderr', '')}")

    async def _agent_conn(self, env: _Env) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to the environment's agent: one an earlier exec left open (saves a
        connect and a thread in the agent, ~0.5 ms), else a new one."""
        loop = asyncio.get_running_loop()
        if env.idle_loop is not loop:
            env.drop_idle()
            env.idle_loop = loop
        while env.idle:
            reader, writer = env.idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        return await asyncio.open_unix_connection(str(env.agent_dir / AGENT_SOCK))

    async def _agent_failed(self, env: _Env, exc: BaseException) -> ExecResult:
        """The agent stopped answering mid-exec: the environment is lost if its container
        is gone, else the exec is an infrastructure error and the container stays."""
        state = await self._settled_state(env.container_id)
        if state not in ("running", "unknown"):
            return await self._lost(env, f"container is {state}")
        return infra_error(f"agent connection failed: {type(exc).__name__}: {exc}")

    async def _session_exec(self, env: _Env, req: ExecRequest) -> ExecResult:
        """One run in a session: the container is already pinned to ``req.cores``."""
        if self._sessions.get(req.session or "") != env.env_id:
            return infra_error(f"no such session {req.session} in {env.env_id}")
        token = secrets.token_hex(8)
        frame = {
            "op": "session_run", "id": req.session, "token": token,
            "script": shell_mod.script(req, token), "cores": list(req.cores),
            "timeout_s": req.timeout_s, "max_output": req.max_output,
        }  # fmt: skip
        wait = None if req.timeout_s is None else req.timeout_s + REPLY_MARGIN_S
        try:
            reply = await _agent_call(env.agent_dir / AGENT_SOCK, frame, wait)
        except (OSError, EOFError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
            return await self._agent_failed(env, e)
        if not reply.get("ok"):
            return infra_error(f"session {req.session}: {reply.get('error')}")
        code = int(reply["exit_code"])
        timed_out = bool(reply["timed_out"])
        detail = f"killed after {req.timeout_s} s" if timed_out else ""
        if reply.get("ended"):
            detail = "; ".join(filter(None, (detail, f"session {req.session}: its shell exited")))
        outcome = outcome_for(code, timed_out)
        if reply.get("ended") and outcome == "ok":
            outcome = "failed"  # the shell itself exited: the session is over
        return ExecResult(
            outcome, code, reply["stdout"], reply["stderr"], float(reply["exec_s"]),
            bool(reply["truncated"]), detail,
        )  # fmt: skip

    async def _session_call(self, env: _Env, frame: dict[str, Any], wait: float) -> dict[str, Any]:
        try:
            reply = await _agent_call(env.agent_dir / AGENT_SOCK, frame, wait)
        except (OSError, EOFError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
            raise EnvError(f"agent connection failed: {type(e).__name__}: {e}") from e
        if not reply.get("ok"):
            raise EnvError(f"agent: {reply.get('error')}")
        return reply

    async def interrupt_session(self, session_id: str) -> bool:
        env = self._envs.get(self._sessions.get(session_id, ""))
        if env is None or not env.alive:
            return False
        reply = await self._session_call(env, {"op": "session_interrupt", "id": session_id}, 5.0)
        return bool(reply.get("interrupted"))

    async def close_session(self, session_id: str) -> None:
        env = self._envs.get(self._sessions.pop(session_id, ""))
        if env is not None and env.alive:
            with contextlib.suppress(EnvError):
                await self._session_call(env, {"op": "session_close", "id": session_id}, 5.0)

    async def cancel(self, action_id: str) -> bool:
        """SIGKILL the processes of the running exec of ``action_id`` (see Backend): those
        carrying its marker, ``TANGRAM_EXEC_ID=<action id>-<8 hex>`` (agent and plain)."""
        env = self._actions.get(action_id)
        if env is None or not env.alive or not _SAFE_ID.fullmatch(action_id):
            return False
        pattern = f"{agent_mod.MARKER_VAR}={action_id}-[0-9a-f]\\{{8\\}}"
        await self._kill_marked(env, "KILL", pattern)
        return True

    async def _kill_marked(self, env: _Env, sig: str, marker: str) -> None:
        with contextlib.suppress(docker.errors.APIError, *_ENGINE_ERRORS):
            await self._call(
                env_container(self.client, env).exec_run,
                ["/bin/sh", "-c", _KILL_SCRIPT, "sh", sig, marker],
            )

    async def _failed(self, env: _Env, why: str) -> ExecResult:
        """An engine call failed: forget the environment only if its container is gone."""
        state = await self._container_state(env.container_id)
        if state in ("running", "unknown"):
            return infra_error(why)
        return await self._lost(env, f"{why} (container is {state})")

    async def _lost(self, env: _Env, why: str) -> ExecResult:
        """The container died or vanished: forget it so the daemon makes a fresh one."""
        if self._closing:
            return infra_error(SHUTDOWN_DETAIL)
        env.alive = False
        if self._envs.get(env.env_id) is env:
            del self._envs[env.env_id]
        await self._remove_container(env.container_id)
        shutil.rmtree(env.agent_dir, ignore_errors=True)
        return infra_error(why)


def container_cwd(cwd: str | None) -> str:
    """An exec's working directory in the container: relative to ``WORKDIR``."""
    return posixpath.join(WORKDIR, cwd) if cwd else WORKDIR


def env_container(client: docker.DockerClient, env: _Env) -> Any:
    """A Container handle without an inspect round trip."""
    return client.containers.prepare_model({"Id": env.container_id})


async def _agent_call(sock: Path, frame: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
    reader, writer = await asyncio.open_unix_connection(str(sock))
    return await _exchange(reader, writer, frame, timeout_s)


async def _exchange(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    frame: dict[str, Any],
    timeout_s: float | None,
    *,
    keep: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] | None = None,
) -> dict[str, Any]:
    """One request and its reply. The connection is closed after, or, with ``keep``, put
    there for the next request once a whole reply came back (never after a failure)."""
    kept = False
    try:
        writer.write(agent_mod.encode_frame(frame))
        await writer.drain()
        reply = await asyncio.wait_for(_read_reply(reader), timeout_s)
        if keep is not None and len(keep) < MAX_IDLE_AGENT_CONNS:
            keep.append((reader, writer))
            kept = True
        return reply
    finally:
        if not kept:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def _read_reply(reader: asyncio.StreamReader) -> dict[str, Any]:
    size = agent_mod.decode_header(await reader.readexactly(4))
    reply = json.loads(await reader.readexactly(size))
    if not isinstance(reply, dict):
        raise EOFError("malformed agent reply")
    return reply

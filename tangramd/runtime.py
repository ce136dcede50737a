"""The executor of ``tangramd up``: runs the core's commands and feeds results back.

Everything with I/O lives here: the Unix-socket server, the execution backend, timers and
logs. The core (``tangramd.core``) decides; this module only carries out and reports.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from tangram.model import InvalidDemand, TangramError
from tangram.pools.api import ApiPool
from tangram.pools.cpu import CpuCluster, CpuNodePool
from tangram.protocol.errors import InfraError, NotFound, UnknownOp
from tangram.protocol.ops import validate_args
from tangram.sched import SchedConfig
from tangram.version import __version__
from tangramd import events as ev
from tangramd.backends.base import Backend, ExecRequest, ExecResult
from tangramd.core import Core, CoreConfig
from tangramd.transport import NOT_SYNC, ConnInfo, UnixServer

log = structlog.get_logger("tangramd")

NODE_ID = "local"


class Runtime:
    """Wires one ``Core`` to a backend and a socket server (the all-in-one daemon)."""

    def __init__(
        self,
        core: Core,
        backend: Backend,
        socket_path: str,
        *,
        state_dir: str,
        max_frame: int = 16 << 20,
        idle_timeout_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.core = core
        self.backend = backend
        self.socket_path = socket_path
        self.state_dir = Path(state_dir)
        self.clock = clock
        self.started = clock()
        self.server = UnixServer(
            socket_path,
            self.handle,
            max_frame=max_frame,
            idle_timeout_s=idle_timeout_s,
            sync_handler=self.handle_sync,
        )
        self._tokens = itertools.count(1)
        self._futures: dict[int, asyncio.Future[Any]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        # TANGRAM_VALIDATE=1 (tests): check the core's invariants after every event
        self._validate = os.environ.get("TANGRAM_VALIDATE") == "1"
        self._load_profiles()

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        actions = await self.backend.reconcile()
        for what in actions:
            log.info("reconciled", detail=what)
        await self.server.start()
        log.info(
            "daemon_ready",
            socket=self.socket_path,
            backend=self.backend.name,
            cores=sum(p.capacity for p in self.core.cpu.nodes),
        )

    async def stop(self) -> None:
        """Graceful stop: refuse new work, end in-flight actions with a typed outcome."""
        self.feed(ev.Shutdown())
        await self.backend.shutdown()  # running execs return infra_error "daemon shutting down"
        deadline = self.clock() + 10.0
        while self._tasks and self.clock() < deadline:
            await asyncio.sleep(0.01)
        for env in list(self.core.envs.values()):
            self.feed(ev.EnvRemoved(env_id=env.id))
        await self.server.close(grace_s=0.5)
        for fut in self._futures.values():
            if not fut.done():
                fut.set_exception(InfraError("daemon shutting down"))
        log.info("daemon_stopped")

    # ------------------------------------------------------------------ event loop glue
    def feed(self, event: ev.Event) -> None:
        now = self.clock()
        try:
            commands = self.core.handle(event, now)
        except Exception:
            log.exception("core_failed", event=type(event).__name__)
            token = getattr(event, "token", None)
            if token is not None:
                self._resolve(token, None, ("internal", "internal error; see daemon log"))
            return
        for cmd in commands:
            self._execute(cmd)
        if self._validate:
            try:
                self.core.validate()
            except AssertionError as exc:
                log.error("invariant_violated", event=type(event).__name__, error=str(exc))
        self._arm_timer()

    def _arm_timer(self) -> None:
        due = self.core.next_wakeup(self.clock())
        if due is None:
            return
        if self._timer is not None and self._timer_at is not None and self._timer_at <= due:
            return
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        delay = max(0.0, due - self.clock())
        self._timer_at = due
        self._timer = loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self.feed(ev.Tick())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _execute(self, cmd: ev.Command) -> None:
        if isinstance(cmd, ev.Reply):
            self._resolve(cmd.token, cmd.result, cmd.error)
        elif isinstance(cmd, ev.RunExec):
            log.info(
                "action_placed",
                action_id=cmd.action_id,
                node=cmd.node,
                env=cmd.env_id,
                cores=list(cmd.cores),
                trajectory=self.core.trajectory_of(cmd.action_id),
            )
            self._spawn(self._run_exec(cmd))
        elif isinstance(cmd, ev.CreateEnv):
            self._spawn(self._create_env(cmd))
        elif isinstance(cmd, ev.RemoveEnv):
            self._spawn(self._remove_env(cmd))
        else:  # pragma: no cover - a new command type without an executor is a bug
            raise TypeError(f"no executor for {cmd!r}")

    def _resolve(self, token: int, result: Any, error: tuple[str, str] | None) -> None:
        fut = self._futures.pop(token, None)
        if fut is None or fut.done():
            return
        if error is not None:
            from tangram.protocol.errors import error_from_wire

            fut.set_exception(error_from_wire(*error))
        else:
            fut.set_result(result)

    async def _create_env(self, cmd: ev.CreateEnv) -> None:
        error = None
        try:
            await self.backend.create_env(cmd.env_id, cmd.image, cmd.mem)
            log.info("env_created", env=cmd.env_id, node=cmd.node, image=cmd.image)
        except Exception as exc:  # backend failure of any kind is an infra error
            error = f"{type(exc).__name__}: {exc}"
            log.warning("env_create_failed", env=cmd.env_id, error=error)
        self.feed(ev.EnvCreated(env_id=cmd.env_id, error=error))

    async def _remove_env(self, cmd: ev.RemoveEnv) -> None:
        try:
            await self.backend.close_env(cmd.env_id)
        except Exception as exc:
            log.warning("env_remove_failed", env=cmd.env_id, error=str(exc))
        self.feed(ev.EnvRemoved(env_id=cmd.env_id))

    async def _run_exec(self, cmd: ev.RunExec) -> None:
        req = ExecRequest(
            env_id=cmd.env_id,
            cmd=cmd.cmd,
            cores=cmd.cores,
            timeout_s=cmd.timeout_s,
            elastic=cmd.elastic,
            env_vars=cmd.env_vars,
            max_output=cmd.max_output,
            action_id=cmd.action_id,
        )
        try:
            res: ExecResult = await self.backend.exec(req)
        except Exception as exc:
            res = ExecResult(
                "infra_error", None, "", "", 0.0, False, f"{type(exc).__name__}: {exc}"
            )
        lost = res.outcome == "infra_error" and not self.backend.env_exists(cmd.env_id)
        log.info(
            "action_finished",
            action_id=cmd.action_id,
            node=cmd.node,
            env=cmd.env_id,
            outcome=res.outcome,
            exit_code=res.exit_code,
            exec_s=round(res.exec_s, 6),
            detail=res.detail or None,
            cores=list(cmd.cores),
        )
        result = {
            "outcome": res.outcome,
            "exit_code": res.exit_code,
            "stdout": res.stdout,
            "stderr": res.stderr,
            "exec_s": res.exec_s,
            "truncated": res.truncated,
            "detail": res.detail,
        }
        self.feed(ev.ExecFinished(action_id=cmd.action_id, result=result, env_lost=lost))

    # ------------------------------------------------------------------ requests
    async def _request(self, event_factory: Callable[[int], ev.Event]) -> Any:
        token = next(self._tokens)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._futures[token] = fut
        self.feed(event_factory(token))
        return await fut

    def _watch(self, conn: ConnInfo) -> None:
        if not getattr(conn, "_tangram_watched", False):
            conn._tangram_watched = True  # type: ignore[attr-defined]  # per-conn flag
            conn.on_close(lambda c: self.feed(ev.ConnClosed(conn=c.id)))

    def handle_sync(self, op: str, args: dict[str, Any], conn: ConnInfo) -> Any:
        """Inline path for ops that never wait (status, lists, profiles, ping)."""
        fn = _SYNC_OPS.get(op)
        if fn is None:
            return NOT_SYNC
        validate_args(op, args)
        return fn(self, args, conn)

    async def handle(self, op: str, args: dict[str, Any], conn: ConnInfo) -> Any:
        validate_args(op, args)
        sync = _SYNC_OPS.get(op)
        if sync is not None:  # the transport's inline path was skipped (slow reader)
            return sync(self, args, conn)
        fn = _OPS.get(op)
        if fn is None:
            raise UnknownOp(f"op {op!r} is not served by tangramd up")
        self._watch(conn)
        return await fn(self, args, conn)

    # ------------------------------------------------------------------ profiles
    def _profiles_path(self) -> Path:
        return self.state_dir / "profiles.json"

    def _load_profiles(self) -> None:
        path = self._profiles_path()
        try:
            self.core.profiles.update(json.loads(path.read_text()))
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            log.warning("profiles_unreadable", path=str(path), error=str(exc))

    def _save_profiles(self) -> None:
        path = self._profiles_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.core.profiles, indent=1, sort_keys=True))
        os.replace(tmp, path)


# -------------------------------------------------------------------------- op table


def _op_ping(rt: Runtime, args: dict[str, Any], conn: ConnInfo) -> Any:
    return {"pong": True, "version": __version__}


def _op_status(rt: Runtime, args: dict[str, Any], conn: ConnInfo) -> Any:
    now = rt.clock()
    out = rt.core.status(now)
    out.update(
        {
            "version": __version__,
            "uptime_s": now - rt.started,
            "backend": rt.backend.name,
            "socket": rt.socket_path,
            "nodes": len(rt.core.cpu.nodes),
        }
    )
    return out


def _op_nodes(rt: Runtime, args: dict[str, Any], conn: ConnInfo) -> Any:
    nodes = []
    for p in rt.core.cpu.nodes:
        nodes.append(
            {
                "id": p.node_id,
                "cores": p.capacity,
                "free_cores": p.free_units(),
                "numa": [list(c) for c in p.numa],
                "mem_bytes": p.mem_total,
                "mem_reserved": p.mem_reserved,
                "busy_cores": [c for cores in p.numa for c in cores if p.holder(c) is not None],
                "gpus": 0,
                "backend": rt.backend.name,
            }
        )
    return {"nodes": nodes}


def _op_queue(rt: Runtime, args: dict[str, Any], conn: ConnInfo) -> Any:
    now = rt.clock()

    def row(rec: Any) -> dict[str, Any]:
        a = rec.action
        return {
            "action_id": a.id,
            "kind": a.kind,
            "state": rec.state,
            "trajectory": a.trajectory,
            "pool": rec.pool_id or None,
            "waiting_s": (rec.started_at or now) - rec.submitted_at,
            "min": a.min_units,
            "max": a.key_amounts.max,
            "units": list(rec.units),
            "elastic": a.is_elastic(),
        }

    waiting = [row(r) for r in rt.core.queue.values()]
    waiting += [row(r) for r in rt.core.actions.values() if r.state == "waiting_env"]
    running = [row(r) for r in rt.core.actions.values() if r.state == "running"]
    return {"waiting": waiting, "running": running}


def _op_story(rt: Runtime, args: dict[str, Any], conn: ConnInfo) -> Any:
    aid = args["action_id"]
    events = rt.core.stories.get(aid)
    if events is None:
        raise NotFound(f"no story for action {aid!r} (unknown or too old)")
    rec = rt.core.actions.get(aid)
    outcome = rt.core.recent.get(aid)
    return {
        "action_id": aid,
        "state": rec.state if rec else ("done" if outcome else "forgotten"),
        "outcome": rec.outcome if rec else outcome,
        "events": [{"t": t - rt.started, "event": e, "detail": d} for t, e, d in events],
    }


async def _op_env_open(rt: Runtime, args: dict[str, Any], conn: ConnInfo) -> Any:
    return await rt._request(
        lambda tok: ev.OpenEnv(
            token=tok,
            image=args.get("image"),
            mem=args.get("mem"),
            trajectory=args.get("trajectory"),
            conn=None,
        )
    )


async def _op_env_close(rt: Runtime, args: dict[str, Any], conn: ConnInfo) -> Any:
    return await rt._request(lambda tok: ev.CloseEnv(token=tok, env_id=args["id"]))


def _op_env_list(rt: Runtime, args: dict[str, Any], conn: ConnInfo) -> Any:
    now = rt.clock()
    return {
        "envs": [
            {
                "id": e.id,
                "node": e.node,
                "image": e.image,
                "mem": e.mem,
                "state": e.state,
                "trajectory": e.trajectory,
                "age_s": now - e.created_at,
                "idle_s": now - e.last_used,
                "active": e.active,
            }
            for e in rt.core.envs.values()
            if not e.throwaway
        ]
    }


async def _op_exec(rt: Runtime, args: dict[str, Any], conn: ConnInfo) -> Any:
    cpus = args.get("cpus")
    if isinstance(cpus, list | tuple):
        cpus = list(cpus)
    return await rt._request(
        lambda tok: ev.SubmitExec(
            token=tok,
            cmd=args["cmd"],
            env=args.get("env"),
            image=args.get("image"),
            cpus=cpus,
            mem=args.get("mem"),
            timeout_s=args.get("timeout_s"),
            profile=args.get("profile"),
            elastic=args.get("elastic"),
            trajectory=args.get("trajectory"),
            task=args.get("task"),
            t1_s=args.get("t1_s"),
            eff=args.get("eff"),
            env_vars=args.get("env_vars"),
            conn=conn.id,
        )
    )


async def _op_lease_acquire(rt: Runtime, args: dict[str, Any], conn: ConnInfo) -> Any:
    return await rt._request(
        lambda tok: ev.AcquireLease(
            token=tok,
            api=args["api"],
            ttl_s=args.get("ttl_s"),
            policy=args.get("policy"),
            deadline_s=args.get("deadline_s"),
            conn=conn.id,
        )
    )


async def _op_lease_release(rt: Runtime, args: dict[str, Any], conn: ConnInfo) -> Any:
    return await rt._request(lambda tok: ev.ReleaseLease(token=tok, lease_id=args["lease_id"]))


def _op_api_list(rt: Runtime, args: dict[str, Any], conn: ConnInfo) -> Any:
    rows = []
    waiting: dict[str, int] = {}
    for rec in rt.core.queue.values():
        if rec.action.kind == "api":
            waiting[rec.action.api or ""] = waiting.get(rec.action.api or "", 0) + 1
    for name, pool in sorted(rt.core.apis.items()):
        rows.append(
            {
                "name": name,
                "concurrency": pool.concurrency,
                "quota": pool.quota,
                "period_s": pool.period_s,
                "overflow": pool.overflow,
                "in_use": pool.in_use,
                "free": pool.free_units(),
                "waiting": waiting.get(name, 0),
            }
        )
    return {"apis": rows}


def _op_profile_save(rt: Runtime, args: dict[str, Any], conn: ConnInfo) -> Any:
    name = args["name"]
    prof = {k: args.get(k) for k in ("dop", "t1_s", "eff", "speedup", "elastic")}
    if not prof["dop"] or prof["t1_s"] is None or not prof["eff"]:
        raise InvalidDemand("profile", "needs dop, t1_s and eff")
    prof["elastic"] = bool(prof["elastic"] if prof["elastic"] is not None else True)
    rt.core.profiles[name] = prof
    rt._save_profiles()
    log.info("profile_saved", name=name, elastic=prof["elastic"])
    return {"name": name, "saved": True}


def _op_profile_get(rt: Runtime, args: dict[str, Any], conn: ConnInfo) -> Any:
    prof = rt.core.profiles.get(args["name"])
    if prof is None:
        raise NotFound(f"profile {args['name']!r} not found")
    return {"name": args["name"], **prof}


def _op_profile_list(rt: Runtime, args: dict[str, Any], conn: ConnInfo) -> Any:
    return {"profiles": [{"name": n, **p} for n, p in sorted(rt.core.profiles.items())]}


_SYNC_OPS: dict[str, Callable[[Runtime, dict[str, Any], ConnInfo], Any]] = {
    "ping": _op_ping,
    "status": _op_status,
    "nodes": _op_nodes,
    "queue": _op_queue,
    "story": _op_story,
    "env.list": _op_env_list,
    "api.list": _op_api_list,
    "profile.save": _op_profile_save,
    "profile.get": _op_profile_get,
    "profile.list": _op_profile_list,
}

_OPS: dict[str, Callable[[Runtime, dict[str, Any], ConnInfo], Any]] = {
    "env.open": _op_env_open,
    "env.close": _op_env_close,
    "exec": _op_exec,
    "lease.acquire": _op_lease_acquire,
    "lease.release": _op_lease_release,
}


# -------------------------------------------------------------------------- building


def build_runtime(config: Any) -> Runtime:
    """Build core, pools and backend from a ``tangramd.config.Config``."""
    from tangramd.topology import discover

    topo = discover()
    cores = set(config.cpu.cores) if config.cpu.cores else set(topo.cores)
    layout = [tuple(c for c in numa if c in cores) for numa in topo.cores_by_numa]
    layout = [n for n in layout if n]
    if not layout:
        raise TangramError(f"cpu.cores {sorted(cores)} selects no core of this host")
    mem = config.cpu.mem or topo.mem_bytes
    cluster = CpuCluster([CpuNodePool(NODE_ID, layout, mem)])
    apis = {
        a.name: ApiPool(
            a.name,
            concurrency=a.concurrency,
            quota=a.quota,
            period_s=a.period_s,
            overflow=a.overflow,
            default_ttl_s=a.ttl_s,
        )
        for a in config.apis
    }
    sc = config.sched
    core_cfg = CoreConfig(
        sched=SchedConfig(
            depth=sc.depth,
            order=sc.order,
            rule=sc.rule,
            starvation_s=sc.starvation_s,
            replay_limit=sc.replay_limit,
        ),
        coalesce_s=sc.coalesce_ms / 1000.0,
        default_env_mem=config.cpu.default_env_mem,
        env_idle_ttl_s=config.cpu.env_idle_ttl_s,
        default_deadline_s=min((a.deadline_s for a in config.apis), default=30.0),
        max_output=config.cpu.max_output_bytes,
        default_image=config.cpu.docker_image if config.cpu.backend == "docker" else None,
    )
    core = Core(cluster, apis, core_cfg)
    if config.gpu.simulated_count or config.services:
        log.warning(
            "gpu_manager_not_available",
            detail="[gpu]/[[service]] are configured but tangramd up has no GPU manager yet",
        )
    state_dir = config.daemon.state_dir
    backend: Backend
    if config.cpu.backend == "docker":
        from tangramd.backends.docker import DockerBackend

        backend = DockerBackend(
            default_image=config.cpu.docker_image,
            state_dir=state_dir,
            use_agent=config.cpu.exec_agent,
        )
    else:
        from tangramd.backends.process import ProcessBackend

        backend = ProcessBackend(os.path.join(state_dir, "process"))
    return Runtime(
        core,
        backend,
        config.daemon.socket,
        state_dir=state_dir,
        max_frame=config.daemon.max_frame_bytes,
        idle_timeout_s=config.daemon.idle_timeout_s,
    )

"""The executor: runs the core's commands and feeds what happened back as events.

Everything with I/O lives here or below: the Unix-socket server, the execution backend,
timers, the profiles file and logs. The core (``tangramd.state``) decides; the executor only
carries out and reports. Requests from clients arrive through the op handlers
(``tangramd.ops``), which turn them into events with a reply token.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import tarfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import structlog

from tangram.protocol.errors import InfraError, UnknownOp, error_from_wire
from tangram.protocol.results import ExecResult
from tangramd import events as ev
from tangramd.backends.base import Backend, ExecRequest, PathEscape
from tangramd.backends.files import NotAFile, TooLarge, start_exec
from tangramd.lifecycle import loop_name
from tangramd.records import RecordJournal, read_json, write_json
from tangramd.services import ServiceHost, ServiceLoadError, ServiceNotFound
from tangramd.state import Core
from tangramd.transport import ConnInfo, Later, UnixServer

log = structlog.get_logger("tangramd")

# Events after which units wait for a pass (an exec or call ended, a lease returned, an
# environment an exec waited for is ready): their pass runs at once, not at the turn's end.
_ENDS = frozenset({ev.ExecFinished, ev.CallFinished, ev.ReleaseLease, ev.EnvCreated})

# what a put or get refuses as the caller's mistake (a bad path, size, kind or tar stream)
BAD_TRANSFER = (
    PathEscape, TooLarge, NotAFile, IsADirectoryError, NotADirectoryError, tarfile.TarError
)  # fmt: skip
STOP_GRACE_S = 10.0  # how long a graceful stop waits for in-flight work to report back


class OpHandlers(Protocol):
    """How requests reach the executor: the op handlers (``tangramd.ops``) satisfy this."""

    def handle(
        self, ex: Executor, op: str, args: dict[str, Any], conn: ConnInfo
    ) -> Awaitable[Any]: ...

    def handle_sync(self, ex: Executor, op: str, args: dict[str, Any], conn: ConnInfo) -> Any: ...

    def handle_inline(self, ex: Executor, op: str, args: dict[str, Any], conn: ConnInfo) -> Any: ...


class EnvRecords(Protocol):
    """Where the persistent environments' records go (``RecordEnv`` / ``PersistEnvs``):
    the state dir's journal in ``tangramd up``, the coordinator's SQLite store in a cluster."""

    def load(self) -> dict[str, dict[str, Any]]: ...

    def put(self, key: str, record: Mapping[str, Any] | None) -> None: ...

    def replace(self, records: Iterable[Mapping[str, Any]]) -> None: ...


class Executor:
    """Wires one ``Core`` to a backend and a socket server (the all-in-one daemon)."""

    def __init__(
        self,
        core: Core,
        backend: Backend,
        socket_path: str,
        *,
        state_dir: str,
        clock: Callable[[], float] = time.monotonic,
        handlers: OpHandlers,
        services: ServiceHost | None = None,
        env_records: EnvRecords | None = None,
        **server_options: Any,
    ) -> None:
        """``server_options`` go to the ``UnixServer`` (frame and connection limits, the
        peer allowlist); ``env_records`` defaults to the state dir's journal."""
        self.core = core
        self.backend = backend
        self.services = services  # the node's GPU service host (None: no GPUs)
        self.socket_path = socket_path
        self.state_dir = Path(state_dir)
        self.clock = clock
        self.started = clock()
        self.server = UnixServer(
            socket_path,
            lambda op, args, conn: handlers.handle(self, op, args, conn),
            sync_handler=lambda op, args, conn: handlers.handle_inline(self, op, args, conn),
            **server_options,
        )
        self._tokens = itertools.count(1)
        self._futures: dict[int, asyncio.Future[Any] | Later] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._soon: asyncio.Handle | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._running_execs: dict[str, ev.RunExec] = {}  # handed to the backend, not ended
        # the persistent environments' records (default: envs.json + envs.journal)
        self._env_records: EnvRecords = env_records or RecordJournal(
            self.state_dir / "envs.json", valid=_is_env_record, problem="env_records_unreadable"
        )
        # TANGRAM_VALIDATE=1 (tests): check the core's invariants after every event
        self._validate = os.environ.get("TANGRAM_VALIDATE") == "1"

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        """Re-adopt the persistent environments an earlier run left (the backend removes
        the rest and kills what was still running), load profiles, start serving."""
        records = self._read_env_records()
        keep = {str(r["id"]): _owner(r.get("owner")) for r in records}
        actions = await self.backend.reconcile(keep)
        for what in actions:
            log.info("reconciled", detail=what)
        kept = tuple(r for r in records if self.backend.env_exists(str(r["id"])))
        if records:
            log.info("envs_readopted", envs=[r["id"] for r in kept], lost=len(records) - len(kept))
        self.feed(ev.EnvsRecovered(envs=kept))
        self.feed(ev.ProfilesLoaded(profiles=self._read_profiles()))
        if self.services is not None:
            await self._recover_services(self.services)
        await self.server.start()
        log.info(
            "daemon_ready",
            socket=self.socket_path,
            backend=self.backend.name,
            cores=self.core.read.total_cores(),
            event_loop=loop_name(),
        )

    async def stop(self) -> None:
        """Graceful stop through the core: refuse new work, end what waits, close throwaway
        environments (persistent ones stay for the next daemon to re-adopt).

        The backend ends running execs (``infra_error`` "daemon shutting down"); their
        ``ExecFinished`` lets the core close their throwaway environments too, and every
        ``RemoveEnv`` comes back as ``EnvRemoved``.
        """
        self.feed(ev.Shutdown())
        if self.services is not None:  # running calls end infra_error; registrations stay
            await self.services.close()
        await self.backend.shutdown(keep=self.core.read.env_ids(persistent_only=True))
        deadline = self.clock() + STOP_GRACE_S
        while (
            self._tasks or self._running_execs or self.core.read.env_ids(throwaway_only=True)
        ) and self.clock() < deadline:
            await asyncio.sleep(0.01)
        leftover = self.core.read.env_ids(throwaway_only=True)
        if leftover:
            log.warning("envs_not_removed_at_stop", envs=leftover)
        await self.server.close(grace_s=0.5)
        for fut in self._futures.values():
            if not fut.done():
                fut.set_exception(InfraError("daemon shutting down"))
        log.info("daemon_stopped")

    # ------------------------------------------------------------------ views of the mode
    def node_rows(self) -> list[dict[str, Any]]:
        """The ``nodes`` view: the one local node, always ready to itself."""
        return [
            {**row, "backend": self.backend.name, "heartbeat_age_s": 0.0}
            for row in self.core.read.node_rows()
        ]

    def join_info(self, rotate: bool) -> dict[str, Any]:
        """``cluster.join``: only a coordinator has a cluster to join."""
        raise UnknownOp("cluster.join is served by `tangramd coordinator`, not `tangramd up`")

    # ------------------------------------------------------------------ event loop glue
    def feed(self, event: ev.Event) -> None:
        now = self.clock()
        try:
            commands = self.core.handle(event, now)
        except Exception:
            log.exception("core_failed", event_type=type(event).__name__)
            token = getattr(event, "token", None)
            if token is not None:
                self._resolve(token, None, ("internal", "internal error; see daemon log"))
            return
        # Replies go out last: after the records the commands write (an answer never
        # reveals what a restart would forget), and after a pass this event made due (an
        # answer wakes its client, which may take the core before the next spawn request
        # has left).
        replies: list[ev.Reply] = []
        try:
            for cmd in commands:
                if isinstance(cmd, ev.Reply):
                    replies.append(cmd)
                else:
                    self._execute(cmd)
            if self._validate:
                try:
                    self.core.validate()
                except AssertionError as exc:
                    event_type = type(event).__name__
                    log.error("invariant_violated", event_type=event_type, error=str(exc))
            self._arm_timer(type(event) in _ENDS)
        finally:
            for reply in replies:
                self._resolve(reply.token, reply.result, reply.error)

    async def request(self, make_event: Callable[[int], ev.Event]) -> Any:
        """Feed the event ``make_event(token)`` and wait for the core's reply to it."""
        token = next(self._tokens)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._futures[token] = fut
        self.feed(make_event(token))
        return await fut

    def request_later(self, make_event: Callable[[int], ev.Event]) -> Later:
        """``request`` without a task: feed the event now; the core's reply answers the
        returned :class:`~tangramd.transport.Later` when it comes (the transport writes it
        in that turn)."""
        token = next(self._tokens)
        later = Later()
        self._futures[token] = later
        self.feed(make_event(token))
        return later

    def answer_now(self, make_event: Callable[[int], ev.Event]) -> Any:
        """Feed an event the core answers within the same ``handle`` call; return the answer
        (or raise its error). For the inline ops that change state (``profile.save``)."""
        token = next(self._tokens)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._futures[token] = fut
        self.feed(make_event(token))
        if not fut.done():  # pragma: no cover - the core must answer these at once
            self._futures.pop(token, None)
            raise RuntimeError("the core did not answer an inline op at once")
        return fut.result()

    def watch(self, conn: ConnInfo) -> None:
        """Tell the core when this client's connection closes (once per connection)."""
        if not getattr(conn, "_tangram_watched", False):
            conn._tangram_watched = True  # type: ignore[attr-defined]  # per-conn flag
            conn.on_close(lambda c: self.feed(ev.ConnClosed(conn=c.id)))

    def _arm_timer(self, ended: bool = False) -> None:
        """Run or schedule the core's next ``Tick``. A pass due now runs at once when
        ``ended`` (the event was the end of an exec or call: its units wait for this pass)
        and it is the first of this turn of the event loop; any other due pass runs once,
        at the end of the turn (after every event the loop read in it), so a burst costs
        one pass per turn, not one per event."""
        now = self.clock()
        due = self.core.next_wakeup(now)
        if due is None:
            return
        if due <= now:
            first = self._soon is None  # no pass has run or been put off in this turn
            if first:
                self._soon = asyncio.get_running_loop().call_soon(self._on_soon)
            if first and ended:
                self.feed(ev.Tick())  # freed units idle until this pass: run it now
            return
        if self._timer is not None and self._timer_at is not None and self._timer_at <= due:
            return
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        delay = max(0.0, due - self.clock())
        self._timer_at = due
        self._timer = loop.call_later(delay, self._on_timer)

    def _on_soon(self) -> None:
        self._soon = None
        now = self.clock()
        due = self.core.next_wakeup(now)
        if due is not None and due <= now:
            self.feed(ev.Tick())

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self.feed(ev.Tick())

    def _log_soon(self, event: str, **fields: Any) -> None:
        """Log an exec's placement or end on the next turn of the loop: formatting and
        writing a log line is a tenth of a millisecond, which must not delay the spawn
        or the answer a client waits for (both are already on their way then)."""
        asyncio.get_running_loop().call_soon(functools.partial(log.info, event, **fields))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ commands
    def _execute(self, cmd: ev.Command) -> None:
        if isinstance(cmd, ev.Reply):
            self._resolve(cmd.token, cmd.result, cmd.error)
        elif isinstance(cmd, ev.RunExec):
            self._start_exec(cmd)
        elif isinstance(cmd, ev.CreateEnv):
            self._spawn(self._create_env(cmd))
        elif isinstance(cmd, ev.RemoveEnv):
            self._spawn(self._remove_env(cmd))
        elif isinstance(cmd, ev.RunTransfer):
            self._spawn(self._run_transfer(cmd))
        elif isinstance(cmd, ev.StartShell):
            self._spawn(self._start_shell(cmd))
        elif isinstance(cmd, ev.InterruptShell):
            self._spawn(self._interrupt_shell(cmd))
        elif isinstance(cmd, ev.EndShell):
            self._spawn(self._end_shell(cmd))
        elif isinstance(cmd, ev.PersistProfiles):
            # before the reply that acknowledges the change
            write_json(self._profiles_path(), dict(cmd.profiles), indent=1)
        elif isinstance(cmd, ev.RecordEnv):
            self._env_records.put(cmd.env_id, cmd.record)  # one line, however many are open
        elif isinstance(cmd, ev.PersistEnvs):
            self._env_records.replace(cmd.envs)
        elif isinstance(cmd, ev.RunCall):
            log.info(
                "action_placed",
                action_id=cmd.action_id,
                node=cmd.node,
                service=cmd.service,
                gpus=list(cmd.gpus),
                evicts=[f"{v.service}@{v.gpu}" for v in cmd.evicted] or None,
                cause=cmd.cause,
            )
            self._spawn(self._run_call(cmd))
        elif isinstance(cmd, ev.LoadService):
            self._spawn(self._load_service(cmd))
        elif isinstance(cmd, ev.UnloadService):
            self._spawn(self._unload_service(cmd))
        else:  # pragma: no cover - a new command type without an executor is a bug
            raise TypeError(f"no executor for {cmd!r}")

    def _resolve(self, token: int, result: Any, error: tuple[str, str] | None) -> None:
        fut = self._futures.pop(token, None)
        if fut is None or fut.done():
            return
        if isinstance(fut, Later):
            if error is not None:
                fut.fail(error_from_wire(*error))
            else:
                fut.resolve(result)
        elif error is not None:
            fut.set_exception(error_from_wire(*error))
        else:
            fut.set_result(result)

    async def _create_env(self, cmd: ev.CreateEnv) -> None:
        error = None
        try:
            await self.backend.create_env(cmd.env_id, cmd.image, cmd.mem, owner=cmd.owner)
        except Exception as exc:  # backend failure of any kind is an infra error
            error = f"{type(exc).__name__}: {exc}"
            log.warning("env_create_failed", env=cmd.env_id, error=error, cause=cmd.cause)
        self.feed(ev.EnvCreated(env_id=cmd.env_id, error=error))
        if error is None:  # after the exec that waited for it is on its way
            self._log_soon(
                "env_created", env=cmd.env_id, node=cmd.node, image=cmd.image, cause=cmd.cause
            )

    async def _remove_env(self, cmd: ev.RemoveEnv) -> None:
        try:
            await self.backend.close_env(cmd.env_id)
        except Exception as exc:
            log.warning("env_remove_failed", env=cmd.env_id, error=str(exc), cause=cmd.cause)
        self.feed(ev.EnvRemoved(env_id=cmd.env_id))

    def _start_exec(self, cmd: ev.RunExec) -> None:
        """Hand an exec to the backend (``files.start_exec``: a backend with ``start_exec``
        sends it off within this call and reports its end from the loop turn that sees it;
        other backends, and execs with files to move, run in a task). Logged once, when it
        ends (``action_finished``; ``action_placed`` at debug level)."""
        trajectory = self._log_placed(cmd)
        self._running_execs[cmd.action_id] = cmd
        done = functools.partial(self._exec_ended, cmd, trajectory)
        try:
            req = self._exec_request(cmd)
        except Exception as exc:  # a malformed placement ends as an infra error
            res = ExecResult("infra_error", detail=f"{type(exc).__name__}: {exc}")
            asyncio.get_running_loop().call_soon(done, res)
            return
        start_exec(self.backend, req, done, self._spawn)

    def _log_placed(self, cmd: ev.RunExec) -> str | None:
        """``action_placed`` at debug level (its end, ``action_finished``, is the info
        line); returns the action's trajectory."""
        trajectory = self.core.read.trajectory_of(cmd.action_id)
        log.debug(
            "action_placed",
            action_id=cmd.action_id,
            node=cmd.node,
            env=cmd.env_id,
            cores=list(cmd.cores),
            trajectory=trajectory,
            cause=cmd.cause,
        )
        return trajectory

    @staticmethod
    def _exec_request(cmd: ev.RunExec) -> ExecRequest:
        return ExecRequest.for_action(
            cmd.spec,
            env_id=cmd.env_id,
            cores=cmd.cores,
            max_output=cmd.max_output,
            action_id=cmd.action_id,
            run_as=cmd.run_as,
        )

    def _exec_ended(self, cmd: ev.RunExec, trajectory: str | None, res: ExecResult) -> None:
        self._running_execs.pop(cmd.action_id, None)
        lost = res.outcome == "infra_error" and not self.backend.env_exists(cmd.env_id)
        self.feed(ev.ExecFinished(action_id=cmd.action_id, result=res, env_lost=lost))
        self._log_soon(  # after the answer, which is on its way now
            "action_finished",
            action_id=cmd.action_id,
            node=cmd.node,
            env=cmd.env_id,
            trajectory=trajectory,
            outcome=res.outcome,
            exit_code=res.exit_code,
            exec_s=round(res.exec_s, 6),
            detail=res.detail or None,
            cores=list(cmd.cores),
            cause=cmd.cause,
        )

    async def _run_transfer(self, cmd: ev.RunTransfer) -> None:
        result, error = await run_transfer(
            self.backend, cmd.env_id, cmd.direction, cmd.path, cmd.data, cmd.tar, cmd.max_bytes
        )
        log.info(
            "env_transfer",
            env=cmd.env_id,
            direction=cmd.direction,
            path=cmd.path,
            error=error[1] if error else None,
            cause=cmd.cause,
        )
        self.feed(ev.TransferDone(token=cmd.token, env_id=cmd.env_id, result=result, error=error))

    async def _start_shell(self, cmd: ev.StartShell) -> None:
        error = None
        try:
            await self.backend.open_session(cmd.env_id, cmd.session_id, run_as=cmd.run_as)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        log.info("session_opened", session=cmd.session_id, env=cmd.env_id, error=error)
        self.feed(ev.SessionOpened(session_id=cmd.session_id, error=error))

    async def _interrupt_shell(self, cmd: ev.InterruptShell) -> None:
        try:
            await self.backend.interrupt_session(cmd.session_id)
        except Exception as exc:
            log.warning("session_interrupt_failed", session=cmd.session_id, error=str(exc))

    async def _end_shell(self, cmd: ev.EndShell) -> None:
        try:
            await self.backend.close_session(cmd.session_id)
        except Exception as exc:
            log.warning("session_close_failed", session=cmd.session_id, error=str(exc))
        self.feed(ev.SessionClosed(session_id=cmd.session_id))

    # ------------------------------------------------------------------ GPU services
    async def _recover_services(self, host: ServiceHost) -> None:
        """Reload the registrations of an earlier run; one that fails to load stays
        registered (state ``failed``) and is retried on its next call."""
        try:
            errors = await host.start()
        except Exception as exc:  # an unreadable registry, a worker that cannot start
            log.error("services_not_reloaded", error=f"{type(exc).__name__}: {exc}")
            errors = {}
        for name, error in errors.items():
            log.warning("service_load_failed", service=name, error=error)
        specs = tuple(host.specs())
        if specs:
            log.info("services_reloaded", services=[s.name for s in specs])
        self.feed(ev.ServicesRecovered(specs=specs))

    async def _load_service(self, cmd: ev.LoadService) -> None:
        host = self.services
        name = cmd.spec.name
        if host is None:  # pragma: no cover - the core refuses services without GPUs
            self.feed(ev.ServiceLoaded(spec=cmd.spec, error="no GPU service host"))
            return
        try:
            info = await host.register(cmd.spec)
        except (ServiceLoadError, ValueError) as exc:
            log.warning("service_register_failed", service=name, error=str(exc), cause=cmd.cause)
            self.feed(ev.ServiceLoaded(spec=cmd.spec, error=str(exc)))
            return
        except Exception as exc:
            error = f"service {name!r}: {type(exc).__name__}: {exc}"
            log.exception("service_register_failed", service=name, cause=cmd.cause)
            self.feed(ev.ServiceLoaded(spec=cmd.spec, error=error, code="infra_error"))
            return
        log.info("service_registered", service=name, module_bytes=info.get("module_bytes"))
        self.feed(ev.ServiceLoaded(spec=cmd.spec, info=info))

    async def _unload_service(self, cmd: ev.UnloadService) -> None:
        if self.services is not None:
            try:
                await self.services.remove(cmd.name)
            except ServiceNotFound:
                pass
            except Exception:
                log.exception("service_remove_failed", service=cmd.name, cause=cmd.cause)
        log.info("service_removed", service=cmd.name, cause=cmd.cause)
        self.feed(ev.ServiceUnloaded(name=cmd.name))

    async def _run_call(self, cmd: ev.RunCall) -> None:
        """Evict, restore, call: ``ServiceHost.call`` never raises for run-time problems;
        a service removed meanwhile is ``rejected``, anything else an ``infra_error``."""
        host = self.services
        restore_s, rate, answer = 0.0, None, None
        try:
            if host is None:  # pragma: no cover - the core places calls only with GPUs
                raise RuntimeError("no GPU service host")
            restored = await host.apply(cmd.service, cmd.gpus, cmd.evicted)
            restore_s = restored.seconds
            real = not all(host.inventory.gpu(g).simulated for g in cmd.gpus)
            if restored.needed and real and restored.nbytes and restored.copy_s > 0:
                rate = restored.nbytes / restored.copy_s
            res = await host.call(cmd.service, cmd.gpus, dict(cmd.payload), cmd.timeout_s)
            outcome, answer, error = res.outcome, res.result, res.error
            exec_s, restore_s = res.exec_s, restore_s + res.restore_s
        except ServiceNotFound:
            outcome, error, exec_s = "rejected", f"service {cmd.service!r} was removed", 0.0
        except Exception as exc:
            log.exception("call_failed", action_id=cmd.action_id, service=cmd.service)
            outcome, error, exec_s = "infra_error", f"{type(exc).__name__}: {exc}", 0.0
        log.info(
            "action_finished",
            action_id=cmd.action_id,
            node=cmd.node,
            service=cmd.service,
            gpus=list(cmd.gpus),
            outcome=outcome,
            restore_s=round(restore_s, 6),
            exec_s=round(exec_s, 6),
            error=error,
            cause=cmd.cause,
        )
        self.feed(
            ev.CallFinished(
                action_id=cmd.action_id,
                outcome=outcome,
                result=answer,
                error=error,
                exec_s=exec_s,
                restore_s=restore_s,
                h2d_bytes_per_s=rate,
            )
        )

    # ------------------------------------------------------------------ profiles file
    def _profiles_path(self) -> Path:
        return self.state_dir / "profiles.json"

    def _read_profiles(self) -> dict[str, Any]:
        loaded = read_json(
            self._profiles_path(),
            "profiles_unreadable",
            lambda data: isinstance(data, dict),
            "not a JSON object",
        )
        return loaded if loaded is not None else {}

    def _read_env_records(self) -> list[dict[str, Any]]:
        """The persistent environments' records: ``envs.json`` with ``envs.journal``
        replayed over it (``records.RecordJournal``)."""
        return list(self._env_records.load().values())


def _owner(value: Any) -> tuple[int, int] | None:
    if isinstance(value, list | tuple) and len(value) == 2:
        return (int(value[0]), int(value[1]))
    return None


async def run_transfer(
    backend: Backend,
    env_id: str,
    direction: str,
    path: str,
    data: bytes,
    tar: bool,
    max_bytes: int,
) -> tuple[dict[str, Any] | None, tuple[str, str] | None]:
    """Put or get a file on ``backend``: the op's result map, or a wire error (a bad path or
    size is ``bad_request``, a missing file ``not_found``, anything else ``infra_error``).
    Shared by ``tangramd up`` and a cluster node."""
    try:
        if direction == "put":
            size = await backend.put(env_id, path, data, tar=tar)
            return {"path": path, "bytes": size}, None
        got, is_tar = await backend.get(env_id, path, max_bytes=max_bytes)
        return {"path": path, "data": got, "tar": is_tar}, None
    except BAD_TRANSFER as e:
        return None, ("bad_request", f"{path}: {e}")
    except FileNotFoundError as e:
        return None, ("not_found", f"{path}: {e.strerror or e}")
    except Exception as exc:  # any other backend failure is an infrastructure error
        return None, ("infra_error", f"{type(exc).__name__}: {exc}")


def _is_env_record(r: Any) -> bool:
    return {"id", "trajectory", "mem"} <= set(r)

"""The executor: runs the core's commands and feeds what happened back as events.

Everything with I/O lives here or below: the Unix-socket server, timers, the records that
survive a restart, the profiles file and logs. The core (``tangramd.state``) decides; the
executor only carries out and reports. Commands on environments, execs, files, shells and
services go to the executor's effects (:mod:`tangramd.run`): this host's backend in
``tangramd up`` (``LocalEffects``), the nodes in a coordinator (``RemoteEffects``); their
outcomes come back as events. Requests from clients arrive through the op handlers
(``tangramd.ops``), which turn them into events with a reply token.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import structlog

from tangram.protocol.errors import DISK_FULL, DiskFull, InfraError, UnknownOp, error_from_wire
from tangramd import events as ev
from tangramd.diskfull import DiskWatch, is_disk_full
from tangramd.lifecycle import loop_name
from tangramd.logs import log_soon
from tangramd.records import RecordJournal, read_json, write_json
from tangramd.run.effects import Effects, ServiceList
from tangramd.state import Core
from tangramd.state.jobstats import parse_job_stats
from tangramd.transport import ConnInfo, Later, UnixServer

log = structlog.get_logger("tangramd")

# Events after which units wait for a pass (an exec or call ended, a lease returned, an
# environment an exec waited for is ready): their pass runs at once, not at the turn's end.
_ENDS = frozenset({ev.ExecFinished, ev.CallFinished, ev.ReleaseLease, ev.EnvCreated})

STOP_GRACE_S = 10.0  # how long a graceful stop waits for in-flight work to report back

# The commands that write the state dir before the replies after them may go out, and the
# requests refused at once while its disk is full (each would write there).
_KEEPS = frozenset({ev.RecordEnv, ev.PersistEnvs, ev.PersistProfiles})
_WRITERS = (ev.OpenEnv, ev.ForkEnv, ev.SaveProfile)


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

    @property
    def where(self) -> str:
        """The file the records are kept in (named when its disk is full)."""
        ...


class Executor:
    """Wires one ``Core`` to its effects and a socket server (``tangramd up``; a coordinator
    is the same with remote effects and the node links)."""

    def __init__(
        self,
        core: Core,
        effects: Effects,
        socket_path: str,
        *,
        state_dir: str,
        clock: Callable[[], float] = time.monotonic,
        handlers: OpHandlers,
        env_records: EnvRecords | None = None,
        operator_uids: Iterable[int] = (),
        **server_options: Any,
    ) -> None:
        """``server_options`` go to the ``UnixServer`` (frame and connection limits, the
        peer allowlist); ``env_records`` defaults to the state dir's journal."""
        self.core = core
        self.effects = effects
        # who may run the operator-only ops, besides root and the daemon's user
        self.operator_uids = frozenset(operator_uids)
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
        # execs the effects run here, not ended: the placement and its trajectory (logged
        # with the end)
        self._placed: dict[str, tuple[ev.RunExec, str | None]] = {}
        # the persistent environments' records (default: envs.json + envs.journal)
        self._env_records: EnvRecords = env_records or RecordJournal(
            self.state_dir / "envs.json", valid=_is_env_record, problem="env_records_unreadable"
        )
        # a full disk under the state dir: writers refused at once, one log line a minute
        self.disk = DiskWatch(self.state_dir, clock)
        # TANGRAM_VALIDATE=1 (tests): check the core's invariants after every event
        self._validate = os.environ.get("TANGRAM_VALIDATE") == "1"
        effects.bind(self._reported, self._spawn)
        self._commands: dict[type, Callable[[Any], None]] = {
            ev.RunExec: self._run_exec,
            ev.CreateEnv: effects.create_env,
            ev.RemoveEnv: effects.remove_env,
            ev.RunTransfer: effects.run_transfer,
            ev.StartShell: effects.start_shell,
            ev.InterruptShell: effects.interrupt_shell,
            ev.KillExec: effects.kill_exec,
            ev.EndShell: effects.end_shell,
            ev.RunCall: effects.run_call,
            ev.StopCall: effects.stop_running_call,
            ev.WarmService: effects.warm_service,
            ev.LoadService: effects.load_service,
            ev.UnloadService: effects.unload_service,
            ev.PersistProfiles: self._persist_profiles,
            ev.PersistJobStats: self._persist_job_stats,
            ev.RecordEnv: self._record_env,
            ev.PersistEnvs: self._persist_envs,
        }

    @property
    def services(self) -> ServiceList | None:
        """The GPU services the effects run calls on (None: no GPUs here)."""
        return self.effects.services

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        """Re-adopt the persistent environments an earlier run left (the backend removes
        the rest and kills what was still running), load profiles, start serving."""
        records = self._read_env_records()
        kept = await self.effects.recover_envs(records)
        if records:
            log.info("envs_readopted", envs=[r["id"] for r in kept], lost=len(records) - len(kept))
        self.feed(ev.EnvsRecovered(envs=kept))
        self.feed(ev.ProfilesLoaded(profiles=self._read_profiles()))
        self.feed(ev.JobStatsLoaded(stats=self._read_job_stats()))
        if self.services is not None:
            self.feed(ev.ServicesRecovered(specs=await self.effects.recover_services()))
        await self.server.start()
        log.info(
            "daemon_ready",
            socket=self.socket_path,
            backend=self.effects.name,
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
        await self.effects.shutdown(keep=self.core.read.env_ids(persistent_only=True))
        deadline = self.clock() + STOP_GRACE_S
        while (
            self._tasks or self.effects.in_flight() or self.core.read.env_ids(throwaway_only=True)
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
            {**row, "backend": self.effects.name, "heartbeat_age_s": 0.0}
            for row in self.core.read.node_rows()
        ]

    def join_info(self, rotate: bool) -> dict[str, Any]:
        """``cluster.join``: only a coordinator has a cluster to join."""
        raise UnknownOp("cluster.join is served by `tangramd coordinator`, not `tangramd up`")

    # ------------------------------------------------------------------ event loop glue
    def feed(self, event: ev.Event) -> None:
        if self.disk.full and isinstance(event, _WRITERS):
            refusal = self.disk.refusal()
            if refusal is not None:  # (back off: the disk is not tried until a probe)
                if event.token is not None:
                    self._resolve(event.token, None, (DISK_FULL, refusal.message))
                return
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
        unkept: DiskFull | None = None  # a change that could not be written
        try:
            for cmd in commands:
                if isinstance(cmd, ev.Reply):
                    replies.append(cmd)
                elif type(cmd) in _KEEPS:
                    try:
                        self._execute(cmd)
                    except Exception as exc:
                        if not is_disk_full(exc):
                            raise
                        unkept = self._unkept(event, cmd, exc)
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
                if unkept is not None and reply.error is None:  # it would acknowledge it
                    self._resolve(reply.token, None, (DISK_FULL, unkept.message))
                else:
                    self._resolve(reply.token, reply.result, reply.error)

    def _unkept(self, event: ev.Event, cmd: ev.Command, exc: BaseException) -> DiskFull:
        """A record the state dir's disk had no room for: the error the replies of this
        event get instead of their results; a new environment that could not be recorded
        is closed again (a restart would not know it)."""
        if isinstance(cmd, ev.RecordEnv):
            gone = cmd.record is None
            what = f"the {'removal' if gone else 'record'} of environment {cmd.env_id}"
            error = self.disk.failed(what, exc, self._env_records.where)
            if not gone and isinstance(event, ev.EnvCreated):
                close = ev.CloseEnv(env_id=cmd.env_id)
                asyncio.get_running_loop().call_soon(self.feed, close)
            return error
        if isinstance(cmd, ev.PersistEnvs):
            return self.disk.failed("the environments' records", exc, self._env_records.where)
        if isinstance(cmd, ev.PersistProfiles) and cmd.changed is not None:
            # the file keeps the profiles as they were: so does the core (its answer fails)
            name, previous = cmd.changed
            asyncio.get_running_loop().call_soon(self.feed, ev.ProfileUnsaved(name, previous))
        return self.disk.failed("the profiles", exc, str(self._profiles_path()))

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

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ commands
    def _execute(self, cmd: ev.Command) -> None:
        if isinstance(cmd, ev.Reply):
            self._resolve(cmd.token, cmd.result, cmd.error)
            return
        run = self._commands.get(type(cmd))
        if run is None:  # pragma: no cover - a new command type without an executor is a bug
            raise TypeError(f"no executor for {cmd!r}")
        run(cmd)

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

    def _run_exec(self, cmd: ev.RunExec) -> None:
        """Hand a placement to the effects (sending never waits: no task, and no turn of
        the loop, stands between the pass and the backend or the node). Logged once, when
        it ends (``action_finished``; ``action_placed`` at debug level)."""
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
        if self.effects.runs_execs_here:  # (else no end is reported here to pop it)
            self._placed[cmd.action_id] = (cmd, trajectory)
        self.effects.run_exec(cmd)

    def _reported(self, event: ev.Event) -> None:
        """An outcome the effects report: fed to the core; an exec's end is logged after
        its answer, which is on its way then."""
        self.feed(event)
        if isinstance(event, ev.ExecFinished):
            placed = self._placed.pop(event.action_id, None)
            if placed is not None:
                cmd, trajectory = placed
                res = event.result
                log_soon(
                    log,
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

    def _persist_profiles(self, cmd: ev.PersistProfiles) -> None:
        # before the reply that acknowledges the change
        write_json(self._profiles_path(), dict(cmd.profiles), indent=1)

    def save_job_stats(self) -> None:
        """Write the jobs' ACT statistics now if they changed since the last save (a
        coordinator's stop, which feeds the core no ``Shutdown``)."""
        if self.core.job_stats.dirty:
            self._persist_job_stats(ev.PersistJobStats(stats=self.core.read.job_stats()))

    def _persist_job_stats(self, cmd: ev.PersistJobStats) -> None:
        """Write the jobs' ACT statistics; no reply waits for them, so a write that fails
        (a full disk: counted by ``self.disk`` as any other) is logged and dropped, never
        raised (the next change writes them whole again)."""
        path = self._job_stats_path()
        if self.disk.full and self.disk.refusal() is not None:
            return
        try:
            write_json(path, dict(cmd.stats))
        except Exception as exc:
            if is_disk_full(exc):
                self.disk.failed("the jobs' ACT statistics", exc, str(path))
            else:
                log.warning("job_stats_unwritable", path=str(path), error=str(exc))

    def _record_env(self, cmd: ev.RecordEnv) -> None:
        self._env_records.put(cmd.env_id, cmd.record)  # one line, however many are open

    def _persist_envs(self, cmd: ev.PersistEnvs) -> None:
        self._env_records.replace(cmd.envs)

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

    def _job_stats_path(self) -> Path:
        return self.state_dir / "job_stats.json"

    def _read_job_stats(self) -> dict[str, Any]:
        """What ``job_stats.json`` kept ({} when missing; unreadable or ill-shaped: logged
        as ``job_stats_unreadable``, and the stats start fresh)."""
        loaded = read_json(
            self._job_stats_path(),
            "job_stats_unreadable",
            parse_job_stats,
            "not the jobs' ACT statistics (tangramd.state.jobstats, version 1)",
        )
        return loaded if loaded is not None else {}

    def _read_env_records(self) -> list[dict[str, Any]]:
        """The persistent environments' records: ``envs.json`` with ``envs.journal``
        replayed over it (``records.RecordJournal``)."""
        return list(self._env_records.load().values())


def _is_env_record(r: Any) -> bool:
    return {"id", "trajectory", "mem"} <= set(r)

"""Commands carried out on this host: its execution backend (environments, execs, file
transfers, shell sessions) and its GPU service host (loads, unloads, calls).

``tangramd up`` and every cluster node use this one class: the all-in-one executor reports
its events to its core, a node turns them into link messages for the coordinator.
"""

from __future__ import annotations

import asyncio
import functools
import tarfile
from typing import Any

import msgpack
import structlog

from tangram.protocol.codec import DEFAULT_MAX_FRAME
from tangram.protocol.results import ExecResult
from tangramd import events as ev
from tangramd.backends.base import Backend, ExecRequest, PathEscape
from tangramd.backends.files import NotAFile, TooLarge, start_exec
from tangramd.logs import log_soon
from tangramd.run.effects import Report, Spawn
from tangramd.services import ServiceHost, ServiceLoadError, ServiceNotFound

log = structlog.get_logger("tangramd")


class _StoppedEarly(Exception):
    """A call stopped (``stop_call``, a cancel) before its handler ran."""


# what a put or get refuses as the caller's mistake (a bad path, size, kind or tar stream)
BAD_TRANSFER = (
    PathEscape, TooLarge, NotAFile, IsADirectoryError, NotADirectoryError, tarfile.TarError
)  # fmt: skip


KILL_TRIES = 600  # a cancel waits up to a minute for its exec to reach the backend
KILL_RETRY_S = 0.1
# what a call's response carries besides the handler's answer (outcome, times, GPUs, ...)
ANSWER_HEADROOM = 64 << 10


def _unbound(event: ev.Event) -> None:  # pragma: no cover - bind() comes first
    raise RuntimeError("LocalEffects used before bind()")


class LocalEffects:
    """The :class:`~tangramd.run.effects.Effects` of one host (see the module doc)."""

    def __init__(
        self,
        backend: Backend,
        services: ServiceHost | None = None,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
    ) -> None:
        self.backend = backend
        self.services = services  # the host's GPU service host (None: no GPUs)
        self.max_frame = max_frame  # a response's limit (``daemon.max_frame_bytes``)
        self.name = backend.name
        self.runs_execs_here = True
        self._report: Report = _unbound
        self._spawn: Spawn = _unbound  # type: ignore[assignment]
        self._running: set[str] = set()  # execs handed to the backend, not reported yet
        self._forking: dict[str, list[ev.CreateEnv]] = {}  # source -> children this turn
        # GPU calls under way (each call of a batch -> its RunCall), the batches told to
        # stop (their leaders) and what a stop waits on (a batch's end)
        self._calls_on: dict[str, ev.RunCall] = {}
        self._stopped: dict[str, str] = {}  # leader -> why its calls end
        self._call_ended: dict[str, asyncio.Event] = {}

    def bind(self, report: Report, spawn: Spawn) -> None:
        """Where outcomes go (``report``) and how background work is started (``spawn``)."""
        self._report, self._spawn = report, spawn

    def in_flight(self) -> int:
        return len(self._running)

    # ------------------------------------------------------------------ life cycle
    async def recover_envs(self, records: list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
        keep = {str(r["id"]): owner_of(r.get("owner")) for r in records}
        for what in await self.backend.reconcile(keep):
            log.info("reconciled", detail=what)
        return tuple(r for r in records if self.backend.env_exists(str(r["id"])))

    async def shutdown(self, keep: list[str]) -> None:
        if self.services is not None:  # running calls end infra_error; registrations stay
            await self.services.close()
        await self.backend.shutdown(keep=keep)

    # ------------------------------------------------------------------ environments
    def create_env(self, cmd: ev.CreateEnv) -> None:
        if cmd.fork_of is not None:  # the children of one env.fork come in one turn:
            batch = self._forking.setdefault(cmd.fork_of, [])  # forked by one backend call
            batch.append(cmd)
            if len(batch) == 1:
                self._spawn(self._fork_envs(cmd.fork_of))
            return
        self._spawn(self._create_env(cmd))

    async def _fork_envs(self, src: str) -> None:
        """One ``fork_env`` for the children of ``src`` asked for in the same turn (one
        snapshot of the source: a Docker commit, or one overlay layer)."""
        cmds = self._forking.pop(src, [])
        error = None
        try:
            fork = getattr(self.backend, "fork_env", None)
            if fork is None:
                raise RuntimeError(f"the {self.backend.name} backend cannot fork")
            await fork(src, [cmd.env_id for cmd in cmds])
        except Exception as exc:  # backend failure of any kind is an infra error
            error = f"{type(exc).__name__}: {exc}"
            log.warning("env_fork_failed", env=src, error=error, cause=cmds[0].cause)
        for cmd in cmds:
            self._report(ev.EnvCreated(env_id=cmd.env_id, error=error))
        if error is None:
            log_soon(log, "env_forked", env=src, children=[c.env_id for c in cmds])

    async def _create_env(self, cmd: ev.CreateEnv) -> None:
        error = None
        try:
            await self.backend.create_env(cmd.env_id, cmd.image, cmd.mem, owner=cmd.owner)
        except Exception as exc:  # backend failure of any kind is an infra error
            error = f"{type(exc).__name__}: {exc}"
            log.warning(
                "env_create_failed", node=cmd.node, env=cmd.env_id, error=error, cause=cmd.cause
            )
        self._report(ev.EnvCreated(env_id=cmd.env_id, error=error))
        if error is None:  # after the exec that waited for it is on its way
            log_soon(
                log, "env_created", env=cmd.env_id, node=cmd.node, image=cmd.image, cause=cmd.cause
            )

    def remove_env(self, cmd: ev.RemoveEnv) -> None:
        self._spawn(self._remove_env(cmd))

    async def _remove_env(self, cmd: ev.RemoveEnv) -> None:
        try:
            await self.backend.close_env(cmd.env_id)
        except Exception as exc:
            log.warning(
                "env_remove_failed", node=cmd.node, env=cmd.env_id, error=str(exc), cause=cmd.cause
            )
        self._report(ev.EnvRemoved(env_id=cmd.env_id))

    # ------------------------------------------------------------------ execs
    def run_exec(self, cmd: ev.RunExec) -> None:
        """Hand an exec to the backend (``files.start_exec``: a backend with ``start_exec``
        sends it off within this call and reports its end from the loop turn that sees it;
        other backends, and execs with files to move, run in a task)."""
        self._running.add(cmd.action_id)
        done = functools.partial(self._exec_ended, cmd)
        try:
            req = ExecRequest.for_action(
                cmd.spec,
                env_id=cmd.env_id,
                cores=cmd.cores,
                max_output=cmd.max_output,
                action_id=cmd.action_id,
                run_as=cmd.run_as,
            )
        except Exception as exc:  # a malformed placement ends as an infra error
            res = ExecResult("infra_error", detail=f"{type(exc).__name__}: {exc}")
            asyncio.get_running_loop().call_soon(done, res)
            return
        start_exec(self.backend, req, done, self._spawn)

    def _exec_ended(self, cmd: ev.RunExec, res: ExecResult) -> None:
        self._running.discard(cmd.action_id)
        lost = res.outcome == "infra_error" and not self.backend.env_exists(cmd.env_id)
        self._report(ev.ExecFinished(action_id=cmd.action_id, result=res, env_lost=lost))

    def kill_exec(self, cmd: ev.KillExec) -> None:
        """``cancel`` of a running exec: the backend kills it and what it started (an exec
        in a shell session is interrupted); its end is reported as any exec's."""
        self._spawn(self._kill_exec(cmd))

    async def _kill_exec(self, cmd: ev.KillExec) -> None:
        # the exec may not have reached the backend yet (its files are being written):
        # try again until the backend has it or it has ended
        for _ in range(KILL_TRIES):
            if cmd.action_id not in self._running:
                return
            try:
                if cmd.session is not None:
                    found = await self.backend.interrupt_session(cmd.session)
                else:
                    found = await self.backend.cancel(cmd.action_id)
            except Exception as exc:
                log.warning(
                    "exec_kill_failed", node=cmd.node, action_id=cmd.action_id, error=str(exc)
                )
                return
            if found:
                log.info("exec_killed", node=cmd.node, action_id=cmd.action_id, cause=cmd.cause)
                return
            await asyncio.sleep(KILL_RETRY_S)
        log.warning("exec_kill_gave_up", node=cmd.node, action_id=cmd.action_id)

    # ------------------------------------------------------------------ files
    def run_transfer(self, cmd: ev.RunTransfer) -> None:
        self._spawn(self._run_transfer(cmd))

    async def _run_transfer(self, cmd: ev.RunTransfer) -> None:
        result, error = await transfer(
            self.backend, cmd.env_id, cmd.direction, cmd.path, cmd.data, cmd.tar, cmd.max_bytes
        )
        log.info(
            "env_transfer",
            node=cmd.node,
            env=cmd.env_id,
            direction=cmd.direction,
            path=cmd.path,
            error=error[1] if error else None,
            cause=cmd.cause,
        )
        self._report(
            ev.TransferDone(token=cmd.token, env_id=cmd.env_id, result=result, error=error)
        )

    # ------------------------------------------------------------------ shell sessions
    def start_shell(self, cmd: ev.StartShell) -> None:
        self._spawn(self._start_shell(cmd))

    async def _start_shell(self, cmd: ev.StartShell) -> None:
        error = None
        try:
            await self.backend.open_session(cmd.env_id, cmd.session_id, run_as=cmd.run_as)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        log.info(
            "session_opened", node=cmd.node, session=cmd.session_id, env=cmd.env_id, error=error
        )
        self._report(ev.SessionOpened(session_id=cmd.session_id, error=error))

    def interrupt_shell(self, cmd: ev.InterruptShell) -> None:
        self._spawn(self._interrupt_shell(cmd))

    async def _interrupt_shell(self, cmd: ev.InterruptShell) -> None:
        try:
            await self.backend.interrupt_session(cmd.session_id)
        except Exception as exc:
            log.warning(
                "session_interrupt_failed", node=cmd.node, session=cmd.session_id, error=str(exc)
            )

    def end_shell(self, cmd: ev.EndShell) -> None:
        self._spawn(self._end_shell(cmd))

    async def _end_shell(self, cmd: ev.EndShell) -> None:
        try:
            await self.backend.close_session(cmd.session_id)
        except Exception as exc:
            log.warning(
                "session_close_failed", node=cmd.node, session=cmd.session_id, error=str(exc)
            )
        self._report(ev.SessionClosed(session_id=cmd.session_id))

    # ------------------------------------------------------------------ GPU services
    async def recover_services(self) -> tuple[Any, ...]:
        """Reload the registrations of an earlier run; one that fails to load stays
        registered (state ``failed``) and is retried on its next call. Returns the specs."""
        host = self.services
        if host is None:
            return ()
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
        return specs

    def load_service(self, cmd: ev.LoadService) -> None:
        self._spawn(self._load_service(cmd))

    async def _load_service(self, cmd: ev.LoadService) -> None:
        host = self.services
        name = cmd.spec.name
        if host is None:  # pragma: no cover - the core refuses services without GPUs
            self._report(ev.ServiceLoaded(spec=cmd.spec, error="no GPU service host"))
            return
        try:
            info = await host.register(cmd.spec)
        except (ServiceLoadError, ValueError) as exc:
            log.warning("service_register_failed", service=name, error=str(exc), cause=cmd.cause)
            self._report(ev.ServiceLoaded(spec=cmd.spec, error=str(exc)))
            return
        except Exception as exc:
            error = f"service {name!r}: {type(exc).__name__}: {exc}"
            log.exception("service_register_failed", service=name, cause=cmd.cause)
            self._report(ev.ServiceLoaded(spec=cmd.spec, error=error, code="infra_error"))
            return
        log.info("service_registered", service=name, module_bytes=info.get("module_bytes"))
        self._report(ev.ServiceLoaded(spec=cmd.spec, info=info))

    def unload_service(self, cmd: ev.UnloadService) -> None:
        self._spawn(self._unload_service(cmd))

    async def _unload_service(self, cmd: ev.UnloadService) -> None:
        if self.services is not None:
            try:
                await self.services.remove(cmd.name)
            except ServiceNotFound:
                pass
            except Exception:
                log.exception("service_remove_failed", service=cmd.name, cause=cmd.cause)
        log.info("service_removed", service=cmd.name, cause=cmd.cause)
        self._report(ev.ServiceUnloaded(name=cmd.name))

    def run_call(self, cmd: ev.RunCall) -> None:
        log.info(
            "action_placed",
            action_id=cmd.action_id,
            node=cmd.node,
            service=cmd.service,
            gpus=list(cmd.gpus),
            evicts=[f"{v.service}@{v.gpu}" for v in cmd.evicted] or None,
            cause=cmd.cause,
        )
        for aid in [cmd.action_id, *(aid for aid, _ in cmd.riders)]:
            self._calls_on[aid] = cmd
        self._spawn(self._run_call(cmd))

    def stop_running_call(self, cmd: ev.StopCall) -> None:
        """``cancel`` of a running call: its pass is stopped as :meth:`stop_call` stops
        one (the replica's workers killed, its next call restarts it); its calls'
        ``CallFinished`` come once that is done (the core ends them ``cancelled``)."""
        log.info("call_stopping", action_id=cmd.action_id, node=cmd.node, cause=cmd.cause)
        why = "cancelled: stopped while running (the replica's workers were killed)"

        async def stop() -> None:
            await self.stop_call(cmd.action_id, why)

        self._spawn(stop())

    async def stop_call(
        self, action_id: str, why: str = "stopped: the coordinator gave up on the call"
    ) -> bool:
        """Stop the batch that runs call ``action_id`` (a rider's or its leader's), as a
        call past its timeout is stopped: the replica's workers are killed (its next call
        restarts it) and the calls end ``infra_error``. Returns once the batch has ended
        and its replica holds nothing; False when no such call runs here."""
        cmd = self._calls_on.get(action_id)
        if cmd is None or self.services is None:
            return False
        ended = self._call_ended.setdefault(cmd.action_id, asyncio.Event())
        self._stopped.setdefault(cmd.action_id, why)
        await self.services.stop(cmd.service, cmd.gpus)  # (the pass in flight ends now)
        await ended.wait()
        return True

    def warm_service(self, cmd: ev.WarmService) -> None:
        log.info("service_warming", service=cmd.service, gpus=list(cmd.gpus), cause=cmd.cause)
        self._spawn(self._warm_service(cmd))

    async def _warm_service(self, cmd: ev.WarmService) -> None:
        """The restore of a ``min_resident`` replica (first: ``apply`` claims the chunk
        before any command after this one can evict it)."""
        host = self.services
        try:
            if host is None:  # pragma: no cover - the core warms only with GPUs
                raise RuntimeError("no GPU service host")
            restored = await host.apply(cmd.service, cmd.gpus)
        except ServiceNotFound:
            return  # removed meanwhile
        except Exception as exc:  # its next call restarts it (the pool believes it resident)
            error = f"{type(exc).__name__}: {exc}"
            log.warning("service_warm_failed", service=cmd.service, error=error, cause=cmd.cause)
            return
        log.info(
            "service_warmed",
            service=cmd.service,
            gpus=list(cmd.gpus),
            restore_s=round(restored.seconds, 6),
            cause=cmd.cause,
        )

    async def _run_call(self, cmd: ev.RunCall) -> None:
        """Evict, restore, call (with its riders, as one batch): ``ServiceHost.call_batch``
        never raises for run-time problems; a service removed meanwhile is ``rejected``,
        anything else an ``infra_error``. Each call of the batch is reported on its own,
        the riders first (the call that holds the GPUs releases them last)."""
        host = self.services
        calls = [(cmd.action_id, cmd.payload), *cmd.riders]
        restore_s, rate = 0.0, None
        ended: list[tuple[str, dict[str, Any] | None, str | None, float]]
        try:
            if host is None:  # pragma: no cover - the core places calls only with GPUs
                raise RuntimeError("no GPU service host")
            restored = await host.apply(cmd.service, cmd.gpus, cmd.evicted)
            restore_s = restored.seconds
            real = not all(host.inventory.gpu(g).simulated for g in cmd.gpus)
            if restored.needed and real and restored.nbytes and restored.copy_s > 0:
                # per GPU, as the pool's estimate is: a k-GPU replica's k workers copy
                # their shards at once (copy_s is the slowest one's)
                rate = restored.nbytes / restored.copy_s / len(cmd.gpus)
            if cmd.action_id in self._stopped:  # stopped while it restored: ended below
                raise _StoppedEarly
            payloads = [dict(payload) for _, payload in calls]
            results = await host.call_batch(cmd.service, cmd.gpus, payloads, cmd.timeout_s)
            restore_s += results[0].restore_s
            ended = []
            for res in results:
                outcome, answer, error = res.outcome, res.result, res.error
                if outcome == "ok" and (too_big := self._oversized(answer)) is not None:
                    outcome, answer, error = "failed", None, too_big
                ended.append((outcome, answer, error, res.exec_s))
        except ServiceNotFound:
            ended = [("rejected", None, f"service {cmd.service!r} was removed", 0.0)] * len(calls)
        except _StoppedEarly:
            ended = []  # (the stop's verdict, below)
        except Exception as exc:
            if cmd.action_id in self._stopped:  # the stop cut its restore short: no fault
                log.info("call_stopped_in_restore", action_id=cmd.action_id, error=str(exc))
            else:
                log.exception("call_failed", action_id=cmd.action_id, service=cmd.service)
            ended = [("infra_error", None, f"{type(exc).__name__}: {exc}", 0.0)] * len(calls)
        if cmd.action_id in self._stopped:  # (stop_call: the coordinator gave up, a cancel)
            if host is not None:  # whatever it restored meanwhile holds nothing either
                await host.stop(cmd.service, cmd.gpus)
            why = self._stopped.pop(cmd.action_id)
            ended = [("infra_error", None, why, 0.0)] * len(calls)
        for aid, _ in calls:
            self._calls_on.pop(aid, None)
        done = self._call_ended.pop(cmd.action_id, None)
        if done is not None:
            done.set()
        finished = list(zip(calls, ended, strict=True))
        for (action_id, _), (outcome, answer, error, exec_s) in [*finished[1:], finished[0]]:
            log.info(
                "action_finished",
                action_id=action_id,
                node=cmd.node,
                service=cmd.service,
                gpus=list(cmd.gpus),
                outcome=outcome,
                restore_s=round(restore_s, 6),
                exec_s=round(exec_s, 6),
                batch=len(calls),
                error=error,
                cause=cmd.cause,
            )
            self._report(
                ev.CallFinished(
                    action_id=action_id,
                    outcome=outcome,
                    result=answer,
                    error=error,
                    exec_s=exec_s,
                    restore_s=restore_s,
                    h2d_bytes_per_s=rate if action_id == cmd.action_id else None,
                    batch=len(calls),
                )
            )

    def _oversized(self, answer: Any) -> str | None:
        """Why a handler's answer cannot reach its caller (it is larger than a response may
        be): the call fails naming its size and the limit; None when it fits."""
        limit = self.max_frame - ANSWER_HEADROOM
        try:
            size = len(msgpack.packb(answer, use_bin_type=True))
        except (TypeError, ValueError, OverflowError) as exc:
            return f"the service's answer cannot be sent: {exc}"
        if size <= limit:
            return None
        return (
            f"the service's answer is {size} bytes, more than the limit of {limit} bytes"
            f" (daemon.max_frame_bytes = {self.max_frame}, less {ANSWER_HEADROOM} for the"
            " rest of the response)"
        )


async def transfer(
    backend: Backend,
    env_id: str,
    direction: str,
    path: str,
    data: bytes,
    tar: bool,
    max_bytes: int,
) -> tuple[dict[str, Any] | None, tuple[str, str] | None]:
    """Put or get a file on ``backend``: the op's result map, or a wire error (a bad path or
    size is ``bad_request``, a missing file ``not_found``, anything else ``infra_error``)."""
    try:
        if direction == "put":
            size = await backend.put(env_id, path, data, tar=tar)
            return {"path": path, "bytes": size}, None
        if direction == "reset":
            reset = getattr(backend, "reset_env", None)
            if reset is None:
                return None, ("bad_request", f"the {backend.name} backend cannot reset")
            await reset(env_id)
            return {"id": env_id, "reset": True}, None
        got, is_tar = await backend.get(env_id, path, max_bytes=max_bytes)
        return {"path": path, "data": got, "tar": is_tar}, None
    except BAD_TRANSFER as e:
        return None, ("bad_request", f"{path}: {e}")
    except FileNotFoundError as e:
        return None, ("not_found", f"{path}: {e.strerror or e}")
    except Exception as exc:  # any other backend failure is an infrastructure error
        return None, ("infra_error", f"{type(exc).__name__}: {exc}")


def owner_of(value: Any) -> tuple[int, int] | None:
    """A record's or a message's ``[uid, gid]`` as a pair (None: none or malformed)."""
    if isinstance(value, list | tuple) and len(value) == 2:
        try:
            return (int(value[0]), int(value[1]))
        except (TypeError, ValueError):
            return None
    return None

"""``tangramd node``: one host's executor and client socket in a cluster.

The node has no core: the coordinator decides. It

- joins over TLS after checking the coordinator's CA against the pinned hash (see
  :mod:`tangramd.cluster.pki`), with the join token the first time and with the
  credential the coordinator then issued (kept in ``<state_dir>/node.json``) afterwards;
- reports its capacity (cores by NUMA node, memory, GPUs from NVML or the simulated
  inventory of ``[gpu]``) and heartbeats;
- carries out ``create_env`` / ``remove_env`` / ``run_exec`` on its local backend and
  reports each outcome until the coordinator acknowledges it (an outcome that finishes
  while the link is down is sent when it is back);
- with GPUs, runs the coordinator's GPU services on its own ``ServiceHost``: it loads the
  registrations the coordinator sends (``load_service``, and all of them with its
  ``welcome``), carries out the gpu pool's plans (``run_call``: evict, restore, call;
  ``warm_service``) and reports each call (``call_done``) and its services' rows
  (``services_state``, what ``service list`` shows of this node);
- serves the client protocol on its Unix socket by forwarding every request to the
  coordinator, so ``Client``, ``AsyncClient`` and ``tangramctl`` work unchanged;
- reconnects with backoff when the link drops, and when the coordinator has been silent
  for the heartbeat timeout;
- keeps the stdin and files of its clients' execs bound elsewhere (above
  ``PULL_MIN_BYTES``) and serves them on its input port (TLS, a fresh self-signed key per
  start, its pin told to the coordinator) to the node the exec is placed on, which pulls
  them with the exec's one-time ticket: they go node to node, never through the
  coordinator;
- records the environments it holds in ``<state_dir>/envs.json`` (one journal line per
  change: ``records.RecordJournal``), so that after a crash
  and restart it re-adopts them (the coordinator keeps those it still gives the node: all
  of them when the node is back within the heartbeat timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import functools
import itertools
import json
import random
import secrets
import ssl
import time
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, NamedTuple

import structlog

from tangram.pools.gpu import Eviction
from tangram.protocol.codec import FrameError, encode
from tangram.protocol.errors import BadRequest, InfraError, error_from_wire
from tangram.protocol.link import (
    EXEC_INPUT,
    PEER_MESSAGES,
    PULL_MIN_BYTES,
    PULL_REQUEST_MAX,
    check_message,
    make_message,
    make_peer_message,
)
from tangram.protocol.ops import MAX_TRANSFER
from tangram.protocol.results import (
    MAX_FILES_BYTES,
    ExecResult,
    ExecSpec,
    cancelled,
    check_env_path,
)
from tangram.version import __version__
from tangramd import events as ev
from tangramd.backends.base import Backend
from tangramd.cluster.link import DEFER_S, Link, LinkClosed, is_loopback, split_host_port
from tangramd.cluster.pki import (
    CertInvalid,
    PinMismatch,
    cert_sha256,
    client_context,
    input_port_context,
    verify_server,
)
from tangramd.lifecycle import loop_name
from tangramd.logs import log_soon
from tangramd.records import RecordJournal, write_json
from tangramd.run.local import LocalEffects, owner_of
from tangramd.services import ServiceHost, ServiceLoadError, ServiceNotFound
from tangramd.services.inventory import Gpu
from tangramd.services.spec import ServiceSpec
from tangramd.transport import ConnInfo, Later, UnixServer

log = structlog.get_logger("tangramd")

CONNECT_TIMEOUT_S = 10.0
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0
PULL_TIMEOUT_S = 30.0  # the most a pull of an exec's input may take, either end
# A connection to another node's input port is kept for the next pull (no new TLS
# handshake); the holder closes one idle this long, the puller reuses one idle half as long.
PULL_IDLE_S = 60.0
PULL_IDLE_KEPT = 2  # idle connections kept per input port
PULL_CONNS_MAX = 64  # connections to this node's input port at once; more are closed at once


class JoinFailed(Exception):
    """The node cannot join and retrying will not help (wrong pin, wrong token)."""


class NodeAgent:
    """The node daemon (see the module doc)."""

    def __init__(
        self,
        *,
        name: str,
        coordinator: tuple[str, int],
        token: str | None,
        ca_sha256: str | None,
        insecure: bool,
        backend: Backend,
        socket_path: str,
        state_dir: str,
        cores_by_numa: tuple[tuple[int, ...], ...],
        mem_bytes: int,
        gpus: tuple[Gpu, ...] = (),
        services: ServiceHost | None = None,
        clock: Callable[[], float] = time.monotonic,
        **server_options: Any,
    ) -> None:
        """``server_options`` go to the local ``UnixServer`` (limits, peer allowlist);
        ``services``: the host of the GPU services on ``gpus`` (None: no GPUs)."""
        self.name = name
        self.coordinator = coordinator
        self.token = token
        self.pin = ca_sha256
        self.insecure = insecure
        self.backend = backend
        self.socket_path = socket_path
        self.state_path = Path(state_dir) / "node.json"
        self.envs_path = Path(state_dir) / "envs.json"  # environments held, for a restart
        self._records = RecordJournal(
            self.envs_path, valid=lambda row: True, problem="envs_record_unreadable"
        )
        self.cores_by_numa = cores_by_numa
        self.mem_bytes = mem_bytes
        self.gpus = gpus
        self.max_frame = int(server_options.get("max_frame", 16 << 20))
        self.clock = clock
        self.server = UnixServer(
            socket_path, self._forward, sync_handler=self._forward_later, **server_options
        )
        self.link: Link | None = None
        self.failed: str | None = None  # why the node gave up joining
        self.gave_up = asyncio.Event()
        self.heartbeat_s = 1.0
        self.heartbeat_timeout_s = 10.0
        self._last_rx = 0.0
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any] | Later] = {}  # requests forwarded
        self._held: dict[int, dict[str, Any]] = {}  # forwarded execs' args: their input
        # the input port: what other nodes may pull (ticket -> request id, and back)
        self.state_dir = Path(state_dir)
        self.input_addr: str | None = None  # host:port, once open
        self.input_pin: str | None = None  # its certificate's pin (None: plain TCP)
        self._input_server: asyncio.base_events.Server | None = None
        self._input_conns: set[asyncio.StreamWriter] = set()
        self._offers: dict[str, int] = {}
        self._tickets: dict[int, str] = {}
        self._pulls: dict[str, asyncio.Task[None]] = {}  # action id: the pull of its input
        # connections to other nodes' input ports, idle: (host, port, pin) -> (link, since)
        self._idle: dict[tuple[str, int, str | None], list[tuple[Link, float]]] = {}
        self._closing = False  # the input port is closing: no connection is kept
        self._watched: set[int] = set()
        self._outbox: dict[str, dict[str, Any]] = {}  # outcomes not yet acknowledged
        self._envs: set[str] = set()
        self._owners: dict[str, tuple[int, int] | None] = {}  # of the environments held
        self._creating: dict[str, tuple[int, int] | None] = {}  # env id: its owner
        # execs handed to the effects, not ended: env, cores and the client to answer
        self._running: dict[str, tuple[str, tuple[int, ...], Any]] = {}
        self._cancelling: set[str] = set()  # of those, the ones a `cancel_exec` kills
        self._started: list[str] = []  # of those, not yet said started (`exec_started`)
        self._started_timer: asyncio.TimerHandle | None = None
        self._transfers: dict[int, str] = {}  # transfers under way: token -> the link's tid
        # shell sessions here (opening or open): session id -> its environment
        self._sessions: dict[str, str] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        # GPU services: the last load or removal of each (a call waits for it), the calls
        # handed to the effects and not ended (leaders and riders), and the rows last told
        self.host = services
        self._service_ops: dict[str, asyncio.Task[None]] = {}
        self._calls: set[str] = set()
        self._stop_waiting: set[str] = set()  # calls told to stop before they started
        self._told: list[dict[str, Any]] | None = None
        self._tell_soon: asyncio.Handle | None = None
        # what the coordinator asks is carried out as tangramd up does it (LocalEffects);
        # each outcome becomes a link message (_outcome)
        self.effects = LocalEffects(backend, services, max_frame=self.max_frame)
        self.effects.bind(self._outcome, self._spawn)

    @property
    def addr(self) -> str:
        return f"{self.coordinator[0]}:{self.coordinator[1]}"

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        """Re-adopt the environments an earlier run of this node held (``envs.json``; the
        backend removes the rest and kills what was still running), then join: the hello
        lists them and the coordinator's welcome says which it still gives this node."""
        records = self._read_envs()
        for what in await self.backend.reconcile(records):
            log.info("reconciled", detail=what)
        self._owners = {e: o for e, o in records.items() if self.backend.env_exists(e)}
        self._envs = set(self._owners)
        if records:
            log.info("envs_readopted", node=self.name, envs=sorted(self._envs))
            try:
                self._records.replace(_row(e, o) for e, o in self._owners.items())
            except OSError as exc:
                log.warning("envs_record_not_written", path=str(self.envs_path), error=str(exc))
        await self.server.start()
        self._loop_task = asyncio.get_running_loop().create_task(self._run_link())
        log.info(
            "node_started",
            node=self.name,
            socket=self.socket_path,
            coordinator=self.addr,
            cores=sum(len(n) for n in self.cores_by_numa),
            backend=self.backend.name,
            event_loop=loop_name(),
        )

    async def stop(self) -> None:
        """End running execs, remove environments, say goodbye, stop serving."""
        await self._close_input_port()
        await self.effects.shutdown(keep=[])
        deadline = self.clock() + 5.0
        while self.effects.in_flight() and self.clock() < deadline:
            await asyncio.sleep(0.01)
        for env_id in list(self._envs):
            await self._close_env_quietly(env_id)
        link = self.link
        if link is not None:
            link.send(make_message("bye"))
            with contextlib.suppress(LinkClosed, TimeoutError):
                await asyncio.wait_for(link.drain(), 1.0)
        await self._end_link_loop()
        self._link_down()
        await self.server.close(grace_s=0.5)
        log.info("node_stopped", node=self.name)

    async def abort(self) -> None:
        """Stop at once as a SIGKILL would, for the in-process test cluster: no goodbye,
        the link reset, the socket closed; the backend's commands, environments and
        ``envs.json`` are left as they are (a restarted node reconciles them)."""
        await self._end_link_loop()  # its end resets the link
        if self.link is not None:
            self.link.abort()
        self._link_down()
        await self._close_input_port()
        await self.server.close()
        log.info("node_aborted", node=self.name)

    async def _end_link_loop(self) -> None:
        """Cancel the link's loop until it has ended: Python 3.11's ``wait_for`` can swallow
        a cancellation that meets its inner dial's end, and the loop would dial on."""
        task = self._loop_task
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.1)

    # ------------------------------------------------------------------ the link
    async def _run_link(self) -> None:
        backoff = BACKOFF_MIN_S
        while True:
            try:
                link = await self._connect()
                try:
                    await self._join(link)
                    backoff = BACKOFF_MIN_S
                    await self._serve(link)
                finally:
                    self._link_down()
                    link.abort()
            except JoinFailed as exc:
                self.failed = str(exc)
                log.error("join_failed", node=self.name, coordinator=self.addr, reason=str(exc))
                self.gave_up.set()
                return
            except (OSError, LinkClosed, FrameError, TimeoutError, ssl.SSLError) as exc:
                log.warning(
                    "coordinator_unreachable",
                    node=self.name,
                    coordinator=self.addr,
                    error=str(exc) or type(exc).__name__,
                    retry_s=round(backoff, 2),
                )
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _connect(self) -> Link:
        host, port = self.coordinator
        tls = None if self.insecure else client_context()
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=tls, limit=1 << 20), self._patience()
        )
        if self._input_server is None:
            # on the address this host reaches the coordinator from: other nodes reach
            # the coordinator, so they can most likely reach this one there
            local = writer.get_extra_info("sockname")
            if isinstance(local, tuple):
                await self._open_input_port(str(local[0]))
        return Link(reader, writer, max_frame=self.max_frame)

    async def _join(self, link: Link) -> None:
        first = await asyncio.wait_for(link.recv(), self._patience())
        if first.get("t") != "ca" or not isinstance(first.get("pem"), str):
            raise LinkClosed("the coordinator did not present its CA")
        if not self.insecure:
            der = link.peer_cert_der()
            if der is None or self.pin is None:
                raise JoinFailed("no TLS certificate to check against --ca-sha256")
            try:
                verify_server(
                    first["pem"].encode(), der, self.pin, datetime.datetime.now(datetime.UTC)
                )
            except (PinMismatch, CertInvalid, ValueError) as exc:  # ValueError: unparsable
                # no secret goes out, only why: so the coordinator's log says it too
                link.send(make_message("reject", reason=str(exc)))
                with contextlib.suppress(LinkClosed, TimeoutError):
                    await asyncio.wait_for(link.drain(), 1.0)
                raise JoinFailed(str(exc)) from None
        # Only now, with the coordinator verified, do secrets go on the wire.
        hello = make_message(
            "hello",
            name=self.name,
            version=__version__,
            cores_by_numa=[list(n) for n in self.cores_by_numa],
            mem_bytes=self.mem_bytes,
            gpus=[
                {
                    "name": g.name,
                    "mem_bytes": g.mem_bytes,
                    "h2d_bytes_per_s": g.h2d_bytes_per_s,
                    "simulated": g.simulated,
                }
                for g in self.gpus
            ],
            backend=self.backend.name,
            envs=sorted(self._envs),
            running=sorted(self._running) + sorted(self._calls),
            outbox=list(self._outbox),
            credential=self._stored_credential(),
            token=self.token or None,
            input_addr=self.input_addr,
            input_pin=self.input_pin,
        )
        link.send(hello)
        answer = await asyncio.wait_for(link.recv(), self._patience())
        if answer.get("t") == "refused":
            reason = str(answer.get("reason", "no reason given"))
            if answer.get("retry"):
                raise LinkClosed(f"refused for now: {reason}")
            raise JoinFailed(f"coordinator {self.addr} refused the join: {reason}")
        if answer.get("t") != "welcome":
            raise LinkClosed(f"expected welcome, got {str(answer.get('t'))[:40]!r}")
        if isinstance(answer.get("credential"), str):
            self._store_credential(answer["credential"])
        self.heartbeat_s = _positive(answer.get("heartbeat_s"), 1.0)
        self.heartbeat_timeout_s = _positive(answer.get("heartbeat_timeout_s"), 10.0)
        keep = {k for k in answer.get("keep", []) if isinstance(k, str)}
        for action_id in answer.get("cancel", []):
            if isinstance(action_id, str) and action_id in self._running:
                self._spawn(self._cancel(action_id))
        for env_id in sorted(self._envs - keep):
            log.info("env_not_owned_removed", node=self.name, env=env_id)
            self._remove_env(env_id)
        if isinstance(answer.get("services"), list):
            self._sync_services(answer["services"], reset=answer.get("services_reset") is True)
        self._told = None  # (the coordinator hears this node's rows afresh)
        log.info("node_joined", node=self.name, coordinator=self.addr, keep=len(keep))

    async def _serve(self, link: Link) -> None:
        self.link = link
        self._last_rx = self.clock()
        for msg in list(self._outbox.values()):
            link.send(msg)
        beat = asyncio.get_running_loop().create_task(self._heartbeat(link))
        try:
            while True:
                msg = await link.recv()
                self._last_rx = self.clock()
                self._on_message(msg)
        finally:
            beat.cancel()

    async def _heartbeat(self, link: Link) -> None:
        while not link.closed:
            silent = self.clock() - self._last_rx
            if silent > self.heartbeat_timeout_s:
                log.warning("coordinator_silent", node=self.name, silent_s=round(silent, 2))
                link.abort()
                return
            link.send(make_message("hb"))
            self._tell_services()  # (what changed with no message: a warm-up, a crash)
            await asyncio.sleep(self.heartbeat_s)

    def _patience(self) -> float:
        """How long a dial or join step may take: a silent coordinator is retried as soon
        as it would count as lost."""
        return min(CONNECT_TIMEOUT_S, self.heartbeat_timeout_s)

    def _link_down(self) -> None:
        if self.link is not None:
            log.warning("coordinator_link_down", node=self.name, coordinator=self.addr)
        self.link = None
        self._watched.clear()
        self._held.clear()  # (a pull of what it held is answered gone)
        self._offers.clear()
        self._tickets.clear()
        pending, self._pending = self._pending, {}
        for owed in pending.values():
            if not owed.done():
                owed.set_exception(
                    InfraError(f"node {self.name}: link to the coordinator {self.addr} dropped")
                )

    def _on_message(self, msg: dict[str, Any]) -> None:
        """One message from the coordinator, to its handler (:attr:`RECEIVES`); an unknown
        or malformed one is logged and dropped."""
        kind = msg.get("t")
        handler = RECEIVES.get(kind) if isinstance(kind, str) else None
        if handler is None:
            log.warning("coordinator_message_unknown", kind=str(kind)[:40])
            return
        try:
            handler(self, msg)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("coordinator_message_bad", kind=str(kind)[:40], error=str(exc))

    def _on_hb(self, msg: dict[str, Any]) -> None:
        """A heartbeat: its arrival (``_last_rx``) is all it says."""

    def _on_ack(self, msg: dict[str, Any]) -> None:
        self._outbox.pop(str(msg["key"]), None)

    # A handler reads what it needs before it hands the command to the effects: a
    # malformed message is logged by _on_message, not lost in a task.

    def _on_create_env(self, msg: dict[str, Any]) -> None:
        env_id, image, mem = str(msg["env_id"]), msg.get("image"), msg.get("mem")
        owner = owner_of(msg.get("owner"))
        self._creating[env_id] = owner
        self.effects.create_env(
            ev.CreateEnv(
                env_id=env_id,
                node=self.name,
                image=image if isinstance(image, str) else None,
                mem=mem if isinstance(mem, int) and not isinstance(mem, bool) else None,
                owner=owner,
            )
        )

    def _on_remove_env(self, msg: dict[str, Any]) -> None:
        self._remove_env(str(msg["env_id"]))

    def _remove_env(self, env_id: str) -> None:
        self._forget_env(env_id)
        self.effects.remove_env(ev.RemoveEnv(env_id=env_id, node=self.name))

    def _on_transfer(self, msg: dict[str, Any]) -> None:
        tid = str(msg["tid"])
        data = msg.get("data") or b""
        held = msg.get("held")
        if isinstance(held, int) and not isinstance(held, bool):
            args = self._release(held)
            if args is None:  # never put an empty file in its place
                error = ["infra_error", "the put's data is no longer held on this node"]
                self._report(make_message("transfer_done", key=f"t:{tid}", tid=tid, error=error))
                return
            data = args["data"]
        try:
            fetch = _fetch_of(msg.get("fetch"))
        except (KeyError, TypeError, ValueError) as exc:
            error = ["infra_error", f"malformed fetch: {str(exc)[:200]}"]
            self._report(make_message("transfer_done", key=f"t:{tid}", tid=tid, error=error))
            return
        cmd = ev.RunTransfer(
            token=next(self._ids),
            env_id=str(msg["env_id"]),
            node=self.name,
            direction=str(msg["direction"]),
            path=str(msg["path"]),
            data=data if isinstance(data, bytes) else b"",
            tar=bool(msg.get("tar")),
            max_bytes=int(msg["max_bytes"]),
        )
        assert cmd.token is not None
        if fetch is not None:  # its data is on another node: pull it first
            key = f"t:{tid}"
            task = asyncio.get_running_loop().create_task(self._pull_then_put(tid, cmd, fetch))
            self._pulls[key] = task
            task.add_done_callback(lambda _: self._pulls.pop(key, None))
            return
        self._transfers[cmd.token] = tid
        self.effects.run_transfer(cmd)

    async def _pull_then_put(self, tid: str, cmd: ev.RunTransfer, fetch: _Fetch) -> None:
        """Pull a put's data from the node that kept it, then write it; if it cannot be
        had, the transfer fails ``infra_error`` (never an empty file)."""
        why = "cancelled before its data arrived"
        try:
            data = (await asyncio.wait_for(self._pull(fetch), PULL_TIMEOUT_S)).get("data")
            if not isinstance(data, bytes) or not data:
                raise LookupError(f"node {fetch.node} sent no data")
        except asyncio.CancelledError:
            self._put_missing(tid, fetch, why)
            raise
        except Exception as exc:
            self._put_missing(tid, fetch, str(exc) or type(exc).__name__)
            return
        assert cmd.token is not None
        self._transfers[cmd.token] = tid
        self.effects.run_transfer(dataclasses.replace(cmd, data=data))

    def _put_missing(self, tid: str, fetch: _Fetch, why: str) -> None:
        log.warning("input_pull_failed", node=self.name, transfer=tid, holder=fetch.node, why=why)
        detail = f"the put's data could not be pulled from node {fetch.node}: {why}"
        error = ["infra_error", detail[:500]]
        self._report(make_message("transfer_done", key=f"t:{tid}", tid=tid, error=error))

    def _on_open_session(self, msg: dict[str, Any]) -> None:
        cmd = ev.StartShell(
            session_id=str(msg["session_id"]),
            env_id=str(msg["env_id"]),
            node=self.name,
            run_as=owner_of(msg.get("run_as")),
        )
        self._sessions[cmd.session_id] = cmd.env_id
        self.effects.start_shell(cmd)

    def _on_cancel_exec(self, msg: dict[str, Any]) -> None:
        """A client's ``cancel`` of an exec running here: kill it; its end is reported
        (and answered, when this node answers its client) as ``cancelled``."""
        action_id = str(msg["action_id"])
        if action_id not in self._running:
            return  # it has ended: its exec_done is on its way
        self._cancelling.add(action_id)
        pull = self._pulls.get(action_id)
        if pull is not None:  # its input is still being pulled: it never starts
            pull.cancel()
            return
        session = msg.get("session")
        self.effects.kill_exec(
            ev.KillExec(
                action_id=action_id,
                node=self.name,
                session=session if isinstance(session, str) else None,
            )
        )

    def _on_interrupt_session(self, msg: dict[str, Any]) -> None:
        self.effects.interrupt_shell(
            ev.InterruptShell(session_id=str(msg["session_id"]), node=self.name)
        )

    def _on_close_session(self, msg: dict[str, Any]) -> None:
        self.effects.end_shell(ev.EndShell(session_id=str(msg["session_id"]), node=self.name))

    def _report(self, msg: dict[str, Any]) -> None:
        """Send an outcome now if the link is up; keep it (by its ``key``) until
        acknowledged."""
        self._outbox[msg["key"]] = msg
        if self.link is not None:
            self.link.send(msg)

    # ------------------------------------------------------------------ outcomes
    def _outcome(self, event: ev.Event) -> None:
        """What the effects report becomes the coordinator's message (kept until acked)."""
        if isinstance(event, ev.ExecFinished):
            self._exec_ended(event)
        elif isinstance(event, ev.EnvCreated):
            owner = self._creating.pop(event.env_id, None)
            if event.error is None:
                self._envs.add(event.env_id)
                self._owners[event.env_id] = owner
                self._record_env(event.env_id, _row(event.env_id, owner))
            key = f"c:{event.env_id}"
            self._report(
                make_message("env_created", key=key, env_id=event.env_id, error=event.error)
            )
        elif isinstance(event, ev.EnvRemoved):
            key = f"r:{event.env_id}"
            self._report(make_message("env_removed", key=key, env_id=event.env_id))
        elif isinstance(event, ev.TransferDone):
            tid = self._transfers.pop(event.token or 0, None)
            if tid is not None:
                error = list(event.error) if event.error else None
                result = event.result
                msg = make_message(
                    "transfer_done", key=f"t:{tid}", tid=tid, result=result, error=error
                )
                self._report(msg)
        elif isinstance(event, ev.SessionOpened):
            sid = event.session_id
            if event.error is not None:
                self._sessions.pop(sid, None)
            self._report(
                make_message("session_opened", key=f"so:{sid}", session_id=sid, error=event.error)
            )
        elif isinstance(event, ev.SessionClosed):
            sid = event.session_id
            self._sessions.pop(sid, None)
            self._report(make_message("session_closed", key=f"sc:{sid}", session_id=sid))
        elif isinstance(event, ev.CallFinished):
            self._call_done(event)
        else:  # pragma: no cover - loads and removals are the node's own (_load, _unload)
            log.warning("node_outcome_unexpected", node=self.name, event=type(event).__name__)

    async def _cancel(self, action_id: str) -> None:
        """Kill an exec the coordinator has already ended (its outcome is ignored there)."""
        pull = self._pulls.get(action_id)
        if pull is not None:  # it has not started: it never will
            pull.cancel()
            return
        try:
            found = await self.backend.cancel(action_id)
        except Exception as exc:
            log.warning("exec_cancel_failed", node=self.name, action_id=action_id, error=str(exc))
            return
        log.info("exec_cancelled", node=self.name, action_id=action_id, was_running=found)

    def _forget_env(self, env_id: str) -> None:
        self._envs.discard(env_id)
        for sid in [s for s, env in self._sessions.items() if env == env_id]:
            del self._sessions[sid]  # its shells go with it
        if self._owners.pop(env_id, False) is not False:
            self._record_env(env_id, None)

    async def _close_env_quietly(self, env_id: str) -> None:
        """Remove an environment at stop, with no outcome to report."""
        self._forget_env(env_id)
        try:
            await self.backend.close_env(env_id)
        except Exception as exc:
            log.warning("env_remove_failed", node=self.name, env=env_id, error=str(exc))

    def _start_exec(self, msg: dict[str, Any]) -> None:
        """Hand a placement to the effects, as the all-in-one executor does."""
        action_id = str(msg["action_id"])
        env_id = str(msg.get("env_id"))
        try:
            cores = tuple(int(c) for c in msg["cores"])
        except (KeyError, TypeError, ValueError):
            cores = ()
        self._running[action_id] = (env_id, cores, msg.get("reply"))
        self._say_started(action_id)
        try:
            cmd = ev.RunExec(
                action_id=action_id,
                env_id=env_id,
                node=self.name,
                cores=cores,
                spec=self._exec_spec(msg),
                max_output=int(msg["max_output"]),
                run_as=owner_of(msg.get("run_as")),
            )
            fetch = _fetch_of(msg.get("fetch"))
        except Exception as exc:  # a malformed placement ends as an infra error
            res = ExecResult("infra_error", detail=f"{type(exc).__name__}: {exc}")
            self._exec_ended(ev.ExecFinished(action_id=action_id, result=res))
            return
        if fetch is None:
            self.effects.run_exec(cmd)
            return
        task = asyncio.get_running_loop().create_task(self._pull_then_run(cmd, fetch))
        self._pulls[action_id] = task
        task.add_done_callback(lambda _: self._pulls.pop(action_id, None))

    def _say_started(self, action_id: str) -> None:
        """The coordinator learns that the exec started (its deadline turns into its run
        bound): in one ``exec_started`` for those of the next ``DEFER_S``, less those that
        ended meanwhile (their ``exec_done`` says it), so a short exec costs no message."""
        self._started.append(action_id)
        if self._started_timer is None:
            loop = asyncio.get_running_loop()
            self._started_timer = loop.call_later(DEFER_S, self._send_started)

    def _send_started(self) -> None:
        self._started_timer = None
        ids = [a for a in self._started if a in self._running]
        self._started.clear()
        if ids and self.link is not None:  # (after a drop, the hello's `running` says it)
            self.link.send(make_message("exec_started", action_ids=ids))

    async def _pull_then_run(self, cmd: ev.RunExec, fetch: _Fetch) -> None:
        """Pull a placed exec's stdin and files from the node that kept them, then run it;
        if they cannot be had (that node is gone, its link dropped, the pull timed out or
        was cancelled) the exec ends ``infra_error``: it never runs without them."""
        try:
            got = await asyncio.wait_for(self._pull(fetch), PULL_TIMEOUT_S)
            spec = dataclasses.replace(cmd.spec, stdin=got.get("stdin"), files=got.get("files"))
        except asyncio.CancelledError:
            self._input_missing(cmd, fetch, "cancelled before its input arrived")
            raise
        except Exception as exc:
            self._input_missing(cmd, fetch, str(exc) or type(exc).__name__)
            return
        if cmd.action_id in self._running:
            self.effects.run_exec(dataclasses.replace(cmd, spec=spec))

    def _input_missing(self, cmd: ev.RunExec, fetch: _Fetch, why: str) -> None:
        log.warning(
            "input_pull_failed", node=self.name, action_id=cmd.action_id, holder=fetch.node, why=why
        )
        if cmd.action_id in self._running:
            detail = f"its stdin and files could not be pulled from node {fetch.node}: {why}"
            res = ExecResult("infra_error", detail=detail[:500])
            self._exec_ended(ev.ExecFinished(action_id=cmd.action_id, result=res))

    async def _pull(self, fetch: _Fetch) -> dict[str, Any]:
        """One pull from ``fetch.node``'s input port: its certificate checked against the
        pin the coordinator relayed, the ticket sent, the ``input`` message (checked in
        full) received; LookupError with the holder's reason when it has none."""
        if fetch.pin is None and not (self.insecure and is_loopback(fetch.host)):
            raise CertInvalid(f"no pin for node {fetch.node}'s input port: plain TCP refused")
        port = (fetch.host, fetch.port, fetch.pin)
        link = self._idle_link(port)
        answer: dict[str, Any] | None = None
        if link is not None:  # the holder may have closed it meanwhile: then a new one
            with contextlib.suppress(LinkClosed, OSError, ssl.SSLError):
                answer = await self._ask(link, fetch.ticket)
        if answer is None:
            link = await self._dial_input_port(fetch)
            answer = await self._ask(link, fetch.ticket)
        assert link is not None
        try:
            kind = check_message(answer, PEER_MESSAGES).name
        except BadRequest:
            link.abort()
            raise
        if kind not in ("input", "gone"):
            link.abort()
            raise BadRequest(f"node {fetch.node} answered a pull with {kind!r}")
        self._keep_idle(port, link)
        if kind == "gone":
            raise LookupError(f"node {fetch.node}: {str(answer['reason'])[:200]}")
        return answer

    async def _dial_input_port(self, fetch: _Fetch) -> Link:
        """A new connection to ``fetch.node``'s input port, its TLS key checked."""
        tls = client_context() if fetch.pin is not None else None
        reader, writer = await asyncio.open_connection(
            fetch.host, fetch.port, ssl=tls, limit=1 << 20
        )
        link = Link(reader, writer, max_frame=self.max_frame)
        if fetch.pin is not None:
            der = link.peer_cert_der()
            if der is None or cert_sha256(der) != fetch.pin:
                link.abort()
                raise CertInvalid(f"node {fetch.node}'s input port is not the one pinned")
        return link

    @staticmethod
    async def _ask(link: Link, ticket: str) -> dict[str, Any]:
        """One pull on ``link``; any failure (or cancellation) ends the link: an answer
        that came later would be taken for the next pull's."""
        try:
            link.send(make_peer_message("pull", ticket=ticket))
            return await link.recv()
        except BaseException:
            link.abort()
            raise

    def _idle_link(self, port: tuple[str, int, str | None]) -> Link | None:
        """A kept connection to an input port, idle for less than half the holder's
        patience (an older one is closed); None if there is none."""
        idle = self._idle.get(port, [])
        while idle:
            link, since = idle.pop()
            if not link.closed and self.clock() - since < PULL_IDLE_S / 2:
                return link
            link.abort()
        self._idle.pop(port, None)
        return None

    def _keep_idle(self, port: tuple[str, int, str | None], link: Link) -> None:
        idle = self._idle.setdefault(port, [])
        if self._closing or len(idle) >= PULL_IDLE_KEPT:
            link.abort()  # (stopping, or enough kept)
        else:
            idle.append((link, self.clock()))

    def _exec_spec(self, msg: dict[str, Any]) -> ExecSpec:
        """A placement's spec; its stdin and files from the request this node forwarded
        when the coordinator left them out (``held``: they crossed the link once)."""
        spec = msg["spec"]
        if msg.get("held") is True:
            args = self._release(int(msg["reply"]["id"]))
            if args is None:
                raise LookupError("the exec's stdin and files are no longer held here")
            spec = {**spec, **{k: args[k] for k in EXEC_INPUT if args.get(k) is not None}}
        return ExecSpec.from_wire(spec)

    def _exec_ended(self, done: ev.ExecFinished) -> None:
        action_id, res = done.action_id, done.result
        env_id, cores, reply = self._running.pop(action_id, ("", (), None))
        if action_id in self._cancelling:
            self._cancelling.discard(action_id)
            res = cancelled(res, "cancelled: killed while running")
        answered = self._answer_exec(reply, action_id, cores, res)
        # after the answer, before this turn ends: the coordinator has the outcome before
        # whatever that client sends next reaches it over the same link
        self._report(
            make_message(
                "exec_done",
                key=f"x:{action_id}",
                action_id=action_id,
                result=res.to_wire(),
                env_lost=done.env_lost,
                answered=answered,
            )
        )
        log_soon(  # after the outcome, which is on its way
            log,
            "action_finished",
            node=self.name,
            action_id=action_id,
            env=env_id,
            outcome=res.outcome,
            exec_s=round(res.exec_s, 6),
            cores=list(cores),
            answered=answered,  # this node answered its client (else the coordinator)
        )

    def _answer_exec(
        self, reply: Any, action_id: str, cores: tuple[int, ...], res: ExecResult
    ) -> bool:
        """Answer the client whose request this exec is, when the coordinator said so
        (``reply``) and it still waits: the core's answer, built from the same facts."""
        if not isinstance(reply, dict):
            return False
        try:
            request_id, queue_s = int(reply["id"]), float(reply["queue_s"])
        except (KeyError, TypeError, ValueError):
            return False
        owed = self._pending.pop(request_id, None)
        self._release(request_id)
        if owed is None or owed.done():
            return False
        final = res.placed(action_id=action_id, queue_s=queue_s, cores=cores, node=self.name)
        if isinstance(owed, Later):
            owed.resolve(final.to_wire())
        else:
            owed.set_result(final.to_wire())
        return True

    # ------------------------------------------------------------------ GPU services
    # The registrations are the coordinator's: this node loads what it is sent (with
    # ``persist=False``: nothing of them is kept here, the welcome brings them back). The
    # loads and removals of one service run in turn, and a call or warm-up of a service
    # waits for the one under way (a node that just joined gets its calls right after the
    # welcome whose loads it is still making).

    def _on_load_service(self, msg: dict[str, Any]) -> None:
        raw = msg["spec"]
        try:
            spec = ServiceSpec.from_json(raw)
        except (ValueError, TypeError) as exc:  # (SpecError is a ValueError)
            name = raw.get("name") if isinstance(raw, dict) else None
            if not isinstance(name, str) or not name:
                raise
            error = f"service {name!r}: {exc}"
            self._report(make_message("service_loaded", key=f"sl:{name}", name=name, error=error))
            return
        self._in_turn(spec.name, lambda: self._load(spec, answer=True))

    def _on_unload_service(self, msg: dict[str, Any]) -> None:
        name = str(msg["name"])
        self._in_turn(name, lambda: self._unload(name, answer=True))

    def _sync_services(self, raw: list[Any], *, reset: bool) -> None:
        """The welcome's services: load each (one held under another spec is removed
        first), remove the others; ``reset``: the coordinator forgot this node's
        residency, so every replica still resident is evicted."""
        if self.host is None:
            return
        specs: dict[str, ServiceSpec] = {}
        for item in raw:
            try:
                spec = ServiceSpec.from_json(item)
            except (ValueError, TypeError) as exc:
                log.warning("service_spec_bad", node=self.name, error=str(exc)[:300])
                continue
            specs[spec.name] = spec
        for known in self.host.specs():
            if known.name not in specs:
                self._in_turn(known.name, functools.partial(self._unload, known.name))
        for spec in specs.values():
            self._in_turn(spec.name, functools.partial(self._load, spec, reset=reset))

    def _in_turn(self, name: str, step: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``step()`` once the load or removal of ``name`` under way has ended."""
        before = self._service_ops.get(name)

        async def after() -> None:
            if before is not None and not before.done():
                await asyncio.wait({before})
            await step()

        task = asyncio.get_running_loop().create_task(after())
        self._service_ops[name] = task
        self._tasks.add(task)

        def done(_: asyncio.Task[None]) -> None:
            self._tasks.discard(task)
            if self._service_ops.get(name) is task:
                del self._service_ops[name]

        task.add_done_callback(done)

    def _when_ready(self, name: str, go: Callable[[], None]) -> None:
        """``go()`` now, or once the load or removal of ``name`` under way has ended."""
        pending = self._service_ops.get(name)
        if pending is None:
            go()
        else:
            pending.add_done_callback(lambda _: go())

    async def _load(self, spec: ServiceSpec, *, answer: bool = False, reset: bool = False) -> None:
        """Register ``spec`` on the host; one that fails to load stays registered here
        (``failed``, retried by its next call, as after a restart of ``tangramd up``);
        ``answer``: say how it went (``service_loaded``)."""
        host = self.host
        assert host is not None, "load_service goes to nodes with GPUs"
        error, code, info = None, "bad_request", None
        try:
            known = next((s for s in host.specs() if s.name == spec.name), None)
            if known is not None and dataclasses.replace(known, eff=spec.eff) != spec:
                await host.remove(spec.name)  # registered afresh while this node was away
            # (a new eff alone, service.set_eff, is kept by register as it is)
            elif known is not None and reset:
                await self._evict_all(host, spec.name)
            info = await host.register(spec, persist=False)
        except (ServiceLoadError, ValueError) as exc:
            error = str(exc)
        except Exception as exc:  # the host failed, not the service
            error, code = f"service {spec.name!r}: {type(exc).__name__}: {exc}", "infra_error"
            log.exception("service_register_failed", node=self.name, service=spec.name)
        if error is None:
            log.info("service_registered", node=self.name, service=spec.name)
        else:
            log.warning("service_load_failed", node=self.name, service=spec.name, error=error)
        if answer:
            key = f"sl:{spec.name}"
            msg = make_message(
                "service_loaded",
                key=key,
                name=spec.name,
                info=info,
                error=error,
                code=code if error is not None else None,
            )
            self._report(msg)
        self._tell_services(soon=True)

    @staticmethod
    async def _evict_all(host: ServiceHost, name: str) -> None:
        for row in host.list():
            if row["name"] != name:
                continue
            for replica in row["replicas"]:
                if replica["state"] == "resident" and replica["gpus"]:
                    await host.evict(name, replica["gpus"])

    async def _unload(self, name: str, *, answer: bool = False) -> None:
        """Remove ``name`` from the host (its calls end ``rejected``); ``answer``: say so
        (``service_unloaded``)."""
        assert self.host is not None, "unload_service goes to nodes with GPUs"
        try:
            await self.host.remove(name)
        except ServiceNotFound:
            pass
        except Exception:
            log.exception("service_remove_failed", node=self.name, service=name)
        log.info("service_removed", node=self.name, service=name)
        if answer:
            self._report(make_message("service_unloaded", key=f"su:{name}", name=name))
        self._tell_services(soon=True)

    def _on_run_call(self, msg: dict[str, Any]) -> None:
        """A placed call (and its riders): run once its service is loaded here."""
        action_id = str(msg["action_id"])
        try:
            riders = tuple((str(aid), dict(payload)) for aid, payload in msg.get("riders") or ())
            cmd = ev.RunCall(
                action_id=action_id,
                service=str(msg["name"]),
                node=self.name,
                gpus=tuple(int(g) for g in msg["gpus"]),
                evicted=tuple(Eviction(int(g), str(s), int(d)) for g, s, d in msg["evicted"]),
                payload=dict(msg["payload"]),
                timeout_s=float(msg["timeout_s"]),
                riders=riders,
            )
        except (KeyError, TypeError, ValueError) as exc:  # no call hangs on a bad message
            why = f"malformed run_call: {str(exc)[:200]}"
            self._call_done(ev.CallFinished(action_id, outcome="infra_error", error=why))
            raise
        self._calls.update([action_id, *(aid for aid, _ in riders)])
        self._when_ready(cmd.service, lambda: self._run_call(cmd))

    def _on_stop_call(self, msg: dict[str, Any]) -> None:
        """The coordinator gave up on a call (its deadline): stop it as ``tangramd up``
        stops a call past its timeout, then say so (``call_stopped``, with what it was)."""
        self._spawn(self._stop_call(str(msg["action_id"])))

    async def _stop_call(self, action_id: str) -> None:
        was = "ended"
        if action_id in self._calls:
            if await self.effects.stop_call(action_id):
                was = "running"  # its workers are gone; its call_done went first
            elif action_id in self._calls:  # waiting for its service's load: never runs
                self._stop_waiting.add(action_id)
                was = "waiting"
        log.warning("call_stopped", node=self.name, action_id=action_id, was=was)
        self._report(
            make_message("call_stopped", key=f"cs:{action_id}", action_id=action_id, was=was)
        )

    def _run_call(self, cmd: ev.RunCall) -> None:
        batch_ids = [*(aid for aid, _ in cmd.riders), cmd.action_id]
        if self._stop_waiting.intersection(batch_ids):  # told to stop before it started
            self._stop_waiting.difference_update(batch_ids)
            why = "stopped before it started: the coordinator gave up on the call"
            for aid in batch_ids:
                self._call_done(
                    ev.CallFinished(aid, outcome="infra_error", error=why, batch=len(batch_ids))
                )
            return
        if self.host is None or cmd.service not in {s.name for s in self.host.specs()}:
            why = f"service {cmd.service!r} is not loaded on node {self.name}"
            batch = 1 + len(cmd.riders)
            for aid in [*(aid for aid, _ in cmd.riders), cmd.action_id]:
                self._call_done(ev.CallFinished(aid, outcome="infra_error", error=why, batch=batch))
            return
        self.effects.run_call(cmd)
        self._tell_services(soon=True)

    def _on_warm_service(self, msg: dict[str, Any]) -> None:
        cmd = ev.WarmService(
            service=str(msg["name"]), node=self.name, gpus=tuple(int(g) for g in msg["gpus"])
        )
        self._when_ready(cmd.service, lambda: self.effects.warm_service(cmd))

    def _call_done(self, done: ev.CallFinished) -> None:
        self._calls.discard(done.action_id)
        self._report(
            make_message(
                "call_done",
                key=f"cd:{done.action_id}",
                action_id=done.action_id,
                outcome=done.outcome,
                result=None if done.result is None else dict(done.result),
                error=done.error,
                exec_s=done.exec_s,
                restore_s=done.restore_s,
                h2d_bytes_per_s=done.h2d_bytes_per_s,
                batch=done.batch,
            )
        )
        self._tell_services(soon=True)

    def _tell_services(self, *, soon: bool = False) -> None:
        """Send the services' rows if they changed since last told: at the end of this
        loop turn (``soon``: after the outcomes of the turn), or now."""
        if self.host is None:
            return
        if soon:
            if self._tell_soon is None:
                self._tell_soon = asyncio.get_running_loop().call_soon(self._tell_services)
            return
        self._tell_soon = None
        rows = self.host.list()
        if rows != self._told and self.link is not None:
            self.link.send(make_message("services_state", services=rows))
            self._told = rows

    # ------------------------------------------------------------------ client requests
    def _forward_later(self, op: str, args: dict[str, Any], conn: ConnInfo) -> Later:
        """Every client op goes to the coordinator; the socket's inline path: no task, the
        coordinator's answer (or error) is written to the client in the loop turn that
        reads it."""
        later = Later()
        self._send_request(op, args, conn, later)
        return later

    async def _forward(self, op: str, args: dict[str, Any], conn: ConnInfo) -> Any:
        """As :meth:`_forward_later`, for the socket's task path (a slow reader)."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        request_id = self._send_request(op, args, conn, fut)
        try:
            return await fut
        finally:
            self._pending.pop(request_id, None)

    def _send_request(
        self, op: str, args: dict[str, Any], conn: ConnInfo, owed: asyncio.Future[Any] | Later
    ) -> int:
        link = self.link
        if link is None:
            raise InfraError(f"node {self.name}: not connected to the coordinator {self.addr}")
        if conn.id not in self._watched:
            self._watched.add(conn.id)
            conn.on_close(self._conn_closed)
        request_id = next(self._ids)
        self._pending[request_id] = owed
        # an exec's input is kept until its placement or answer: if it runs here, the
        # coordinator need not send it back (run_exec's held); if its environment is here,
        # it can run nowhere else, and the input does not cross the link at all (withheld)
        holds = (
            op == "exec"
            and isinstance(args, dict)
            and any(args.get(k) is not None for k in EXEC_INPUT)
        )
        withheld = holds and (
            args.get("env") in self._envs or args.get("session") in self._sessions
        )
        ticket = None
        if holds and not withheld and self.input_addr is not None:
            # bound elsewhere: a large input stays here too, for the node it is placed on
            # to pull (run_exec's fetch); invalid input goes on, for the coordinator to refuse
            size = _input_size(args)
            if size is not None and size >= PULL_MIN_BYTES:
                ticket = secrets.token_urlsafe(32)
                self._offers[ticket] = request_id
                self._tickets[request_id] = ticket
                withheld = True
        if holds:
            self._held[request_id] = args
        if withheld:
            args = {k: v for k, v in args.items() if k not in EXEC_INPUT}
        elif (  # a put into an environment here: its data stays here (transfer's held)
            op == "env.put"
            and isinstance(args, dict)
            and isinstance(args.get("data"), bytes)
            and args["data"]
            and (
                args.get("id") in self._envs
                or (  # elsewhere, a large one too, for that node to pull (transfer's fetch)
                    self.input_addr is not None
                    and PULL_MIN_BYTES <= len(args["data"]) <= MAX_TRANSFER
                )
            )
        ):
            if args.get("id") not in self._envs:
                ticket = secrets.token_urlsafe(32)
                self._offers[ticket] = request_id
                self._tickets[request_id] = ticket
            self._held[request_id] = args
            args = {**args, "data": b""}
            holds = withheld = True
        msg = make_message(
            "req",
            id=request_id,
            conn=conn.id,
            op=op,
            args=args,
            peer=list(conn.peer) if conn.peer is not None else None,
            held=True if holds else None,
            withheld=True if withheld else None,
            ticket=ticket,
        )
        link.send(msg)
        return request_id

    def _release(self, request_id: int) -> dict[str, Any] | None:
        """Forget a forwarded request's kept input (and its ticket): the args, or None."""
        ticket = self._tickets.pop(request_id, None)
        if ticket is not None:
            self._offers.pop(ticket, None)
        return self._held.pop(request_id, None)

    # ------------------------------------------------------------------ the input port
    async def _open_input_port(self, host: str) -> None:
        """Listen for other nodes' pulls on ``host`` (any free port); without it, every
        input goes with its request, as before (logged)."""
        try:
            if self.insecure:
                tls, pin = None, None
            else:
                tls, pin = input_port_context(self.state_dir / "input-port")
            server = await asyncio.start_server(
                self._serve_pull,
                host,
                0,
                ssl=tls,
                ssl_handshake_timeout=PULL_TIMEOUT_S if tls is not None else None,
                limit=PULL_REQUEST_MAX,
            )
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.warning("input_port_not_opened", node=self.name, host=host, error=str(exc))
            return
        self._input_server = server
        port = server.sockets[0].getsockname()[1]
        self.input_addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.input_pin = pin
        log.info("input_port_open", node=self.name, addr=self.input_addr, tls=tls is not None)

    async def _close_input_port(self) -> None:
        self._closing = True
        pulls = list(self._pulls.values())
        for task in pulls:
            task.cancel()
        if pulls:
            await asyncio.wait(pulls, timeout=1.0)
        server, self._input_server = self._input_server, None
        if server is not None:
            server.close()
        for writer in list(self._input_conns):
            writer.transport.abort()
        idle, self._idle = self._idle, {}
        for links in idle.values():
            for link, _ in links:
                link.abort()
        if server is not None:
            with contextlib.suppress(OSError, TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 1.0)

    async def _serve_pull(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Pulls on one connection: read a ``pull`` (a few bytes: the first within
        ``PULL_TIMEOUT_S``, the next within ``PULL_IDLE_S``), answer ``input`` once per
        ticket, else ``gone``; after a malformed one, close. Nothing a peer sends here
        ends more than its own connection."""
        if len(self._input_conns) >= PULL_CONNS_MAX:  # a flood ends here, not in fds
            log.warning("input_pull_refused", node=self.name, error="too many connections")
            writer.transport.abort()
            return
        self._input_conns.add(writer)
        link = Link(reader, writer, max_frame=PULL_REQUEST_MAX)
        served = 0
        try:
            while True:
                try:
                    wait_s = PULL_IDLE_S if served else PULL_TIMEOUT_S
                    msg = await asyncio.wait_for(link.recv(), wait_s)
                except (LinkClosed, TimeoutError):
                    if served:
                        return  # the puller hung up, or left it idle: it has every answer
                    raise
                answer, keep = self._pull_answer(msg, link.peer)
                writer.write(encode(answer, max_frame=self.max_frame))
                served += 1
                if not keep:
                    break
                await asyncio.wait_for(writer.drain(), PULL_TIMEOUT_S)
            # a close flushes what is still buffered (an abort would drop it); the
            # connection is gone once the puller has it all, or has hung up
            writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                await asyncio.wait_for(reader.read(1), PULL_TIMEOUT_S)
        except (LinkClosed, FrameError, OSError, TimeoutError, ssl.SSLError, ValueError) as exc:
            log.warning("input_pull_refused", node=self.name, peer=link.peer, error=str(exc)[:200])
        finally:
            self._input_conns.discard(writer)
            link.abort()

    def _pull_answer(self, msg: dict[str, Any], peer: str) -> tuple[dict[str, Any], bool]:
        """The answer to one pull, and whether the connection may serve another (not
        after a malformed one)."""
        try:
            if check_message(msg, PEER_MESSAGES).name != "pull":
                raise BadRequest(f"expected pull, got {msg['t']!r}")
        except BadRequest as exc:
            log.warning("input_pull_refused", node=self.name, peer=peer, error=str(exc)[:200])
            return make_peer_message("gone", reason=f"bad pull: {str(exc)[:200]}"), False
        request_id = self._offers.get(str(msg["ticket"]))
        args = None if request_id is None else self._release(request_id)
        if args is None:
            log.warning("input_pull_refused", node=self.name, peer=peer, error="unknown ticket")
            return make_peer_message("gone", reason="no input is kept here under that ticket"), True
        log.info("input_pulled", node=self.name, peer=peer, request=request_id)
        data = args.get("data") if isinstance(args.get("data"), bytes) else None
        answer = make_peer_message(
            "input", stdin=args.get("stdin"), files=args.get("files"), data=data
        )
        return answer, True

    def _answer(self, msg: dict[str, Any]) -> None:
        self._release(int(msg["id"]))
        owed = self._pending.pop(int(msg["id"]), None)
        if owed is None or owed.done():
            return
        if msg.get("ok"):
            if isinstance(owed, Later):
                owed.resolve(msg.get("result"))
            else:
                owed.set_result(msg.get("result"))
        else:
            error = msg.get("error") or {}
            owed.set_exception(
                error_from_wire(str(error.get("code", "internal")), str(error.get("message")))
            )

    def _conn_closed(self, conn: ConnInfo) -> None:
        self._watched.discard(conn.id)
        if self.link is not None:
            self.link.send(make_message("conn_closed", conn=conn.id))

    # ------------------------------------------------------------------ state dir
    def _stored_credential(self) -> str | None:
        try:
            data = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("coordinator_ca") != self.pin:
            return None  # a credential for another coordinator
        if data.get("name") != self.name or not isinstance(data.get("credential"), str):
            return None
        return str(data["credential"])

    def _store_credential(self, credential: str) -> None:
        data = {"name": self.name, "credential": credential, "coordinator_ca": self.pin}
        write_json(self.state_path, data)

    def _read_envs(self) -> dict[str, tuple[int, int] | None]:
        """``envs.json`` (+ ``envs.journal``): {"id", "owner": [uid, gid] | null} records;
        what cannot be read is skipped (logged)."""
        out: dict[str, tuple[int, int] | None] = {}
        for env_id, row in self._records.load().items():
            try:
                out[env_id] = owner_of(row.get("owner"))
            except (TypeError, ValueError):
                continue
        return out

    def _record_env(self, env_id: str, record: dict[str, Any] | None) -> None:
        """One change to what the node holds (``None``: gone), one journal line."""
        try:
            self._records.put(env_id, record)
        except OSError as exc:
            log.warning("envs_record_not_written", path=str(self.envs_path), error=str(exc))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


# What a node receives on a joined link, each message to its handler: exactly the
# coordinator's messages of tangram.protocol.link after the join (tests/test_link_table.py).
RECEIVES: Final[Mapping[str, Callable[[NodeAgent, dict[str, Any]], None]]] = MappingProxyType(
    {
        "hb": NodeAgent._on_hb,
        "resp": NodeAgent._answer,
        "ack": NodeAgent._on_ack,
        "run_exec": NodeAgent._start_exec,
        "create_env": NodeAgent._on_create_env,
        "remove_env": NodeAgent._on_remove_env,
        "transfer": NodeAgent._on_transfer,
        "open_session": NodeAgent._on_open_session,
        "interrupt_session": NodeAgent._on_interrupt_session,
        "cancel_exec": NodeAgent._on_cancel_exec,
        "close_session": NodeAgent._on_close_session,
        "load_service": NodeAgent._on_load_service,
        "unload_service": NodeAgent._on_unload_service,
        "run_call": NodeAgent._on_run_call,
        "stop_call": NodeAgent._on_stop_call,
        "warm_service": NodeAgent._on_warm_service,
    }
)


class _Fetch(NamedTuple):
    """Where a placed exec's input is to be pulled from (``run_exec``'s ``fetch``)."""

    node: str
    host: str
    port: int
    pin: str | None
    ticket: str


def _fetch_of(value: Any) -> _Fetch | None:
    """``run_exec``'s ``fetch``, read in full (ValueError, TypeError, KeyError if not)."""
    if value is None:
        return None
    host, port = split_host_port(str(value["addr"]))
    pin, ticket = value.get("pin"), value["ticket"]
    if not isinstance(ticket, str) or not ticket or not (pin is None or isinstance(pin, str)):
        raise ValueError("fetch: ticket must be a non-empty str, pin a str or null")
    return _Fetch(str(value["node"])[:64], host, port, pin or None, ticket)


def _input_size(args: dict[str, Any]) -> int | None:
    """The bytes of an exec's stdin and files, or None when the coordinator would refuse
    them (wrong types, a path outside the environment, too much): such input goes with
    the request, so its client gets the coordinator's ``bad_request`` as before."""
    stdin, files = args.get("stdin"), args.get("files")
    if not (stdin is None or isinstance(stdin, bytes)):
        return None
    if files is None:
        return len(stdin or b"")
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, bytes) for k, v in files.items()
    ):
        return None
    try:
        for path in files:
            check_env_path(path)
    except BadRequest:
        return None
    size = sum(len(v) for v in files.values())
    return None if size > MAX_FILES_BYTES else size + len(stdin or b"")


def _positive(value: Any, default: float) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value)
    return default


def _row(env_id: str, owner: tuple[int, int] | None) -> dict[str, Any]:
    return {"id": env_id, "owner": list(owner) if owner else None}

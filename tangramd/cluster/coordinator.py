"""``tangramd coordinator``: the one global core over every node's pools.

The coordinator is the all-in-one executor with its backend replaced by the nodes: the
same :class:`~tangramd.state.Core` (queues, scheduler, environment book over a
:class:`~tangram.pools.cpu.CpuCluster` whose nodes come and go), the same op handlers on
its Unix socket, and a TLS link server for nodes. A command for a node (``CreateEnv``,
``RunExec``, ``RemoveEnv``) goes over that node's link; the node's answer comes back as
the event the core expects (``EnvCreated``, ``ExecFinished``, ``EnvRemoved``). Client
requests that nodes forward from their own sockets run through the same op handlers.

GPU services: a node's hello lists its GPUs, which join the core's gpu pool
(``NodeGpus``, once its welcome is on its way), so the core places calls on them and plans
evictions and restores as ``tangramd up``'s does (with the node's restore bandwidth); the
``RunCall`` goes to that node, which runs it on its own service host and answers each call
(``call_done``). Registrations are replicated to the nodes with GPUs
(:mod:`tangramd.cluster.services`).

Failure: a node whose link has been silent for ``heartbeat_timeout_s`` is lost
(``NodeLost``: its actions end ``infra_error`` naming it, its calls too, its environments
are lost, its pools leave, its GPUs' residency with them). A node that comes back is
reconciled: the welcome lists the environments it still owns (and the services), and
what was in flight across a short drop is resent or ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import ssl
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Final, NamedTuple

import structlog

from tangram.model import TangramError
from tangram.protocol.codec import FrameError
from tangram.protocol.errors import (
    InfraError,
    NotFound,
    UnknownOp,
    error_to_wire,
)
from tangram.protocol.link import check_message, make_message
from tangram.protocol.results import ExecResult
from tangram.version import __version__
from tangramd import events as ev
from tangramd.cluster.config import ClusterConfig
from tangramd.cluster.link import Link, LinkClosed, split_host_port
from tangramd.cluster.pki import CoordinatorPki
from tangramd.cluster.registry import NodeRecord, NodeRegistry, Refused
from tangramd.cluster.services import ClusterServices
from tangramd.cluster.store import Store, StoreEnvRecords
from tangramd.diskfull import is_disk_full
from tangramd.executor import Executor, OpHandlers
from tangramd.lifecycle import loop_name
from tangramd.run.local import owner_of
from tangramd.run.remote import OnNode, PutOnNode, RemoteEffects
from tangramd.state import Core
from tangramd.transport import NOT_SYNC, ConnInfo, Later

log = structlog.get_logger("tangramd")

HELLO_TIMEOUT_S = 10.0
REMOTE_CONN_BASE = 1 << 40  # ids of clients on node sockets, apart from local connections
# cluster.join hands out secrets; node.lost could take any node down: neither is served
# to clients on a node's socket, only on the coordinator's own.
LOCAL_ONLY_OPS = frozenset({"cluster.join", "node.lost", "node.forget"})


class _Forwarded(NamedTuple):
    """An exec a node forwarded, owed an answer."""

    link: Link  # the node's link it came over
    request_id: Any  # the node's id for the request
    action_id: str | None = None  # set when that node answers its client itself
    held: bool = False  # that node holds the exec's stdin and files (req's held)
    withheld: bool = False  # ... and only that node has them (req's withheld)
    fetch: dict[str, Any] | None = None  # ... and another node may pull them (req's ticket)


class CoordinatorExecutor(Executor):
    """The executor of ``tangramd coordinator`` (see the module doc)."""

    def __init__(
        self,
        core: Core,
        *,
        socket_path: str,
        state_dir: str,
        listen: tuple[str, int],
        cluster: ClusterConfig,
        pki: CoordinatorPki | None,
        handlers: OpHandlers,
        services: ClusterServices | None = None,
        restore_timeout_s: float = 600.0,
        **server_options: Any,
    ) -> None:
        """``services``: the GPU service registrations (default: none declared, kept in
        ``state_dir``); ``restore_timeout_s`` (``[gpu] restore_timeout_s``): what a node's
        restore may take, part of a call's deadline (``RemoteEffects``)."""
        store = Store(state_dir)
        # the core's commands go to the nodes (each to the node holding its environment,
        # or its GPUs)
        self.remote = RemoteEffects(
            lambda node, msg: self._send(node, msg),
            lambda cmd: self._reply_on_node(cmd),
            lambda cmd: self._put_on_node(cmd),
            request_timeout_s=cluster.node_request_timeout_s,
            restore_timeout_s=restore_timeout_s,
            overdue=lambda node, why: self._suspect(node, why),
            lost=lambda node, why: self._lose_named(node, why),
            services=services or ClusterServices(state_dir),
            gpu_nodes=lambda: self._gpu_nodes(),
        )
        super().__init__(
            core,
            self.remote,
            socket_path,
            state_dir=state_dir,
            handlers=handlers,
            env_records=StoreEnvRecords(store),  # RecordEnv reaches SQLite before replies
            **server_options,
        )
        self.handlers = handlers
        self.listen = listen
        self.cluster = cluster
        self.pki = pki
        self.store = store
        self.registry = NodeRegistry(self.store)
        self.registry.unsaved = lambda what, exc: self.disk.failed(what, exc, self.db_path)
        self.max_frame = int(server_options.get("max_frame", 16 << 20))
        self._link_server: asyncio.base_events.Server | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._remote_ids = itertools.count(REMOTE_CONN_BASE)
        # forwarded execs owed an answer (see _Forwarded)
        self._forwarded: dict[Later, _Forwarded] = {}
        self._node_answers: dict[str, Later] = {}  # action id: its forwarded exec
        self._forwarding: _Forwarded | None = None  # the request handle_inline serves
        self._serving: _Forwarded | None = None  # the withheld request a task serves
        self._held_puts: dict[int, _Forwarded] = {}  # request token: its withheld data
        self.port = listen[1]

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        self.feed(ev.ProfilesLoaded(profiles=self._read_profiles()))
        self.feed(ev.JobStatsLoaded(stats=self._read_job_stats()))
        self._restore()
        self.feed(ev.ServicesRecovered(specs=await self.remote.recover_services()))
        # The nodes' port first: a local client that reaches the socket can be told it
        # (cluster.join), so it must be bound, and known, by then.
        tls = self.pki.server_context() if self.pki is not None else None
        host, port = self.listen
        self._link_server = await asyncio.start_server(
            self._serve_link,
            host,
            port,
            ssl=tls,
            ssl_handshake_timeout=HELLO_TIMEOUT_S if tls is not None else None,
        )
        self.port = self._link_server.sockets[0].getsockname()[1]
        try:
            await self.server.start()
        except BaseException:
            self._link_server.close()
            raise
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        log.info(
            "coordinator_ready",
            socket=self.socket_path,
            listen=f"{host}:{self.port}",
            tls=tls is not None,
            ca_sha256=self.pki.ca_sha256() if self.pki else None,
            event_loop=loop_name(),
        )

    def _restore(self) -> None:
        """After a restart: environments are back in the book, lost until their node
        reconnects; a known node has ``heartbeat_timeout_s`` to do so, else it is lost."""
        now = self.clock()
        for rec in self.registry.nodes.values():
            rec.restored, rec.last_seen = True, now
        envs = self.store.envs()
        if envs:
            rows = tuple(
                {
                    "id": e.id,
                    "trajectory": e.trajectory,
                    "node": e.node,
                    "image": e.image,
                    "mem": e.mem,
                    "lost_node": e.lost_node,
                }
                for e in envs
            )
            self.feed(ev.EnvsRestored(envs=rows))
            log.info("envs_restored", count=len(rows))

    async def stop(self) -> None:
        """Stop serving; environments on nodes stay (nodes reconcile when it is back)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._link_server is not None:
            self._link_server.close()
        for rec in self.registry.nodes.values():
            if rec.link is not None:
                rec.link.abort()
        await self.server.close(grace_s=0.5)
        for fut in self._futures.values():
            if not fut.done():
                fut.set_exception(InfraError("coordinator shutting down"))
        self.save_job_stats()  # (no Shutdown goes through its core)
        self.store.close()
        log.info("coordinator_stopped")

    # ------------------------------------------------------------------ views
    def node_rows(self) -> list[dict[str, Any]]:
        rows = {row["name"]: row for row in self.core.read.node_rows()}
        now = self.clock()
        out = []
        for rec in sorted(self.registry.nodes.values(), key=lambda r: r.name):
            row = rows.pop(rec.name, None) or _row_without_pool(rec)
            if rec.lost:
                row["state"] = "lost"
            row["heartbeat_age_s"] = now - rec.last_seen if rec.last_seen else None
            row["backend"] = rec.backend
            row["gpus"] = len(rec.gpus)
            row["gpu_list"] = [
                {
                    "local": g["local"],
                    "name": g["name"],
                    "mem_bytes": g["mem_bytes"],
                    "simulated": g["simulated"],
                }
                for g in rec.gpus
            ]
            out.append(row)
        return out

    @property
    def db_path(self) -> str:
        return str(self.store.path)

    def join_info(self, rotate: bool) -> dict[str, Any]:
        if rotate:
            try:
                self.registry.rotate()
            except Exception as exc:
                if not is_disk_full(exc):
                    raise
                raise self.disk.failed("the new join token", exc, self.db_path) from None
            log.info("join_token_rotated")
        host = self.listen[0]
        if host in ("", "0.0.0.0", "::"):
            host = socket.getfqdn()
        host = f"[{host}]" if ":" in host else host
        return {
            "coordinator": f"{host}:{self.port}",
            "token": self.registry.token,
            "ca_sha256": self.pki.ca_sha256() if self.pki is not None else "",
        }

    def forget_node(self, name: str) -> dict[str, Any]:
        """``node.forget``: the name's credential is dropped (a token may join it again);
        a node connected under it is declared lost first."""
        rec = self.registry.nodes.get(name)
        try:
            forgotten = self.registry.forget(name)
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            raise self.disk.failed(f"forgetting node {name}", exc, self.db_path) from None
        if rec is not None and not rec.lost:
            self._lose(rec, "forgotten by an operator")
        return {"name": name, "forgotten": forgotten}

    def _suspect(self, node: str, why: str) -> None:
        """A node missed a request's deadline: it is drained (no new trajectories go
        there; an operator undrains it) and logged."""
        log.warning("node_suspect", node=node, reason=why)
        self.feed(ev.DrainNode(node=node, drain=True))

    def _lose_named(self, node: str, why: str) -> None:
        """A node that did not confirm it stopped a call (``RemoteEffects``): lost now, as
        ``node.lost`` does (its GPUs leave the pool; alive, it rejoins afresh)."""
        rec = self.registry.nodes.get(node)
        if rec is not None:
            self._lose(rec, why)

    def lose_node(self, name: str, why: str) -> dict[str, Any]:
        """``node.lost``: what the heartbeat timeout does, now (an outside monitor such as
        Ray saw the host die). A node that is in fact alive reconnects and joins afresh."""
        rec = self.registry.nodes.get(name)
        if rec is None:
            raise NotFound(f"no node named {name!r}")
        already = rec.lost
        self._lose(rec, why[:200])
        return {"name": name, "already_lost": already}

    # ------------------------------------------------------------------ commands to nodes
    def _reply_on_node(self, cmd: ev.RunExec) -> OnNode:
        """When the exec came from a client of the node it runs on, that node answers the
        client itself as soon as it ends (``reply``: the request and its time queued, the
        one fact the core adds that the node lacks), then reports the outcome: one link
        round trip less per action. The core's reply to it then goes nowhere (see
        :meth:`_on_exec_done`); the answer is the same ``ExecResult.placed``. ``held``
        when that node holds the exec's stdin and files (``req``'s ``held``); ``missing``
        says why the exec cannot run at all: its input stayed on a node it is not placed
        on (``req``'s ``withheld``, after that node's link was replaced). ``fetch``, for
        an exec placed on another node than the one that kept its input (``req``'s
        ``ticket``): where that node pulls it from; the bytes never come here."""
        answer = self.core.read.exec_reply(cmd.action_id)
        if answer is None:
            return OnNode()
        token, queue_s = answer
        later = self._futures.get(token)
        if not isinstance(later, Later):
            return OnNode()
        target = self._forwarded.get(later)
        if target is None:
            return OnNode()
        if target.link is not self.registry.link_of(cmd.node):
            if target.fetch is not None:  # that node pulls them from the one that kept them
                return OnNode(fetch=target.fetch)
            if target.withheld:
                return OnNode(missing="its stdin and files stayed on the node it came from")
            return OnNode()
        self._forwarded[later] = target._replace(action_id=cmd.action_id)
        self._node_answers[cmd.action_id] = later
        return OnNode({"id": target.request_id, "queue_s": queue_s}, held=target.held)

    def _send(self, node: str, msg: dict[str, Any]) -> bool:
        link = self.registry.link_of(node)
        return link is not None and link.send(msg)

    def _gpu_nodes(self) -> list[str]:
        """The connected nodes with GPUs (where a registration goes)."""
        return [
            rec.name
            for rec in self.registry.nodes.values()
            if rec.gpus and self.registry.link_of(rec.name) is not None
        ]

    # ------------------------------------------------------------------ node links
    async def _serve_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = Link(reader, writer, max_frame=self.max_frame)
        try:
            rec = await self._join(link)
        except Refused as exc:
            if not (exc.retry and self.disk.full):  # (else disk_full says it, once a minute)
                log.warning("node_refused", peer=link.peer, reason=str(exc))
            link.send(make_message("refused", reason=str(exc), retry=exc.retry))
            await _drain_quietly(link)
            await link.wait_closed()
            return
        except (LinkClosed, FrameError, TimeoutError, ssl.SSLError, OSError) as exc:
            log.info("node_link_failed_before_join", peer=link.peer, error=str(exc))
            await link.wait_closed()
            return
        try:
            while True:
                msg = await link.recv()
                rec.last_seen = self.clock()
                link.cork()  # what answers it leaves in one write
                try:
                    self._on_message(rec, link, msg)
                finally:
                    link.uncork()
        except (LinkClosed, FrameError, OSError, ssl.SSLError) as exc:
            if rec.link is link:
                log.warning("node_link_closed", node=rec.name, error=str(exc))
        finally:
            if self.registry.detach(rec.name, link) is not None:
                self._drop_remote_conns(rec)
            await link.wait_closed()

    async def _join(self, link: Link) -> NodeRecord:
        pem = self.pki.ca_pem().decode() if self.pki is not None else ""
        link.send(make_message("ca", pem=pem, version=__version__))
        hello = await asyncio.wait_for(link.recv(), HELLO_TIMEOUT_S)
        if hello.get("t") == "reject":
            log.warning(
                "node_rejected_coordinator", peer=link.peer, reason=str(hello.get("reason"))[:300]
            )
            raise LinkClosed("the node rejected this coordinator")
        name, cores, mem, backend = _parse_hello(hello)
        _check_claim(self.cluster, cores, mem)
        gpus = _parse_gpus(hello.get("gpus"))
        try:
            credential = self.registry.authenticate(
                name, _opt_str(hello, "token"), _opt_str(hello, "credential")
            )
        except Exception as exc:  # its credential could not be kept: it tries again later
            if not is_disk_full(exc):
                raise
            error = self.disk.failed(f"node {name}'s credential", exc, self.db_path)
            raise Refused(error.message, retry=True) from None
        rec, was_lost = self.registry.attach(name, link, cores, mem, self.clock())
        rec.backend, rec.gpus, rec.restored = backend, gpus, False
        rec.input_addr, rec.input_pin = _input_port(hello)
        self.feed(ev.NodeJoined(node=name, cores_by_numa=cores, mem_bytes=mem))
        work = self.core.read.node_work(name)
        welcome = make_message(
            "welcome",
            name=name,
            credential=credential,
            heartbeat_s=self.cluster.heartbeat_s,
            heartbeat_timeout_s=self.cluster.heartbeat_timeout_s,
            keep=work["keep"],
            # what it still runs that the core has ended (lost meanwhile): it kills them
            cancel=[
                a for a in _str_list(hello, "running") if self.core.read.action_node(a) != name
            ],
            services=[spec.to_json() for spec in self.remote.service_specs()] if gpus else None,
            services_reset=True if gpus and was_lost else None,
        )
        link.send(welcome)
        if not was_lost:
            self._resume_inflight(name, hello, work)
        if gpus:  # (after the welcome: a restore it lets start goes out after it)
            count, per_gpu, h2d = _gpu_capacity(gpus)
            self.feed(ev.NodeGpus(node=name, count=count, mem_per_gpu=per_gpu, h2d_bytes_per_s=h2d))
        log.info(
            "node_joined",
            node=name,
            peer=link.peer,
            cores=rec.cores,
            mem_bytes=mem,
            resumed=not was_lost,
            with_token=credential is not None,
        )
        return rec

    def _resume_inflight(self, node: str, hello: dict[str, Any], work: dict[str, Any]) -> None:
        """After a drop shorter than the timeout: resend what the node never got, end what
        it no longer knows. Outcomes it still holds come next (its outbox)."""
        held = set(_str_list(hello, "envs"))
        running = set(_str_list(hello, "running"))
        pending = set(_str_list(hello, "outbox"))
        for env in work["creating"]:
            if env["env_id"] not in held and f"c:{env['env_id']}" not in pending:
                msg = make_message(
                    "create_env",
                    env_id=env["env_id"],
                    image=env.get("image"),
                    mem=env.get("mem"),
                    owner=env.get("owner"),
                )
                self._send(node, msg)
        for env_id in work["closing"]:
            if env_id not in held and f"r:{env_id}" not in pending:
                self.feed(ev.EnvRemoved(env_id=env_id))
        self.remote.started(sorted(running))  # (an exec_started may have been lost)
        for action_id in work["running"]:
            if action_id not in running and f"x:{action_id}" not in pending:
                self.remote.answered(f"x:{action_id}")  # (ended here: no deadline left)
                detail = f"node {node} lost track of the action while its link was down"
                self.feed(ev.ExecFinished(action_id, ExecResult("infra_error", detail=detail)))
        for action_id in work["calls"]:  # a run_call (or its call_done) lost with the link
            stopped = f"cs:{action_id}" in pending
            if action_id in running and not stopped:  # a stop_call may have been lost too
                self.remote.resend_stop(node, action_id)
            elif action_id not in running and f"cd:{action_id}" not in pending and not stopped:
                self.remote.answered(f"cl:{action_id}")  # (ended here: no deadline left)
                if self.remote.stopping(action_id):  # it was told to stop: it has
                    self.remote.call_stopped(action_id)
                    continue
                detail = f"node {node} lost track of the call while its link was down"
                self.feed(ev.CallFinished(action_id, outcome="infra_error", error=detail))
        for kill in work["killing"]:  # a cancel_exec may have been lost with the link
            if kill["action_id"] in running:
                msg = make_message(
                    "cancel_exec", action_id=kill["action_id"], session=kill["session"]
                )
                self._send(node, msg)

    def _on_message(self, rec: NodeRecord, link: Link, msg: dict[str, Any]) -> None:
        """One message from a node, to its handler (:data:`RECEIVES`); an unknown or
        malformed one is logged and dropped."""
        kind = msg.get("t")
        handler = RECEIVES.get(kind) if isinstance(kind, str) else None
        if handler is None:
            log.warning("node_message_unknown", node=rec.name, kind=str(kind)[:40])
            return
        try:
            handler(self, rec, link, msg)
        except (KeyError, TypeError, ValueError, TangramError) as exc:
            log.warning("node_message_bad", node=rec.name, kind=str(kind)[:40], error=str(exc))
        except Exception as exc:  # a full disk under the store never ends the link
            if not is_disk_full(exc):
                raise
            self.disk.failed(f"what node {rec.name}'s {str(kind)[:40]} changed", exc, self.db_path)

    def _on_hb(self, rec: NodeRecord, link: Link, msg: dict[str, Any]) -> None:
        link.send(make_message("hb"))

    def _on_req(self, rec: NodeRecord, link: Link, msg: dict[str, Any]) -> None:
        if not self._remote_inline(rec, link, msg):
            self._spawn(self._remote_request(rec, link, msg))

    def _on_conn_closed(self, rec: NodeRecord, link: Link, msg: dict[str, Any]) -> None:
        conn = rec.remote_conns.pop(int(msg["conn"]), None)
        if conn is not None:
            conn._fire()

    def _on_bye(self, rec: NodeRecord, link: Link, msg: dict[str, Any]) -> None:
        self._lose(rec, "node stopped")

    # A node's outcome becomes the core's event if it is about that node's work; each is
    # acknowledged (the node keeps it until then).

    def _on_exec_started(self, rec: NodeRecord, link: Link, msg: dict[str, Any]) -> None:
        self.remote.started(_str_list(msg, "action_ids"))

    def _on_exec_done(self, rec: NodeRecord, link: Link, msg: dict[str, Any]) -> None:
        action_id = str(msg["action_id"])
        self.remote.answered(f"x:{action_id}")
        later = self._node_answers.pop(action_id, None)
        if later is not None and msg.get("answered") is True:
            self._forwarded.pop(later, None)  # its client has the answer
        # not ended already (node lost, resumed), and this node's
        if self.core.read.action_node(action_id) == rec.name:
            result = ExecResult.from_wire(msg["result"])
            self.feed(ev.ExecFinished(action_id, result, env_lost=bool(msg.get("env_lost"))))
        link.defer(make_message("ack", key=str(msg["key"])))  # see Link.defer

    def _on_env_created(self, rec: NodeRecord, link: Link, msg: dict[str, Any]) -> None:
        env_id = str(msg["env_id"])
        if not self.remote.env_answered(env_id):  # too late: it failed at its deadline
            if msg.get("error") is None:
                link.send(make_message("remove_env", env_id=env_id))
        elif self.core.read.env_node(env_id) == rec.name:
            error = msg.get("error")
            self.feed(ev.EnvCreated(env_id=env_id, error=None if error is None else str(error)))
        link.send(make_message("ack", key=str(msg["key"])))

    def _on_env_removed(self, rec: NodeRecord, link: Link, msg: dict[str, Any]) -> None:
        env_id = str(msg["env_id"])
        self.remote.answered(f"r:{env_id}")
        if self.core.read.env_node(env_id) == rec.name:
            self.feed(ev.EnvRemoved(env_id=env_id))
        link.send(make_message("ack", key=str(msg["key"])))

    def _on_transfer_done(self, rec: NodeRecord, link: Link, msg: dict[str, Any]) -> None:
        cmd = self.remote.transfer_done(str(msg["tid"]))
        if cmd is not None:
            error = msg.get("error")
            self.feed(
                ev.TransferDone(
                    token=cmd.token,
                    env_id=cmd.env_id,
                    result=msg.get("result"),
                    error=(str(error[0]), str(error[1])) if error else None,
                )
            )
        link.send(make_message("ack", key=str(msg["key"])))

    def _on_session_opened(self, rec: NodeRecord, link: Link, msg: dict[str, Any]) -> None:
        error = msg.get("error")
        session_id = str(msg["session_id"])
        self.remote.answered(f"so:{session_id}")
        if self.remote.late_session(session_id):  # failed at its deadline: close it there
            if error is None:
                link.send(make_message("close_session", session_id=session_id))
        else:
            error = None if error is None else str(error)
            self.feed(ev.SessionOpened(session_id=session_id, error=error))
        link.send(make_message("ack", key=str(msg["key"])))

    def _on_session_closed(self, rec: NodeRecord, link: Link, msg: dict[str, Any]) -> None:
        self.remote.answered(f"sc:{msg['session_id']}")
        self.feed(ev.SessionClosed(session_id=str(msg["session_id"])))
        link.send(make_message("ack", key=str(msg["key"])))

    def _on_service_loaded(self, rec: NodeRecord, link: Link, msg: dict[str, Any]) -> None:
        name, info = str(msg["name"]), msg.get("info")
        error = None if msg.get("error") is None else str(msg["error"])
        if error is not None:
            log.warning("service_load_failed", node=rec.name, service=name, error=error)
        code = str(msg.get("code") or "infra_error")
        self.remote.service_loaded(
            rec.name, name, info if isinstance(info, dict) else {}, error, code
        )
        link.send(make_message("ack", key=str(msg["key"])))

    def _on_service_unloaded(self, rec: NodeRecord, link: Link, msg: dict[str, Any]) -> None:
        self.remote.service_unloaded(rec.name, str(msg["name"]))
        link.send(make_message("ack", key=str(msg["key"])))

    def _on_call_done(self, rec: NodeRecord, link: Link, msg: dict[str, Any]) -> None:
        check_message(msg)  # (its outcome, times and batch go to the core as they are)
        action_id = str(msg["action_id"])
        self.remote.answered(f"cl:{action_id}")
        if self.remote.stopping(action_id):  # past its deadline: it ended there meanwhile
            self.remote.call_stopped(action_id)
        # not ended already (node lost, or past its deadline), and this node's
        elif self.core.read.call_node(action_id) == rec.name:
            result, h2d = msg.get("result"), msg.get("h2d_bytes_per_s")
            self.feed(
                ev.CallFinished(
                    action_id=action_id,
                    outcome=str(msg["outcome"]),
                    result=result if isinstance(result, dict) else None,
                    error=None if msg.get("error") is None else str(msg["error"]),
                    exec_s=float(msg["exec_s"]),
                    restore_s=float(msg["restore_s"]),
                    h2d_bytes_per_s=float(h2d) if isinstance(h2d, int | float) else None,
                    batch=int(msg["batch"]),
                )
            )
        link.defer(make_message("ack", key=str(msg["key"])))  # see Link.defer

    def _on_call_stopped(self, rec: NodeRecord, link: Link, msg: dict[str, Any]) -> None:
        """The node stopped a call past its deadline (or found it ended): it ends now
        (``infra_error``), and its GPUs go back to the pool."""
        check_message(msg)
        action_id = str(msg["action_id"])
        if self.core.read.call_node(action_id) == rec.name:
            log.info("call_stopped", node=rec.name, action_id=action_id, was=str(msg["was"]))
            self.remote.call_stopped(action_id)
        link.send(make_message("ack", key=str(msg["key"])))

    def _on_services_state(self, rec: NodeRecord, link: Link, msg: dict[str, Any]) -> None:
        rows = msg["services"]
        if self.remote.services is not None and isinstance(rows, list):
            self.remote.services.reported(rec.name, rows)

    def _remote_inline(self, rec: NodeRecord, link: Link, msg: dict[str, Any]) -> bool:
        """Answer a forwarded view (status, nodes, ...) at once, and submit an ``exec`` at
        once, as the Unix socket's inline path does: its answer goes out in the loop turn
        that produces it (the node's outcome, whose ``ack`` it shares a write with); False
        for ops that wait otherwise (they run as tasks)."""
        op, args = msg.get("op"), msg.get("args") or {}
        if not isinstance(op, str) or not isinstance(args, dict) or op in LOCAL_ONLY_OPS:
            return False
        request_id = msg.get("id")
        try:
            conn = self._remote_conn(rec, msg)
            self._forwarding = _Forwarded(
                link,
                request_id,
                held=msg.get("held") is True,
                withheld=msg.get("withheld") is True,
                fetch=_fetch_from(rec, msg),
            )
            try:
                result = self.handlers.handle_inline(self, op, args, conn)
            finally:
                self._forwarding = None
            if result is NOT_SYNC:
                return False
            if isinstance(result, Later):
                return True  # wired in request_later, answered when the core answers
            reply = make_message("resp", id=request_id, ok=True, result=result)
        except Exception as exc:  # every failure is an answer, never a dead link
            reply = make_message("resp", id=request_id, ok=False, error=error_to_wire(exc))
        link.send(reply)
        return True

    async def request(self, make_event: Callable[[int], ev.Event]) -> Any:
        """As the executor's; for a node's ``env.put`` whose data that node kept
        (``req``'s ``withheld``), the request's token is remembered so that its transfer
        takes the data there (:meth:`_put_on_node`)."""
        origin, self._serving = self._serving, None
        if origin is None:
            return await super().request(make_event)
        tokens: list[int] = []

        def remembered(token: int) -> ev.Event:
            tokens.append(token)
            self._held_puts[token] = origin
            return make_event(token)

        try:
            return await super().request(remembered)
        finally:
            for token in tokens:
                self._held_puts.pop(token, None)

    def _put_on_node(self, cmd: ev.RunTransfer) -> PutOnNode:
        """For a transfer: the node's request whose data a put takes there (``held``), or
        where the node pulls that data from (``fetch``: it is on another node), or why a
        put cannot run (``missing``: its data stayed on a node it is not sent to)."""
        origin = self._held_puts.pop(cmd.token, None) if cmd.token is not None else None
        if origin is None:
            return PutOnNode()
        if origin.link is not self.registry.link_of(cmd.node):
            if origin.fetch is not None:
                return PutOnNode(fetch=origin.fetch)
            return PutOnNode(missing="the put's data stayed on the node it came from")
        return PutOnNode(held=int(origin.request_id))

    def request_later(self, make_event: Callable[[int], ev.Event]) -> Later:
        """As the executor's, and an exec forwarded by a node is known as such before the
        core sees it: the pass that event runs may place it at once (_reply_on_node)."""
        origin, self._forwarding = self._forwarding, None
        if origin is None:
            return super().request_later(make_event)
        token = next(self._tokens)
        later = Later()
        self._futures[token] = later
        self._forwarded[later] = origin
        later.then(self._answer_forwarded)
        self.feed(make_event(token))
        return later

    def _answer_forwarded(self, later: Later) -> None:
        """Send the answer to a forwarded exec when the core gives it (unless its node
        answered its client itself)."""
        target = self._forwarded.pop(later, None)
        if target is None:
            return
        link, request_id, action_id = target.link, target.request_id, target.action_id
        if action_id is not None:
            self._node_answers.pop(action_id, None)
        if later.error is None:
            link.send(make_message("resp", id=request_id, ok=True, result=later.result))
        else:
            error = error_to_wire(later.error)
            link.send(make_message("resp", id=request_id, ok=False, error=error))

    async def _remote_request(self, rec: NodeRecord, link: Link, msg: dict[str, Any]) -> None:
        """A client request from a node's socket, through the same op handlers."""
        request_id = msg.get("id")
        try:
            op, args = msg["op"], msg.get("args") or {}
            if not isinstance(op, str) or not isinstance(args, dict):
                raise UnknownOp("malformed forwarded request")
            if op in LOCAL_ONLY_OPS:
                raise UnknownOp(f"{op} is served on the coordinator's own socket only")
            conn = self._remote_conn(rec, msg)
            if msg.get("withheld") is True:  # read by request() before this task yields
                fetch = _fetch_from(rec, msg)
                self._serving = _Forwarded(link, request_id, held=True, withheld=True, fetch=fetch)
            try:
                result = await self.handlers.handle(self, op, args, conn)
            finally:
                self._serving = None
            reply = make_message("resp", id=request_id, ok=True, result=result)
        except Exception as exc:  # every failure is an answer, never a dead link
            reply = make_message("resp", id=request_id, ok=False, error=error_to_wire(exc))
        link.send(reply)

    def _remote_conn(self, rec: NodeRecord, msg: dict[str, Any]) -> ConnInfo:
        """The coordinator's stand-in for a client of a node's socket: who it is is what
        that node saw (``req``'s ``peer``), so its commands run as that caller, as on
        ``tangramd up``; a client with no known uid (an older node) stays as it was."""
        conn_id, peer = int(msg["conn"]), owner_of(msg.get("peer"))
        conn = rec.remote_conns.get(conn_id)
        if conn is None:  # (one connection of the node's socket: one peer throughout)
            uid, gid = peer if peer is not None else (None, None)
            conn = rec.remote_conns[conn_id] = ConnInfo(id=next(self._remote_ids), uid=uid, gid=gid)
        return conn

    def _drop_remote_conns(self, rec: NodeRecord) -> None:
        conns, rec.remote_conns = rec.remote_conns, {}
        for conn in conns.values():
            conn._fire()

    # ------------------------------------------------------------------ failure
    async def _watch(self) -> None:
        """Declare nodes lost whose link has been silent for the heartbeat timeout."""
        timeout = self.cluster.heartbeat_timeout_s
        period = min(self.cluster.heartbeat_s, timeout / 4)
        while True:
            await asyncio.sleep(period)
            now = self.clock()
            for rec in self.registry.overdue(now, timeout):
                state = "link closed" if rec.link is None else "no heartbeat"
                self._lose(rec, f"{state} for {now - rec.last_seen:.1f} s")
            for rec in self.registry.nodes.values():
                if rec.restored and rec.lost and now - rec.last_seen > timeout:
                    rec.restored = False
                    log.warning("node_lost", node=rec.name, why="not back after a restart")
                    self.feed(ev.NodeLost(node=rec.name, why="not back after a restart"))

    def _lose(self, rec: NodeRecord, why: str) -> None:
        if rec.lost:
            return
        rec.lost = True
        link, rec.link = rec.link, None
        if link is not None:
            link.abort()
        self._drop_remote_conns(rec)
        self.remote.node_gone(rec.name)
        log.warning("node_lost", node=rec.name, why=why)
        self.feed(ev.NodeLost(node=rec.name, why=why))


Handler = Callable[[CoordinatorExecutor, NodeRecord, Link, dict[str, Any]], None]

# What the coordinator receives on a joined link, each message to its handler: exactly
# the nodes' messages of tangram.protocol.link after the join (tests/test_link_table.py).
RECEIVES: Final[Mapping[str, Handler]] = MappingProxyType(
    {
        "hb": CoordinatorExecutor._on_hb,
        "req": CoordinatorExecutor._on_req,
        "conn_closed": CoordinatorExecutor._on_conn_closed,
        "exec_started": CoordinatorExecutor._on_exec_started,
        "exec_done": CoordinatorExecutor._on_exec_done,
        "env_created": CoordinatorExecutor._on_env_created,
        "env_removed": CoordinatorExecutor._on_env_removed,
        "transfer_done": CoordinatorExecutor._on_transfer_done,
        "session_opened": CoordinatorExecutor._on_session_opened,
        "session_closed": CoordinatorExecutor._on_session_closed,
        "service_loaded": CoordinatorExecutor._on_service_loaded,
        "service_unloaded": CoordinatorExecutor._on_service_unloaded,
        "call_done": CoordinatorExecutor._on_call_done,
        "call_stopped": CoordinatorExecutor._on_call_stopped,
        "services_state": CoordinatorExecutor._on_services_state,
        "bye": CoordinatorExecutor._on_bye,
    }
)


# ---------------------------------------------------------------------- helpers


def _check_claim(cluster: ClusterConfig, cores: tuple[tuple[int, ...], ...], mem: int) -> None:
    """A node's hello claims no more than ``[cluster] max_node_cores`` / ``max_node_mem``
    (a rogue node cannot make the scheduler plan on capacity it made up)."""
    count = sum(len(group) for group in cores)
    if count > cluster.max_node_cores:
        raise Refused(
            f"hello: {count} cores is more than [cluster] max_node_cores ({cluster.max_node_cores})"
        )
    if mem > cluster.max_node_mem:
        raise Refused(
            f"hello: {mem} bytes of memory is more than [cluster] max_node_mem "
            f"({cluster.max_node_mem})"
        )


def _parse_hello(
    hello: dict[str, Any],
) -> tuple[str, tuple[tuple[int, ...], ...], int, str]:
    """Name, cores by NUMA node, memory and backend of a hello; Refused when malformed."""
    if hello.get("t") != "hello":
        raise Refused(f"expected hello, got {str(hello.get('t'))[:40]!r}")
    name = hello.get("name")
    if not isinstance(name, str) or not name or len(name) > 64 or not name.isprintable():
        raise Refused("hello: name must be a printable string of 1-64 characters")
    numa = hello.get("cores_by_numa", [])
    mem = hello.get("mem_bytes", 0)
    ok = isinstance(numa, list) and all(
        isinstance(group, list)
        and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in group)
        for group in numa
    )
    if not ok or not isinstance(mem, int) or isinstance(mem, bool) or mem < 0:
        raise Refused("hello: cores_by_numa must be lists of core ids, mem_bytes an int >= 0")
    cores = tuple(tuple(sorted(group)) for group in numa if group)
    flat = [c for group in cores for c in group]
    if len(set(flat)) != len(flat):
        raise Refused("hello: a core appears twice in cores_by_numa")
    backend = str(hello.get("backend", "process"))[:32]
    return name, cores, mem, backend


MAX_GPUS = 64


def _parse_gpus(value: Any) -> tuple[dict[str, Any], ...]:
    """The GPUs of a hello (``[{local, name, mem_bytes, h2d_bytes_per_s, simulated}]``);
    Refused when malformed. The ``nodes`` view shows them; the gpu pool takes them as
    :func:`_gpu_capacity` says."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_GPUS:
        raise Refused(f"hello: gpus must be a list of at most {MAX_GPUS} maps")
    gpus = []
    for k, gpu in enumerate(value):
        if not isinstance(gpu, dict):
            raise Refused(f"hello: gpus[{k}] must be a map")
        mem, h2d = gpu.get("mem_bytes"), gpu.get("h2d_bytes_per_s")
        if not (
            isinstance(mem, int)
            and not isinstance(mem, bool)
            and mem >= 0
            and isinstance(h2d, int | float)
            and not isinstance(h2d, bool)
            and h2d > 0
        ):
            raise Refused(f"hello: gpus[{k}] needs mem_bytes (int >= 0) and h2d_bytes_per_s > 0")
        gpus.append(
            {
                "local": k,
                "name": str(gpu.get("name", "gpu"))[:64],
                "mem_bytes": mem,
                "h2d_bytes_per_s": float(h2d),
                "simulated": bool(gpu.get("simulated", False)),
            }
        )
    return tuple(gpus)


def _gpu_capacity(gpus: tuple[dict[str, Any], ...]) -> tuple[int, int, float]:
    """What the gpu pool takes of a node's GPUs: their count, and the smallest memory and
    restore bandwidth among them (the pool's GPUs are uniform; ``NodeGpus`` uses the
    largest count the buddy chunks take)."""
    return (
        len(gpus),
        min(int(g["mem_bytes"]) for g in gpus),
        min(float(g["h2d_bytes_per_s"]) for g in gpus),
    )


def _fetch_from(rec: NodeRecord, msg: dict[str, Any]) -> dict[str, Any] | None:
    """Where another node pulls the input a node kept for its request ``msg`` (``req``'s
    ``withheld`` and ``ticket``; its input port from its hello); None without either."""
    ticket = msg.get("ticket")
    if msg.get("withheld") is not True or not isinstance(ticket, str) or not ticket:
        return None
    if rec.input_addr is None:
        return None
    return {"node": rec.name, "addr": rec.input_addr, "pin": rec.input_pin, "ticket": ticket}


def _input_port(hello: dict[str, Any]) -> tuple[str | None, str | None]:
    """A hello's input port (``input_addr``, ``input_pin``); ``(None, None)`` when it has
    none or names it wrongly (that node's input then goes with its requests)."""
    addr, pin = _opt_str(hello, "input_addr"), _opt_str(hello, "input_pin")
    if addr is None or len(addr) > 300 or (pin is not None and len(pin) > 100):
        return None, None
    try:
        split_host_port(addr)
    except ValueError:
        return None, None
    return addr, pin


def _opt_str(msg: dict[str, Any], key: str) -> str | None:
    value = msg.get(key)
    return value if isinstance(value, str) and value else None


def _str_list(msg: dict[str, Any], key: str) -> list[str]:
    value = msg.get(key)
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _row_without_pool(rec: NodeRecord) -> dict[str, Any]:
    """A ``nodes`` row for a node the core has no pool for (lost, or a pure gateway)."""
    return {
        "name": rec.name,
        "state": "ready",
        "mem_gb": round(rec.mem_bytes / (1 << 30), 3),
        "envs": 0,
        "running": 0,
        "id": rec.name,
        "cores": 0,
        "free_cores": 0,
        "numa": [],
        "mem_bytes": rec.mem_bytes,
        "mem_reserved": 0,
        "busy_cores": [],
        "gpus": 0,
    }


async def _drain_quietly(link: Link) -> None:
    with contextlib.suppress(LinkClosed, TimeoutError):
        await asyncio.wait_for(link.drain(), 2.0)

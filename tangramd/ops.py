"""The op handlers of the daemon: one function per op of ``tangram.protocol.ops.OPS``.

A handler validates nothing itself (``validate_args`` did, against the op table), reads
views through the core's read-model methods, and turns a request that changes state into
an event for ``Core.handle`` (the only mutator). Ops whose answer the core gives in the
same ``handle`` call run inline on the transport's fast path (``SYNC_OPS``); ops that wait
(for cores, an environment, a lease) are coroutines (``ASYNC_OPS``).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from tangram import _native
from tangram.protocol.errors import Forbidden, UnknownOp
from tangram.protocol.ops import OPS, validate_args
from tangram.protocol.results import CallSpec, ExecSpec
from tangram.version import __version__
from tangramd import events as ev
from tangramd.transport import NOT_SYNC, ConnInfo, Later

if TYPE_CHECKING:
    from tangramd.executor import Executor

Args = dict[str, Any]


def handle_sync(ex: Executor, op: str, args: Args, conn: ConnInfo) -> Any:
    """Inline path for ops that never wait; ``NOT_SYNC`` for the others."""
    fn = SYNC_OPS.get(op)
    if fn is None:
        return NOT_SYNC
    validate_args(op, args)
    admit(ex, op, conn)
    return fn(ex, args, conn)


def handle_inline(ex: Executor, op: str, args: Args, conn: ConnInfo) -> Any:
    """The Unix socket's inline path: ``handle_sync``, and ``exec`` submitted at once and
    answered without a task (a :class:`~tangramd.transport.Later` the core's reply
    resolves, written by the transport in that turn)."""
    if op == "exec":
        validate_args(op, args)
        ex.watch(conn)
        return _exec_later(ex, args, conn)
    return handle_sync(ex, op, args, conn)


async def handle(ex: Executor, op: str, args: Args, conn: ConnInfo) -> Any:
    validate_args(op, args)
    admit(ex, op, conn)
    sync = SYNC_OPS.get(op)
    if sync is not None:  # the transport's inline path was skipped (slow reader)
        return sync(ex, args, conn)
    fn = ASYNC_OPS.get(op)
    if fn is None:
        raise UnknownOp(f"op {op!r} is not served by tangramd up")
    ex.watch(conn)
    return await fn(ex, args, conn)


def is_operator(ex: Executor, conn: ConnInfo) -> bool:
    """Operators are root, the daemon's user and ``daemon.operator_uids`` (a caller of a
    node's socket as that node saw it); a connection with no known uid (no SO_PEERCRED) is
    the daemon's own."""
    peer = conn.peer
    return peer is None or peer[0] in (0, os.geteuid()) or peer[0] in ex.operator_uids


def _viewer(ex: Executor, conn: ConnInfo) -> int | None:
    """Whose records a view shows: None (all) to an operator, else the caller's uid."""
    return None if is_operator(ex, conn) else conn.uid


def admit(ex: Executor, op: str, conn: ConnInfo) -> None:
    """Refuse an operator-only op (``OPS[op].operator_only``) to anyone else."""
    spec = OPS.get(op)
    if spec is not None and spec.operator_only and not is_operator(ex, conn):
        raise Forbidden(
            f"{op}: operators only (root, the daemon's user, uid {os.geteuid()}, and "
            f"daemon.operator_uids); uid {conn.uid} is not one"
        )


# -------------------------------------------------------------------------- views


def _ping(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return {"pong": True, "version": __version__}


def _status(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    now = ex.clock()
    return {
        **ex.core.read.status(now),
        "version": __version__,
        "uptime_s": now - ex.started,
        "backend": ex.effects.name,
        "socket": ex.socket_path,
        "nodes": len(ex.core.cpu.nodes),
        # connected clients (the in-process gateway's connection among them)
        "clients": ex.server.connections,
        "core": "compiled" if _native.ACTIVE else "interpreted",  # tangram/_native.py
    }


def _nodes(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return {"nodes": ex.node_rows()}


def _node_drain(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return ex.answer_now(lambda tok: ev.DrainNode(node=args["name"], drain=True, token=tok))


def _node_undrain(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return ex.answer_now(lambda tok: ev.DrainNode(node=args["name"], drain=False, token=tok))


def _cluster_join(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return ex.join_info(rotate=bool(args.get("rotate")))


def _node_lost(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    # Only the coordinator has nodes to lose; `tangramd up`'s one node is itself.
    lose = getattr(ex, "lose_node", None)
    if lose is None:
        raise UnknownOp("node.lost is served by `tangramd coordinator`, not `tangramd up`")
    return lose(args["name"], args.get("why") or "declared lost by an operator")


def _node_forget(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    forget = getattr(ex, "forget_node", None)
    if forget is None:
        raise UnknownOp("node.forget is served by `tangramd coordinator`, not `tangramd up`")
    return forget(args["name"])


def _queue(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return ex.core.read.queue_view(ex.clock(), _viewer(ex, conn))


def _story(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return ex.core.read.story(args["action_id"], origin=ex.started, viewer=_viewer(ex, conn))


def _env_list(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    viewer = _viewer(ex, conn)
    rows = ex.core.read.env_rows(ex.clock(), viewer)
    others = 0 if viewer is None else len(ex.core.read.env_rows(ex.clock())) - len(rows)
    return {"envs": rows, "others": others}


def _api_list(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return {"apis": ex.core.read.api_rows()}


def _jobs(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return {"jobs": ex.core.read.job_rows()}


def _profile_get(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return ex.core.read.profile(args["name"])


def _profile_list(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return {"profiles": ex.core.read.profile_rows()}


def _profile_save(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    profile = {key: value for key, value in args.items() if key != "name"}
    return ex.answer_now(lambda tok: ev.SaveProfile(name=args["name"], profile=profile, token=tok))


def _service_list(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    if ex.services is None:
        return {"services": []}
    waiting = ex.core.read.service_waiting()
    return {
        "services": [{**row, "waiting": waiting.get(row["name"], 0)} for row in ex.services.list()]
    }


# -------------------------------------------------------------------------- requests


async def _env_open(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return await ex.request(
        lambda tok: ev.OpenEnv(
            token=tok,
            image=args.get("image"),
            mem=args.get("mem"),
            trajectory=args.get("trajectory"),
            # a persistent environment outlives the connection that opened it, once
            # opened: one still waiting (for memory) when it closes is withdrawn
            conn=conn.id,
            peer=conn.peer,
            timeout_s=args.get("timeout_s"),
        )
    )


async def _env_close(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return await ex.request(lambda tok: ev.CloseEnv(token=tok, env_id=args["id"], peer=conn.peer))


async def _env_fork(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return await ex.request(
        lambda tok: ev.ForkEnv(token=tok, env_id=args["env"], n=args.get("n", 1), peer=conn.peer)
    )


async def _env_reset(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return await ex.request(lambda tok: ev.ResetEnv(token=tok, env_id=args["env"], peer=conn.peer))


async def _env_put(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return await ex.request(
        lambda tok: ev.PutFile(
            token=tok,
            env_id=args["id"],
            path=args["path"],
            data=args["data"],
            tar=bool(args.get("tar")),
            peer=conn.peer,
        )
    )


async def _env_get(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return await ex.request(
        lambda tok: ev.GetFile(token=tok, env_id=args["id"], path=args["path"], peer=conn.peer)
    )


async def _session_open(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return await ex.request(
        lambda tok: ev.OpenSession(token=tok, env_id=args["env"], peer=conn.peer)
    )


async def _session_interrupt(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return await ex.request(
        lambda tok: ev.InterruptSession(token=tok, session_id=args["id"], peer=conn.peer)
    )


async def _session_close(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return await ex.request(
        lambda tok: ev.CloseSession(token=tok, session_id=args["id"], peer=conn.peer)
    )


def _exec_later(ex: Executor, args: Args, conn: ConnInfo) -> Later:
    spec = ExecSpec.from_wire(args)
    return ex.request_later(
        lambda tok: ev.SubmitExec(spec=spec, token=tok, conn=conn.id, peer=conn.peer)
    )


async def _exec(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    spec = ExecSpec.from_wire(args)
    return await ex.request(
        lambda tok: ev.SubmitExec(spec=spec, token=tok, conn=conn.id, peer=conn.peer)
    )


async def _lease_acquire(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return await ex.request(
        lambda tok: ev.AcquireLease(
            token=tok,
            api=args["api"],
            ttl_s=args.get("ttl_s"),
            policy=args.get("policy"),
            deadline_s=args.get("deadline_s"),
            conn=conn.id,
            job=args.get("job"),
        )
    )


async def _lease_release(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return await ex.request(lambda tok: ev.ReleaseLease(token=tok, lease_id=args["lease_id"]))


async def _service_register(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    spec = {key: value for key, value in args.items() if value is not None}
    return await ex.request(lambda tok: ev.RegisterService(args=spec, token=tok))


async def _service_set_eff(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return await ex.request(
        lambda tok: ev.SetServiceEff(name=args["name"], eff=args["eff"], token=tok)
    )


async def _service_remove(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return await ex.request(lambda tok: ev.RemoveService(name=args["name"], token=tok))


async def _call(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    spec = CallSpec(
        args["name"],
        args["payload"],
        args.get("timeout_s"),
        args.get("job"),
        args.get("gpus"),
        args.get("ref"),
    )
    return await ex.request(
        lambda tok: ev.SubmitCall(spec=spec, token=tok, conn=conn.id, peer=conn.peer)
    )


async def _cancel(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    """Answered at once, except for a running exec: when it has been killed."""
    return await ex.request(
        lambda tok: ev.CancelAction(
            token=tok,
            action_id=args.get("id"),
            ref=args.get("ref"),
            conn=conn.id,
            peer=conn.peer,
            job=args.get("job"),
            everyone=args.get("job") is not None and is_operator(ex, conn),
        )
    )


def _lease_renew(ex: Executor, args: Args, conn: ConnInfo) -> Any:
    return ex.answer_now(
        lambda tok: ev.RenewLease(token=tok, lease_id=args["lease"], ttl_s=float(args["ttl_s"]))
    )


SYNC_OPS: dict[str, Callable[[Executor, Args, ConnInfo], Any]] = {
    "ping": _ping,
    "status": _status,
    "nodes": _nodes,
    "node.drain": _node_drain,
    "node.undrain": _node_undrain,
    "node.lost": _node_lost,
    "node.forget": _node_forget,
    "cluster.join": _cluster_join,
    "queue": _queue,
    "story": _story,
    "env.list": _env_list,
    "api.list": _api_list,
    "jobs": _jobs,
    "profile.save": _profile_save,
    "profile.get": _profile_get,
    "profile.list": _profile_list,
    "service.list": _service_list,
    "lease.renew": _lease_renew,
}

ASYNC_OPS: dict[str, Callable[[Executor, Args, ConnInfo], Awaitable[Any]]] = {
    "env.open": _env_open,
    "env.close": _env_close,
    "env.fork": _env_fork,
    "env.reset": _env_reset,
    "exec": _exec,
    "env.put": _env_put,
    "env.get": _env_get,
    "session.open": _session_open,
    "session.interrupt": _session_interrupt,
    "session.close": _session_close,
    "lease.acquire": _lease_acquire,
    "lease.release": _lease_release,
    "service.register": _service_register,
    "service.remove": _service_remove,
    "service.set_eff": _service_set_eff,
    "call": _call,
    "cancel": _cancel,
}

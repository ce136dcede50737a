"""Nodes in cluster mode: a node's CPU pool joins, drains, or is lost with its work.

The nodes themselves are the CPU cluster's pools (``core.cpu``) and the gpu pool's nodes
(``core.gpu``); what this module owns is what joining and losing one means for the other
books.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tangram.model import TangramError
from tangram.pools.cpu import CpuNodePool
from tangram.pools.gpu import ALLOWED_GPU_COUNTS, GpuNodePool
from tangram.protocol.errors import NotFound
from tangramd import events as ev
from tangramd.state.dispatch import handles
from tangramd.state.handlers.actions import close_env, finish_action
from tangramd.state.handlers.services import keep_warm

if TYPE_CHECKING:
    from tangramd.state.context import Core
    from tangramd.state.envs import EnvRec


@handles(ev.NodeJoined)
def node_joined(core: Core, e: ev.NodeJoined, now: float, out: list[ev.Command]) -> None:
    pool_id = f"cpu:{e.node}"
    if pool_id in core.pools or not e.cores_by_numa:
        return  # a known node came back within the timeout, or a pure gateway
    pool = CpuNodePool(e.node, e.cores_by_numa, e.mem_bytes)
    core.cpu.add_node(pool)
    core.pools[pool_id] = pool
    core.envs.reclaim(e.node, now, core.stimulus)
    core.passer.dirty = True


@handles(ev.NodeGpus)
def node_gpus(core: Core, e: ev.NodeGpus, now: float, out: list[ev.Command]) -> None:
    gpu = core.gpu
    if gpu is None or e.node in {node.node_id for node in gpu.nodes}:
        return  # no gpu pool here, or back within the timeout: residency as it was
    usable = max((n for n in ALLOWED_GPU_COUNTS if n <= e.count), default=0)
    if not usable or e.mem_per_gpu <= 0 or not e.h2d_bytes_per_s > 0:
        return
    pool = GpuNodePool(e.node, usable, mem_per_gpu=e.mem_per_gpu, h2d_bytes_per_s=e.h2d_bytes_per_s)
    gpu.add_node(pool)
    core.passer.dirty = True
    keep_warm(core, out)


@handles(ev.NodeLost)
def node_lost(core: Core, e: ev.NodeLost, now: float, out: list[ev.Command]) -> None:
    """End the node's running actions (``infra_error``), lose its environments, drop
    its pools (its GPUs' residency with them), and move the queued work of its throwaway
    environments elsewhere.

    Running actions never hang: they end here, naming the node. Persistent
    environments stay in the book as lost, so the next action on one gets
    ``env_lost``. A throwaway environment holds no state worth keeping: its actions
    that had not started wait for a fresh one on another node. A service's replicas
    on the node are gone: its next call restores one on another node.
    """
    why = f"node {e.node} lost: {e.why}"
    cause = core.stimulus
    lose_gpus(core, e.node, now, out, why)
    core.envs.give_up(e.node)
    on_node = [env for env in core.envs if env.node == e.node]
    persistent = [env.id for env in on_node if not env.throwaway]
    ids = {env.id for env in on_node}
    moving: list[EnvRec] = []
    for rec in core.actions:
        env = core.envs.get(rec.env) if rec.env in ids else None
        if env is None:
            continue
        if rec.state == "running" or not env.throwaway:
            finish_action(core, rec, now, out, outcome="infra_error", detail=why)
        elif rec.state == "queued":
            core.actions.unqueue(rec.action.id)
            env.pending.append(rec.action.id)
            core.actions.move(rec, "waiting_env", now, f"{why}; moving to another node", cause)
    for env in on_node:
        if env.state in ("closing", "closed"):
            core.envs.removed(env.id, now, out, cause)  # it will never answer
        elif env.throwaway and env.pending:
            moving.append(env)
        elif env.state == "creating":
            token, env.open_token = env.open_token, None
            if token is not None:
                out.append(core.reply(token, error=("infra_error", why)))
            close_env(core, env, now, out, why)
        else:
            core.envs.lose_node(env, now, why, cause)
    pool_id = f"cpu:{e.node}"
    if pool_id in core.pools:
        del core.pools[pool_id]
        core.cpu.remove_node(e.node)
    for env in moving:
        try:
            core.envs.move(env, now, out, cause, why)
        except TangramError as exc:  # no node could ever hold it now
            for aid in tuple(env.pending):
                finish_action(
                    core, core.actions[aid], now, out, outcome="infra_error", detail=exc.message
                )
    if core.cfg.record_envs:  # what survives a restart: lost for good, or gone
        for env_id in persistent:
            gone_or_lost = core.envs.get(env_id)
            kept = gone_or_lost is not None and gone_or_lost.state in ("ready", "lost")
            record = core.envs.record(gone_or_lost) if kept and gone_or_lost else None
            out.append(ev.RecordEnv(env_id=env_id, record=record, cause=cause))
    core.passer.dirty = True


@handles(ev.EnvsRestored)
def envs_restored(core: Core, e: ev.EnvsRestored, now: float, out: list[ev.Command]) -> None:
    for row in e.envs:
        core.envs.restore(
            now,
            env_id=str(row["id"]),
            trajectory=str(row["trajectory"]),
            node=str(row["node"]),
            image=row.get("image"),
            mem=int(row["mem"]),
            lost_node=str(row.get("lost_node") or ""),
            cause=core.stimulus,
        )


@handles(ev.DrainNode)
def drain_node(core: Core, e: ev.DrainNode, now: float, out: list[ev.Command]) -> None:
    try:
        core.cpu.set_draining(e.node, e.drain)
    except KeyError:
        raise NotFound(f"node {e.node!r} not found (or lost)") from None
    if e.token is not None:
        out.append(core.reply(e.token, result={"name": e.node, "draining": e.drain}))


def lose_gpus(core: Core, node: str, now: float, out: list[ev.Command], why: str) -> None:
    """The calls on ``node``'s GPUs end ``infra_error`` (its open batches are never
    sent), and the node leaves the gpu pool with what was resident there."""
    gpu = core.gpu
    if gpu is None or node not in {pool.node_id for pool in gpu.nodes}:
        return
    for name in list(core.services.forming):
        left = [b for b in core.services.forming[name] if b.node != node]
        if left:
            core.services.forming[name] = left
        else:
            del core.services.forming[name]
    for rec in core.actions:
        if rec.state != "running" or rec.call is None:
            continue
        riding = core.services.riding.get(rec.action.id)
        if (riding[0] if riding else gpu.node_of_action(rec.action.id)) != node:
            continue
        core.services.riding.pop(rec.action.id, None)
        finish_action(core, rec, now, out, outcome="infra_error", detail=why)
    gpu.remove_node(node)
    core.passer.dirty = True
    keep_warm(core, out)

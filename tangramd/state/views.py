"""The read model: the views the ops and the CLI show (status, queue, stories,
environments, APIs, nodes, profiles), read from the books and never changing them."""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Any

from tangram.jobs import DEFAULT_JOB
from tangram.model import ActionId
from tangram.protocol.errors import NotFound
from tangram.sched.share import Job, dominant_share, pool_totals
from tangramd.state.actions import ActionRec
from tangramd.state.handlers.actions import waiting_for

if TYPE_CHECKING:
    from tangramd.state.context import Core


class ReadModel:
    """The views of one core (``core.read``)."""

    def __init__(self, core: Core) -> None:
        self.core = core

    def trajectory_of(self, action_id: str) -> str | None:
        rec = self.core.actions.get(action_id)
        return rec.action.trajectory if rec else None

    def status(self, now: float) -> dict[str, Any]:
        """The daemon's summary. Besides the actions ``queued`` for units, it counts
        those ``waiting_env`` (for their environment to be created, or for the memory it
        needs), and the environments ``waiting_mem``; ``mem_wait`` says what the first of
        them needs (``memory: needs 1 GiB, 0.3 GiB free``; None when none waits)."""
        running = waiting_env = 0
        for r in self.core.actions.live.values():
            running += r.state == "running"
            waiting_env += r.state == "waiting_env"
        mem_waiters = self.core.envs.waiting_mem()
        return {
            "queued": len(self.core.actions.queue),
            "waiting_env": waiting_env,
            "waiting_mem": len(mem_waiters),
            "mem_wait": self.core.envs.mem_wait(mem_waiters[0]) if mem_waiters else None,
            "running": running,
            "environments": self.core.envs.live_count(),
            "leases": sum(1 for lease in self.core.leases if lease.state == "granted"),
            "passes": self.core.passer.passes,
            "recent": recent_summary(self.core.actions.finished),
            "pools": {
                pid: {"capacity": p.capacity, "free": p.free_units()}
                for pid, p in self.core.pools.items()
            },
        }

    def queue_view(self, now: float, viewer: int | None = None) -> dict[str, Any]:
        """Waiting and running actions, and the environments waiting for memory
        (``envs``). A waiting row's ``waiting_for`` names what it waits for (cores,
        memory and how much, its environment being created). A ``viewer`` uid (not an
        operator) gets only its own rows, and in ``others`` how many it does not see."""
        core = self.core
        mine = _visible_to(viewer)

        def row(rec: ActionRec) -> dict[str, Any]:
            a = rec.action
            waiting = rec.state in ("queued", "waiting_env")
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
                "waiting_for": waiting_for(core, rec) if waiting else None,
                "deadline_s": _left(core.actions.deadlines.get(a.id), now),
                "job": a.job,
            }

        queued = [*core.actions.queue.values()]
        queued += [r for r in core.actions.live.values() if r.state == "waiting_env"]
        live = [r for r in core.actions.live.values() if r.state == "running"]
        held = list(core.envs.waiting_mem())
        others = {
            "waiting": sum(not mine(r.owner) for r in queued),
            "running": sum(not mine(r.owner) for r in live),
            "envs": sum(not mine(e.owner) for e in held),
        }
        waiting = [row(r) for r in queued if mine(r.owner)]
        running = [row(r) for r in live if mine(r.owner)]
        envs = [
            {
                "env_id": env.id,
                "state": env.state,
                "trajectory": env.trajectory,
                "mem": env.mem,
                "throwaway": env.throwaway,
                "waiting_s": now - env.created_at,
                "waiting_for": core.envs.mem_wait(env),
                "deadline_s": _left(core.envs.deadlines.get(env.id), now),
            }
            for env in held
            if mine(env.owner)
        ]
        return {"waiting": waiting, "running": running, "envs": envs, "others": others}

    def story(self, record_id: str, origin: float, viewer: int | None = None) -> dict[str, Any]:
        """Every transition of one record (an action, environment, session or lease), with
        times relative to ``origin``; ``kind`` says which it is. A ``viewer`` uid (not an
        operator) is told only its own records' stories: another's is not found."""
        core = self.core
        log = core.stories.get(record_id)
        if log is None or not _visible_to(viewer)(self._owner_of(record_id)):
            raise NotFound(
                f"no story for {record_id!r}: not an action, environment, session or lease "
                "id this daemon knows (or too old)"
            )
        kind = core.stories.kind(record_id) or "action"
        live: Any = {
            "action": core.actions.get,
            "call": core.actions.get,
            "lease": core.actions.get,
            "environment": core.envs.get,
            "session": core.sessions.get,
        }[kind](record_id)
        is_action = kind in ("action", "call", "lease")
        outcome = core.actions.recent.get(ActionId(record_id)) if is_action else None
        if live is not None:
            state = live.state
        elif is_action:
            state = "done" if outcome else "forgotten"
        else:
            state = "closed"
        waits = None
        if is_action and live is not None and live.state in ("queued", "waiting_env"):
            waits = waiting_for(core, live)
        elif kind == "environment" and live is not None and live.state == "waiting_mem":
            waits = core.envs.mem_wait(live)
        return {
            "action_id": record_id,
            "id": record_id,
            "kind": kind,
            # the job of a live action (a finished one's is in its "submitted" event)
            "job": live.action.job if is_action and live is not None else None,
            "state": state,
            "waiting_for": waits,
            "outcome": getattr(live, "outcome", None) if live is not None else outcome,
            "events": [
                {
                    "t": t - origin,
                    "event": "finished" if new == "done" else new,
                    "from": old,
                    "detail": str(why),  # a placement's is formatted now (PlacementNote)
                    "cause": cause,
                }
                for t, old, new, why, cause in log
            ],
        }

    def session_rows(self) -> list[dict[str, Any]]:
        return self.core.sessions.rows()

    def _owner_of(self, record_id: str) -> tuple[int, int] | None:
        """Who submitted an action or opened an environment or session (None: unknown)."""
        core = self.core
        rec = core.actions.get(record_id)
        if rec is not None:
            return rec.owner
        if (owner := core.actions.owners.get(ActionId(record_id))) is not None:
            return owner
        env = core.envs.get(record_id)
        if env is None and (session := core.sessions.get(record_id)) is not None:
            env = core.envs.get(session.env)
        return env.owner if env is not None else None

    def env_rows(self, now: float, viewer: int | None = None) -> list[dict[str, Any]]:
        """``env.list``'s rows: a ``viewer`` uid (not an operator) gets its own."""
        mine = _visible_to(viewer)
        return [row for row in self.core.envs.rows(now) if mine(self._owner_of(row["id"]))]

    def job_rows(self) -> list[dict[str, Any]]:
        """One row per job (configured, or seen on an action since start): its terms, its
        queued and running actions, the cores and GPUs they hold, its share (dominant
        share of the cluster over its weight, tangram.sched.share), how many of its actions
        ended (``done``) and its recent ACTs (both kept across restarts: a job known only
        from them has a row too)."""
        core = self.core
        names = set(core.jobs_seen) | set(core.cfg.jobs) | {DEFAULT_JOB} | set(core.job_stats)
        queued: dict[str, int] = {}
        for rec in core.actions.queue.values():
            queued[rec.action.job] = queued.get(rec.action.job, 0) + 1
        running: dict[str, int] = {}
        held: dict[str, dict[str, int]] = {}
        for rec in core.actions.live.values():
            if rec.state == "running":
                job = rec.action.job
                running[job] = running.get(job, 0) + 1
                if rec.pool_id:
                    mine = held.setdefault(job, {})
                    r = core.pools[rec.pool_id].resource
                    mine[r] = mine.get(r, 0) + (len(rec.units) or 1)
        totals = pool_totals(core.pools)
        rows = []
        for name in sorted(names):
            spec = core.cfg.jobs.get(name) or Job(name)
            mine = held.get(name, {})
            acts = sorted(core.job_stats.get(name))
            rows.append(
                {
                    "name": name,
                    "weight": spec.weight,
                    "priority": spec.priority,
                    "max_cores": spec.max_cores,
                    "max_gpus": spec.max_gpus,
                    "queued": queued.get(name, 0),
                    "running": running.get(name, 0),
                    "cores": mine.get("cpu", 0),
                    "gpus": mine.get("gpu", 0),
                    "share": round(dominant_share(mine, totals, spec.weight), 6),
                    "done": core.job_stats.count(name),
                    "act_p50": _pct(acts, 0.50),
                    "act_p99": _pct(acts, 0.99),
                }
            )
        return rows

    def job_stats(self) -> dict[str, Any]:
        """The jobs' ACT statistics as ``job_stats.json`` holds them (jobstats.py)."""
        return self.core.job_stats.snapshot()

    def api_rows(self) -> list[dict[str, Any]]:
        waiting: dict[str, int] = {}
        for rec in self.core.actions.queue.values():
            if rec.action.kind == "api":
                waiting[rec.action.api or ""] = waiting.get(rec.action.api or "", 0) + 1
        return [
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
            for name, pool in sorted(self.core.apis.items())
        ]

    def node_rows(self) -> list[dict[str, Any]]:
        """The ``nodes`` view of the nodes with a pool (``heartbeat_age_s`` is the
        executor's: the core does not know the links)."""
        envs: dict[str, int] = {}
        for env in self.core.envs:
            if env.node and env.state not in ("closing", "closed"):
                envs[env.node] = envs.get(env.node, 0) + 1
        return [
            {
                "name": p.node_id,
                "state": "draining" if self.core.cpu.is_draining(p.node_id) else "ready",
                "mem_gb": round(p.mem_total / (1 << 30), 3),
                "envs": envs.get(p.node_id, 0),
                "running": len(p.actions()),
                "id": p.node_id,
                "cores": p.capacity,
                "free_cores": p.free_units(),
                "numa": [list(c) for c in p.numa],
                "mem_bytes": p.mem_total,
                "mem_reserved": p.mem_reserved,
                "busy_cores": [c for cores in p.numa for c in cores if p.holder(c) is not None],
                "gpus": self.gpu_count(p.node_id),
            }
            for p in self.core.cpu.nodes
        ]

    def node_work(self, node: str) -> dict[str, Any]:
        """What the core expects of one node (cluster reconciliation after a reconnect):
        the environments it still owns, those being created (with image and memory) or
        removed there, the exec actions running there, and those of them a ``cancel`` is
        killing (``{"action_id", "session"}``: the kill is sent again), and the service
        calls sent there that have not ended (``calls``)."""
        keep: list[str] = []
        creating: list[dict[str, Any]] = []
        closing: list[str] = []
        for env in self.core.envs:
            if env.node != node or env.lost_node:
                continue
            if env.state == "closing":
                closing.append(env.id)
            elif env.state in ("ready", "creating", "lost"):
                keep.append(env.id)
                if env.state == "creating":
                    creating.append({"env_id": env.id, "image": env.image, "mem": env.mem})
        pool_id = f"cpu:{node}"
        here = [
            rec
            for rec in self.core.actions.live.values()
            if rec.state == "running" and rec.action.kind == "exec" and rec.pool_id == pool_id
        ]
        killing = [
            {"action_id": rec.action.id, "session": rec.spec.session if rec.spec else None}
            for rec in here
            if rec.cancelling
        ]
        return {
            "keep": keep,
            "creating": creating,
            "closing": closing,
            "running": [rec.action.id for rec in here],
            "killing": killing,
            "calls": self.node_calls(node),
        }

    def call_node(self, action_id: str) -> str | None:
        """The node a running service call runs on, a batch's rider too (None: not
        running)."""
        rec = self.core.actions.get(action_id)
        if rec is None or rec.state != "running" or rec.call is None:
            return None
        riding = self.core.services.riding.get(rec.action.id)
        if riding is not None:
            return riding[0]
        gpu = self.core.gpu
        return None if gpu is None else gpu.node_of_action(rec.action.id)

    def node_calls(self, node: str) -> list[str]:
        """The calls sent to ``node`` that have not ended (not those of a batch that is
        still forming: it has not been sent)."""
        forming = {
            rec.action.id
            for batches in self.core.services.forming.values()
            for batch in batches
            for rec in (batch.leader, *batch.riders)
        }
        return [
            aid
            for aid, rec in self.core.actions.live.items()
            if rec.call is not None and aid not in forming and self.call_node(aid) == node
        ]

    def env_node(self, env_id: str) -> str | None:
        """The node holding an environment (None: unknown or not placed)."""
        env = self.core.envs.get(env_id)
        return env.node if env is not None and env.node else None

    def exec_reply(self, action_id: str) -> tuple[int, float] | None:
        """A running exec's reply token and time queued: what a cluster node needs to answer
        the client itself as this core's reply would (None: no reply pending)."""
        rec = self.core.actions.get(action_id)
        if rec is None or rec.state != "running" or rec.token is None or rec.call is not None:
            return None
        return rec.token, (rec.started_at or rec.submitted_at) - rec.submitted_at

    def action_node(self, action_id: str) -> str | None:
        """The node a running exec action runs on (None: not running)."""
        rec = self.core.actions.get(action_id)
        if rec is None or rec.state != "running" or not rec.pool_id.startswith("cpu:"):
            return None
        return rec.pool_id[len("cpu:") :]

    def gpu_count(self, node_id: str) -> int:
        gpu = self.core.gpu
        if gpu is None or node_id not in {node.node_id for node in gpu.nodes}:
            return 0
        return gpu.node(node_id).n_gpus

    def service_waiting(self) -> dict[str, int]:
        """Queued calls per service."""
        waiting: dict[str, int] = {}
        for rec in self.core.actions.queue.values():
            if rec.call is not None:
                waiting[rec.call.name] = waiting.get(rec.call.name, 0) + 1
        return waiting

    def profile(self, name: str) -> dict[str, Any]:
        prof = self.core.profiles.get(name)
        if prof is None:
            raise NotFound(f"profile {name!r} not found")
        return {"name": name, **prof}

    def profile_rows(self) -> list[dict[str, Any]]:
        return [{"name": n, **p} for n, p in sorted(self.core.profiles.items())]

    def total_cores(self) -> int:
        return sum(p.capacity for p in self.core.cpu.nodes)

    def env_ids(self, *, throwaway_only: bool = False, persistent_only: bool = False) -> list[str]:
        return [
            env.id
            for env in self.core.envs
            if not (throwaway_only and not env.throwaway)
            and not (persistent_only and env.throwaway)
        ]


def _left(deadline: float | None, now: float) -> float | None:
    """Seconds until a wait's deadline (None: it has none)."""
    return None if deadline is None else max(0.0, deadline - now)


def recent_summary(finished: deque[tuple[str, float, float]]) -> dict[str, dict[str, float]]:
    """Mean queue / exec / ACT seconds per action kind over the recent finished actions."""
    acc: dict[str, list[float]] = {}
    for kind, queue_s, exec_s in finished:
        row = acc.setdefault(kind, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += queue_s
        row[2] += exec_s
    return {
        kind: {"count": int(n), "queue_s": q / n, "exec_s": x / n, "act_s": (q + x) / n}
        for kind, (n, q, x) in acc.items()
    }


def _visible_to(viewer: int | None) -> Any:
    """Whether a record with this owner shows to ``viewer`` (None: an operator, who sees
    every record; a uid sees those it owns, never one whose owner is unknown)."""
    return lambda owner: viewer is None or (owner is not None and owner[0] == viewer)


def _pct(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None: no value yet)."""
    if not sorted_values:
        return None
    n = len(sorted_values)
    return round(sorted_values[min(n - 1, max(0, math.ceil(q * n) - 1))], 6)

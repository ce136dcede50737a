"""The action book: live actions, the queue, and how an action ends.

An action is one atomic call (an exec, a lease, a service call). The book holds the live
ones, the FCFS queue of those waiting for units, and the outcome of recently ended ones;
their stories stay in the core's :class:`~tangramd.state.story.Stories`. The exec
handlers live here too; :func:`finish_action` is the one way any action ends.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tangram.model import Action, ActionId, EnvId, TangramError, make_action
from tangram.protocol.errors import EnvLost, InfraError, NotFound, ShuttingDown
from tangram.protocol.results import CallResult, CallSpec, ExecResult, ExecSpec
from tangramd import events as ev
from tangramd.state.dispatch import handles
from tangramd.state.story import STORY_LIMIT, Stories, StoryLog, note, transition

if TYPE_CHECKING:
    from tangramd.state.core import Core
    from tangramd.state.envs import EnvRec

ACTION_EDGES: dict[tuple[str, str], str] = {
    ("new", "queued"): "submitted with a ready environment",
    ("new", "waiting_env"): "submitted while its environment is being created",
    ("waiting_env", "queued"): "the backend reported the environment created",
    ("waiting_env", "done"): "environment creation failed, env closed, client gone, shutdown",
    ("queued", "waiting_env"): "its node was lost; its throwaway env is recreated elsewhere",
    ("queued", "running"): "the scheduler placed it and the pool allocated its units",
    ("queued", "done"): "infeasible, lease deadline passed, client gone, or shutdown",
    ("running", "done"): "the backend finished the exec / the lease was released or expired",
}


STORY_KIND = {"api": "lease", "service": "call"}  # what ``tangramctl story`` calls them


@dataclass
class ActionRec:
    """A live action. ``history`` is its story: every transition, kept after it ends."""

    action: Action
    token: int | None
    env: EnvId | None
    conn: int | None
    submitted_at: float
    history: StoryLog
    spec: ExecSpec | None = None  # exec actions: the request as submitted
    run_as: tuple[int, int] | None = None  # exec actions: the user the command runs as
    call: CallSpec | None = None  # service actions: the call as submitted
    state: str = "new"
    pool_id: str = ""
    units: tuple[int, ...] = ()
    started_at: float | None = None
    expected_s: float = 0.0
    outcome: str | None = None


class ActionBook:
    """Live actions (``live``), the FCFS queue and the recent outcomes."""

    def __init__(self, stories: Stories) -> None:
        self.stories = stories
        self.live: dict[ActionId, ActionRec] = {}
        self.queue: dict[ActionId, ActionRec] = {}  # waiting for units, FCFS (seq) order
        self.recent: OrderedDict[ActionId, str] = OrderedDict()  # outcome of ended ones
        self.finished: deque[tuple[str, float, float]] = deque(maxlen=4096)  # kind, queue, exec
        # actions queued since the last pass (insertion order): the short pass reads them
        self.fresh: dict[ActionId, None] = {}
        self.queued_api = 0  # queued lease actions (next_wakeup asks their pools)
        self._seq = itertools.count(1)

    # ------------------------------------------------------------------ reads
    def get(self, action_id: str) -> ActionRec | None:
        return self.live.get(ActionId(action_id))

    def __getitem__(self, action_id: ActionId) -> ActionRec:
        return self.live[action_id]

    def __iter__(self) -> Iterator[ActionRec]:
        return iter(list(self.live.values()))

    def __len__(self) -> int:
        return len(self.live)

    def next_seq(self) -> int:
        return next(self._seq)

    # ------------------------------------------------------------------ changes
    def add(
        self,
        action: Action,
        now: float,
        *,
        token: int | None,
        env: EnvId | None,
        conn: int | None,
        spec: ExecSpec | None = None,
        run_as: tuple[int, int] | None = None,
        call: CallSpec | None = None,
    ) -> ActionRec:
        """A new action, in state ``new``, with a fresh story."""
        rec = ActionRec(
            action=action,
            token=token,
            env=env,
            conn=conn,
            submitted_at=now,
            history=self.stories.open(action.id, STORY_KIND.get(action.kind, "action")),
            spec=spec,
            run_as=run_as,
            call=call,
        )
        self.live[action.id] = rec
        return rec

    def move(self, rec: ActionRec, new: str, now: float, why: str, cause: int) -> None:
        transition(rec, new, ACTION_EDGES, now, why, cause)

    def enqueue(self, rec: ActionRec, now: float, cause: int) -> None:
        self.move(rec, "queued", now, "ready to schedule", cause)
        self.queue[rec.action.id] = rec
        self.queued_api += rec.action.kind == "api"
        self.fresh[rec.action.id] = None

    def unqueue(self, aid: ActionId) -> ActionRec | None:
        rec = self.queue.pop(aid, None)
        self.fresh.pop(aid, None)
        if rec is not None and rec.action.kind == "api":
            self.queued_api -= 1
        return rec

    def forget(self, rec: ActionRec, outcome: str) -> None:
        """The action ended: drop the record (its story keeps what happened)."""
        self.live.pop(rec.action.id, None)
        self.recent[rec.action.id] = outcome
        if len(self.recent) > STORY_LIMIT:
            self.recent.popitem(last=False)


# ---------------------------------------------------------------------- how actions end
def finish_action(
    core: Core,
    rec: ActionRec,
    now: float,
    out: list[ev.Command],
    *,
    outcome: str,
    result: ExecResult | None = None,
    detail: str = "",
    error: tuple[str, str] | None = None,
    call: CallResult | None = None,
) -> None:
    """End ``rec`` with ``outcome``: release its units, answer its client, close its
    throwaway environment when it was the last user, and forget the record."""
    if rec.state == "done":
        return
    books = core.actions
    env = core.envs.get(rec.env) if rec.env else None
    if env is not None and rec.action.id in env.pending:
        env.pending.remove(rec.action.id)
    books.unqueue(rec.action.id)
    if rec.spec is not None and rec.spec.session is not None:
        core.sessions.idle(rec.spec.session, rec.action.id)
    if rec.units:
        core.pools[rec.pool_id].release(rec.action.id)
        core.meter.finished(rec.pool_id, rec.action.id)
        core.passer.dirty = True
    books.move(rec, "done", now, f"{outcome} {detail}".strip(), core.stimulus)
    rec.outcome = outcome
    queue_s = (rec.started_at or now) - rec.submitted_at
    if result is None:
        exec_s = now - rec.started_at if rec.started_at is not None else 0.0
        result = ExecResult(outcome, exec_s=exec_s, detail=detail)  # type: ignore[arg-type]
    books.finished.append((rec.action.kind, queue_s, result.exec_s))
    if env is not None:
        env.active = max(0, env.active - 1)
        env.last_used = now
        if not env.active:  # idle from now on, maybe
            core.idle_from(now)
    if rec.token is not None:
        if error is not None:
            out.append(core.reply(rec.token, error=error))
        elif rec.call is not None:
            from tangramd.state.services import call_answer

            ended = call or CallResult(outcome, error=detail)  # type: ignore[arg-type]
            answer = call_answer(core, rec, now, queue_s, ended)
            out.append(core.reply(rec.token, result=answer.to_wire()))
        else:
            final = result.placed(
                action_id=rec.action.id,
                queue_s=queue_s,
                cores=rec.units,
                node=env.node if env else None,
            )
            out.append(core.reply(rec.token, result=final.to_wire()))
        rec.token = None
    if env is not None and env.active == 0 and env.throwaway:
        close_env(core, env, now, out, "throwaway environment done")
    books.forget(rec, outcome)


def close_env(core: Core, env: EnvRec, now: float, out: list[ev.Command], why: str) -> None:
    """Start removing an environment; the actions waiting for it end ``rejected``."""
    for aid in core.envs.close(env, now, out, why, core.stimulus):
        finish_action(core, core.actions[aid], now, out, outcome="rejected", detail=why)


# ---------------------------------------------------------------------- exec handlers
@handles(ev.SubmitExec)
def submit_exec(core: Core, e: ev.SubmitExec, now: float, out: list[ev.Command]) -> None:
    if core.shutting_down:
        raise ShuttingDown("daemon is shutting down")
    spec = e.spec
    cpus: Any = 1 if spec.cpus is None else spec.cpus
    t1_s, eff = spec.t1_s, spec.eff
    if spec.profile is not None:
        prof = core.profiles.get(spec.profile)
        if prof is None:
            raise NotFound(f"profile {spec.profile!r} not found (see `tangramctl profile --save`)")
        if prof.get("elastic", True):
            t1_s, eff = prof["t1_s"], prof["eff"]
            if spec.cpus is None:
                dops = sorted(int(k) for k in prof["dop"])
                cpus = [dops[0], dops[-1]]
    if isinstance(cpus, tuple):
        cpus = list(cpus)
    session = core.sessions.for_exec(spec.session, spec.env, e.peer) if spec.session else None
    if session is not None:
        env = core.ready_env(session.env, e.peer)
    elif spec.env is not None:
        opened = core.envs.open_env(spec.env, e.peer)
        if opened is None:
            raise NotFound(f"environment {spec.env!r} not found")
        env = opened
        if env.awaiting_node:
            raise InfraError(
                f"environment {env.id}: node {env.node} has not reconnected since the "
                "coordinator restarted; retry"
            )
        if env.lost_node:
            raise EnvLost(
                f"environment {env.id} was lost with node {env.lost_node}; open a new one"
            )
    else:
        env = core.envs.open(
            now,
            out,
            core.stimulus,
            image=spec.image,
            mem=spec.mem,
            trajectory=spec.trajectory,
            throwaway=True,
            token=None,
            conn=e.conn,
            owner=e.peer,
        )
    max_cores = max((p.capacity for p in core.cpu.nodes), default=0)
    aid = ActionId(core.new_id("a"))
    try:
        action = make_action(
            aid,
            "exec",
            env.trajectory,
            {"cpu": cpus},
            task=spec.task or "default",
            seq=core.actions.next_seq(),
            t1_s=t1_s,
            eff=eff,
            submitted_at=now,
            klass=f"{spec.task or 'default'}/exec/{command_class(spec.cmd)}",
            capacity={"cpu": max_cores},
        )
    except TangramError:
        if env.throwaway:
            close_env(core, env, now, out, "submission rejected")
        raise
    rec = core.actions.add(
        action,
        now,
        token=e.token,
        env=env.id,
        conn=e.conn,
        spec=spec,
        run_as=e.peer if core.cfg.exec_as_peer else None,
    )
    if session is not None:
        session.busy = aid  # one command at a time per shell
    note(rec, now, "submitted", f"cpus={cpus} env={env.id} cmd={short(spec.cmd)}", core.stimulus)
    env.active += 1
    env.last_used = now
    if env.state == "ready":
        core.enqueue(rec, now)
    elif env.state == "lost":
        core.envs.recreate(env, now, out, core.stimulus)
        env.pending.append(aid)
        core.actions.move(
            rec, "waiting_env", now, f"environment {env.id} being recreated", core.stimulus
        )
    else:
        env.pending.append(aid)
        core.actions.move(
            rec, "waiting_env", now, f"environment {env.id} being created", core.stimulus
        )


@handles(ev.ExecFinished)
def exec_done(core: Core, e: ev.ExecFinished, now: float, out: list[ev.Command]) -> None:
    rec = core.actions.get(e.action_id)
    if rec is None or rec.state != "running":
        return
    res = e.result
    env = core.envs.get(rec.env) if rec.env else None
    if res.outcome == "infra_error" and env is not None and e.env_lost:
        core.envs.lose(env, now, res.detail or "backend lost it", core.stimulus)
    elif res.outcome in ("ok", "failed"):
        core.history.observe(rec.action.klass, res.exec_s)
    finish_action(
        core,
        rec,
        now,
        out,
        outcome=res.outcome,
        result=res,
        detail=f"exit={res.exit_code} exec_s={res.exec_s:.4f} {res.detail}".strip(),
    )


def run_exec(core: Core, rec: ActionRec, out: list[ev.Command]) -> None:
    """The placed exec goes to the backend of its environment's node."""
    env = core.envs.get(rec.env) if rec.env else None
    assert env is not None and rec.spec is not None, "exec actions have an env and a spec"
    out.append(
        ev.RunExec(
            action_id=rec.action.id,
            env_id=env.id,
            node=env.node,
            cores=tuple(rec.units),
            spec=rec.spec,
            max_output=core.cfg.max_output,
            run_as=rec.run_as,
            cause=core.stimulus,
        )
    )


# ---------------------------------------------------------------------- helpers
def cmd_text(cmd: str | Sequence[str]) -> str:
    return cmd if isinstance(cmd, str) else " ".join(str(c) for c in cmd)


def command_class(cmd: str | Sequence[str]) -> str:
    """History class of a command: its program name (``pytest`` for pytest runs)."""
    words = cmd_text(cmd).split()
    for w in words:
        if "pytest" in w or w == "py.test":
            return "pytest"
    return words[0].rsplit("/", 1)[-1] if words else "?"


def short(cmd: str | Sequence[str], limit: int = 80) -> str:
    text = cmd_text(cmd)
    return text if len(text) <= limit else text[: limit - 1] + "…"

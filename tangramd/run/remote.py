"""Commands sent to the node that holds the environment: the coordinator's effects.

Each command becomes one link message (``tangram.protocol.link``) to its node; the node
carries it out with its :class:`~tangramd.run.local.LocalEffects` and sends the outcome
back, which the coordinator's link handlers feed to the core. What is reported here is
only what never reached a node: a node that is not connected fails the command at once
(on the next turn of the loop, never inside the ``feed`` that issued it).

The GPU commands go the same way to the node that holds the GPUs (``run_call``,
``warm_service``); a registration goes to every connected node with GPUs (``load_service``)
and is answered once all of them have loaded it, a removal likewise (``unload_service``).
The coordinator's service list is :class:`~tangramd.cluster.services.ClusterServices`
(``services``): the registrations and what the nodes report.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from tangram.protocol.link import EXEC_INPUT, make_message
from tangram.protocol.results import ExecResult
from tangramd import events as ev
from tangramd.run.effects import Report, Spawn

if TYPE_CHECKING:
    from tangramd.cluster.services import ClusterServices
    from tangramd.services.spec import ServiceSpec

Send = Callable[[str, dict[str, Any]], bool]  # (node, message) -> sent


class OnNode(NamedTuple):
    """What a placement's node does besides running it (the coordinator decides)."""

    reply: dict[str, Any] | None = None  # the client request it answers itself
    held: bool = False  # it holds the exec's stdin and files: the spec leaves them out
    missing: str | None = None  # why the exec cannot run: its input is on another node
    fetch: dict[str, Any] | None = None  # where it pulls its input from (another node)


class PutOnNode(NamedTuple):
    """Where a transfer's data is, when not in the transfer (the coordinator decides)."""

    held: int | None = None  # the node's own request that holds it
    missing: str | None = None  # why the transfer cannot run: its data is on another node
    fetch: dict[str, Any] | None = None  # where the node pulls it from (another node)


ReplyOnNode = Callable[[ev.RunExec], OnNode]
PutsOnNode = Callable[[ev.RunTransfer], PutOnNode]

# What a node may take, past the exec's own timeout, to report its end: the pull of its
# input from another node (``PULL_TIMEOUT_S`` of tangramd.cluster.node) on top of the
# request deadline itself.
FETCH_GRACE_S = 30.0


class _Owed:
    """An answer a node owes (see :meth:`RemoteEffects._watch_answer`): ``what`` names the
    request for the error; an exec's ``run_s`` bounds its run once the node has said it
    started (None: no bound, its spec has no timeout); a call's is its whole deadline."""

    __slots__ = ("deadline", "node", "run_s", "session", "started", "what")

    def __init__(
        self, node: str, what: str, deadline: float, run_s: float | None, session: str | None
    ) -> None:
        self.node, self.what, self.deadline, self.run_s = node, what, deadline, run_s
        self.session = session  # an exec's shell session (its kill interrupts it)
        self.started = False


NO_GPUS = "no node with GPUs is connected to this coordinator"


class _Asked:
    """A registration or removal sent to the nodes with GPUs: who has not answered yet,
    and what those who did said (``(node, info, error, code)``)."""

    __slots__ = ("answers", "spec", "waiting")

    def __init__(self, spec: ServiceSpec | None, waiting: set[str]) -> None:
        self.spec = spec
        self.waiting = waiting
        self.answers: list[tuple[str, dict[str, Any], str | None, str]] = []


def _unbound(event: ev.Event) -> None:  # pragma: no cover - bind() comes first
    raise RuntimeError("RemoteEffects used before bind()")


class RemoteEffects:
    """The :class:`~tangramd.run.effects.Effects` of a coordinator (see the module doc)."""

    name = "cluster"
    runs_execs_here = False  # the nodes run them and log their ends

    def __init__(
        self,
        send: Send,
        reply_on_node: ReplyOnNode,
        put_on_node: PutsOnNode,
        *,
        request_timeout_s: float = 60.0,
        restore_timeout_s: float = 600.0,
        overdue: Callable[[str, str], None] = lambda node, why: None,
        lost: Callable[[str, str], None] = lambda node, why: None,
        services: ClusterServices | None = None,
        gpu_nodes: Callable[[], list[str]] = list,
    ) -> None:
        """Every command that a node answers has a deadline: a ``create_env``,
        ``transfer``, ``open_session``, ``close_session`` or ``remove_env`` its node has not
        answered within ``request_timeout_s``, or a ``run_exec`` it has not said it started
        (``exec_started``) within it, fails (``infra_error``; a removal or a close counts as
        done), and ``overdue(node, why)`` is told (the coordinator drains it). A started
        exec has its own timeout plus ``request_timeout_s`` (plus ``FETCH_GRACE_S`` when it
        pulls its input) to end; past that it fails the same way and the node is told to
        kill it. A ``run_call`` has its ``timeout_s`` plus ``restore_timeout_s`` (``[gpu]
        restore_timeout_s``: what the node's restore may take) plus ``request_timeout_s``
        for each of its calls' ``call_done``; past that each call left fails
        ``infra_error`` naming the node and the node is drained the same way; but first
        the node is told to stop it (``stop_call``), and the call ends (the core releases
        its GPUs) only once the node confirms (``call_stopped``, or its ``call_done``), so
        its GPUs are never given to another call while it may still run there. A node that
        does not confirm within ``request_timeout_s`` is ``lost(node, why)`` (the
        coordinator declares it lost: that ends the call and frees its GPUs). A late
        answer is dropped (the core has moved on)."""
        self._send = send
        self.request_timeout_s = request_timeout_s
        self.restore_timeout_s = restore_timeout_s
        self._overdue = overdue
        self._lost = lost
        self._stopping: dict[str, str] = {}  # calls told to stop: action id -> why it failed
        # "x:<action>" (an exec), "cl:<action>" (a call), "so:"/"sc:<session>", "r:<env>"
        self._owed: dict[str, _Owed] = {}
        self._sweep: asyncio.TimerHandle | None = None
        self._late_sessions: dict[str, str] = {}  # opened past their deadline: id -> node
        self._creating: dict[str, asyncio.TimerHandle] = {}  # env id: its deadline
        self._expired: set[str] = set()  # env ids failed at their deadline
        self._reply_on_node = reply_on_node
        self._put_on_node = put_on_node
        self._report: Report = _unbound
        self._transfers: dict[str, ev.RunTransfer] = {}  # sent to a node, not answered yet
        self._transfer_ids = itertools.count(1)
        self.services = services  # registrations and the nodes' rows (``service list``)
        self._gpu_nodes = gpu_nodes  # the connected nodes with GPUs
        self._loading: dict[str, _Asked] = {}  # registrations the nodes are loading
        self._unloading: dict[str, _Asked] = {}  # removals under way

    def bind(self, report: Report, spawn: Spawn) -> None:
        self._report = report

    def in_flight(self) -> int:
        return 0  # the nodes hold the work; a coordinator's stop leaves it to them

    def _fail(self, event: ev.Event) -> None:
        asyncio.get_running_loop().call_soon(self._report, event)

    def _unreachable(self, node: str) -> str:
        return f"node {node} is not connected"

    # ------------------------------------------------------------------ life cycle
    async def recover_envs(self, records: list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
        return tuple(records)  # the nodes reconcile theirs when they rejoin

    async def recover_services(self) -> tuple[Any, ...]:
        """The registrations an earlier run kept, and the config's ``[[service]]``: the
        nodes load them as they join (their ``welcome``)."""
        return () if self.services is None else self.services.recover()

    def service_specs(self) -> list[ServiceSpec]:
        """What a node with GPUs that joins now loads: the registrations, and those being
        made (should one fail, its removal reaches that node too)."""
        kept = [] if self.services is None else self.services.specs()
        loading = [asked.spec for asked in self._loading.values() if asked.spec is not None]
        return kept + [spec for spec in loading if spec not in kept]

    async def shutdown(self, keep: list[str]) -> None:
        """Nothing to end here: environments and running work stay on their nodes."""

    # ------------------------------------------------------------------ commands
    def create_env(self, cmd: ev.CreateEnv) -> None:
        msg = make_message(
            "create_env",
            env_id=cmd.env_id,
            image=cmd.image,
            mem=cmd.mem,
            owner=list(cmd.owner) if cmd.owner else None,
        )
        if not self._send(cmd.node, msg):
            self._fail(ev.EnvCreated(env_id=cmd.env_id, error=self._unreachable(cmd.node)))
            return
        loop = asyncio.get_running_loop()
        self._creating[cmd.env_id] = loop.call_later(
            self.request_timeout_s, self._create_overdue, cmd
        )

    def _create_overdue(self, cmd: ev.CreateEnv) -> None:
        self._creating.pop(cmd.env_id, None)
        self._expired.add(cmd.env_id)
        why = f"node {cmd.node} did not answer create_env within {self.request_timeout_s:g} s"
        self._report(ev.EnvCreated(env_id=cmd.env_id, error=why))
        self._overdue(cmd.node, why)

    def env_answered(self, env_id: str) -> bool:
        """A node answered ``create_env``: False when it came after its deadline (the
        environment failed then; the caller removes what the node made late)."""
        timer = self._creating.pop(env_id, None)
        if timer is not None:
            timer.cancel()
        if env_id in self._expired:
            self._expired.discard(env_id)
            return False
        return True

    def remove_env(self, cmd: ev.RemoveEnv) -> None:
        if not self._send(cmd.node, make_message("remove_env", env_id=cmd.env_id)):
            # nothing to remove there now; the node drops it when it reconciles
            self._fail(ev.EnvRemoved(env_id=cmd.env_id))
            return
        self._watch_answer(f"r:{cmd.env_id}", cmd.node, "remove_env")

    def run_exec(self, cmd: ev.RunExec) -> None:
        reply, held, missing, fetch = self._reply_on_node(cmd)
        if missing is not None:  # never run without its input
            self._fail(ev.ExecFinished(cmd.action_id, ExecResult("infra_error", detail=missing)))
            return
        spec = cmd.spec.to_wire()
        if held:  # the node has them: they do not cross the link a second time
            for name in EXEC_INPUT:
                spec.pop(name, None)
        msg = make_message(
            "run_exec",
            action_id=cmd.action_id,
            env_id=cmd.env_id,
            cores=list(cmd.cores),
            spec=spec,
            max_output=cmd.max_output,
            run_as=list(cmd.run_as) if cmd.run_as else None,
            reply=reply,
            held=True if held else None,
            fetch=fetch,
        )
        if not self._send(cmd.node, msg):
            res = ExecResult("infra_error", detail=self._unreachable(cmd.node))
            self._fail(ev.ExecFinished(cmd.action_id, res))
            return
        timeout = cmd.spec.timeout_s
        run_s = None if timeout is None else timeout + self.request_timeout_s
        if run_s is not None and fetch is not None:
            run_s += FETCH_GRACE_S
        self._watch_answer(f"x:{cmd.action_id}", cmd.node, "run_exec", run_s, cmd.spec.session)

    def run_transfer(self, cmd: ev.RunTransfer) -> None:
        held, missing, fetch = self._put_on_node(cmd)
        if missing is not None:  # never put an empty file in place of the data
            error = ("infra_error", missing)
            self._fail(ev.TransferDone(token=cmd.token, env_id=cmd.env_id, error=error))
            return
        self._transfers[key := f"t{next(self._transfer_ids)}"] = cmd
        msg = make_message(
            "transfer",
            tid=key,
            env_id=cmd.env_id,
            direction=cmd.direction,
            path=cmd.path,
            data=cmd.data,
            tar=cmd.tar,
            max_bytes=cmd.max_bytes,
            held=held,
            fetch=fetch,
        )
        if not self._send(cmd.node, msg):
            self._transfers.pop(key, None)
            error = ("infra_error", self._unreachable(cmd.node))
            self._fail(ev.TransferDone(token=cmd.token, env_id=cmd.env_id, error=error))
            return
        asyncio.get_running_loop().call_later(self.request_timeout_s, self._transfer_overdue, key)

    def _transfer_overdue(self, key: str) -> None:
        cmd = self._transfers.pop(key, None)  # None: answered in time
        if cmd is None:
            return
        why = f"node {cmd.node} did not answer a transfer within {self.request_timeout_s:g} s"
        self._report(
            ev.TransferDone(token=cmd.token, env_id=cmd.env_id, error=("infra_error", why))
        )
        self._overdue(cmd.node, why)

    def transfer_done(self, tid: str) -> ev.RunTransfer | None:
        """The transfer a node's ``transfer_done`` answers (None: unknown or answered)."""
        return self._transfers.pop(tid, None)

    def start_shell(self, cmd: ev.StartShell) -> None:
        msg = make_message(
            "open_session",
            session_id=cmd.session_id,
            env_id=cmd.env_id,
            run_as=list(cmd.run_as) if cmd.run_as else None,
        )
        if not self._send(cmd.node, msg):
            error = self._unreachable(cmd.node)
            self._fail(ev.SessionOpened(session_id=cmd.session_id, error=error))
            return
        self._watch_answer(f"so:{cmd.session_id}", cmd.node, "open_session")

    def kill_exec(self, cmd: ev.KillExec) -> None:
        """The node kills it (its end comes back as the exec's ``exec_done``)."""
        msg = make_message("cancel_exec", action_id=cmd.action_id, session=cmd.session)
        self._send(cmd.node, msg)

    def interrupt_shell(self, cmd: ev.InterruptShell) -> None:
        self._send(cmd.node, make_message("interrupt_session", session_id=cmd.session_id))

    def end_shell(self, cmd: ev.EndShell) -> None:
        if not self._send(cmd.node, make_message("close_session", session_id=cmd.session_id)):
            self._fail(ev.SessionClosed(session_id=cmd.session_id))
            return
        self._watch_answer(f"sc:{cmd.session_id}", cmd.node, "close_session")

    # ------------------------------------------------------------------ deadlines
    def _watch_answer(
        self,
        key: str,
        node: str,
        what: str,
        run_s: float | None = None,
        session: str | None = None,
        within_s: float | None = None,
    ) -> None:
        """Expect the node's answer to ``key`` within ``within_s`` (default
        ``request_timeout_s``). One timer sweeps them all (an exec adds a map entry, not a
        timer of its own)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.request_timeout_s if within_s is None else within_s)
        self._owed[key] = _Owed(node, what, deadline, run_s, session)
        if self._sweep is None:
            self._sweep = loop.call_later(self._sweep_s(), self._sweep_owed)

    def _sweep_s(self) -> float:
        return min(max(self.request_timeout_s / 8, 0.02), 2.0)

    def answered(self, key: str) -> bool:
        """A node answered ``key`` (its outcome's key, e.g. ``x:<action>``): False when no
        answer was owed any more (it came after its deadline, or was never asked)."""
        return self._owed.pop(key, None) is not None

    def started(self, action_ids: list[str]) -> None:
        """A node says these execs started (``exec_started``): from now on each has its
        run bound (its timeout plus the grace) instead of the request deadline."""
        now = asyncio.get_running_loop().time()
        for action_id in action_ids:
            owed = self._owed.get(f"x:{action_id}")
            if owed is None or owed.started:
                continue
            owed.started = True
            if owed.run_s is None:
                del self._owed[f"x:{action_id}"]  # no timeout: it runs as long as it runs
            else:
                owed.deadline = now + owed.run_s

    def node_gone(self, node: str) -> None:
        """A node is lost: what it owed is ended with it (``NodeLost``), not at a deadline;
        a registration or removal no longer waits for it."""
        for key in [k for k, owed in self._owed.items() if owed.node == node]:
            del self._owed[key]
            if key.startswith("cs:"):  # (NodeLost ends the call)
                self._stopping.pop(key[3:], None)
        for session_id in [s for s, n in self._late_sessions.items() if n == node]:
            del self._late_sessions[session_id]  # (it dropped them, if it opened them)
        if self.services is not None:
            self.services.node_gone(node)
        for name, asked in list(self._loading.items()):
            if node in asked.waiting:
                self.service_loaded(node, name, {}, f"node {node} was lost", "infra_error")
        for name, asked in list(self._unloading.items()):
            if node in asked.waiting:
                self.service_unloaded(node, name)

    def stopping(self, action_id: str) -> bool:
        """The call is past its deadline, told to stop, and not confirmed stopped yet."""
        return action_id in self._stopping

    def resend_stop(self, node: str, action_id: str) -> None:
        """A node that rejoined still runs a call told to stop: tell it again."""
        if action_id in self._stopping:
            self._send(node, make_message("stop_call", action_id=action_id))

    def call_stopped(self, action_id: str) -> None:
        """The node no longer runs the call (its ``call_stopped`` or ``call_done``, or it
        rejoined without it): the call ends ``infra_error`` for missing its deadline, and
        the core releases its GPUs. Nothing for a call not being stopped."""
        self._owed.pop(f"cs:{action_id}", None)
        why = self._stopping.pop(action_id, None)
        if why is not None:
            self._report(ev.CallFinished(action_id, outcome="infra_error", error=why))

    def late_session(self, session_id: str) -> bool:
        """True once for a session whose ``session_opened`` came after its deadline (it
        failed then): the caller closes what the node opened late."""
        return self._late_sessions.pop(session_id, None) is not None

    def _sweep_owed(self) -> None:
        self._sweep = None
        now = asyncio.get_running_loop().time()
        for key in [k for k, owed in self._owed.items() if owed.deadline <= now]:
            self._expire(key, self._owed.pop(key))
        if self._owed:
            self._sweep = asyncio.get_running_loop().call_later(self._sweep_s(), self._sweep_owed)

    def _expire(self, key: str, owed: _Owed) -> None:
        kind, _, name = key.partition(":")
        node, limit = owed.node, self.request_timeout_s
        if kind == "x" and owed.started:
            assert owed.run_s is not None
            why = (
                f"node {node} did not report the end of exec {name} within {owed.run_s:.3g} s"
                " of its start (its timeout and the node_request_timeout_s grace)"
            )
        elif kind == "x":
            why = f"node {node} did not acknowledge run_exec within {limit:g} s"
        elif kind == "cl":
            assert owed.run_s is not None
            why = (
                f"node {node} did not answer run_call for call {name} within"
                f" {owed.run_s:.3g} s (its timeout_s, [gpu] restore_timeout_s and"
                " [cluster] node_request_timeout_s)"
            )
        elif kind == "cs":  # lost: that ends the call and frees its GPUs (NodeLost)
            why = f"node {node} did not confirm stop_call for call {name} within {limit:g} s"
            self._stopping.pop(name, None)
            self._lost(node, why)
            return
        else:
            why = f"node {node} did not answer {owed.what} within {limit:g} s"
        if kind == "x":
            kill = make_message("cancel_exec", action_id=name, session=owed.session)
            self._send(node, kill)  # in case it runs after all
            self._report(ev.ExecFinished(name, ExecResult("infra_error", detail=why)))
        elif kind == "cl":  # it ends once the node confirms it stopped it (call_stopped)
            self._stopping[name] = why
            self._send(node, make_message("stop_call", action_id=name))
            self._watch_answer(f"cs:{name}", node, "stop_call")
        elif kind == "so":
            self._late_sessions[name] = node
            self._report(ev.SessionOpened(session_id=name, error=why))
        elif kind == "sc":
            self._report(ev.SessionClosed(session_id=name))
        else:  # "r": removed as far as the core knows; the node drops it when it rejoins
            self._report(ev.EnvRemoved(env_id=name))
        self._overdue(node, why)

    # ------------------------------------------------------------------ GPU services
    def load_service(self, cmd: ev.LoadService) -> None:
        """To every connected node with GPUs; answered once all of them have (an error on
        one fails the registration, and the others drop it again)."""
        spec = cmd.spec
        msg = make_message("load_service", spec=spec.to_json())
        nodes = {node for node in self._gpu_nodes() if self._send(node, msg)}
        if not nodes:
            self._fail(ev.ServiceLoaded(spec=spec, error=NO_GPUS, code="infra_error"))
            return
        self._loading[spec.name] = _Asked(spec, nodes)

    def service_loaded(
        self, node: str, name: str, info: dict[str, Any], error: str | None, code: str
    ) -> None:
        """A node's ``service_loaded`` (or its loss): the registration is answered once
        every node it went to has answered. One that nothing waits for (the welcome's
        loads) is only logged by the caller."""
        asked = self._loading.get(name)
        if asked is None or node not in asked.waiting:
            return
        asked.waiting.discard(node)
        asked.answers.append((node, info, error, code))
        if asked.waiting:
            return
        del self._loading[name]
        spec = asked.spec
        assert spec is not None, "a registration has its spec"
        failed = [(n, e, c) for n, _, e, c in asked.answers if e is not None]
        loaded = [n for n, _, e, _ in asked.answers if e is None]
        if not failed or (loaded and all(c == "infra_error" for _, _, c in failed)):
            # loaded where it could be: a node lost meanwhile loads it when it is back
            if self.services is not None:
                self.services.added(spec)
            rows = {n: i for n, i, e, _ in asked.answers if e is None}
            info = self.services.row(spec, rows) if self.services is not None else {}
            self._report(ev.ServiceLoaded(spec=spec, info=info))
            return
        for other in self._gpu_nodes():  # (a node that joined meanwhile has it too)
            self._send(other, make_message("unload_service", name=name))
        where, why, code = failed[0]
        self._report(ev.ServiceLoaded(spec=spec, error=f"node {where}: {why}", code=code))

    def unload_service(self, cmd: ev.UnloadService) -> None:
        """Every connected node with GPUs drops it (its calls end ``rejected``); the
        removal is answered once all of them have."""
        if self.services is not None:
            self.services.removed(cmd.name)
        msg = make_message("unload_service", name=cmd.name)
        nodes = {node for node in self._gpu_nodes() if self._send(node, msg)}
        if not nodes:
            self._fail(ev.ServiceUnloaded(name=cmd.name))
            return
        self._unloading[cmd.name] = _Asked(None, nodes)

    def service_unloaded(self, node: str, name: str) -> None:
        """A node's ``service_unloaded`` (or its loss)."""
        asked = self._unloading.get(name)
        if asked is None or node not in asked.waiting:
            return
        asked.waiting.discard(node)
        if not asked.waiting:
            del self._unloading[name]
            self._report(ev.ServiceUnloaded(name=name))

    def run_call(self, cmd: ev.RunCall) -> None:
        """To the node that holds the GPUs: it evicts, restores and calls, and answers
        each call of the batch (``call_done``) within the call's ``timeout_s`` plus the
        restore's and the request's grace (else it fails there: see ``__init__``); not
        connected, every call fails."""
        msg = make_message(
            "run_call",
            action_id=cmd.action_id,
            name=cmd.service,
            gpus=list(cmd.gpus),
            evicted=[[v.gpu, v.service, v.dop] for v in cmd.evicted],
            payload=dict(cmd.payload),
            timeout_s=cmd.timeout_s,
            riders=[[aid, dict(payload)] for aid, payload in cmd.riders] or None,
        )
        if self._send(cmd.node, msg):
            limit = cmd.timeout_s + self.restore_timeout_s + self.request_timeout_s
            for action_id in [*(aid for aid, _ in cmd.riders), cmd.action_id]:  # riders first
                key = f"cl:{action_id}"
                self._watch_answer(key, cmd.node, "run_call", run_s=limit, within_s=limit)
            return
        why = self._unreachable(cmd.node)
        batch = 1 + len(cmd.riders)
        for action_id in [*(aid for aid, _ in cmd.riders), cmd.action_id]:
            self._fail(
                ev.CallFinished(action_id=action_id, outcome="infra_error", error=why, batch=batch)
            )

    def stop_running_call(self, cmd: ev.StopCall) -> None:
        """``cancel`` of a running call: its node is told to stop it (``stop_call``); its
        deadline entry goes (the node is not suspect for it), and the call ends once the
        node confirms (``call_stopped`` or its ``call_done``; the core ends it
        ``cancelled``), or with the node, lost if it does not confirm within
        ``node_request_timeout_s``."""
        aid = cmd.action_id
        if aid in self._stopping:
            return
        self._owed.pop(f"cl:{aid}", None)
        self._stopping[aid] = f"cancelled: stopped on node {cmd.node} while running"
        self._send(cmd.node, make_message("stop_call", action_id=aid))  # (or on its rejoin)
        self._watch_answer(f"cs:{aid}", cmd.node, "stop_call")

    def warm_service(self, cmd: ev.WarmService) -> None:
        """To the node that holds the GPUs (no answer: a restore that fails there leaves
        the replica to its next call, as on ``tangramd up``)."""
        self._send(cmd.node, make_message("warm_service", name=cmd.service, gpus=list(cmd.gpus)))

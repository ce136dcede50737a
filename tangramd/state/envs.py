"""The environment book: a node's environments, their memory and their wait queue.

An environment is a trajectory's long-lived state on one node (a working directory or a
container). It holds memory for its whole life and no cores between actions. The book
owns every ``EnvRec`` and the FIFO of environments waiting for memory; it emits the
node-side commands (``CreateEnv``, ``RemoveEnv``) and answers the core with typed results
(:class:`Ready`, :class:`Failed`, :class:`Gone`), so the core acts on actions and clients
while the book never touches either. This is the node side of the node/coordinator split:
the core's queues and scheduler are the coordinator side.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from tangram.model import ActionId, EnvId, TrajectoryId, Unschedulable
from tangram.pools.cpu import CpuCluster, NeverFits, NoRoomYet, Placed
from tangramd import events as ev
from tangramd.state.deadlines import Deadlines
from tangramd.state.story import Stories, StoryLog, note, transition

LOST_GONE_KEPT = 4096  # ids of environments lost with their node, remembered after removal

if TYPE_CHECKING:
    pass

EnvState = Literal["new", "waiting_mem", "creating", "ready", "lost", "closing", "closed"]

ENV_EDGES: dict[tuple[EnvState, EnvState], str] = {
    ("new", "creating"): "env.open or a throwaway exec asked for it, and a node has the memory",
    ("new", "waiting_mem"): "env.open or a throwaway exec found no node with the memory free",
    ("new", "ready"): "re-adopted from the state dir after a daemon restart",
    ("new", "lost"): "restored from the coordinator's store; lost until its node reconnects",
    ("waiting_mem", "creating"): "another environment's memory was freed and it now fits",
    ("waiting_mem", "closing"): "closed (or its client left) before memory became free",
    ("creating", "ready"): "the backend created it",
    ("creating", "closing"): "creation failed, or closed while being created",
    ("ready", "lost"): "an exec found it gone (container died or removed behind our back)",
    ("creating", "lost"): "its node was lost while the environment was being created",
    ("lost", "waiting_mem"): "a throwaway env of a lost node waits for memory on another node",
    ("lost", "creating"): "the next action recreates a fresh environment",
    ("lost", "ready"): "its node reconnected to a restarted coordinator that restored it",
    ("ready", "closing"): "env.close, idle TTL, throwaway done, or shutdown",
    ("lost", "closing"): "env.close of a lost environment",
    ("closing", "closed"): "the backend removed it",
}


@dataclass
class EnvRec:
    """One environment; ``history`` is its story (``tangramctl story e…``)."""

    id: EnvId
    trajectory: TrajectoryId
    node: str
    image: str | None
    mem: int
    created_at: float
    last_used: float
    history: StoryLog
    throwaway: bool = False
    open_token: int | None = None
    close_token: int | None = None
    conn: int | None = None
    owner: tuple[int, int] | None = None  # (uid, gid) of the client that opened it
    state: EnvState = "new"
    lost_node: str = ""  # set when the environment was lost with its node (cluster mode)
    awaiting_node: bool = False  # restored by a restarted coordinator, node not back yet
    active: int = 0  # actions submitted and not done
    pending: list[ActionId] = field(default_factory=list)
    fork: ForkGroup | None = None  # created by env.fork: the group its reply waits for


@dataclass
class ForkGroup:
    """The children of one ``env.fork``, answered together once the backend has made
    them all (``fork_s``: from the request to the last one)."""

    source: EnvId
    token: int | None
    ids: tuple[EnvId, ...]
    started: float
    left: int
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Ready:
    """The backend created ``env``: its ``pending`` actions may be queued."""

    env: EnvRec
    pending: tuple[ActionId, ...]


@dataclass(frozen=True, slots=True)
class Failed:
    """Creating ``env`` failed with ``error``; its ``pending`` actions cannot run."""

    env: EnvRec
    pending: tuple[ActionId, ...]
    error: str


@dataclass(frozen=True, slots=True)
class Gone:
    """The backend removed ``env``; the book forgot it."""

    env: EnvRec


def random_env_id() -> EnvId:
    """``e`` and 128 random bits in hex: an environment id is a capability no caller can
    guess or enumerate (issue 30: ids were ``e1``, ``e2``, ... and any caller could reach
    another's environment by counting)."""
    return EnvId("e" + os.urandom(16).hex())


@dataclass(frozen=True, slots=True)
class EnvDefaults:
    mem: int = 1 << 30
    image: str | None = None
    idle_ttl_s: float = 1800.0
    owned_by_peer: bool = False  # files belong to the client that opened it (exec as peer)


class EnvBook:
    """Environments of the nodes of one ``CpuCluster`` (see the module doc)."""

    def __init__(
        self,
        cpu: CpuCluster,
        defaults: EnvDefaults,
        stories: Stories,
        new_id: Callable[[], EnvId] | None = None,
    ) -> None:
        """``new_id``: where new ids come from (default :func:`random_env_id`)."""
        self.cpu = cpu
        self.defaults = defaults
        self.stories = stories
        self._envs: dict[EnvId, EnvRec] = {}
        self._waitq: deque[EnvId] = deque()  # waiting for memory, FIFO
        # removed after being lost with their node (it came back and dropped them): id ->
        # (node, owner), so that their next use is still env_lost, not not_found (bounded)
        self.lost_gone: dict[EnvId, tuple[str, tuple[int, int] | None]] = {}
        self.deadlines = Deadlines()  # env.open waits that give up (its timeout_s)
        self._new_id = new_id or random_env_id

    # ------------------------------------------------------------------ reads
    def get(self, env_id: str) -> EnvRec | None:
        return self._envs.get(EnvId(env_id))

    def open_env(self, env_id: str, peer: tuple[int, int] | None = None) -> EnvRec | None:
        """The environment if it exists, is not being closed, and ``peer`` may use it: its
        owner, root, or anyone when either side is unknown."""
        env = self._envs.get(EnvId(env_id))
        if env is None or env.state in ("closing", "closed"):
            return None
        if peer is not None and env.owner is not None and peer[0] not in (0, env.owner[0]):
            return None  # another user's environment: as if it did not exist
        return env

    def __iter__(self) -> Iterator[EnvRec]:
        return iter(list(self._envs.values()))

    def __len__(self) -> int:
        return len(self._envs)

    def live_count(self) -> int:
        return sum(1 for env in self._envs.values() if env.state != "closed")

    def idle_deadlines(self) -> Iterator[float]:
        """When each idle ready environment reaches its idle TTL."""
        for env in self._envs.values():
            if env.state == "ready" and not env.active:
                yield env.last_used + self.defaults.idle_ttl_s

    def waiting_mem(self) -> list[EnvRec]:
        """Environments waiting for memory, first come first."""
        envs = (self._envs.get(env_id) for env_id in self._waitq)
        return [env for env in envs if env is not None and env.state == "waiting_mem"]

    def mem_free(self) -> int:
        """The most memory free on one node that takes new environments (bytes)."""
        cpu = self.cpu
        return max((n.mem_free for n in cpu.nodes if not cpu.is_draining(n.node_id)), default=0)

    def mem_wait(self, env: EnvRec) -> str:
        """What ``env`` waits for, as ``status``, ``queue`` and ``story`` say it:
        ``memory: needs 1 GiB, 0.3 GiB free``."""
        return f"memory: needs {gib(env.mem)}, {gib(self.mem_free())} free"

    def affinity(self) -> dict[TrajectoryId, str]:
        """Pool of each trajectory whose environment is placed."""
        return {
            env.trajectory: f"cpu:{env.node}"
            for env in self._envs.values()
            if env.node and not env.lost_node
        }

    def rows(self, now: float) -> list[dict[str, Any]]:
        """The ``env.list`` view: persistent environments."""
        return [
            {
                "id": e.id,
                "node": e.node,
                "image": e.image,
                "mem": e.mem,
                "state": e.state,
                "trajectory": e.trajectory,
                "age_s": now - e.created_at,
                "idle_s": now - e.last_used,
                "active": e.active,
            }
            for e in self._envs.values()
            if not e.throwaway
        ]

    def records(self) -> tuple[dict[str, Any], ...]:
        """What a restarted daemon needs to re-adopt the persistent environments."""
        return tuple(
            self.record(e)
            for e in self._envs.values()
            if not e.throwaway and e.state in ("ready", "lost")
        )

    @staticmethod
    def record(e: EnvRec) -> dict[str, Any]:
        """One persistent environment's record (see ``records``)."""
        return {
            "id": e.id,
            "trajectory": e.trajectory,
            "node": e.node,
            "image": e.image,
            "mem": e.mem,
            "owner": list(e.owner) if e.owner is not None else None,
            "lost_node": e.lost_node,  # lost with its node (a coordinator's record)
        }

    # ------------------------------------------------------------------ changes
    def adopt(self, records: Iterable[Mapping[str, Any]], now: float, cause: int) -> list[EnvRec]:
        """Take over environments an earlier run left (ready, idle TTL restarting now).

        Records that name an unknown node or no longer fit in memory are skipped (and
        returned nowhere): the backend removes what the book does not hold.
        """
        adopted: list[EnvRec] = []
        for rec in records:
            env_id = EnvId(str(rec["id"]))
            if env_id in self._envs:
                continue
            traj = TrajectoryId(str(rec["trajectory"]))
            placed = self.cpu.place_trajectory(traj, env_id, 0, int(rec["mem"]))
            if not isinstance(placed, Placed) or placed.node != rec.get("node", placed.node):
                if isinstance(placed, Placed):
                    self.cpu.forget_trajectory(traj)
                continue
            owner = rec.get("owner")
            env = EnvRec(
                id=env_id,
                trajectory=traj,
                node=placed.node,
                image=rec.get("image"),
                mem=int(rec["mem"]),
                created_at=now,
                last_used=now,
                history=self.stories.open(env_id, "environment"),
                owner=(int(owner[0]), int(owner[1])) if owner else None,
            )
            transition(env, "ready", ENV_EDGES, now, "re-adopted after a daemon restart", cause)
            self._envs[env_id] = env
            adopted.append(env)
        return adopted

    def open(
        self,
        now: float,
        out: list[ev.Command],
        cause: int,
        *,
        image: str | None,
        mem: int | None,
        trajectory: str | None,
        throwaway: bool,
        token: int | None,
        conn: int | None,
        owner: tuple[int, int] | None = None,
        deadline: float | None = None,
    ) -> EnvRec:
        """A new environment: created at once where memory is free, else waiting for it
        (until ``deadline`` if one is given: see :meth:`give_up_waiting`).

        Raises ``Unschedulable`` when no node could ever hold it.
        """
        env_id = self._new_id()
        while env_id in self._envs:  # never reuse a live or restored id
            env_id = self._new_id()
        traj = TrajectoryId(trajectory or f"traj-{env_id}")
        mem_bytes = self.defaults.mem if mem is None else mem
        placed = self.cpu.place_trajectory(traj, env_id, 0, mem_bytes)
        if isinstance(placed, NeverFits):
            raise Unschedulable(f"cannot place environment: {placed.shortfall.describe()}")
        env = EnvRec(
            id=env_id,
            trajectory=traj,
            node=placed.node if isinstance(placed, Placed) else "",
            image=image or self.defaults.image,
            mem=mem_bytes,
            created_at=now,
            last_used=now,
            history=self.stories.open(env_id, "environment"),
            throwaway=throwaway,
            open_token=token,
            conn=conn,
            owner=owner,
        )
        self._envs[env_id] = env
        if isinstance(placed, NoRoomYet):
            why = f"no node has the memory free: {self.mem_wait(env)}"
            transition(env, "waiting_mem", ENV_EDGES, now, why, cause)
            self._waitq.append(env_id)
            if deadline is not None:
                self.deadlines.set(env_id, deadline)
        else:
            transition(env, "creating", ENV_EDGES, now, f"placed on {env.node}", cause)
            out.append(self._create(env, cause))
        return env

    def fork(
        self, src: EnvRec, n: int, now: float, out: list[ev.Command], cause: int, token: int | None
    ) -> ForkGroup:
        """``n`` children of ``src`` on its node, each holding ``src``'s memory: placed at
        once or not at all (a fork does not wait for memory; raises ``Unschedulable``)."""
        placed_ids: list[tuple[EnvId, TrajectoryId]] = []
        for _ in range(n):
            env_id = self._new_id()
            while env_id in self._envs or any(env_id == i for i, _ in placed_ids):
                env_id = self._new_id()
            traj = TrajectoryId(f"traj-{env_id}")
            placed = self.cpu.place_trajectory(traj, env_id, 0, src.mem)
            if not isinstance(placed, Placed) or placed.node != src.node:
                if isinstance(placed, Placed):
                    self.cpu.forget_trajectory(traj)
                for _, t in placed_ids:
                    self.cpu.forget_trajectory(t)
                raise Unschedulable(
                    f"cannot fork {src.id} into {n}: each child holds its memory "
                    f"({gib(src.mem)}) on its node {src.node}, which has room for "
                    f"{len(placed_ids)} now (a fork does not wait for memory)"
                )
            placed_ids.append((env_id, traj))
        group = ForkGroup(
            source=src.id, token=token, ids=tuple(i for i, _ in placed_ids), started=now, left=n
        )
        for env_id, traj in placed_ids:
            env = EnvRec(
                id=env_id,
                trajectory=traj,
                node=src.node,
                image=src.image,
                mem=src.mem,
                created_at=now,
                last_used=now,
                history=self.stories.open(env_id, "environment"),
                owner=src.owner,
                fork=group,
            )
            self._envs[env_id] = env
            transition(env, "creating", ENV_EDGES, now, f"forked from {src.id}", cause)
            create = self._create(env, cause)
            out.append(
                ev.CreateEnv(
                    env_id=create.env_id,
                    node=create.node,
                    image=create.image,
                    mem=create.mem,
                    owner=create.owner,
                    fork_of=src.id,
                    cause=cause,
                )
            )
        note(src, now, "forked", f"into {n}: {', '.join(group.ids)}", cause)
        src.last_used = now
        return group

    def restore(
        self,
        now: float,
        *,
        env_id: str,
        trajectory: str,
        node: str,
        image: str | None,
        mem: int,
        lost_node: str,
        cause: int,
    ) -> EnvRec:
        """An environment a restarted coordinator read back: lost until its node
        reconnects (:meth:`reclaim`), for good if it was lost before the restart."""
        env = EnvRec(
            id=EnvId(env_id),
            trajectory=TrajectoryId(trajectory),
            node=node,
            image=image,
            mem=mem,
            created_at=now,
            last_used=now,
            history=self.stories.open(env_id, "environment"),
            lost_node=node,
            awaiting_node=not lost_node,
        )
        transition(env, "lost", ENV_EDGES, now, "restored from the coordinator's store", cause)
        self._envs[env.id] = env
        return env

    def reclaim(self, node: str, now: float, cause: int) -> list[EnvRec]:
        """``node`` is back: its restored environments are ready again where its memory
        holds them; returns them."""
        back = []
        for env in self._envs.values():
            if not (env.awaiting_node and env.node == node):
                continue
            env.awaiting_node = False
            if self.cpu.place_on(env.trajectory, env.id, node, env.mem):
                env.lost_node = ""
                transition(env, "ready", ENV_EDGES, now, "its node reconnected", cause)
                back.append(env)
        return back

    def give_up(self, node: str) -> None:
        """``node`` did not come back: its restored environments stay lost."""
        for env in self._envs.values():
            if env.awaiting_node and env.node == node:
                env.awaiting_node = False

    def recreate(self, env: EnvRec, now: float, out: list[ev.Command], cause: int) -> None:
        """A lost environment is created afresh for its next action."""
        transition(env, "creating", ENV_EDGES, now, "next action recreates a lost env", cause)
        out.append(self._create(env, cause))

    def created(
        self, env_id: str, error: str | None, now: float, cause: int
    ) -> Ready | Failed | None:
        """The backend's answer to ``CreateEnv``; None if nobody waits for it any more."""
        env = self._envs.get(EnvId(env_id))
        if env is None or env.state != "creating":
            return None
        pending = tuple(env.pending)
        env.pending.clear()
        if error is None:
            transition(env, "ready", ENV_EDGES, now, "backend created it", cause)
            return Ready(env, pending)
        return Failed(env, pending, error)

    def lose(self, env: EnvRec, now: float, why: str, cause: int) -> None:
        """An exec found the environment gone behind our back."""
        if env.state == "ready":
            transition(env, "lost", ENV_EDGES, now, why, cause)

    def move(self, env: EnvRec, now: float, out: list[ev.Command], cause: int, why: str) -> None:
        """A throwaway environment whose node was lost starts afresh on another node (or
        waits for memory); raises ``Unschedulable`` when no node could ever hold it."""
        if env.state != "lost":
            transition(env, "lost", ENV_EDGES, now, why, cause)
        placed = self.cpu.place_trajectory(env.trajectory, env.id, 0, env.mem)
        if isinstance(placed, NeverFits):
            raise Unschedulable(f"cannot place environment: {placed.shortfall.describe()}")
        if isinstance(placed, NoRoomYet):
            env.node = ""
            transition(env, "waiting_mem", ENV_EDGES, now, "waiting for memory elsewhere", cause)
            self._waitq.append(env.id)
            return
        env.node = placed.node
        transition(env, "creating", ENV_EDGES, now, f"recreated on {placed.node}", cause)
        out.append(self._create(env, cause))

    def lose_node(self, env: EnvRec, now: float, why: str, cause: int) -> None:
        """The node holding ``env`` was lost: the environment is lost for good.

        Unlike :meth:`lose`, the next action is refused (``env_lost``) rather than given a
        fresh environment: the node's memory reservation went with the node.
        """
        env.lost_node = env.node
        if env.state == "ready":
            transition(env, "lost", ENV_EDGES, now, why, cause)

    def close(
        self, env: EnvRec, now: float, out: list[ev.Command], why: str, cause: int
    ) -> tuple[ActionId, ...]:
        """Start removing ``env``; returns the actions that were waiting for it."""
        if env.state in ("closing", "closed"):
            return ()
        self.deadlines.drop(env.id)
        transition(env, "closing", ENV_EDGES, now, why, cause)
        pending = tuple(env.pending)
        env.pending.clear()
        out.append(ev.RemoveEnv(env_id=env.id, node=env.node, cause=cause))
        return pending

    def removed(self, env_id: str, now: float, out: list[ev.Command], cause: int) -> Gone | None:
        """The backend removed the environment: forget it, give its memory to waiters."""
        env = self._envs.pop(EnvId(env_id), None)
        if env is None:
            return None
        if env.state == "closing":
            transition(env, "closed", ENV_EDGES, now, "backend removed it", cause)
        if env.lost_node and env.state == "lost":
            self.lost_gone[env.id] = (env.lost_node, env.owner)
            if len(self.lost_gone) > LOST_GONE_KEPT:
                del self.lost_gone[next(iter(self.lost_gone))]
        self.cpu.forget_trajectory(env.trajectory)
        self._place_waiting(now, out, cause)
        return Gone(env)

    def lost_error(self, env_id: str, peer: tuple[int, int] | None) -> str | None:
        """Why ``env_id``, not found now, is ``env_lost`` (None: it is not)."""
        gone = self.lost_gone.get(EnvId(env_id))
        if gone is None:
            return None
        node, owner = gone
        if peer is not None and owner is not None and peer[0] not in (0, owner[0]):
            return None  # (another user's: not found, as for a live one)
        return f"environment {env_id} was lost with node {node}; open a new one"

    def give_up_waiting(self, now: float) -> list[EnvRec]:
        """Environments whose ``env.open`` deadline passed while they wait for memory."""
        envs = (self._envs.get(EnvId(env_id)) for env_id in self.deadlines.due(now))
        return [env for env in envs if env is not None and env.state == "waiting_mem"]

    def idle_expired(self, now: float) -> list[EnvRec]:
        """Ready environments idle for longer than the idle TTL."""
        ttl = self.defaults.idle_ttl_s
        return [
            env
            for env in self._envs.values()
            if env.state == "ready" and not env.active and now - env.last_used >= ttl
        ]

    # ------------------------------------------------------------------ helpers
    def _create(self, env: EnvRec, cause: int) -> ev.CreateEnv:
        owner = env.owner if self.defaults.owned_by_peer else None
        return ev.CreateEnv(
            env_id=env.id, node=env.node, image=env.image, mem=env.mem, owner=owner, cause=cause
        )

    def _place_waiting(self, now: float, out: list[ev.Command], cause: int) -> None:
        """Memory was freed: place waiting environments in FIFO order."""
        while self._waitq:
            env = self._envs.get(self._waitq[0])
            if env is None or env.state != "waiting_mem":
                self._waitq.popleft()
                continue
            placed = self.cpu.place_trajectory(env.trajectory, env.id, 0, env.mem)
            if not isinstance(placed, Placed):
                return
            self._waitq.popleft()
            self.deadlines.drop(env.id)
            env.node = placed.node
            transition(env, "creating", ENV_EDGES, now, "memory became free", cause)
            out.append(self._create(env, cause))


def gib(nbytes: int) -> str:
    """Bytes as GiB for people: ``1 GiB``, ``0.3 GiB``, ``0.00098 GiB``."""
    value = nbytes / (1 << 30)
    return f"{value:.2g} GiB" if value < 1 else f"{value:.3g} GiB"

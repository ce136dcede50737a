"""Node-side bookkeeping of the daemon core: environments and their life cycle.

An environment is a trajectory's long-lived state on one node (a working directory or a
container). It holds memory for its whole life and no cores between actions. These are the
``Core`` methods and event handlers that open, create, recreate and remove environments;
they change state only through the core's single entry point (``Core.handle``) and emit
``CreateEnv``/``RemoveEnv`` commands for the executor.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tangram.model import EnvId, TrajectoryId, Unschedulable
from tangram.protocol.errors import NotFound, ShuttingDown
from tangramd import events as ev
from tangramd.entities import ENV_EDGES, EnvRec, transition

if TYPE_CHECKING:
    from tangram.pools.cpu import CpuCluster
    from tangramd.core import CoreConfig
    from tangramd.entities import ActionRec


class EnvBook:
    """Environment methods of ``Core`` (a mixin: the state lives on the core)."""

    cfg: CoreConfig
    cpu: CpuCluster
    envs: dict[EnvId, EnvRec]
    env_waitq: deque[EnvId]
    actions: dict[Any, ActionRec]
    shutting_down: bool

    if TYPE_CHECKING:  # provided by Core

        def _new_id(self, prefix: str) -> str: ...

        def _finish_action(
            self,
            rec: ActionRec,
            now: float,
            out: list[ev.Command],
            *,
            outcome: str,
            result: Mapping[str, Any] | None = None,
            detail: str = "",
            error: tuple[str, str] | None = None,
        ) -> None: ...

    def _open_env(
        self,
        now: float,
        out: list[ev.Command],
        *,
        image: str | None,
        mem: int | None,
        trajectory: str | None,
        throwaway: bool,
        token: int | None,
        cause: int,
        conn: int | None = None,
    ) -> EnvRec:
        if self.shutting_down:
            raise ShuttingDown("daemon is shutting down")
        env_id = EnvId(self._new_id("e"))
        traj = TrajectoryId(trajectory or f"traj-{env_id}")
        mem_bytes = self.cfg.default_env_mem if mem is None else mem
        placed = self.cpu.place_trajectory(traj, env_id, 0, mem_bytes)
        if not isinstance(placed, str) and placed.reason == "never":
            raise Unschedulable(f"cannot place environment: {placed.describe()}")
        env = EnvRec(
            id=env_id,
            trajectory=traj,
            node=placed if isinstance(placed, str) else "",
            image=image or self.cfg.default_image,
            mem=mem_bytes,
            created_at=now,
            last_used=now,
            throwaway=throwaway,
            open_token=token,
            conn=conn,
        )
        if not isinstance(placed, str):  # no memory free now: wait in FIFO order
            env.state = "waiting_mem"
            self.env_waitq.append(env_id)
            self.envs[env_id] = env
            return env
        self.envs[env_id] = env
        out.append(ev.CreateEnv(env_id, env.node, env.image, mem_bytes, cause=cause))
        return env

    def _retry_waiting_envs(self, now: float, out: list[ev.Command]) -> None:
        """Memory was freed: place waiting environments in FIFO order."""
        while self.env_waitq:
            env = self.envs.get(self.env_waitq[0])
            if env is None or env.state != "waiting_mem":
                self.env_waitq.popleft()
                continue
            placed = self.cpu.place_trajectory(env.trajectory, env.id, 0, env.mem)
            if not isinstance(placed, str):
                return
            self.env_waitq.popleft()
            env.node = placed
            transition(env, "creating", ENV_EDGES, now, "memory became free")
            out.append(ev.CreateEnv(env.id, env.node, env.image, env.mem, cause=0))

    def _close_env(self, env: EnvRec, now: float, out: list[ev.Command], why: str) -> None:
        if env.state in ("closing", "closed"):
            return
        transition(env, "closing", ENV_EDGES, now, why)
        for aid in list(env.pending):
            self._finish_action(self.actions[aid], now, out, outcome="rejected", detail=why)
        env.pending.clear()
        out.append(ev.RemoveEnv(env.id, env.node, cause=0))


# ---------------------------------------------------------------------- event handlers


def on_open(core: Any, e: ev.OpenEnv, now: float, out: list[ev.Command]) -> None:
    core._open_env(
        now,
        out,
        image=e.image,
        mem=e.mem,
        trajectory=e.trajectory,
        throwaway=False,
        token=e.token,
        cause=e.cause,
        conn=e.conn,
    )


def on_close(core: Any, e: ev.CloseEnv, now: float, out: list[ev.Command]) -> None:
    env = core.envs.get(EnvId(e.env_id))
    if env is None or env.state in ("closing", "closed"):
        raise NotFound(f"environment {e.env_id!r} not found")
    env.close_token = e.token
    core._close_env(env, now, out, "closed by client")


def on_env_created(core: Any, e: ev.EnvCreated, now: float, out: list[ev.Command]) -> None:
    env = core.envs.get(EnvId(e.env_id))
    if env is None or env.state != "creating":
        return
    if e.error is None:
        transition(env, "ready", ENV_EDGES, now, "backend created it")
        if env.open_token is not None:
            out.append(ev.Reply(env.open_token, result={"id": env.id, "node": env.node}, cause=0))
            env.open_token = None
        for aid in env.pending:
            core._enqueue(core.actions[aid], now)
        env.pending.clear()
        return
    if env.open_token is not None:
        out.append(ev.Reply(env.open_token, error=("infra_error", e.error), cause=0))
        env.open_token = None
    for aid in list(env.pending):
        core._finish_action(
            core.actions[aid],
            now,
            out,
            outcome="infra_error",
            detail=f"environment creation failed: {e.error}",
        )
    env.pending.clear()
    core._close_env(env, now, out, f"creation failed: {e.error}")


def on_env_removed(core: Any, e: ev.EnvRemoved, now: float, out: list[ev.Command]) -> None:
    env = core.envs.get(EnvId(e.env_id))
    if env is None:
        return
    if env.state == "closing":
        transition(env, "closed", ENV_EDGES, now, "backend removed it")
    core.cpu.forget_trajectory(env.trajectory)
    del core.envs[env.id]
    if env.close_token is not None:
        out.append(ev.Reply(env.close_token, result={"closed": True}, cause=0))
    core._retry_waiting_envs(now, out)

"""What the simulator's drivers share: one trajectory in flight and one submitted action."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tangram.model import Action
from tangram.sim.trace import TraceAction, Trajectory


@dataclass(slots=True)
class Traj:
    """A trajectory in flight: its next step, its RL step group and (k8s) its pod."""

    spec: Trajectory
    idx: int = 0
    group: tuple[str, int] = ("", 0)
    pod: Any = None  # k8s: (node, cores, created_at) once the pod exists
    pending: Run | None = None  # k8s: first action waiting for its pod


@dataclass(slots=True)
class Run:
    """One submitted action and its timings."""

    action: Action
    ta: TraceAction
    traj: Traj
    submit: float
    start: float = -1.0
    restore: float = 0.0
    exec: float = 0.0
    units: int = 0
    pool_id: str = ""
    attempts: int = 0  # api-retry: refused calls so far

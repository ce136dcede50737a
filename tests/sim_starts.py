"""A simulator engine that logs every start, for tests that compare two runs' decisions."""

from __future__ import annotations

from typing import Any

from tangram.sim.engine import Engine
from tangram.sim.runs import Run

Start = tuple[str, str, float, int]  # (action, node, time, cores)


def logged(*args: Any, **kwargs: Any) -> tuple[Engine, list[Start]]:
    """``Engine(*args, **kwargs)`` and the list it logs every start into."""
    starts: list[Start] = []

    def log(run: Run, now: float, units: int) -> None:
        starts.append((str(run.action.id), run.pool_id, now, units))

    return Engine(*args, on_start=log, **kwargs), starts

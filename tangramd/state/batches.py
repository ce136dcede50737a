"""Sending a formed batch of GPU calls to the host: one module both the call handlers and
the cancel handler use (each imports it; neither imports the other)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tangramd import events as ev
from tangramd.state.services import Batch

if TYPE_CHECKING:
    from tangramd.state.context import Core


def send_batch(core: Core, batch: Batch, out: list[ev.Command]) -> None:
    """The batch to the host: its leader's ``RunCall`` carries the riders' payloads. The
    leader's expected duration is the history's for a pass of this batch size."""
    leader = batch.leader
    assert leader.call is not None, "a batch is calls"
    klass = leader.action.klass
    if batch.size > 1 and core.history.count(f"{klass}@{batch.size}"):
        spec = core.services.specs.get(leader.call.name)
        speedup = spec.speedup(len(batch.gpus)) if spec is not None else 1.0
        leader.expected_s = core.history.estimate(f"{klass}@{batch.size}") / speedup
    calls = [leader, *batch.riders]
    timeout = min(r.call.timeout_s or core.cfg.call_timeout_s for r in calls if r.call)
    out.append(
        ev.RunCall(
            action_id=leader.action.id,
            service=leader.call.name,
            node=batch.node,
            gpus=batch.gpus,
            evicted=batch.evicted,
            payload=leader.call.payload,
            timeout_s=timeout,
            riders=tuple((r.action.id, r.call.payload) for r in batch.riders if r.call),
            cause=core.stimulus,
        )
    )

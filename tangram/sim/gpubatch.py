"""Dynamic batching of GPU service calls under the tangram policy, as the daemon does it
(docs/architecture.md §4.2, ``tangramd/state/handlers/services.py``).

When the scheduler places a call to a service whose ``max_batch`` is above 1 (the leader),
it takes along up to ``max_batch - 1`` calls to the same service that wait in the GPU queue
(riders, in queue order; not those the same pass places or fails itself). The riders run in
the leader's forward pass on the leader's GPUs: they start and finish with it and hold no
units of their own.

The pass lasts what the static baseline's service time model gives for the same calls
started together on the leader's ``g`` GPUs (``tangram.sim.baselines``): a call alone takes
``t(g)``, the trace's duration at ``g`` GPUs; while ``n`` calls run every one progresses
``1 + rho (n - 1)`` times slower, ``rho`` the running calls' mean of
``min(E(g) / gain, 1)`` with ``E(g) = t(1) / (g t(g))`` and ``gain`` the cluster's
``[baselines] static_batch_gain``. The pass ends when the last of them would be done
(``pass_seconds``); every call of the batch finishes then. The leader's restore, if any,
comes first and counts for the riders too.

A service with ``max_batch = 1`` (the default) never batches: the engine builds no
``GpuBatcher`` at all unless some service batches, so its runs are unchanged.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from tangram.model import ActionId
from tangram.sim.cluster import ClusterSpec
from tangram.sim.runs import Run


class BatchHost(Protocol):
    """What the batcher needs from the engine."""

    def start_run(
        self, run: Run, now: float, units: int, restore: float, resource: str, delay: float = 0.0
    ) -> None: ...

    def push(self, time: float, kind: int, obj: object) -> None: ...

    def add_busy(self, resource: str, unit_seconds: float) -> None: ...


def call_rho(run: Run, gpus: int, gain: float) -> float:
    """A call's ``rho`` on ``gpus`` GPUs: ``min(E(g) / gain, 1)`` (the static baseline's)."""
    alone = run.ta.true_duration(gpus)
    eff = run.ta.true_duration(1) / (gpus * alone) if alone > 0 else 1.0
    return min(eff / gain, 1.0)


def pass_seconds(solo: Sequence[float], rho: Sequence[float]) -> float:
    """How long a batch of calls started together runs until the last is done.

    ``solo[i]``: call ``i``'s time alone; ``rho[i]``: its rho. Processor sharing as in
    ``baselines._Batch``: while the calls ``k..`` (by solo time) run, each progresses
    ``1 + rho (m - 1)`` times slower, ``m`` of them, ``rho`` their mean."""
    order = sorted(range(len(solo)), key=lambda i: solo[i])
    total = 0.0
    done = 0.0  # solo seconds every remaining call has had
    rho_left = sum(rho)
    for k, i in enumerate(order):
        m = len(order) - k
        slowdown = 1.0 + (m - 1) * rho_left / m if m > 1 else 1.0
        total += max(solo[i] - done, 0.0) * slowdown
        done = max(done, solo[i])
        rho_left -= rho[i]
    return total


class GpuBatcher:
    """Leader + riders batching of service calls placed by the scheduler (see module doc)."""

    def __init__(self, host: BatchHost, cluster: ClusterSpec, done_kind: int) -> None:
        self.host = host
        self.limits = {s.name: s.max_batch for s in cluster.services if s.max_batch > 1}
        self.gain = cluster.baselines.static_batch_gain
        self.done_kind = done_kind  # the engine's DONE: every call of a pass ends with it
        self.batches = 0  # passes with riders
        self.riders = 0  # calls that rode in one

    @staticmethod
    def enabled(cluster: ClusterSpec) -> bool:
        return any(s.max_batch > 1 for s in cluster.services)

    def start(
        self,
        run: Run,
        now: float,
        units: int,
        restore: float,
        queue: dict[ActionId, Run],
        skip: Collection[ActionId],
    ) -> float | None:
        """Start the placed call ``run`` (the leader) on ``units`` GPUs with the riders it
        takes from ``queue`` (the GPU queue, in submission order; ``skip``: the calls this
        pass places or fails). Returns when the pass ends, or None when no call rode along
        (then the engine's own ``start_run`` started it, as without batching)."""
        service = run.action.service or ""
        limit = self.limits.get(service, 1)
        riders: list[Run] = []
        if limit > 1:
            for other in queue.values():
                if len(riders) >= limit - 1:
                    break
                aid = other.action.id
                if other.action.service == service and aid not in skip:
                    riders.append(other)
        if not riders:
            self.host.start_run(run, now, units, restore, "gpu")
            return None
        for other in riders:
            del queue[other.action.id]
        calls = [run, *riders]
        span = pass_seconds(
            [c.ta.true_duration(units) for c in calls],
            [call_rho(c, units, self.gain) for c in calls],
        )
        end = now + restore + span
        for c in calls:
            c.start, c.units, c.restore, c.exec = now, units, restore, span
        self.host.add_busy("gpu", units * span)
        for c in calls:  # the leader first: its DONE releases the GPUs
            self.host.push(end, self.done_kind, c)
        self.batches += 1
        self.riders += len(riders)
        return end

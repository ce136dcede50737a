"""What the handlers see of the core: the books, the pools and a few shared acts.

The router (:class:`tangramd.state.core.Core`) is the one implementation. Handlers are
typed against this protocol rather than the router's class, so the handler modules and
the router do not import each other: the router imports the handlers (to fill the
dispatch table), the handlers import only the books and this protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tangram.model import HistoryEstimator
    from tangram.pools.api import ApiPool
    from tangram.pools.cpu import CpuCluster
    from tangram.pools.gpu import GpuCluster
    from tangram.sched import LoadMeter
    from tangramd import events as ev
    from tangramd.state.actions import ActionBook, ActionRec
    from tangramd.state.config import CoreConfig
    from tangramd.state.envs import EnvBook, EnvRec
    from tangramd.state.jobstats import JobStats
    from tangramd.state.leases import LeaseBook
    from tangramd.state.passes import PassBook
    from tangramd.state.services import ServiceBook
    from tangramd.state.sessions import SessionBook
    from tangramd.state.story import Stories


class Core(Protocol):
    """The core as its handlers use it (see the module doc)."""

    cfg: CoreConfig
    cpu: CpuCluster
    apis: dict[str, ApiPool]
    gpu: GpuCluster | None
    pools: dict[str, Any]
    history: HistoryEstimator
    meter: LoadMeter
    stories: Stories
    actions: ActionBook
    envs: EnvBook
    sessions: SessionBook
    leases: LeaseBook
    services: ServiceBook
    profiles: dict[str, dict[str, Any]]
    passer: PassBook
    shutting_down: bool
    stimulus: int  # the id of the event being handled: every command's and entry's cause
    idle_due: float | None
    jobs_seen: set[str]  # every job an action was submitted under (issue 34)
    job_stats: JobStats  # each job's recent ACTs and count (the ``jobs`` op)

    def new_id(self, prefix: str) -> str: ...

    def reply(
        self, token: int, result: Any = None, error: tuple[str, str] | None = None
    ) -> ev.Reply: ...

    def enqueue(self, rec: ActionRec, now: float) -> None: ...

    def ready_env(self, env_id: str, peer: tuple[int, int] | None = None) -> EnvRec: ...

    def idle_from(self, now: float) -> None: ...

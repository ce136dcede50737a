"""The core's settings (``CoreConfig``), filled by the daemon's composition root from
``tangram.toml`` and by tests directly."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tangram.sched import Job, SchedConfig


@dataclass
class CoreConfig:
    sched: SchedConfig = field(default_factory=SchedConfig)
    coalesce_s: float = 0.0
    default_env_mem: int = 1 << 30
    env_idle_ttl_s: float = 1800.0
    default_lease_ttl_s: float = 60.0
    default_deadline_s: float = 30.0
    max_output: int = 1 << 20
    default_image: str | None = None
    exec_as_peer: bool = False  # commands run as the connecting client (cpu.exec_user="peer")
    # emit RecordEnv / PersistEnvs (tangramd up; a coordinator keeps its own registry)
    record_envs: bool = True
    # env.fork (tangramd up); a coordinator refuses it for now: its children would have to
    # be made by the node that holds the source's layers, and the link carries no fork yet
    forks: bool = True
    max_transfer: int = 8 << 20  # bytes one env.get may return (env.put: the op table's cap)
    call_timeout_s: float = 300.0  # a service call's handler limit when the call gives none
    # Short-cut passes that provably decide what the full pass would
    # (``scheduling.short_waiting``); False: every pass reads the whole queue (tests
    # compare the two).
    short_passes: bool = True
    # ``[[job]]``: the jobs' terms (fair share across jobs, tangram.sched.share; issue 34)
    jobs: Mapping[str, Job] = field(default_factory=dict)

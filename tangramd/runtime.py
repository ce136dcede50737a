"""The composition root of ``tangramd up``: config in, a ready-to-start executor out.

``build_runtime`` is the one place that knows every concrete part: it discovers the host,
builds the pools, the core (with the scheduler config built once from ``[sched]``), the
execution backend, and wires them to the socket server through the executor.
"""

from __future__ import annotations

import os
from typing import Any

import structlog

from tangram.model import TangramError
from tangram.pools.api import ApiPool
from tangram.pools.cpu import CpuCluster, CpuNodePool
from tangramd import ops
from tangramd.backends.base import Backend
from tangramd.config import resolve_user
from tangramd.core import Core, CoreConfig
from tangramd.executor import Executor

log = structlog.get_logger("tangramd")

NODE_ID = "local"


def build_runtime(config: Any) -> Executor:
    """Build core, pools and backend from a ``tangramd.config.Config``."""
    from tangramd.topology import discover

    topo = discover()
    cores = set(config.cpu.cores) if config.cpu.cores else set(topo.cores)
    layout = [tuple(c for c in numa if c in cores) for numa in topo.cores_by_numa]
    layout = [n for n in layout if n]
    if not layout:
        raise TangramError(f"cpu.cores {sorted(cores)} selects no core of this host")
    mem = config.cpu.mem or topo.mem_bytes
    cluster = CpuCluster([CpuNodePool(NODE_ID, layout, mem)])
    apis = {
        a.name: ApiPool(
            a.name,
            concurrency=a.concurrency,
            quota=a.quota,
            period_s=a.period_s,
            overflow=a.overflow,
            default_ttl_s=a.ttl_s,
        )
        for a in config.apis
    }
    core_cfg = CoreConfig(
        sched=config.sched.scheduler(),
        coalesce_s=config.sched.coalesce_ms / 1000.0,
        default_env_mem=config.cpu.default_env_mem,
        env_idle_ttl_s=config.cpu.env_idle_ttl_s,
        default_deadline_s=min((a.deadline_s for a in config.apis), default=30.0),
        max_output=config.cpu.max_output_bytes,
        default_image=config.cpu.docker_image if config.cpu.backend == "docker" else None,
        exec_as_peer=config.cpu.exec_user == "peer",
    )
    core = Core(cluster, apis, core_cfg)
    if config.gpu.simulated_count or config.services:
        log.warning(
            "gpu_manager_not_available",
            detail="[gpu]/[[service]] are configured but tangramd up has no GPU manager yet",
        )
    state_dir = config.daemon.state_dir
    backend: Backend
    if config.cpu.backend == "docker":
        from tangramd.backends.docker import DockerBackend

        backend = DockerBackend(
            default_image=config.cpu.docker_image,
            state_dir=state_dir,
            use_agent=config.cpu.exec_agent,
        )
    else:
        from tangramd.backends.process import ProcessBackend

        sandbox_user = None
        if config.cpu.exec_user != "peer":
            sandbox_user = resolve_user(config.cpu.exec_user)
        backend = ProcessBackend(os.path.join(state_dir, "process"), default_user=sandbox_user)
    daemon = config.daemon
    return Executor(
        core,
        backend,
        daemon.socket,
        state_dir=state_dir,
        handlers=ops,
        max_frame=daemon.max_frame_bytes,
        idle_timeout_s=daemon.idle_timeout_s,
        frame_timeout_s=daemon.frame_timeout_s,
        max_connections=daemon.max_connections,
        max_buffered_bytes=daemon.max_buffered_bytes,
        allowed_uids=daemon.allowed_uids,
        allowed_gids=daemon.allowed_gids,
    )

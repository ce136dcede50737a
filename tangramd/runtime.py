"""The composition root of ``tangramd up``: config in, a ready-to-start executor out.

``build_runtime`` is the one place that knows every concrete part: it discovers the host
(cores, memory, GPUs), builds the pools, the core (with the scheduler config built once
from ``[sched]``), the execution backend and the GPU service host, and wires them to the
socket server through the executor. The cluster daemons reuse its pieces
(``api_pools``, ``core_config``, ``make_backend``, ``server_options``).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import structlog

from tangram.model import TangramError
from tangram.pools.api import ApiPool
from tangram.pools.cpu import CpuCluster, CpuNodePool
from tangram.pools.gpu import ALLOWED_GPU_COUNTS, GpuCluster
from tangramd import ops
from tangramd.backends.base import Backend
from tangramd.config import COMMAND_LINE, ConfigError, resolve_user
from tangramd.executor import Executor
from tangramd.run.local import LocalEffects
from tangramd.services import Inventory, ServiceHost, SimulatedGpus, discover
from tangramd.services.spec import GB, ServiceSpec
from tangramd.state import Core, CoreConfig

log = structlog.get_logger("tangramd")

NODE_ID = "local"


def build_runtime(config: Any) -> Executor:
    """Build core, pools, backend and service host from a ``tangramd.config.Config``."""
    from tangramd.topology import discover as discover_host

    topo = discover_host()
    cores = set(config.cpu.cores) if config.cpu.cores else set(topo.cores)
    layout = [tuple(c for c in numa if c in cores) for numa in topo.cores_by_numa]
    layout = [n for n in layout if n]
    if not layout:
        raise TangramError(f"cpu.cores {sorted(cores)} selects no core of this host")
    mem = config.cpu.mem or topo.mem_bytes
    cluster = CpuCluster([CpuNodePool(NODE_ID, layout, mem)])
    state_dir = config.daemon.state_dir
    inventory = gpu_inventory(config.gpu)
    declared = declared_services(config, inventory)
    gpu, host = None, None
    if len(inventory):
        gpu = GpuCluster([inventory.node_pool(NODE_ID)], {})
        host = ServiceHost(
            inventory,
            state_dir,
            load_timeout_s=config.gpu.load_timeout_s,
            http_load_timeout_s=config.gpu.http_load_timeout_s,
            restore_timeout_s=config.gpu.restore_timeout_s,
            declared=declared,
        )
    log.info(
        "gpus_discovered",
        gpus=len(inventory),
        simulated=sum(1 for g in inventory.gpus if g.simulated),
        nvml=inventory.nvml_error or "ok",
    )
    cfg = replace(core_config(config), call_timeout_s=config.gpu.call_timeout_s)
    core = Core(cluster, api_pools(config), cfg, gpu=gpu)
    return Executor(
        core,
        LocalEffects(make_backend(config), host, max_frame=config.daemon.max_frame_bytes),
        config.daemon.socket,
        state_dir=state_dir,
        handlers=ops,
        operator_uids=config.daemon.operator_uids,
        **server_options(config),
    )


def declared_services(config: Any, inventory: Inventory) -> tuple[ServiceSpec, ...]:
    """The ``[[service]]`` registrations, checked against the GPUs (as ``service register``
    checks them); a ``ConfigError`` naming the entry when there are no GPUs or one does not
    fit on any of its GPU counts."""
    specs = tuple(service.spec() for service in config.services)
    source = config.path or COMMAND_LINE
    for i, spec in enumerate(specs):
        if not len(inventory):
            raise ConfigError(
                source,
                f"service[{i}]",
                f"service {spec.name!r} needs GPUs and this daemon has none",
                "[gpu] simulated = { count = N, mem_gb = G }, or NVML GPUs",
            )
        per_gpu = min(gpu.mem_bytes for gpu in inventory.gpus)
        counts = [k for k in spec.gpus if k <= len(inventory)]
        if not any(-(-spec.mem_bytes // k) <= per_gpu for k in counts):
            raise ConfigError(
                source,
                f"service[{i}].mem_gb",
                f"{spec.mem_gb:g} GB does not fit on {'/'.join(map(str, spec.gpus))} GPU(s) "
                f"of {per_gpu} bytes each ({len(inventory)} GPUs here)",
                f"up to {per_gpu * max(counts, default=0) / GB:g} GB",
            )
    return specs


def api_pools(config: Any) -> dict[str, ApiPool]:
    """The ``[[api]]`` endpoints as pools."""
    return {
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


def core_config(config: Any) -> CoreConfig:
    """The core's config (the scheduler's built once from ``[sched]``)."""
    return CoreConfig(
        sched=config.sched.scheduler(),
        coalesce_s=config.sched.coalesce_ms / 1000.0,
        default_env_mem=config.cpu.default_env_mem,
        env_idle_ttl_s=config.cpu.env_idle_ttl_s,
        default_deadline_s=min((a.deadline_s for a in config.apis), default=30.0),
        max_output=config.cpu.max_output_bytes,
        default_image=config.cpu.docker_image if config.cpu.backend == "docker" else None,
        exec_as_peer=config.cpu.exec_user == "peer",
        jobs=dict(getattr(config, "jobs", {})),
    )


def make_backend(config: Any) -> Backend:
    """The execution backend of ``[cpu] backend`` (environments under the state dir)."""
    state_dir = config.daemon.state_dir
    if config.cpu.backend == "docker":
        from tangramd.backends.docker import DockerBackend

        return DockerBackend(
            default_image=config.cpu.docker_image,
            state_dir=state_dir,
            use_agent=config.cpu.exec_agent,
        )
    from tangramd.backends.process import ProcessBackend

    sandbox_user = None if config.cpu.exec_user == "peer" else resolve_user(config.cpu.exec_user)
    return ProcessBackend(
        os.path.join(state_dir, "process"),
        default_user=sandbox_user,
        isolation=config.cpu.isolation,
        env_pids_max=config.cpu.env_pids_max,
        env_network=config.cpu.env_network,
        hide=[state_dir],  # (the daemon's whole state: its keys, journal, other envs)
    )


def server_options(config: Any) -> dict[str, Any]:
    """The Unix socket server's limits and peer allowlist, from ``[daemon]``."""
    daemon = config.daemon
    return {
        "max_frame": daemon.max_frame_bytes,
        "idle_timeout_s": daemon.idle_timeout_s,
        "frame_timeout_s": daemon.frame_timeout_s,
        "max_connections": daemon.max_connections,
        "max_buffered_bytes": daemon.max_buffered_bytes,
        "allowed_uids": daemon.allowed_uids,
        "allowed_gids": daemon.allowed_gids,
    }


def gpu_inventory(gpu: Any) -> Inventory:
    """The node's GPUs from ``[gpu]``: NVML ones (``nvml = true``), then the simulated ones,
    cut to the largest count the buddy pool takes (1, 2, 4, 8)."""
    sim = gpu.simulated
    simulated = SimulatedGpus(sim.count, sim.mem_gb, sim.h2d_gbps) if sim is not None else None
    inventory = discover(simulated, use_nvml=gpu.nvml)
    usable = max((n for n in ALLOWED_GPU_COUNTS if n <= len(inventory)), default=0)
    if usable < len(inventory):
        log.warning("gpus_unused", found=len(inventory), used=usable, detail="not 1, 2, 4 or 8")
        inventory = Inventory(inventory.gpus[:usable], inventory.nvml_error, ())
    return inventory

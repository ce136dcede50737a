"""Start-up of ``tangramd coordinator`` and ``tangramd node``: config, state dir, serve.

The click commands in :mod:`tangramd.main` parse the options and call :func:`coordinator`
or :func:`node`; everything they build is composed here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import socket
import sys
from typing import Any

import click
import structlog

from tangram.model import TangramError
from tangram.pools.cpu import CpuCluster
from tangramd import ops
from tangramd.cluster import config as cluster_config
from tangramd.cluster.link import is_loopback, split_host_port
from tangramd.config import ConfigError, parse_cores
from tangramd.lifecycle import (
    StateDirBusy,
    install_stop_handlers,
    lock_state_dir,
    run_loop,
    sd_notify,
)
from tangramd.logs import configure_logging
from tangramd.transport import check_socket_free

log = structlog.get_logger("tangramd")


def _fail(message: str, code: int = 1) -> None:
    click.echo(f"tangramd: {message}", err=True)
    sys.exit(code)


def _load(config_path: str | None, overrides: dict[str, Any]) -> tuple[Any, Any]:
    try:
        return cluster_config.load(config_path, overrides)
    except ConfigError as exc:
        _fail(str(exc), 2)
        raise AssertionError("unreachable") from None


def _address(text: str, what: str) -> tuple[str, int]:
    try:
        return split_host_port(text)
    except ValueError as exc:
        _fail(f"{what}: {exc}", 2)
        raise AssertionError("unreachable") from None


def _run(config: Any, serve: Any) -> None:
    """Lock the state dir, serve until SIGTERM/SIGINT; errors become one clear line."""
    configure_logging(config.daemon.log_format, config.daemon.log_level)
    os.umask(0o077)
    try:
        lock = lock_state_dir(config.daemon.state_dir)
    except StateDirBusy as exc:
        _fail(str(exc))
        return
    except OSError as exc:
        _fail(f"state dir {config.daemon.state_dir}: {exc.strerror}")
        return
    code = 0
    try:
        check_socket_free(config.daemon.socket)
        code = run_loop(serve(), config.daemon.event_loop)
    except TangramError as exc:
        _fail(str(exc))
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        _fail(f"cannot serve{where}: {exc.strerror or exc}")
    finally:
        lock.close()
    if code:
        sys.exit(code)


# --------------------------------------------------------------------------- coordinator


def coordinator(
    *,
    listen: str,
    socket_path: str | None,
    state_dir: str | None,
    config_path: str | None,
    insecure: bool,
) -> None:
    host, port = _address(listen, "--listen")
    if insecure and not is_loopback(host):
        _fail(f"--insecure serves plain TCP and is refused off loopback (got {host})", 2)
    config, cluster = _load(
        config_path, {"daemon.socket": socket_path, "daemon.state_dir": state_dir}
    )

    async def serve() -> int:
        from tangramd.cluster.coordinator import CoordinatorExecutor
        from tangramd.cluster.pki import ensure_pki
        from tangramd.core import Core
        from tangramd.runtime import api_pools, core_config, server_options

        pki = None if insecure else ensure_pki(config.daemon.state_dir, [host])
        # the coordinator's registry (SQLite) keeps the environments, not PersistEnvs
        cfg = dataclasses.replace(core_config(config), record_envs=False)
        core = Core(CpuCluster([]), api_pools(config), cfg)
        ex = CoordinatorExecutor(
            core,
            socket_path=config.daemon.socket,
            state_dir=config.daemon.state_dir,
            listen=(host, port),
            cluster=cluster,
            pki=pki,
            handlers=ops,
            **server_options(config),
        )
        stop = asyncio.Event()
        uninstall = install_stop_handlers(asyncio.get_running_loop(), stop)
        try:
            await ex.start()
            gc.collect()
            gc.freeze()
            sd_notify("READY=1\nSTATUS=coordinating")
            await stop.wait()
            sd_notify("STOPPING=1")
            await ex.stop()
        finally:
            uninstall()
        return 0

    _run(config, serve)


# --------------------------------------------------------------------------- node


def node(
    *,
    coordinator_addr: str,
    token: str | None,
    ca_sha256: str | None,
    socket_path: str | None,
    state_dir: str | None,
    name: str | None,
    cpus: str | None,
    cpu_backend: str | None,
    config_path: str | None,
    insecure: bool,
) -> None:
    host, port = _address(coordinator_addr, "--coordinator")
    if insecure and not is_loopback(host):
        _fail(f"--insecure sends the token in the clear and is refused off loopback ({host})", 2)
    if not insecure and not ca_sha256:
        _fail("--ca-sha256 is required (see `tangramctl cluster join`)", 2)
    config, _cluster = _load(
        config_path,
        {"daemon.socket": socket_path, "daemon.state_dir": state_dir, "cpu.backend": cpu_backend},
    )
    from tangramd.topology import discover

    topo = discover()
    if cpus is None:
        offered = set(config.cpu.cores or topo.cores)
    elif cpus.strip() == "":
        offered = set()  # a pure gateway
    else:
        try:
            offered = set(parse_cores(cpus))
        except ValueError as exc:
            _fail(f"--cpus: {exc}", 2)
            return
        outside = offered - set(topo.cores)
        if outside:
            _fail(f"--cpus: core(s) {sorted(outside)} are not usable on this host", 2)
    numa = (tuple(c for c in cores if c in offered) for cores in topo.cores_by_numa)
    layout = tuple(cores for cores in numa if cores)
    mem = config.cpu.mem or topo.mem_bytes

    async def serve() -> int:
        from tangramd.cluster.node import NodeAgent
        from tangramd.cluster.pki import normalise_pin
        from tangramd.runtime import gpu_inventory, make_backend, server_options

        inventory = gpu_inventory(config.gpu)
        agent = NodeAgent(
            name=name or socket.gethostname(),
            coordinator=(host, port),
            token=token,
            ca_sha256=normalise_pin(ca_sha256) if ca_sha256 else None,
            insecure=insecure,
            backend=make_backend(config),
            socket_path=config.daemon.socket,
            state_dir=config.daemon.state_dir,
            cores_by_numa=layout,
            mem_bytes=mem,
            gpus=inventory.gpus,
            **server_options(config),
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        uninstall = install_stop_handlers(loop, stop)
        try:
            await agent.start()
            sd_notify("READY=1\nSTATUS=serving")
            gave_up = loop.create_task(agent.gave_up.wait())
            stopping = loop.create_task(stop.wait())
            await asyncio.wait({gave_up, stopping}, return_when=asyncio.FIRST_COMPLETED)
            gave_up.cancel()
            stopping.cancel()
            sd_notify("STOPPING=1")
            await agent.stop()
        finally:
            uninstall()
        if agent.failed is not None:
            click.echo(f"tangramd node: {agent.failed}", err=True)
            return 1
        return 0

    _run(config, serve)

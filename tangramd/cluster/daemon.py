"""Start-up of ``tangramd coordinator`` and ``tangramd node``: config, state dir, serve.

The click commands in :mod:`tangramd.main` parse the options and call :func:`coordinator`
or :func:`node`; everything they build is composed here (:func:`build_coordinator`,
:func:`build_node`, :func:`serve_node`), and the in-process test cluster
(``tests/cluster_harness.py``) composes its daemons through the same functions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import sys
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

import click
import structlog

from tangram.model import TangramError
from tangram.pools.cpu import CpuCluster
from tangram.pools.gpu import GpuCluster
from tangramd import ops
from tangramd.cluster import config as cluster_config
from tangramd.cluster.link import is_loopback, split_host_port
from tangramd.collector import freeze_startup
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

if TYPE_CHECKING:
    from tangramd.cluster.config import ClusterConfig
    from tangramd.cluster.coordinator import CoordinatorExecutor
    from tangramd.cluster.node import NodeAgent

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


def build_coordinator(
    config: Any, cluster: ClusterConfig, listen: tuple[str, int], *, insecure: bool
) -> CoordinatorExecutor:
    """The coordinator as ``tangramd coordinator`` composes it, not started (the
    in-process test cluster builds it here too): its PKI unless ``insecure``, its core
    (its cpu and gpu pools empty until nodes join), the config's ``[[service]]``."""
    from tangramd.cluster.coordinator import CoordinatorExecutor
    from tangramd.cluster.pki import ensure_pki
    from tangramd.cluster.services import ClusterServices
    from tangramd.runtime import api_pools, core_config, server_options
    from tangramd.state import Core

    pki = None if insecure else ensure_pki(config.daemon.state_dir, [listen[0]])
    # the environments' records go to the coordinator's SQLite store (StoreEnvRecords)
    cfg = dataclasses.replace(
        core_config(config), forks=False, call_timeout_s=config.gpu.call_timeout_s
    )
    core = Core(CpuCluster([]), api_pools(config), cfg, gpu=GpuCluster([], {}))
    declared = tuple(service.spec() for service in config.services)
    return CoordinatorExecutor(
        core,
        socket_path=config.daemon.socket,
        state_dir=config.daemon.state_dir,
        listen=listen,
        cluster=cluster,
        pki=pki,
        handlers=ops,
        operator_uids=config.daemon.operator_uids,
        services=ClusterServices(config.daemon.state_dir, declared),
        restore_timeout_s=config.gpu.restore_timeout_s,
        **server_options(config),
    )


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
        ex = build_coordinator(config, cluster, (host, port), insecure=insecure)
        stop = asyncio.Event()
        uninstall = install_stop_handlers(asyncio.get_running_loop(), stop)
        try:
            await ex.start()
            freeze_startup()
            sd_notify("READY=1\nSTATUS=coordinating")
            await stop.wait()
            sd_notify("STOPPING=1")
            await ex.stop()
        finally:
            uninstall()
        return 0

    _run(config, serve)


# --------------------------------------------------------------------------- node


def node_capacity(config: Any, cpus: str | None) -> tuple[tuple[tuple[int, ...], ...], int]:
    """The cores (by NUMA node) and the memory a node offers: ``cpus`` as ``--cpus`` takes
    it (None: ``[cpu] cores`` or every usable core; "": none, a pure gateway). Raises
    ValueError naming what is wrong."""
    from tangramd.topology import discover

    topo = discover()
    if cpus is None:
        offered = set(config.cpu.cores or topo.cores)
    elif cpus.strip() == "":
        offered = set()
    else:
        offered = set(parse_cores(cpus))
        outside = offered - set(topo.cores)
        if outside:
            raise ValueError(f"core(s) {sorted(outside)} are not usable on this host")
    numa = (tuple(c for c in cores if c in offered) for cores in topo.cores_by_numa)
    return tuple(cores for cores in numa if cores), config.cpu.mem or topo.mem_bytes


def build_node(
    config: Any,
    *,
    name: str,
    coordinator: tuple[str, int],
    token: str | None,
    ca_sha256: str | None,
    insecure: bool,
    capacity: tuple[tuple[tuple[int, ...], ...], int],
) -> NodeAgent:
    """The node as ``tangramd node`` composes it, not started (the in-process test cluster
    builds it here too): its backend, GPU inventory and service host from ``config``."""
    from tangramd.cluster.node import NodeAgent
    from tangramd.cluster.pki import normalise_pin
    from tangramd.runtime import gpu_inventory, make_backend, server_options
    from tangramd.services import ServiceHost

    layout, mem = capacity
    if config.services:  # validated like `tangramd up`'s, registered nowhere
        log.warning(
            "config_services_not_registered",
            services=[service.name for service in config.services],
            detail="a node's [[service]] entries are not registered: a cluster's services are "
            "registered on its coordinator (its [[service]] or `tangramctl service register`), "
            "which loads them on every node with GPUs",
        )
    inventory = gpu_inventory(config.gpu)
    host = None
    if len(inventory):  # its replicas' logs under the state dir; registrations not kept
        host = ServiceHost(
            inventory,
            config.daemon.state_dir,
            load_timeout_s=config.gpu.load_timeout_s,
            http_load_timeout_s=config.gpu.http_load_timeout_s,
            restore_timeout_s=config.gpu.restore_timeout_s,
            node=name,
        )
    return NodeAgent(
        name=name,
        coordinator=coordinator,
        token=token,
        ca_sha256=normalise_pin(ca_sha256) if ca_sha256 else None,
        insecure=insecure,
        backend=make_backend(config),
        socket_path=config.daemon.socket,
        state_dir=config.daemon.state_dir,
        cores_by_numa=layout,
        mem_bytes=mem,
        gpus=inventory.gpus,
        services=host,
        **server_options(config),
    )


async def serve_node(agent: NodeAgent, stop: asyncio.Event) -> int:
    """Start ``agent`` and serve until ``stop`` is set or it gives up joining (wrong pin,
    wrong token: ``agent.failed`` says why); stop it. The exit code: 1 if it gave up."""
    loop = asyncio.get_running_loop()
    await agent.start()
    sd_notify("READY=1\nSTATUS=serving")
    gave_up = loop.create_task(agent.gave_up.wait())
    stopping = loop.create_task(stop.wait())
    try:
        await asyncio.wait({gave_up, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gave_up.cancel()
        stopping.cancel()
    sd_notify("STOPPING=1")
    await agent.stop()
    return 0 if agent.failed is None else 1


TOKEN_ENV = "TANGRAM_JOIN_TOKEN"
TOKEN_CREDENTIAL = "join-token"  # $CREDENTIALS_DIRECTORY/join-token (systemd LoadCredential=)
TOKEN_ON_ARGV_WARNING = (
    "warning: --token puts the join token on this process's command line, which `ps` shows "
    f"every local user; pass --token-file PATH, ${TOKEN_ENV} or the systemd credential "
    f"{TOKEN_CREDENTIAL} (LoadCredential=) instead"
)


def join_token(
    token: str | None, token_file: str | None, environ: MutableMapping[str, str]
) -> str | None:
    """The node's join token, from the first of: ``--token-file``, ``--token`` (warned
    about: argv is public), ``$TANGRAM_JOIN_TOKEN``, the systemd credential ``join-token``;
    None if none gives one (a node with its own credential needs none). The variable is
    removed from ``environ``: the node's commands and services never inherit it. Raises
    ValueError naming the source that is unusable."""
    from_env = environ.pop(TOKEN_ENV, "").strip() or None
    if token is not None and token_file is not None:
        raise ValueError("pass --token or --token-file, not both")
    if token_file is not None:
        return _read_token(token_file, "--token-file", empty_ok=False)
    if token is not None:
        click.echo(f"tangramd node: {TOKEN_ON_ARGV_WARNING}", err=True)
        return token.strip() or None
    if from_env is not None:
        return from_env
    credentials = environ.get("CREDENTIALS_DIRECTORY")
    if credentials:
        path = os.path.join(credentials, TOKEN_CREDENTIAL)
        if os.path.exists(path):  # an empty one (SetCredential= default): no token
            return _read_token(path, f"credential {TOKEN_CREDENTIAL}", empty_ok=True)
    return None


def _read_token(path: str, what: str, *, empty_ok: bool) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ValueError(f"{what} {path}: {why}") from None
    if not text and not empty_ok:
        raise ValueError(f"{what} {path} is empty")
    return text or None


def node(
    *,
    coordinator_addr: str,
    token: str | None,
    token_file: str | None,
    ca_sha256: str | None,
    socket_path: str | None,
    state_dir: str | None,
    name: str | None,
    cpus: str | None,
    cpu_backend: str | None,
    config_path: str | None,
    insecure: bool,
) -> None:
    try:
        token = join_token(token, token_file, os.environ)
    except ValueError as exc:
        _fail(str(exc), 2)
    host, port = _address(coordinator_addr, "--coordinator")
    if insecure and not is_loopback(host):
        _fail(f"--insecure sends the token in the clear and is refused off loopback ({host})", 2)
    if not insecure and not ca_sha256:
        _fail("--ca-sha256 is required (see `tangramctl cluster join`)", 2)
    config, _cluster = _load(
        config_path,
        {"daemon.socket": socket_path, "daemon.state_dir": state_dir, "cpu.backend": cpu_backend},
    )
    try:
        capacity = node_capacity(config, cpus)
    except ValueError as exc:
        _fail(f"--cpus: {exc}", 2)
        return

    async def serve() -> int:
        agent = build_node(
            config,
            name=name or socket.gethostname(),
            coordinator=(host, port),
            token=token,
            ca_sha256=ca_sha256,
            insecure=insecure,
            capacity=capacity,
        )
        stop = asyncio.Event()
        uninstall = install_stop_handlers(asyncio.get_running_loop(), stop)
        try:
            code = await serve_node(agent, stop)
        finally:
            uninstall()
        if agent.failed is not None:
            click.echo(f"tangramd node: {agent.failed}", err=True)
        return code

    _run(config, serve)

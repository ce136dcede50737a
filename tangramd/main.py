"""``tangramd``: the node daemon program (``tangramd up`` is the all-in-one mode)."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any

import click
import structlog

from tangram.model import TangramError
from tangramd.config import ConfigError, load_config, resolve_user
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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="arl-tangram")
def cli() -> None:
    """ARL-Tangram daemon: action-level resource manager for agentic RL."""


@cli.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="TOML config file (see config/tangram.toml).",
)
@click.option(
    "--socket", "socket_path", default=None, metavar="PATH", help="Unix socket path for clients."
)
@click.option(
    "--state-dir",
    default=None,
    metavar="DIR",
    help="Directory for environments and the registry.",
)
@click.option(
    "--cpu-backend",
    type=click.Choice(["process", "docker"]),
    default=None,
    help="Where exec actions run (default from config: process).",
)
@click.option(
    "--http",
    "http_listen",
    default=None,
    metavar="HOST:PORT",
    help="Also serve the HTTP gateway (as `tangramd http`) in this process.",
)
@click.option(
    "--http-unix",
    default=None,
    metavar="PATH",
    help="Also (or only) serve the HTTP gateway on a Unix socket: its peers pass "
    "daemon.allowed_uids and run as their own uid, no API key needed.",
)
@click.option(
    "--http-api-key-file",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="With --http: file holding the key every request must send as X-API-Key.",
)
@click.option(
    "--http-user",
    default=None,
    metavar="USER",
    help="With --http: the user (name or uid) HTTP callers count as (default: the daemon's).",
)
@click.option(
    "--http-cpus",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="With --http: cores per /run_code (default 1).",
)
@click.option(
    "--http-insecure-no-auth",
    is_flag=True,
    default=None,
    help="With --http on a non-loopback address: serve it without an API key anyway.",
)
def up(
    config_path: str | None,
    socket_path: str | None,
    state_dir: str | None,
    cpu_backend: str | None,
    http_listen: str | None,
    http_unix: str | None,
    http_api_key_file: str | None,
    http_user: str | None,
    http_cpus: int | None,
    http_insecure_no_auth: bool | None,
) -> None:
    """Run coordinator + node + local socket in one process until SIGTERM/SIGINT."""
    try:
        config = load_config(
            config_path,
            {
                "daemon.socket": socket_path,
                "daemon.state_dir": state_dir,
                "cpu.backend": cpu_backend,
            },
        )
    except ConfigError as exc:
        click.echo(f"tangramd: {exc}", err=True)
        sys.exit(2)
    gateway = None
    if http_listen is not None or http_unix is not None:
        try:
            from tangramd.gateway import embedded
        except ImportError as exc:
            click.echo(f"tangramd up --http: {_NO_HTTP_EXTRA}: {exc}", err=True)
            sys.exit(2)
        keys = _http_keys("tangramd up --http", config.http.keys, own_process=True)
        host, port, key = "", 0, None
        if http_listen is not None:
            host, port, key = _http_settings(
                "tangramd up --http",
                http_listen,
                http_api_key_file,
                bool(http_insecure_no_auth),
                keyed=bool(keys),
            )
        peer = None
        if http_user is not None:
            peer = resolve_user(http_user)
            if peer is None:
                click.echo(f"tangramd up: --http-user {http_user!r}: no such user", err=True)
                sys.exit(2)
        gateway = _Gateway(embedded, host, port, key, peer, http_cpus or 1, keys, http_unix)
    else:
        given: dict[str, object] = {
            "--http-api-key-file": http_api_key_file,
            "--http-user": http_user,
            "--http-cpus": http_cpus,
            "--http-insecure-no-auth": http_insecure_no_auth,
        }
        for option, value in given.items():
            if value is not None:
                click.echo(f"tangramd up: {option} needs --http HOST:PORT", err=True)
                sys.exit(2)
    configure_logging(config.daemon.log_format, config.daemon.log_level)
    # Files the daemon writes (registry, profiles, environments) are private: 0600/0700.
    os.umask(0o077)
    try:
        lock = lock_state_dir(config.daemon.state_dir, shared=os.geteuid() == 0)
    except StateDirBusy as exc:
        click.echo(f"tangramd: {exc}", err=True)
        sys.exit(1)
    except OSError as exc:
        click.echo(f"tangramd: state dir {config.daemon.state_dir}: {exc.strerror}", err=True)
        sys.exit(1)
    try:
        check_socket_free(config.daemon.socket)  # fail before touching any state
        if gateway is not None:
            runs_as_root = gateway.peer is None and os.geteuid() == 0
            if runs_as_root and gateway.host and config.cpu.exec_user == "peer":
                click.echo(
                    "tangramd up: HTTP callers' commands run as root (cpu.exec_user = "
                    '"peer"); pass --http-user to run them as an unprivileged user',
                    err=True,
                )
            try:  # bound before anything starts: an address in use changes nothing
                if gateway.host:
                    gateway.sock = gateway.module.bind(gateway.host, gateway.port)
            except OSError as exc:
                why = exc.strerror or exc
                click.echo(f"tangramd up: cannot serve HTTP on {http_listen}: {why}", err=True)
                sys.exit(1)
            try:
                if gateway.unix is not None:
                    gateway.unix_sock = gateway.module.bind_unix(gateway.unix)
            except OSError as exc:
                why = exc.strerror or exc
                click.echo(f"tangramd up: cannot serve HTTP on {gateway.unix}: {why}", err=True)
                sys.exit(1)
        run_loop(_serve(config, gateway), config.daemon.event_loop)
    except ConfigError as exc:  # a [[service]] that cannot run on the GPUs found
        click.echo(f"tangramd: {exc}", err=True)
        sys.exit(2)
    except TangramError as exc:
        click.echo(f"tangramd: {exc}", err=True)
        sys.exit(1)
    except OSError as exc:  # the socket is in use, its directory is not writable, ...
        where = f" {exc.filename}" if exc.filename else ""
        click.echo(f"tangramd: cannot serve{where}: {exc.strerror or exc}", err=True)
        sys.exit(1)
    finally:
        lock.close()


@dataclass
class _Gateway:
    """``tangramd up --http``'s settings, and its socket once bound."""

    module: Any  # tangramd.gateway.embedded (imported only with --http: it needs uvicorn)
    host: str
    port: int
    key: str | None
    peer: tuple[int, int] | None
    cpus: int
    keys: list[tuple[str, tuple[int, int] | None]]  # [http] keys: key, its user (or None)
    unix: str | None = None  # --http-unix PATH
    sock: socket.socket | None = None
    unix_sock: socket.socket | None = None


async def _serve(config: Any, gateway: _Gateway | None = None) -> None:
    """Serve until a stop signal (with ``gateway``: its HTTP gateway too)."""
    from tangramd.collector import freeze_startup
    from tangramd.runtime import build_runtime

    runtime = build_runtime(config)
    stop = asyncio.Event()
    uninstall = install_stop_handlers(asyncio.get_running_loop(), stop)
    http = None
    try:
        await runtime.start()
        if gateway is not None and (gateway.sock or gateway.unix_sock) is not None:
            http = gateway.module.EmbeddedGateway(
                runtime.server,
                gateway.sock,
                unix_sock=gateway.unix_sock,
                api_key=gateway.key,
                cpus=gateway.cpus,
                peer=gateway.peer,
                limits=config.http,
                keys=gateway.keys,
            )
            try:
                await http.start()
            except BaseException:
                await runtime.stop()
                raise
        # Start-up objects (modules, config, pools) never die: keep them out of the cyclic
        # GC's full collections (the daemon's collector policy: tangramd/collector.py).
        freeze_startup()
        sd_notify("READY=1\nSTATUS=serving")
        await stop.wait()
        sd_notify("STOPPING=1")
        log.info("daemon_stopping")
        if http is not None:
            await http.stop()  # its requests end first: they are the daemon's clients
        await runtime.stop()
    finally:
        uninstall()


_NO_HTTP_EXTRA = "needs the http extra (pip install 'arl-tangram[http]')"


def _http_keys(
    prog: str, path: str | None, *, own_process: bool
) -> list[tuple[str, tuple[int, int] | None]]:
    """``[http] keys``: each key and the (uid, gid) its requests run as (None: the
    gateway's callers' user); exit 2 naming the line on a bad file or unknown user, or on
    a per-key user a separate ``tangramd http`` cannot speak for (the daemon sees its
    socket's uid only)."""
    if path is None:
        return []
    from tangramd.gateway.callers import read_keys

    try:
        entries = read_keys(path)
    except (OSError, ValueError) as exc:
        click.echo(f"{prog}: [http] keys: {exc}", err=True)
        sys.exit(2)
    keys: list[tuple[str, tuple[int, int] | None]] = []
    for entry in entries:
        user = None if entry.user is None else resolve_user(entry.user)
        if entry.user is not None and user is None:
            click.echo(f"{prog}: [http] keys {path}: {entry.user!r}: no such user", err=True)
            sys.exit(2)
        if user is not None and not own_process and user[0] != os.geteuid():
            click.echo(
                f"{prog}: [http] keys {path}: user {entry.user!r}: a separate gateway runs "
                "every command as its own user; per-key users need `tangramd up --http`",
                err=True,
            )
            sys.exit(2)
        keys.append((entry.key, user if own_process else None))
    return keys


def _http_settings(
    prog: str, listen: str, api_key_file: str | None, insecure: bool, *, keyed: bool = False
) -> tuple[str, int, str | None]:
    """HOST, PORT and the API key (None: no key) of an HTTP gateway's options; exit 2 with
    a one-line message on a bad value, or on a non-loopback address without a key (unless
    ``insecure``), before anything is bound."""
    host, sep, port_text = listen.rpartition(":")
    if not sep or not port_text.isdigit() or not host or int(port_text) > 65535:
        click.echo(f"{prog}: --listen {listen!r}: want HOST:PORT", err=True)
        sys.exit(2)
    key = None
    if api_key_file is not None:
        with open(api_key_file, encoding="utf-8") as f:
            key = f.read().strip()
        if not key:
            click.echo(f"{prog}: {api_key_file} is empty", err=True)
            sys.exit(2)
    elif keyed:
        pass  # [http] keys
    elif not _loopback(host.strip("[]")):
        if not insecure:
            click.echo(
                f"{prog}: refusing to serve {host} without an API key: anyone who can reach "
                f"it could run commands as the daemon's users (give {_key_option(prog)}, "
                f"listen on 127.0.0.1, or pass {_insecure_option(prog)})",
                err=True,
            )
            sys.exit(2)
        click.echo(
            f"{prog}: warning: serving {host} without an API key "
            f"({_insecure_option(prog)}): anyone who can reach it runs commands",
            err=True,
        )
    else:
        click.echo(
            f"{prog}: warning: no API key: any local user can reach {listen} and run "
            "commands as the gateway's callers, bypassing daemon.allowed_uids "
            f"(give {_key_option(prog)})",
            err=True,
        )
    return host.strip("[]"), int(port_text), key


def _loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (``localhost`` or a loopback address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any address
        return False


def _key_option(prog: str) -> str:
    return "--http-api-key-file" if prog.startswith("tangramd up") else "--api-key-file"


def _insecure_option(prog: str) -> str:
    return "--http-insecure-no-auth" if prog.startswith("tangramd up") else "--insecure-no-auth"


@cli.command()
@click.option(
    "--listen",
    default="127.0.0.1:8080",
    show_default=True,
    metavar="HOST:PORT",
    help="Address to serve HTTP on (loopback unless you say otherwise).",
)
@click.option(
    "--socket",
    "socket_path",
    default=None,
    metavar="PATH",
    help="Socket of the running tangramd up.",
)
@click.option(
    "--api-key-file",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="File holding the key every request must send as X-API-Key.",
)
@click.option(
    "--cpus",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    metavar="N",
    help="Cores per /run_code.",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="TOML config file whose [http] section sets the limits (max_body, ...).",
)
@click.option(
    "--insecure-no-auth",
    is_flag=True,
    help="Serve a non-loopback address without --api-key-file anyway.",
)
def http(
    listen: str,
    socket_path: str | None,
    api_key_file: str | None,
    cpus: int,
    config_path: str | None,
    insecure_no_auth: bool,
) -> None:
    """Serve SandboxFusion /run_code, SWE-ReX /swerex/ENV and /metrics over HTTP."""
    try:
        import uvicorn

        from tangramd.gateway.app import build_app
    except ImportError as exc:
        click.echo(f"tangramd http: {_NO_HTTP_EXTRA}: {exc}", err=True)
        sys.exit(2)
    from tangram.protocol import default_socket_path

    try:
        limits = load_config(config_path, {}).http
    except ConfigError as exc:
        click.echo(f"tangramd http: {exc}", err=True)
        sys.exit(2)
    keys = _http_keys("tangramd http", limits.keys, own_process=False)
    host, port, key = _http_settings(
        "tangramd http", listen, api_key_file, insecure_no_auth, keyed=bool(keys)
    )
    daemon_socket = socket_path or default_socket_path()
    app = build_app(
        daemon_socket,
        api_key=key,
        keys=[(k, None) for k, _ in keys],
        cpus=cpus,
        max_body=limits.max_body,
        max_run_timeout_s=limits.max_run_timeout_s,
    )
    shown = f"[{host}]" if ":" in host else host
    click.echo(
        f"tangramd http: serving http://{shown}:{port} (/run_code, /run_jupyter, "
        f"/swerex/ENV, /envs, /metrics, /health) for the daemon at {daemon_socket}"
        + ("" if key is None and not keys else "; every request must send X-API-Key"),
        err=True,
    )
    problem = _daemon_problem(daemon_socket)
    if problem is not None:
        click.echo(
            f"tangramd http: warning: {problem}; every call fails until a daemon answers there "
            "(start `tangramd up`, or pass --socket)",
            err=True,
        )
    if os.geteuid() == 0:
        click.echo(
            "tangramd http: warning: this gateway runs as root: with the daemon's "
            'cpu.exec_user = "peer" (the default) its callers\' commands run as root; run it '
            "as an unprivileged user in daemon.allowed_uids (e.g. `runuser -u tangram -- "
            "tangramd http`), or use `tangramd up --http ... --http-user USER`",
            err=True,
        )
    from tangramd.gateway.conns import uvicorn_limits

    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
        **uvicorn_limits(limits),
    )


@cli.command()
@click.option(
    "--coordinator",
    "coordinator_addr",
    required=True,
    metavar="HOST:PORT",
    help="The coordinator's node address (its --listen).",
)
@click.option(
    "--token-file",
    default=None,
    metavar="PATH",
    help="File holding the join token (`tangramctl cluster join --token-file`); also read "
    "from $TANGRAM_JOIN_TOKEN or the systemd credential join-token.",
)
@click.option(
    "--token",
    default=None,
    metavar="TOKEN",
    help="The join token itself (warned about: `ps` shows it; prefer --token-file).",
)
@click.option(
    "--ca-sha256", default=None, metavar="HEX", help="Pinned hash of the coordinator's CA."
)
@click.option(
    "--socket", "socket_path", default=None, metavar="PATH", help="Unix socket path for clients."
)
@click.option(
    "--state-dir",
    default=None,
    metavar="DIR",
    help="Directory for environments and the credential.",
)
@click.option("--name", default=None, metavar="NAME", help="Node name (default: the host name).")
@click.option("--cpus", default=None, metavar="LIST", help="Cores offered, e.g. 0-3 ('' : none).")
@click.option(
    "--cpu-backend",
    type=click.Choice(["process", "docker"]),
    default=None,
    help="Where exec actions run (default from config: process).",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="TOML config file (see config/node.toml).",
)
@click.option("--insecure", is_flag=True, help="Plain TCP (loopback only; tests and demos).")
def node(**options: Any) -> None:
    """Per-host node: joins a coordinator, runs its environments, serves the local socket."""
    from tangramd.cluster import daemon

    daemon.node(**options)


@cli.command()
@click.option("--listen", required=True, metavar="HOST:PORT", help="Where nodes connect.")
@click.option(
    "--socket", "socket_path", default=None, metavar="PATH", help="Unix socket path for operators."
)
@click.option(
    "--state-dir", default=None, metavar="DIR", help="Directory for the CA, registry, profiles."
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="TOML config file (see config/coordinator.toml).",
)
@click.option("--insecure", is_flag=True, help="Plain TCP (loopback only; tests and demos).")
def coordinator(**options: Any) -> None:
    """Cluster coordinator: the global scheduler over every node's pools."""
    from tangramd.cluster import daemon

    daemon.coordinator(**options)


def _daemon_problem(socket_path: str) -> str | None:
    """Why the daemon at ``socket_path`` does not answer a ping now (None: it does)."""
    from tangram import Client

    try:
        with Client(socket_path, connect_timeout_s=2.0, timeout_s=5.0) as c:
            c.ping()
    except Exception as exc:  # any failure is the warning's text, never a crash
        return f"no tangramd answers at {socket_path} ({type(exc).__name__}: {exc})"
    return None


def main() -> None:
    cli()


if __name__ == "__main__":
    main()

"""A real `tangramd up` with a real `tangramd http` in front of it, or serving the gateway
itself (`tangramd up --http`): the gateway tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from daemon_fixture import running_daemon

from tangram.testing import SpawnedDaemon
from tangramd.gateway.spawn import SpawnedGateway, free_port, spawn_gateway, wait_http


@dataclass
class Stack:
    daemon: SpawnedDaemon
    gateway: SpawnedGateway

    @property
    def url(self) -> str:
        return self.gateway.url


@contextlib.contextmanager
def running_stack(tmp: Path, *gateway_args: str, in_process: bool = False) -> Iterator[Stack]:
    """Daemon and gateway; the gateway's log must stay free of tracebacks. ``in_process``:
    the daemon serves the gateway itself (``tangramd up --http``; ``gateway_args`` are its
    ``--http-*`` options), and ``Stack.gateway`` is the daemon's process and log."""
    if in_process:
        port = free_port()
        with running_daemon(tmp, "--http", f"127.0.0.1:{port}", *gateway_args) as daemon:
            gw = SpawnedGateway(daemon.proc, f"http://127.0.0.1:{port}", daemon.log_path)
            wait_http(gw.url, daemon.proc, daemon.log_path)
            yield Stack(daemon, gw)
            assert daemon.proc.poll() is None, daemon.log()
        return  # running_daemon checks the log
    with running_daemon(tmp) as daemon, spawn_gateway(daemon.socket, tmp, *gateway_args) as gw:
        yield Stack(daemon, gw)
        assert gw.proc.poll() is None, gw.log()
    assert "Traceback" not in gw.log(), gw.log()

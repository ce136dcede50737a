"""A real `tangramd up` with a real `tangramd http` in front of it (the gateway tests)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from daemon_fixture import running_daemon

from tangram.testing import SpawnedDaemon
from tangramd.gateway.spawn import SpawnedGateway, spawn_gateway


@dataclass
class Stack:
    daemon: SpawnedDaemon
    gateway: SpawnedGateway

    @property
    def url(self) -> str:
        return self.gateway.url


@contextlib.contextmanager
def running_stack(tmp: Path, *gateway_args: str) -> Iterator[Stack]:
    """Daemon and gateway; the gateway's log must stay free of tracebacks."""
    with running_daemon(tmp) as daemon, spawn_gateway(daemon.socket, tmp, *gateway_args) as gw:
        yield Stack(daemon, gw)
        assert gw.proc.poll() is None, gw.log()
    assert "Traceback" not in gw.log(), gw.log()

"""Start ``tangramd http`` as a subprocess on a free loopback port (tests, benchmarks)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass
class SpawnedGateway:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def spawn_gateway(
    daemon_socket: str,
    workdir: str | os.PathLike[str],
    *args: str,
    ready_timeout_s: float = 30.0,
) -> Iterator[SpawnedGateway]:
    """``tangramd http`` for the daemon at ``daemon_socket`` until the block ends."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(workdir) / f"gateway-{port}.log"
    cmd = [sys.executable, "-m", "tangramd.main", "http", "--listen", f"127.0.0.1:{port}"]
    cmd += ["--socket", daemon_socket, *args]
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
    gateway = SpawnedGateway(proc, url, log_path)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tangramd http exited early:\n{gateway.log()}")
            try:
                with urllib.request.urlopen(f"{url}/openapi.json", timeout=1):
                    break
            except urllib.error.HTTPError:  # it answers (401 with an API key)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tangramd http did not start:\n{gateway.log()}") from None
                time.sleep(0.05)
        yield gateway
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

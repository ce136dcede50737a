"""Start ``tangramd http`` as a subprocess on a free loopback port, or wait for the gateway
of a ``tangramd up --http`` (tests, benchmarks)."""

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
        wait_http(url, proc, log_path, ready_timeout_s)
        yield gateway
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_http(
    url: str, proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float = 30.0
) -> None:
    """Until the gateway at ``url`` (served by ``proc``) answers; raise RuntimeError with
    its log if the process exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway's process exited early:\n{_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"{url}/openapi.json", timeout=1):
                return
        except urllib.error.HTTPError:  # it answers (401 with an API key)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start:\n{_tail(log_path)}") from None
            time.sleep(0.05)


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-4000:]
    except OSError:
        return ""

"""Start the real daemons as subprocesses, for tests, examples and benchmarks.

``spawn_daemon``: ``tangramd up`` on a private socket. ``spawn_gateway``: ``tangramd http``
on a free loopback port in front of it; ``wait_http`` waits for the gateway of a
``tangramd up --http``. ``wait_for`` (and ``wait_for_async`` in an event loop) polls a
condition with a deadline: tests wait on the event itself, never on a fixed sleep. The
test suite, ``bench/`` and ``examples/`` all spawn through this one module.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from tangram.client import Client

T = TypeVar("T")


def wait_for(
    check: Callable[[], T],
    timeout_s: float,
    what: str,
    *,
    every_s: float = 0.01,
    ignore: tuple[type[BaseException], ...] = (),
    fatal: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll ``check`` until it returns a truthy value, and return that value.

    Exceptions of the types in ``ignore`` count as "not yet" (the last one is named in the
    timeout's message), unless they are also of a type in ``fatal``; any other propagates.
    Raises TimeoutError naming ``what``.
    """
    deadline = time.monotonic() + timeout_s
    last_error: BaseException | None = None
    while True:
        try:
            value = check()
            if value:
                return value
        except fatal:
            raise
        except ignore as exc:
            last_error = exc
        if time.monotonic() > deadline:
            why = f" (last error: {last_error!r})" if last_error is not None else ""
            raise TimeoutError(f"{what}: not within {timeout_s} s{why}")
        time.sleep(every_s)


async def wait_for_async(
    check: Callable[[], T | Awaitable[T]],
    timeout_s: float,
    what: str,
    *,
    every_s: float = 0.01,
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """``wait_for`` inside an event loop: ``check`` may be a coroutine function, and the
    loop's other tasks run between polls."""
    deadline = time.monotonic() + timeout_s
    last_error: BaseException | None = None
    while True:
        try:
            value = check()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value
        except ignore as exc:
            last_error = exc
        if time.monotonic() > deadline:
            why = f" (last error: {last_error!r})" if last_error is not None else ""
            raise TimeoutError(f"{what}: not within {timeout_s} s{why}")
        await asyncio.sleep(every_s)


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


def _stop(proc: subprocess.Popen[bytes], sig: int, timeout_s: float) -> int | None:
    """Send ``sig`` and wait; the exit status, or None after a kill on a hang."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


# --------------------------------------------------------------------------- tangramd up


@dataclass
class SpawnedDaemon:
    """A ``tangramd up`` subprocess: its socket, state directory and log file."""

    proc: subprocess.Popen[bytes]
    socket: str
    state_dir: str
    log_path: Path

    def client(self, **kw: object) -> Client:
        return Client(self.socket, **kw)  # type: ignore[arg-type]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send ``sig`` and wait; returns the exit status (kills and raises on a hang)."""
        code = _stop(self.proc, sig, timeout)
        if code is None:
            raise RuntimeError(f"tangramd did not stop on signal {sig}:\n{self.log()}")
        return code


def spawn_daemon(
    workdir: str | os.PathLike[str],
    config: str = "",
    *args: str,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 30.0,
) -> SpawnedDaemon:
    """Write ``config`` to ``workdir/tangram.toml``, start the daemon, wait until it answers."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    sock = str(work / "tangramd.sock")
    cfg = work / "tangram.toml"
    cfg.write_text(config)
    log_path = work / "tangramd.log"
    cmd = [sys.executable, "-m", "tangramd.main", "up", "--config", str(cfg), "--socket", sock]
    cmd += ["--state-dir", str(work / "state"), *args]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=full_env)
    daemon = SpawnedDaemon(proc, sock, str(work / "state"), log_path)

    def answers_or_exited() -> bool:
        if proc.poll() is None:  # any error while it starts means "not yet"
            with Client(sock, connect_timeout_s=1.0) as c:
                c.ping()
        return True

    try:
        wait_for(answers_or_exited, ready_timeout_s, "tangramd", every_s=0.05, ignore=(Exception,))
    except TimeoutError:
        _stop(proc, signal.SIGKILL, 10.0)
        raise RuntimeError(f"tangramd did not come up:\n{daemon.log()}") from None
    if proc.poll() is not None:
        raise RuntimeError(f"tangramd exited early ({proc.returncode}):\n{daemon.log()}")
    return daemon


# --------------------------------------------------------------------------- tangramd http


@dataclass
class SpawnedGateway:
    """A ``tangramd http`` subprocess (or the daemon serving ``--http``) and its URL."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


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
        _stop(proc, signal.SIGTERM, 10.0)


def wait_http(
    url: str, proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float = 30.0
) -> None:
    """Until the gateway at ``url`` (served by ``proc``) answers; raise RuntimeError with
    its log if the process exits or the time runs out."""

    def answers() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway's process exited early:\n{_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"{url}/openapi.json", timeout=1):
                return True
        except urllib.error.HTTPError:  # it answers (401 with an API key)
            return True

    try:
        wait_for(answers, timeout_s, "the gateway answering", every_s=0.05, ignore=(OSError,))
    except TimeoutError:
        raise RuntimeError(f"the gateway did not start:\n{_tail(log_path)}") from None

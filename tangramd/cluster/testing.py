"""Start a real coordinator and real nodes as subprocesses (tests, demo, benchmark).

Every wait is bounded: a daemon that does not come up, or a condition that does not hold
in time, raises with the daemon's log.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tangram.client import Client

T = TypeVar("T")


class DaemonExited(RuntimeError):
    """The daemon a wait depends on has exited: waiting longer cannot help."""


def wait_for(
    check: Callable[[], T | None], timeout_s: float, what: str, *, every_s: float = 0.05
) -> T:
    """Poll ``check`` until it returns a truthy value; raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout_s
    last_error: BaseException | None = None
    while True:
        try:
            value = check()
            if value:
                return value
        except DaemonExited:
            raise
        except Exception as exc:  # not ready yet: remember why for the timeout message
            last_error = exc
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s (last error: {last_error!r})")
        time.sleep(every_s)


@dataclass
class Daemon:
    """One ``tangramd coordinator`` or ``tangramd node`` subprocess."""

    proc: subprocess.Popen[bytes]
    socket: str
    state_dir: str
    log_path: Path
    name: str = ""
    join: dict[str, Any] = field(default_factory=dict)  # coordinator: cluster.join answer

    def client(self, **kw: Any) -> Client:
        return Client(self.socket, **kw)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL, no goodbye: what a crashed host looks like to the coordinator."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"daemon did not stop on SIGTERM:\n{self.log()}") from None


def stop_all(daemons: Sequence[Daemon]) -> None:
    """SIGTERM what still runs, newest first (nodes before their coordinator)."""
    for daemon in reversed(daemons):
        if daemon.proc.poll() is None:
            daemon.stop()


def check_clean(*daemons: Daemon) -> None:
    """No traceback and no broken invariant in any of their logs."""
    for daemon in daemons:
        text = daemon.log()
        assert "Traceback" not in text, text
        assert "invariant_violated" not in text, text


def _start(args: Sequence[str], work: Path, stem: str, env: dict[str, str] | None) -> Any:
    log_path = work / f"{stem}.log"
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tangramd.main", *args],
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=full_env,
        )
    return proc, log_path


def spawn_coordinator(
    workdir: str | os.PathLike[str],
    config: str = "",
    *,
    listen: str = "127.0.0.1:0",
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 30.0,
    extra: Sequence[str] = (),
) -> Daemon:
    """A coordinator on a private socket and a free loopback port; waits until it answers."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    cfg = work / "coordinator.toml"
    cfg.write_text(config)
    sock, state = str(work / "coordinator.sock"), str(work / "coordinator-state")
    args = ["coordinator", "--listen", listen, "--socket", sock, "--state-dir", state]
    proc, log_path = _start([*args, "--config", str(cfg), *extra], work, "coordinator", env)
    daemon = Daemon(proc, sock, state, log_path, name="coordinator")

    def ready() -> dict[str, Any] | None:
        if proc.poll() is not None:
            raise DaemonExited(f"coordinator exited ({proc.returncode}):\n{daemon.log()}")
        with Client(sock, connect_timeout_s=1.0) as c:
            return c.cluster_join()

    try:
        daemon.join = _wait_alive(ready, proc, ready_timeout_s, "coordinator ready", daemon)
    except BaseException:
        daemon.kill()
        raise
    return daemon


def spawn_node(
    workdir: str | os.PathLike[str],
    coordinator: Daemon,
    name: str,
    *,
    cpus: str | None = None,
    token: str | None = None,
    ca_sha256: str | None = None,
    config: str = "",
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
    wait_ready: bool = True,
    ready_timeout_s: float = 30.0,
    address: str | None = None,
) -> Daemon:
    """A node joined to ``coordinator`` (its current token and CA hash unless given;
    ``address``: dial this instead, e.g. a :class:`FaultProxy`)."""
    work = Path(workdir) / name
    work.mkdir(parents=True, exist_ok=True)
    cfg = work / "node.toml"
    cfg.write_text(config)
    sock, state = str(work / "node.sock"), str(work / "state")
    join = coordinator.join
    args = [
        "node",
        "--coordinator",
        address or join["coordinator"],
        "--socket",
        sock,
        "--state-dir",
        state,
        "--name",
        name,
        "--config",
        str(cfg),
    ]
    token = join["token"] if token is None else token
    ca = join["ca_sha256"] if ca_sha256 is None else ca_sha256
    if token:
        args += ["--token", token]
    if ca:
        args += ["--ca-sha256", ca]
    if cpus is not None:
        args += ["--cpus", cpus]
    proc, log_path = _start([*args, *extra], work, "node", env)
    daemon = Daemon(proc, sock, state, log_path, name=name)
    if wait_ready:
        try:
            wait_node_state(coordinator, name, "ready", ready_timeout_s, node=daemon)
        except BaseException:
            daemon.kill()
            raise
    return daemon


def node_row(coordinator: Daemon, name: str) -> dict[str, Any] | None:
    with Client(coordinator.socket, connect_timeout_s=1.0) as c:
        return next((row for row in c.nodes() if row["name"] == name), None)


def wait_node_state(
    coordinator: Daemon,
    name: str,
    state: str,
    timeout_s: float,
    *,
    node: Daemon | None = None,
) -> dict[str, Any]:
    """Wait until the coordinator lists node ``name`` in ``state``."""

    def check() -> dict[str, Any] | None:
        if node is not None and state != "lost" and node.proc.poll() is not None:
            raise DaemonExited(f"node {name} exited ({node.proc.returncode}):\n{node.log()}")
        row = node_row(coordinator, name)
        if row is None or row["state"] != state:
            return None
        if node is not None and state == "ready":
            node_row(node, name)  # the node's side of the link is up too (else InfraError)
        return row

    return _wait_alive(check, None, timeout_s, f"node {name} {state}", node or coordinator)


def _wait_alive(
    check: Callable[[], T | None],
    proc: subprocess.Popen[bytes] | None,
    timeout_s: float,
    what: str,
    daemon: Daemon,
) -> T:
    try:
        return wait_for(check, timeout_s, what)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}\n--- {daemon.name} log ---\n{daemon.log()}") from None


class FaultProxy:
    """A TCP proxy between a node and the coordinator that can partition them.

    ``partition()`` holds every byte in both directions (on existing and new connections)
    until ``heal()``: what a black-holed network looks like to TCP, which retransmits and
    delivers late. ``cut()`` resets every connection now. It runs its own event loop in a
    thread, listening on a free loopback port.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._loop = asyncio.new_event_loop()
        self._open: asyncio.Event | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.address = ""

    def start(self) -> str:
        self._thread.start()
        self.address = asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        return self.address

    async def _listen(self) -> str:
        self._open = asyncio.Event()
        self._open.set()
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        return f"127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(
            self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True
        )
        self._writers -= {writer, up_writer}

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._open is not None
        try:
            while data := await reader.read(1 << 16):
                await self._open.wait()
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    def _call(self, fn: Callable[[], object]) -> None:
        async def run() -> None:
            fn()

        asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def partition(self) -> None:
        assert self._open is not None
        self._call(self._open.clear)

    def heal(self) -> None:
        assert self._open is not None
        self._call(self._open.set)

    def cut(self) -> None:
        def reset() -> None:
            for writer in list(self._writers):
                writer.transport.abort()

        self._call(reset)

    def close(self) -> None:
        self.heal()
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

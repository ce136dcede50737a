"""Start the real daemons as subprocesses, for tests, examples and benchmarks.

``spawn_daemon``: ``tangramd up`` on a private socket. ``spawn_gateway``: ``tangramd http``
on a free loopback port in front of it; ``wait_http`` waits for the gateway of a
``tangramd up --http``. ``spawn_coordinator`` and ``spawn_node``: a cluster, with
``wait_node_state`` and a :class:`FaultProxy` that partitions a node from its coordinator.
``wait_for`` (and ``wait_for_async`` in an event loop) polls a condition with a deadline:
tests wait on the event itself, never on a fixed sleep. The test suite, ``bench/``,
``scripts/`` and ``examples/`` all spawn through this one module (the test suite's
in-process cluster is ``tests/cluster_harness.py``: it needs the daemons' internals).
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
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

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


# --------------------------------------------------------------------------- a cluster


class DaemonExited(RuntimeError):
    """The daemon a wait depends on has exited: waiting longer cannot help."""


def wait_for_daemon(
    check: Callable[[], T | None], timeout_s: float, what: str, *, every_s: float = 0.05
) -> T:
    """Poll ``check`` until it returns a truthy value; raise TimeoutError naming ``what``.
    Any error of ``check`` means "not yet" (a daemon still starting), except
    :class:`DaemonExited`: waiting longer cannot help then."""
    value = wait_for(
        check, timeout_s, what, every_s=every_s, ignore=(Exception,), fatal=(DaemonExited,)
    )
    return value  # type: ignore[return-value]  # truthy, so not None


class DaemonLike(Protocol):
    """What the cluster helpers need of a daemon: a subprocess (:class:`ClusterDaemon`) or
    one run in the test's own process (the test suite's in-process cluster)."""

    socket: str
    name: str

    def log(self) -> str: ...

    def poll(self) -> int | None: ...


@dataclass
class ClusterDaemon:
    """One ``tangramd coordinator`` or ``tangramd node`` subprocess."""

    proc: subprocess.Popen[bytes]
    socket: str
    state_dir: str
    log_path: Path
    name: str = ""
    join: dict[str, Any] = field(default_factory=dict)  # coordinator: cluster.join answer

    def client(self, **kw: Any) -> Client:
        return Client(self.socket, **kw)

    @property
    def workdir(self) -> Path:
        """Its own directory (config, log, socket): a test may put files there."""
        return self.log_path.parent

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def poll(self) -> int | None:
        """Its exit code, None while it runs."""
        return self.proc.poll()

    def wait(self, timeout_s: float) -> int:
        """Wait until it exits; its exit code."""
        return self.proc.wait(timeout_s)

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
) -> ClusterDaemon:
    """A coordinator on a private socket and a free loopback port; waits until it answers."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    cfg = work / "coordinator.toml"
    cfg.write_text(config)
    sock, state = str(work / "coordinator.sock"), str(work / "coordinator-state")
    args = ["coordinator", "--listen", listen, "--socket", sock, "--state-dir", state]
    proc, log_path = _start([*args, "--config", str(cfg), *extra], work, "coordinator", env)
    daemon = ClusterDaemon(proc, sock, state, log_path, name="coordinator")

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
    coordinator: ClusterDaemon,
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
) -> ClusterDaemon:
    """A node joined to ``coordinator`` (its current token, passed as
    ``$TANGRAM_JOIN_TOKEN``, and CA hash unless given; ``address``: dial this instead, e.g.
    a :class:`FaultProxy`)."""
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
    env = dict(env or {})
    if token:  # from the environment, as a deployment should: never on the command line
        env.setdefault("TANGRAM_JOIN_TOKEN", token)
    if ca:
        args += ["--ca-sha256", ca]
    if cpus is not None:
        args += ["--cpus", cpus]
    proc, log_path = _start([*args, *extra], work, "node", env)
    daemon = ClusterDaemon(proc, sock, state, log_path, name=name)
    if wait_ready:
        try:
            wait_node_state(coordinator, name, "ready", ready_timeout_s, node=daemon)
        except BaseException:
            daemon.kill()
            raise
    return daemon


def node_row(coordinator: DaemonLike, name: str) -> dict[str, Any] | None:
    with Client(coordinator.socket, connect_timeout_s=1.0) as c:
        return next((row for row in c.nodes() if row["name"] == name), None)


def wait_node_state(
    coordinator: DaemonLike,
    name: str,
    state: str,
    timeout_s: float,
    *,
    node: DaemonLike | None = None,
) -> dict[str, Any]:
    """Wait until the coordinator lists node ``name`` in ``state``."""

    def check() -> dict[str, Any] | None:
        if node is not None and state != "lost" and node.poll() is not None:
            raise DaemonExited(f"node {name} exited ({node.poll()}):\n{node.log()}")
        row = node_row(coordinator, name)
        if row is None or row["state"] != state:
            return None
        if node is not None and state == "ready":
            node_row(node, name)  # the node's side of the link is up too (else InfraError)
        return row

    every_s = 0.01 if getattr(coordinator, "in_process", False) else 0.05
    return _wait_alive(
        check, None, timeout_s, f"node {name} {state}", node or coordinator, every_s=every_s
    )


def _wait_alive(
    check: Callable[[], T | None],
    proc: subprocess.Popen[bytes] | None,
    timeout_s: float,
    what: str,
    daemon: DaemonLike,
    *,
    every_s: float = 0.05,
) -> T:
    try:
        return wait_for_daemon(check, timeout_s, what, every_s=every_s)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}\n--- {daemon.name} log ---\n{daemon.log()}") from None


class FaultProxy:
    """A TCP proxy between a node and the coordinator that can partition them.

    ``partition()`` holds every byte in both directions (on existing and new connections)
    until ``heal()``: what a black-holed network looks like to TCP, which retransmits and
    delivers late. It runs its own event loop in a thread, listening on a free loopback
    port.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._loop = asyncio.new_event_loop()
        self._open: asyncio.Event | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.address = ""

    def start(self) -> str:
        self._thread.start()
        self.address = asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        return self.address

    async def _listen(self) -> str:
        self._open = asyncio.Event()
        self._open.set()
        self._server = server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
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

    def close(self) -> None:
        """Stop listening, reset every connection, and end the loop once its pumps are."""
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._shut(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()

    async def _shut(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._open is not None:
            self._open.set()
        for writer in list(self._writers):
            writer.transport.abort()
        me = asyncio.current_task()
        others = [task for task in asyncio.all_tasks() if task is not me]
        if others:
            await asyncio.wait(others, timeout=5)

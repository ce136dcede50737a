"""A real coordinator and real nodes in this process, on one event loop (most cluster
tests: :class:`InProcessCluster`). They are used like the subprocess daemons of
``tangram.testing`` (``spawn_coordinator``, ``spawn_node``: socket, ``log()``, ``kill()``,
``stop()``), so the helpers here and there take either kind.

Every wait is bounded: a daemon that does not come up, or a condition that does not hold
in time, raises with the daemon's log.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import psutil
import structlog

from tangram.client import Client
from tangram.testing import (
    ClusterDaemon,
    DaemonExited,
    FaultProxy,
    node_row,
    spawn_coordinator,
    spawn_node,
    wait_node_state,
)
from tangram.testing import wait_for_daemon as wait_for
from tangramd.cluster import config as cluster_config
from tangramd.cluster.link import split_host_port
from tangramd.lifecycle import lock_state_dir
from tangramd.transport import check_socket_free

T = TypeVar("T")

__all__ = [
    "AnyDaemon",
    "DaemonExited",
    "FaultProxy",
    "InProcessCluster",
    "InProcessDaemon",
    "check_clean",
    "node_row",
    "off_the_table",
    "record_links",
    "spawn_coordinator",
    "spawn_node",
    "stop_all",
    "two_one_core_nodes",
    "wait_for",
    "wait_node_state",
]


def stop_all(daemons: Sequence[AnyDaemon]) -> None:
    """SIGTERM what still runs, newest first (nodes before their coordinator); in-process
    nodes all at once."""
    here = [d for d in daemons if isinstance(d, InProcessDaemon)]
    if here:
        here[0].cluster.stop_all(here)
    for daemon in reversed(daemons):
        if daemon.poll() is None:
            daemon.stop()


def check_clean(*daemons: AnyDaemon) -> None:
    """No traceback and no broken invariant in any of their logs (in-process ones: nor in
    the lines their cluster could not tell apart)."""
    for daemon in daemons:
        texts = [daemon.log()]
        if isinstance(daemon, InProcessDaemon):
            texts.append(daemon.cluster.stray_log())
        for text in texts:
            assert "Traceback" not in text, text
            assert "invariant_violated" not in text, text


def record_links(monkeypatch: Any, *, deferred: bool = True) -> list[dict[str, Any]]:
    """Every message any link sends (``Link.send``; with ``deferred``, ``Link.defer`` too)
    until ``monkeypatch`` (the test's) undoes it, in order."""
    from tangramd.cluster.link import Link

    seen: list[dict[str, Any]] = []
    send, defer = Link.send, Link.defer

    def record_send(self: Link, msg: Mapping[str, Any]) -> bool:
        seen.append(dict(msg))
        return send(self, msg)

    def record_defer(self: Link, msg: Mapping[str, Any]) -> bool:
        seen.append(dict(msg))
        return defer(self, msg)

    monkeypatch.setattr(Link, "send", record_send)
    if deferred:
        monkeypatch.setattr(Link, "defer", record_defer)
    return seen


def off_the_table(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """Why each of ``messages`` fails the link table's full check (types included)."""
    from tangram.protocol.errors import BadRequest
    from tangram.protocol.link import check_message

    bad = []
    for msg in messages:
        try:
            check_message(msg)
        except BadRequest as exc:
            bad.append(f"{exc}: {str(msg)[:200]}")
    return bad


@contextlib.contextmanager
def two_one_core_nodes(tmp: Path, config: str) -> Iterator[dict[str, InProcessDaemon]]:
    """An in-process coordinator (``config``) and nodes ``a`` and ``b`` of one core each
    (this process's first and last), invariants validated; their logs must stay clean."""
    cores = sorted(os.sched_getaffinity(0))
    with InProcessCluster(tmp, env={"TANGRAM_VALIDATE": "1"}) as here:
        coord = here.coordinator(config)
        daemons = {"coordinator": coord}
        daemons["a"] = here.node(coord, "a", cpus=str(cores[0]))
        daemons["b"] = here.node(coord, "b", cpus=str(cores[-1]))
        yield daemons
        stop_all(list(daemons.values()))
        check_clean(*daemons.values())


# --------------------------------------------------------------------------- in process

_WHO: contextvars.ContextVar[str | None] = contextvars.ContextVar("tangramd_daemon", default=None)
_STRAY = ""  # the lines no daemon's context logged (a watcher thread's, the loop's own)


class _LogSink(logging.Handler):
    """structlog's logger and the standard library's handler in one: each rendered line
    goes to the daemon whose task logged it (the context variable its tasks inherit)."""

    def __init__(self, lines: dict[str, list[str]]) -> None:
        super().__init__(logging.INFO)
        self.lines = lines
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))

    def __call__(self, *_args: Any) -> _LogSink:  # structlog's logger factory
        return self

    def msg(self, line: str) -> None:
        self.lines.setdefault(_WHO.get() or _STRAY, []).append(line)

    debug = info = warning = warn = error = err = critical = fatal = exception = log = msg

    def emit(self, record: logging.LogRecord) -> None:
        self.msg(self.format(record))


class InProcessCluster:
    """Coordinators and nodes of this process, on one event loop in a background thread.

    Each daemon is composed by the functions ``tangramd coordinator`` and ``tangramd node``
    use (:mod:`tangramd.cluster.daemon`), with its state dir locked, on its own Unix socket
    under ``workdir``, over loopback TCP with the real link, TLS (or ``insecure``) and
    process backend: a node is up in a tenth of a second, where a subprocess takes one
    or two. The test thread talks to them as to subprocesses (:class:`InProcessDaemon`).
    While it is open the process's logging goes to the daemons' logs (JSON lines, as a
    daemon writes them), ``env`` is in ``os.environ`` and the umask is 077.

    :meth:`close` stops what runs, ends what a killed node's backend left running, and
    fails if a task or a child process outlives the cluster.
    """

    _open: ClassVar[bool] = False

    def __init__(self, workdir: str | os.PathLike[str], *, env: dict[str, str] | None = None):
        if InProcessCluster._open:
            raise RuntimeError("one in-process cluster at a time: logging is per process")
        InProcessCluster._open = True
        self.workdir = Path(workdir)
        self.daemons: list[InProcessDaemon] = []
        self.lines: dict[str, list[str]] = {}
        self._orphans: list[Callable[[], Awaitable[None]]] = []  # ends of killed nodes' work
        self._env = {key: os.environ.get(key) for key in env or {}}
        os.environ.update(env or {})
        self._umask = os.umask(0o077)
        self._structlog = dict(structlog.get_config())
        self._sink = _LogSink(self.lines)
        structlog.configure(
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.format_exc_info,
                structlog.processors.JSONRenderer(),
            ],
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
            logger_factory=self._sink,
            cache_logger_on_first_use=False,
        )
        root = logging.getLogger()
        self._root_level = root.level
        root.addHandler(self._sink)
        root.setLevel(logging.INFO)
        self._children = {p.pid for p in psutil.Process().children(recursive=True)}
        # the standard library's loop whatever the policy: its callbacks keep the context
        # they were registered in, which tells the daemons' lines apart (uvloop is
        # tests/test_event_loop.py's, with subprocesses)
        self.loop: asyncio.AbstractEventLoop = asyncio.SelectorEventLoop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def __enter__(self) -> InProcessCluster:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self.close(check=exc_type is None)  # a failure inside is the one to report

    def call(self, who: str, fn: Callable[[], Awaitable[T]], timeout_s: float = 60.0) -> T:
        """Run ``fn()`` on the cluster's loop as daemon ``who`` (its log gets the lines)."""

        async def as_who() -> T:
            _WHO.set(who)
            return await fn()

        return asyncio.run_coroutine_threadsafe(as_who(), self.loop).result(timeout_s)

    def stray_log(self) -> str:
        """The lines logged outside every daemon's context."""
        return "\n".join(list(self.lines.get(_STRAY, ())))

    def coordinator(
        self, config: str = "", *, listen: str = "127.0.0.1:0", insecure: bool = False
    ) -> InProcessDaemon:
        """As :func:`spawn_coordinator` (the same files under ``workdir``), here."""
        from tangramd.cluster.daemon import build_coordinator

        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "coordinator.toml"
        cfg.write_text(config)
        sock, state = (
            str(self.workdir / "coordinator.sock"),
            str(self.workdir / "coordinator-state"),
        )
        config_, cluster = cluster_config.load(
            cfg, {"daemon.socket": sock, "daemon.state_dir": state}
        )
        daemon = InProcessDaemon(self, "coordinator", sock, state, self.workdir, is_node=False)

        async def start() -> None:
            daemon.lock = lock_state_dir(state)
            try:
                check_socket_free(sock)
                ex = build_coordinator(config_, cluster, split_host_port(listen), insecure=insecure)
                await ex.start()
            except BaseException:
                daemon.ended(1)
                raise

            async def stop(code: int) -> None:
                await ex.stop()
                daemon.ended(code)

            daemon.halt = stop

        self.call(daemon.name, start)
        self.daemons.append(daemon)
        with daemon.client(connect_timeout_s=5.0) as c:
            daemon.join = c.cluster_join()
        return daemon

    def node(
        self,
        coordinator: AnyDaemon,
        name: str,
        *,
        cpus: str | None = None,
        token: str | None = None,
        ca_sha256: str | None = None,
        config: str = "",
        insecure: bool = False,
        wait_ready: bool = True,
        ready_timeout_s: float = 30.0,
        address: str | None = None,
    ) -> InProcessDaemon:
        """As :func:`spawn_node` (the same files under ``workdir/name``), here; its
        ``coordinator`` may be in this process or a subprocess."""
        from tangramd.cluster.daemon import build_node, node_capacity, serve_node

        work = self.workdir / name
        work.mkdir(parents=True, exist_ok=True)
        cfg = work / "node.toml"
        cfg.write_text(config)
        sock, state = str(work / "node.sock"), str(work / "state")
        config_, _ = cluster_config.load(cfg, {"daemon.socket": sock, "daemon.state_dir": state})
        join = coordinator.join
        token = join["token"] if token is None else token
        pin = join["ca_sha256"] if ca_sha256 is None else ca_sha256
        capacity = node_capacity(config_, cpus)
        daemon = InProcessDaemon(self, name, sock, state, work, is_node=True)
        stopping = asyncio.Event()

        async def start() -> None:
            daemon.lock = lock_state_dir(state)
            try:
                check_socket_free(sock)
                agent = build_node(
                    config_,
                    name=name,
                    coordinator=split_host_port(address or join["coordinator"]),
                    token=token or None,
                    ca_sha256=pin or None,
                    insecure=insecure,
                    capacity=capacity,
                )
            except BaseException:
                daemon.ended(1)
                raise
            task = asyncio.get_running_loop().create_task(serve_node(agent, stopping))
            task.add_done_callback(lambda t: daemon.ended(_exit_code(t, daemon)))

            async def halt(code: int) -> None:
                if code == 0:  # SIGTERM: a graceful stop
                    stopping.set()
                    await asyncio.wait({task})
                    return
                task.cancel()  # SIGKILL: no goodbye, nothing removed
                await asyncio.wait({task})
                await agent.abort()
                self._orphans.append(agent.backend.shutdown)
                if agent.host is not None:  # its service workers, as its backend's commands
                    self._orphans.append(agent.host.close)
                daemon.ended(code)

            daemon.halt = halt

        self.call(name, start)
        self.daemons.append(daemon)
        if wait_ready:
            try:
                wait_node_state(coordinator, name, "ready", ready_timeout_s, node=daemon)
            except BaseException:
                daemon.kill()
                raise
        return daemon

    def stop_all(self, daemons: Sequence[InProcessDaemon] | None = None) -> None:
        """SIGTERM to each of ``daemons`` (all) still running: the nodes at once, then the
        coordinators."""
        running = [d for d in self.daemons if d.poll() is None]
        if daemons is not None:
            running = [d for d in running if d in daemons]
        for group in ([d for d in running if d.is_node], [d for d in running if not d.is_node]):
            if group:
                self.call("", functools.partial(_together, [d.halted(0) for d in group]))

    def close(self, *, check: bool = True) -> None:
        """Stop every daemon still running (nodes first), end what killed nodes' backends
        left, stop the loop; fail (``check``) if a task or a child process is left over."""
        try:
            self.stop_all()
            for end in self._orphans:
                self.call("", end)
            leftover = self.call("", _leftover_tasks)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()
            self._restore()
        children = _wait_children_gone(self._children)
        if check:
            assert not leftover, f"tasks outlived the cluster: {leftover}"
            assert not children, f"child processes outlived the cluster: {children}"

    def _restore(self) -> None:
        logging.getLogger().removeHandler(self._sink)
        logging.getLogger().setLevel(self._root_level)
        structlog.configure(**self._structlog)
        os.umask(self._umask)
        for key, value in self._env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        InProcessCluster._open = False


class InProcessDaemon:
    """A coordinator or node of an :class:`InProcessCluster`, used as
    ``tangram.testing.ClusterDaemon`` is:
    its socket, state dir and log; ``stop()`` as SIGTERM does; ``kill()`` drops a node as
    SIGKILL would (its link reset, no goodbye, its backend's work left as it is) and stops
    a coordinator (which says no goodbye either: its nodes see their links reset)."""

    in_process = True  # wait_node_state polls these more often (no process to start)

    def __init__(
        self,
        cluster: InProcessCluster,
        name: str,
        socket: str,
        state_dir: str,
        workdir: Path,
        *,
        is_node: bool,
    ) -> None:
        self.cluster = cluster
        self.name = name
        self.is_node = is_node
        self.socket = socket
        self.state_dir = state_dir
        self.workdir = workdir
        self.join: dict[str, Any] = {}
        self.lock: Any = None
        self.halt: Callable[[int], Awaitable[None]] | None = None
        self._exit: concurrent.futures.Future[int] = concurrent.futures.Future()

    def client(self, **kw: Any) -> Client:
        return Client(self.socket, **kw)

    def log(self) -> str:
        return "\n".join(list(self.cluster.lines.get(self.name, ())))

    def ended(self, code: int) -> None:
        """It exited with ``code`` (called on the loop): its state dir is free again."""
        if self.lock is not None:
            self.lock.close()
            self.lock = None
        if not self._exit.done():
            self._exit.set_result(code)

    def poll(self) -> int | None:
        return self._exit.result() if self._exit.done() else None

    def wait(self, timeout_s: float) -> int:
        return self._exit.result(timeout_s)

    def kill(self) -> None:
        self._halt(-signal.SIGKILL)

    def stop(self, timeout_s: float = 30.0) -> int:
        self._halt(0, timeout_s)
        return self.wait(timeout_s)

    def _halt(self, code: int, timeout_s: float = 30.0) -> None:
        if self.poll() is None:
            self.cluster.call(self.name, lambda: self.halted(code), timeout_s)

    async def halted(self, code: int) -> None:
        """On the loop: stop (``code`` 0) or kill it, its lines in its own log."""
        _WHO.set(self.name)
        if self.halt is not None and self.poll() is None:
            await self.halt(code)


AnyDaemon = ClusterDaemon | InProcessDaemon


def _exit_code(task: asyncio.Task[int], daemon: InProcessDaemon) -> int:
    """A node's serve task ended: its exit code (an exception is logged, as a crash's
    traceback would be, and is exit code 1)."""
    if task.cancelled():
        return -signal.SIGKILL
    exc = task.exception()
    if exc is None:
        return task.result()
    lines = traceback.format_exception(exc)
    daemon.cluster.lines.setdefault(daemon.name, []).append("".join(lines))
    return 1


async def _together(steps: list[Awaitable[None]]) -> None:
    await asyncio.gather(*steps)


async def _leftover_tasks(grace_s: float = 2.0) -> list[str]:
    """Tasks other than this one still running after ``grace_s``: cancelled and named."""
    me = asyncio.current_task()
    deadline = time.monotonic() + grace_s
    while (left := [t for t in asyncio.all_tasks() if t is not me and not t.done()]) and (
        time.monotonic() < deadline
    ):
        await asyncio.sleep(0.01)
    for task in left:
        task.cancel()
    return [repr(task) for task in left]


def _wait_children_gone(before: set[int], timeout_s: float = 5.0) -> list[str]:
    """Child processes started since ``before`` still alive after ``timeout_s`` (killed)."""
    deadline = time.monotonic() + timeout_s
    while (left := _children_since(before)) and time.monotonic() < deadline:
        time.sleep(0.02)
    named = []
    for proc in left:
        with contextlib.suppress(psutil.Error):
            named.append(f"{proc.pid} {' '.join(proc.cmdline())[:200]}")
            proc.kill()
    return named


def _children_since(before: set[int]) -> list[psutil.Process]:
    """This process's live descendants not in ``before``."""
    out = []
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if proc.pid not in before and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
    return out

"""Process life cycle of the daemons: systemd readiness and stop signals.

- :func:`sd_notify` speaks systemd's notify protocol with the standard library only (one
  datagram to ``$NOTIFY_SOCKET``, abstract ``@`` names included), so ``Type=notify`` units
  work without libsystemd; without ``$NOTIFY_SOCKET`` (a terminal, a test) it does nothing.
- :func:`lock_state_dir` makes the state directory private and takes its ``flock``: a
  second daemon on the same directory exits with the holder's pid instead of removing the
  first one's environments.
- :func:`install_stop_handlers` turns SIGTERM/SIGINT into an :class:`asyncio.Event` that the
  daemon's main coroutine awaits, so shutdown runs as ordinary code on the loop (ending
  in-flight actions with a typed outcome, removing the socket) instead of inside a signal
  handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import socket
import stat
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Final, TypeVar

import structlog

from tangram.model import TangramError

log = structlog.get_logger(__name__)

NOTIFY_ENV: Final = "NOTIFY_SOCKET"
STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT)

T = TypeVar("T")


def _notify_address(value: str) -> str | bytes:
    """``@name`` is an abstract socket (a leading NUL byte on the wire)."""
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    return value


def sd_notify(message: str, *, env: dict[str, str] | None = None) -> bool:
    """Send ``message`` (e.g. ``"READY=1"``, ``"STOPPING=1"``, ``"STATUS=..."``) to systemd.

    Returns True if it was sent, False when there is no ``$NOTIFY_SOCKET`` or sending
    failed: readiness reporting must never take the daemon down.
    """
    target = (env if env is not None else os.environ).get(NOTIFY_ENV)
    if not target:
        return False
    if not target.startswith(("/", "@")):
        log.warning("sd_notify_bad_socket", notify_socket=target)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(_notify_address(target))
            sock.sendall(message.encode())
    except OSError as exc:
        log.warning("sd_notify_failed", notify_socket=target, error=str(exc))
        return False
    return True


def notify_ready(status: str = "") -> bool:
    """``READY=1`` (plus ``STATUS=`` if given) once the socket serves requests."""
    return sd_notify("READY=1" + (f"\nSTATUS={status}" if status else ""))


def notify_stopping(status: str = "") -> bool:
    """``STOPPING=1`` when shutdown begins, so systemd shows ``deactivating``."""
    return sd_notify("STOPPING=1" + (f"\nSTATUS={status}" if status else ""))


def install_stop_handlers(
    loop: asyncio.AbstractEventLoop,
    stop: asyncio.Event,
    signals: Iterable[signal.Signals] = STOP_SIGNALS,
    *,
    on_signal: Callable[[signal.Signals], object] | None = None,
) -> Callable[[], None]:
    """Make each of ``signals`` set ``stop`` (and call ``on_signal``); return an uninstaller.

    A second stop signal while ``stop`` is already set is logged and otherwise ignored:
    shutdown is already under way and has its own grace period (``TimeoutStopSec`` bounds
    it from outside). Must be called from the loop's thread (asyncio's rule for
    ``add_signal_handler``).
    """
    installed: list[signal.Signals] = []

    def handle(signum: signal.Signals) -> None:
        repeated = stop.is_set()
        log.info("signal_received", signal=signum.name, shutdown_in_progress=repeated)
        if not repeated:
            stop.set()
        if on_signal is not None:
            on_signal(signum)

    for signum in signals:
        loop.add_signal_handler(signum, handle, signum)
        installed.append(signum)

    def uninstall() -> None:
        for signum in installed:
            with contextlib.suppress(ValueError, RuntimeError):  # loop already closed
                loop.remove_signal_handler(signum)
        installed.clear()

    return uninstall


__all__ = [
    "NOTIFY_ENV",
    "STOP_SIGNALS",
    "StateDirBusy",
    "StateDirLock",
    "install_stop_handlers",
    "lock_state_dir",
    "notify_ready",
    "notify_stopping",
    "sd_notify",
]


# --- one daemon per state directory -----------------------------------------------------

LOCK_NAME: Final = "tangramd.lock"


class StateDirBusy(RuntimeError):
    """Another daemon holds the state directory's lock."""


class StateDirLock:
    """An exclusive ``flock`` on ``<state_dir>/tangramd.lock``, held for the daemon's life.

    The kernel drops it when the process dies (even by SIGKILL), so a crashed daemon never
    leaves a stale lock; the file holds the holder's pid for the message of the next one.
    """

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the lock
            self.fd = -1


def lock_state_dir(state_dir: str, *, shared: bool = False) -> StateDirLock:
    """Create ``state_dir`` (0700; 0711 with ``shared``: commands running as other users
    must reach their own environment inside it) and take its lock, or raise StateDirBusy
    naming the holder's pid."""
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    st = os.stat(state_dir)
    if st.st_mode & (stat.S_ISVTX | stat.S_IWOTH) or st.st_uid != os.geteuid():
        # e.g. --state-dir /tmp: tightening it would break everyone else's use of it
        raise StateDirBusy(
            f"state dir {state_dir} is shared (world-writable, sticky or not ours); "
            "give tangramd a directory of its own"
        )
    os.chmod(state_dir, 0o711 if shared else 0o700)
    path = os.path.join(state_dir, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StateDirBusy(
            f"state dir {state_dir} is in use by another tangramd (pid {holder}); "
            "stop it first or give this one its own --state-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return StateDirLock(fd, path)


def run_loop(main: Coroutine[Any, Any, T], event_loop: str = "auto") -> T:
    """Run the daemon's main coroutine on ``event_loop``: ``uvloop`` (libuv; less CPU per
    message and per exec), ``asyncio`` (the standard library's), or
    ``auto``: uvloop where it is installed, else asyncio."""
    if event_loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if event_loop == "uvloop":
                raise TangramError(
                    "daemon.event_loop = 'uvloop' but uvloop is not installed "
                    "(pip install uvloop, or event_loop = 'auto')"
                ) from None
        else:
            return uvloop.run(main)
    return asyncio.run(main)


def loop_name() -> str:
    """The running event loop's kind, for the daemons' ready lines: uvloop or asyncio."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"

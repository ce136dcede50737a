"""What every service runtime offers ``ServiceHost``, and the results it hands back.

A runtime instance is one *replica*: one worker process (torch) or one model server (http).
``ServiceHost`` decides nothing about placement; it tells a replica to ``restore`` onto a
chunk of GPUs, ``evict``, or ``call``, as the pure pool decided.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from tangramd.services.inventory import Gpu

OUTCOMES = ("ok", "failed", "timeout", "rejected", "infra_error")


class ServiceError(Exception):
    """Base of the service runtime's errors."""


class ServiceLoadError(ServiceError):
    """A service could not be loaded (its factory failed, its server did not come up).

    The message names the service and the underlying exception.
    """


class ReplicaCrashed(ServiceError):
    """The replica's process died or stopped answering; its calls end with ``infra_error``."""


class Moved(NamedTuple):
    """One restore or eviction as measured by the replica: bytes moved, seconds copying."""

    nbytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class WorkerReply:
    """One call as the replica saw it: ``ok`` or ``failed`` (the handler rejected it)."""

    ok: bool
    result: dict[str, Any] | None
    error: str | None
    exec_s: float


class Replica(Protocol):
    """One running instance of a service (a torch worker or an http model server)."""

    @property
    def alive(self) -> bool: ...

    @property
    def nbytes(self) -> int | None:
        """Bytes the instance moves on restore (None when the runtime cannot tell)."""

    async def start(self, gpus: tuple[Gpu, ...]) -> None:
        """Load the service (the host backup); ``ServiceLoadError`` if that fails."""

    async def restore(self, gpus: tuple[Gpu, ...]) -> Moved:
        """Copy the backup onto ``gpus``; ``ReplicaCrashed`` if the process is gone."""

    async def evict(self) -> Moved:
        """Drop the device copy, keep the backup; ``ReplicaCrashed`` if the process is gone."""

    async def call(self, payload: dict[str, Any], timeout: float) -> WorkerReply:
        """Run one call; ``TimeoutError`` after ``timeout`` s, ``ReplicaCrashed`` on a crash."""

    async def call_batch(self, payloads: list[dict[str, Any]], timeout: float) -> list[WorkerReply]:
        """Run several calls together (one forward pass, or concurrent requests to a server
        that batches itself); one reply per payload, in order. Raises as ``call`` does."""

    async def close(self) -> None:
        """Stop the process (idempotent)."""


def log_tail(path: Path | None, lines: int = 12) -> str:
    """The last lines of a worker's log, for error messages ('' when there is none)."""
    if path is None or not path.exists():
        return ""
    with path.open(errors="replace") as log:
        tail = deque(log, maxlen=lines)
    return "".join(tail).strip()

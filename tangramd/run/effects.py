"""The effects protocol: what an executor asks of the place where commands take effect.

Each method starts the command's work and returns at once; what happened comes back as
one event through the ``report`` callback the effects were built with (``EnvCreated``,
``EnvRemoved``, ``ExecFinished``, ``TransferDone``, ``SessionOpened``, ``SessionClosed``,
``ServiceLoaded``, ``ServiceUnloaded``, ``CallFinished``; an interrupt reports nothing).
A method never raises for the work's own failure: that is the reported event's error.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from tangramd import events as ev

Report = Callable[[ev.Event], None]
Spawn = Callable[[Coroutine[Any, Any, None]], None]


class ServiceList(Protocol):
    """What ``service list`` reads: this host's ``ServiceHost``, or a coordinator's
    ``ClusterServices`` (its nodes' rows merged)."""

    def list(self) -> list[dict[str, Any]]: ...


class Effects(Protocol):
    """Carries out the core's commands on environments, execs, files, shells and services."""

    name: str  # what ``status`` shows as the backend

    @property
    def services(self) -> ServiceList | None:
        """The GPU services the effects run calls on, if any."""
        ...

    # True: execs run here and each one's end is reported by these effects (the executor
    # logs it); False: they run on another host, which logs them (a coordinator's nodes)
    runs_execs_here: bool

    def bind(self, report: Report, spawn: Spawn) -> None:
        """Where outcomes go (``report``) and how background work is started (``spawn``);
        the executor calls it once, before any command."""
        ...

    def create_env(self, cmd: ev.CreateEnv) -> None: ...

    def remove_env(self, cmd: ev.RemoveEnv) -> None: ...

    def run_exec(self, cmd: ev.RunExec) -> None: ...

    def kill_exec(self, cmd: ev.KillExec) -> None: ...

    def run_transfer(self, cmd: ev.RunTransfer) -> None: ...

    def start_shell(self, cmd: ev.StartShell) -> None: ...

    def interrupt_shell(self, cmd: ev.InterruptShell) -> None: ...

    def end_shell(self, cmd: ev.EndShell) -> None: ...

    def load_service(self, cmd: ev.LoadService) -> None: ...

    def unload_service(self, cmd: ev.UnloadService) -> None: ...

    def run_call(self, cmd: ev.RunCall) -> None: ...

    def stop_running_call(self, cmd: ev.StopCall) -> None:
        """Stop a running call's forward pass (``cancel``): its calls' ``CallFinished``
        come once the replica holds nothing."""
        ...

    def warm_service(self, cmd: ev.WarmService) -> None:
        """Restore a replica with no call (reports nothing)."""
        ...

    def in_flight(self) -> int:
        """Execs started and not reported yet (a graceful stop waits for them)."""
        ...

    async def recover_envs(self, records: list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
        """After a restart: keep the environments ``records`` name that still exist (remove
        the rest, kill what still runs); returns the records kept."""
        ...

    async def recover_services(self) -> tuple[Any, ...]:
        """After a restart: reload the registered services; returns their specs."""
        ...

    async def shutdown(self, keep: list[str]) -> None:
        """A graceful stop: end running work (reported as usual); environments in ``keep``
        stay for the next daemon."""
        ...

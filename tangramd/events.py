"""Events fed to ``Core.handle`` and the commands it returns (small frozen values).

``token`` identifies a pending client request (the executor maps it to a reply future);
``cause`` links a command to the event that caused it, for logs and stories.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Event:
    cause: int = 0


# ---------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class SubmitExec(Event):
    token: int | None = None
    cmd: list[str] | str = ""
    env: str | None = None
    image: str | None = None
    cpus: Any = None
    mem: int | None = None
    timeout_s: float | None = None
    profile: str | None = None
    elastic: bool | None = None
    trajectory: str | None = None
    task: str | None = None
    t1_s: float | None = None
    eff: Mapping[Any, float] | None = None
    env_vars: Mapping[str, str] | None = None
    conn: int | None = None


@dataclass(frozen=True, slots=True)
class OpenEnv(Event):
    token: int | None = None
    image: str | None = None
    mem: int | None = None
    trajectory: str | None = None
    conn: int | None = None


@dataclass(frozen=True, slots=True)
class CloseEnv(Event):
    token: int | None = None
    env_id: str = ""


@dataclass(frozen=True, slots=True)
class EnvCreated(Event):
    env_id: str = ""
    error: str | None = None  # None: created


@dataclass(frozen=True, slots=True)
class EnvRemoved(Event):
    env_id: str = ""


@dataclass(frozen=True, slots=True)
class ExecFinished(Event):
    action_id: str = ""
    result: Mapping[str, Any] = field(default_factory=dict)
    env_lost: bool = False  # the backend no longer has the environment


@dataclass(frozen=True, slots=True)
class AcquireLease(Event):
    token: int | None = None
    api: str = ""
    ttl_s: float | None = None
    policy: str | None = None
    deadline_s: float | None = None
    conn: int | None = None


@dataclass(frozen=True, slots=True)
class ReleaseLease(Event):
    token: int | None = None
    lease_id: str = ""


@dataclass(frozen=True, slots=True)
class ConnClosed(Event):
    conn: int = 0


@dataclass(frozen=True, slots=True)
class Tick(Event):
    pass


@dataclass(frozen=True, slots=True)
class Shutdown(Event):
    pass


# ---------------------------------------------------------------------------- commands


@dataclass(frozen=True, slots=True)
class Command:
    cause: int = 0


@dataclass(frozen=True, slots=True)
class Reply(Command):
    token: int = 0
    result: Any = None
    error: tuple[str, str] | None = None

    def __init__(
        self, token: int, result: Any = None, error: tuple[str, str] | None = None, cause: int = 0
    ) -> None:
        object.__setattr__(self, "token", token)
        object.__setattr__(self, "result", result)
        object.__setattr__(self, "error", error)
        object.__setattr__(self, "cause", cause)


@dataclass(frozen=True, slots=True)
class CreateEnv(Command):
    env_id: str = ""
    node: str = ""
    image: str | None = None
    mem: int = 0

    def __init__(self, env_id: str, node: str, image: str | None, mem: int, cause: int = 0) -> None:
        object.__setattr__(self, "env_id", env_id)
        object.__setattr__(self, "node", node)
        object.__setattr__(self, "image", image)
        object.__setattr__(self, "mem", mem)
        object.__setattr__(self, "cause", cause)


@dataclass(frozen=True, slots=True)
class RemoveEnv(Command):
    env_id: str = ""
    node: str = ""

    def __init__(self, env_id: str, node: str, cause: int = 0) -> None:
        object.__setattr__(self, "env_id", env_id)
        object.__setattr__(self, "node", node)
        object.__setattr__(self, "cause", cause)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunExec(Command):
    action_id: str
    env_id: str
    node: str
    cores: tuple[int, ...]
    cmd: list[str] | str
    timeout_s: float | None
    elastic: bool
    env_vars: dict[str, str]
    max_output: int

"""ARL-Tangram: action-level resource manager for agentic RL.

What a rollout process needs: ``from tangram import Client, AsyncClient, ExecResult``.
Names are imported lazily (PEP 562) so that ``import tangram.model`` stays free of asyncio
and sockets (style: the core never imports I/O modules).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tangram import _native

_native.select()  # the compiled core or its sources, before any of its modules is imported

if TYPE_CHECKING:
    from tangram.client import AsyncClient, Client, Env, ExecResult, default_socket_path
    from tangram.model import InvalidDemand, TangramError, Unschedulable
    from tangram.protocol.errors import (
        BadRequest,
        ConnectionFailed,
        DiskFull,
        EnvLost,
        Forbidden,
        InfraError,
        InternalError,
        NotFound,
        QuotaExceeded,
        ShuttingDown,
        Timeout,
        UnknownOp,
    )

_EXPORTS: dict[str, str] = {
    "AsyncClient": "tangram.client",
    "Client": "tangram.client",
    "Env": "tangram.client",
    "ExecResult": "tangram.client",
    "default_socket_path": "tangram.client",
    "InvalidDemand": "tangram.model",
    "TangramError": "tangram.model",
    "Unschedulable": "tangram.model",
    "BadRequest": "tangram.protocol.errors",
    "ConnectionFailed": "tangram.protocol.errors",
    "DiskFull": "tangram.protocol.errors",
    "EnvLost": "tangram.protocol.errors",
    "Forbidden": "tangram.protocol.errors",
    "InfraError": "tangram.protocol.errors",
    "InternalError": "tangram.protocol.errors",
    "NotFound": "tangram.protocol.errors",
    "QuotaExceeded": "tangram.protocol.errors",
    "ShuttingDown": "tangram.protocol.errors",
    "Timeout": "tangram.protocol.errors",
    "UnknownOp": "tangram.protocol.errors",
}

__all__ = [
    "AsyncClient",
    "BadRequest",
    "Client",
    "ConnectionFailed",
    "DiskFull",
    "Env",
    "EnvLost",
    "ExecResult",
    "Forbidden",
    "InfraError",
    "InternalError",
    "InvalidDemand",
    "NotFound",
    "QuotaExceeded",
    "ShuttingDown",
    "TangramError",
    "Timeout",
    "UnknownOp",
    "Unschedulable",
    "default_socket_path",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tangram' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

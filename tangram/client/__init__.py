"""Clients of the daemon's Unix socket (docs/design.md §6): ``Client`` (blocking) and
``AsyncClient``.

Both speak the framed msgpack protocol of :mod:`tangram.protocol`, turn error codes back
into the typed exceptions of :mod:`tangram.protocol.errors`, and share one declaration of
every op (:mod:`tangram.client.ops`).
"""

from tangram.client.aio import AsyncClient
from tangram.client.ops import Cpus, Env, Size
from tangram.client.sync import CallInterrupted, Client, ExecInterrupted
from tangram.protocol import (
    SOCKET_ENV,
    SYSTEM_SOCKET,
    CallResult,
    ExecResult,
    Outcome,
    default_socket_path,
)

AsyncEnv = Env  # one handle class serves both clients

__all__ = [
    "SOCKET_ENV",
    "SYSTEM_SOCKET",
    "AsyncClient",
    "AsyncEnv",
    "CallInterrupted",
    "CallResult",
    "Client",
    "Cpus",
    "Env",
    "ExecInterrupted",
    "ExecResult",
    "Outcome",
    "Size",
    "default_socket_path",
]

"""Wire error codes (docs/design.md §6) and the typed exception for each.

The set of codes is fixed: a client maps each code back to the same exception class the
server raised, so ``except QuotaExceeded`` works across the socket. Every class derives
from :class:`tangram.model.TangramError` and carries the code as ``.code``; the model's own
errors (``InvalidDemand`` → ``bad_request``, ``Unschedulable`` → ``unschedulable``) travel
unchanged.
"""

from __future__ import annotations

from typing import Final

from tangram.model import TangramError, Unschedulable

BAD_REQUEST: Final = "bad_request"
UNKNOWN_OP: Final = "unknown_op"
NOT_FOUND: Final = "not_found"
UNSCHEDULABLE: Final = "unschedulable"
QUOTA_EXCEEDED: Final = "quota_exceeded"
TIMEOUT: Final = "timeout"
INFRA_ERROR: Final = "infra_error"
INTERNAL: Final = "internal"
SHUTTING_DOWN: Final = "shutting_down"
ENV_LOST: Final = "env_lost"
FORBIDDEN: Final = "forbidden"
DISK_FULL: Final = "disk_full"

ERROR_CODES: Final[tuple[str, ...]] = (
    BAD_REQUEST,
    UNKNOWN_OP,
    NOT_FOUND,
    UNSCHEDULABLE,
    QUOTA_EXCEEDED,
    TIMEOUT,
    INFRA_ERROR,
    INTERNAL,
    SHUTTING_DOWN,
    ENV_LOST,
    FORBIDDEN,
    DISK_FULL,
)


class BadRequest(TangramError):
    """The request is malformed: a field is missing, of the wrong type or out of range.

    ``request_id`` is the id of the offending request when it could be read, so the
    transport can answer it; ``None`` means the answer goes out with ``"id": null``.
    """

    code = BAD_REQUEST

    def __init__(self, message: str, *, request_id: int | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class UnknownOp(TangramError):
    """The op name is not in the op table of the daemon that received it."""

    code = UNKNOWN_OP


class NotFound(TangramError):
    """The named object (environment, lease, profile, service, action, API) does not exist."""

    code = NOT_FOUND


class QuotaExceeded(TangramError):
    """An API quota is exhausted and the lease policy said not to wait (``reject``)."""

    code = QUOTA_EXCEEDED


class Timeout(TangramError):
    """A deadline passed before the request could be served (e.g. a lease ``deadline_s``)."""

    code = TIMEOUT


class InfraError(TangramError):
    """The infrastructure failed (docker, NVML, a node, the socket): not the task's fault."""

    code = INFRA_ERROR


class ConnectionFailed(InfraError):
    """The client could not reach the daemon, or the connection dropped mid-request."""


class InternalError(TangramError):
    """A bug in the daemon: the request may be fine, the server failed to handle it."""

    code = INTERNAL


class ShuttingDown(TangramError):
    """The daemon is stopping and no longer accepts (or finishes) this request."""

    code = SHUTTING_DOWN


class EnvLost(TangramError):
    """The environment was lost with the node that held it; open a new one."""

    code = ENV_LOST


class Forbidden(TangramError):
    """An operator-only op (drain, profile save, service register, join tokens, ...) from a
    caller that is not an operator (root, the daemon's user, ``daemon.operator_uids``)."""

    code = FORBIDDEN


class DiskFull(InfraError):
    """The disk holding the daemon's state dir (its records, the coordinator's database)
    is full: the change could not be kept, so it was not made. The message names the
    filesystem and the path; retry once space is freed there. An ``InfraError`` too."""

    code = DISK_FULL


ERROR_CLASSES: Final[dict[str, type[TangramError]]] = {
    BAD_REQUEST: BadRequest,
    UNKNOWN_OP: UnknownOp,
    NOT_FOUND: NotFound,
    UNSCHEDULABLE: Unschedulable,
    QUOTA_EXCEEDED: QuotaExceeded,
    TIMEOUT: Timeout,
    INFRA_ERROR: InfraError,
    INTERNAL: InternalError,
    SHUTTING_DOWN: ShuttingDown,
    ENV_LOST: EnvLost,
    FORBIDDEN: Forbidden,
    DISK_FULL: DiskFull,
}


def error_from_wire(code: str, message: str) -> TangramError:
    """The exception a client raises for a wire error.

    An unknown code (a newer daemon) yields a plain ``TangramError`` that keeps the code.
    """
    cls = ERROR_CLASSES.get(code)
    if cls is None:
        # ``code`` is a class attribute on every typed error: a subclass for the unknown code
        unknown: type[TangramError] = type(
            "TangramError", (TangramError,), {"code": code, "__module__": __name__}
        )
        return unknown(message)
    return cls(message)


def error_to_wire(exc: BaseException) -> dict[str, str]:
    """The ``{"code", "message"}`` map for an exception raised while serving a request.

    Typed errors keep their code and message; anything else is a bug and becomes
    ``internal`` with the exception's type and text.
    """
    if isinstance(exc, TangramError) and exc.code in ERROR_CLASSES:
        return {"code": exc.code, "message": exc.message}
    text = str(exc)
    return {
        "code": INTERNAL,
        "message": f"{type(exc).__name__}: {text}" if text else type(exc).__name__,
    }

"""Sans-IO wire protocol (docs/design.md §6): frame codec, envelopes, op table, error codes, the
exec request/result shapes, and where the daemon's socket is.

Bytes in, messages out: nothing here touches sockets, asyncio or the clock.
"""

from tangram.protocol.codec import DEFAULT_MAX_FRAME, FrameDecoder, FrameError, decode_body, encode
from tangram.protocol.errors import (
    ERROR_CLASSES,
    ERROR_CODES,
    BadRequest,
    ConnectionFailed,
    EnvLost,
    InfraError,
    InternalError,
    NotFound,
    QuotaExceeded,
    ShuttingDown,
    Timeout,
    UnknownOp,
    error_from_wire,
    error_to_wire,
)
from tangram.protocol.messages import (
    MalformedResponse,
    Request,
    Response,
    error_response,
    make_request,
    ok_response,
    parse_request,
    parse_response,
)
from tangram.protocol.ops import (
    LEASE_POLICIES,
    OPS,
    PROTOCOL_VERSION,
    Arg,
    Op,
    parse_size,
    render_markdown,
    validate_args,
)
from tangram.protocol.paths import SOCKET_ENV, SYSTEM_SOCKET, default_socket_path
from tangram.protocol.results import (
    OUTCOMES,
    CallResult,
    CallSpec,
    ExecResult,
    ExecSpec,
    Outcome,
)

__all__ = [
    "DEFAULT_MAX_FRAME",
    "ERROR_CLASSES",
    "ERROR_CODES",
    "LEASE_POLICIES",
    "OPS",
    "OUTCOMES",
    "PROTOCOL_VERSION",
    "SOCKET_ENV",
    "SYSTEM_SOCKET",
    "Arg",
    "BadRequest",
    "CallResult",
    "CallSpec",
    "ConnectionFailed",
    "EnvLost",
    "ExecResult",
    "ExecSpec",
    "FrameDecoder",
    "FrameError",
    "InfraError",
    "InternalError",
    "MalformedResponse",
    "NotFound",
    "Op",
    "Outcome",
    "QuotaExceeded",
    "Request",
    "Response",
    "ShuttingDown",
    "Timeout",
    "UnknownOp",
    "decode_body",
    "default_socket_path",
    "encode",
    "error_from_wire",
    "error_response",
    "error_to_wire",
    "make_request",
    "ok_response",
    "parse_request",
    "parse_response",
    "parse_size",
    "render_markdown",
    "validate_args",
]

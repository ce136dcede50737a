"""Request and response envelopes (docs/design.md §6).

Request: ``{"id": int, "op": str, "args": map}``.
Response: ``{"id": int, "ok": true, "result": any}`` or
``{"id": int | null, "ok": false, "error": {"code": str, "message": str}}`` (``id`` is null
only when the request's id could not be read).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tangram.model import TangramError
from tangram.protocol.errors import BadRequest, error_from_wire, error_to_wire

# msgpack integers: ids outside this range cannot be encoded back in a response.
MIN_ID = -(1 << 63)
MAX_ID = (1 << 64) - 1


class MalformedResponse(TangramError):
    """The daemon sent a frame that is not a valid response (a protocol bug, not a task's)."""

    code = "internal"


@dataclass(frozen=True, slots=True)
class Request:
    """One parsed request: the envelope is valid, the args are not yet validated."""

    id: int
    op: str
    args: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Response:
    """One parsed response; exactly one of ``result`` (ok) and ``error`` (not ok) is set."""

    id: int | None
    ok: bool
    result: Any = None
    error: TangramError | None = None

    def unwrap(self) -> Any:
        """The result, or raise the typed error the daemon reported."""
        if self.error is not None:
            raise self.error
        return self.result


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def make_request(request_id: int, op: str, args: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The request map (not yet encoded)."""
    return {"id": request_id, "op": op, "args": dict(args) if args else {}}


def ok_response(request_id: int, result: Any) -> dict[str, Any]:
    """A success response map."""
    return {"id": request_id, "ok": True, "result": result}


def error_response(request_id: int | None, exc: BaseException) -> dict[str, Any]:
    """A failure response map for ``exc`` (non-typed exceptions become ``internal``)."""
    return {"id": request_id, "ok": False, "error": error_to_wire(exc)}


def _read_id(msg: Mapping[str, Any]) -> int | None:
    value = msg.get("id")
    if type(value) is int and MIN_ID <= value <= MAX_ID:
        return value
    return None


def parse_request(msg: Mapping[str, Any]) -> Request:
    """Check the envelope of a decoded request; raise BadRequest naming the bad field.

    The error carries ``request_id`` whenever ``id`` itself was valid, so the caller can
    answer the request instead of dropping it.
    """
    if "id" not in msg:
        raise BadRequest("request: missing field 'id' (expected int)")
    request_id = _read_id(msg)
    if request_id is None:
        raise BadRequest(f"request: field 'id' must be int, got {_type_name(msg['id'])}")
    op = msg.get("op")
    if op is None:
        raise BadRequest("request: missing field 'op' (expected str)", request_id=request_id)
    if not isinstance(op, str) or not op:
        raise BadRequest(
            f"request: field 'op' must be a non-empty str, got {_type_name(op)}",
            request_id=request_id,
        )
    args = msg.get("args", {})
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise BadRequest(
            f"request: field 'args' must be a map, got {_type_name(args)}", request_id=request_id
        )
    extra = set(msg) - {"id", "op", "args"}
    if extra:
        raise BadRequest(
            f"request: unknown field(s) {sorted(extra)} (allowed: id, op, args)",
            request_id=request_id,
        )
    return Request(request_id, op, args)


def parse_response(msg: Mapping[str, Any]) -> Response:
    """Check the envelope of a decoded response; raise MalformedResponse if it is not one."""
    if "id" not in msg or (msg["id"] is not None and _read_id(msg) is None):
        raise MalformedResponse(f"response: bad or missing 'id': {msg.get('id')!r}")
    request_id = _read_id(msg)
    ok = msg.get("ok")
    if ok is True:
        if "result" not in msg:
            raise MalformedResponse("response: ok response without 'result'")
        return Response(request_id, True, result=msg["result"])
    if ok is not False:
        raise MalformedResponse(f"response: field 'ok' must be bool, got {_type_name(ok)}")
    error = msg.get("error")
    if not isinstance(error, dict):
        raise MalformedResponse(f"response: field 'error' must be a map, got {_type_name(error)}")
    code, message = error.get("code"), error.get("message")
    if not isinstance(code, str) or not isinstance(message, str):
        raise MalformedResponse("response: error needs str 'code' and str 'message'")
    return Response(request_id, False, error=error_from_wire(code, message))

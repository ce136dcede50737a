"""The gateway's FastAPI application: routes, API key, metrics, the daemon connection.

``build_app(socket, api_key=...)`` returns the app ``tangramd http`` serves with uvicorn.
It talks to the daemon through one :class:`~tangram.client.AsyncClient` (requests are
pipelined over its connection), so every call is an action the daemon schedules;
``tangramd up --http`` serves the same app in the daemon's own process, with the client
handing requests to the daemon's server directly (:mod:`tangramd.gateway.local`).

- ``POST /run_code``: SandboxFusion (``sandbox_fusion.py``);
- ``POST /run_jupyter``: SandboxFusion's notebook mode (``jupyter.py``);
- ``POST /envs``, ``/swerex/{env}/…``: SWE-ReX's remote runtime (``swerex.py``);
- ``GET /metrics``: Prometheus text format (``metrics.py``);
- ``GET /health``: liveness of the gateway and the daemon behind it.

With an API key every request must carry it, compared in constant time, else it is answered
401 before anything else happens: in the ``X-API-Key`` header, or, for a client that cannot
send a header (SandboxFusion's own ``sandbox_fusion`` client), as the first path segment
after ``/k/``: ``set_endpoint("http://HOST:PORT/k/KEY")`` makes it post to
``/k/KEY/run_code``, which is served as ``/run_code``. (Such a URL holds the key: keep it
out of logs you share; the gateway logs no request lines.) Errors never take the process down:
a malformed body is a 422 with FastAPI's JSON detail, an unexpected exception on a SWE-ReX
route is SWE-ReX's 511 transfer, a refusal of the daemon elsewhere a 4xx, a 504 (its
``timeout``: a wait that ran out) or a 502 with a JSON body (anything else is a bug: a
500, logged with its traceback).

Limits (``[http]`` in the config): a body larger than ``max_body`` is a 413, refused on its
``Content-Length`` or, for a chunked body, as soon as the bytes received pass the limit,
never read whole; a ``run_timeout`` (``compile_timeout``, ``cell_timeout``,
``total_timeout``) above ``max_run_timeout_s`` is a 400 naming the field; JSON nested too
deep for the parser is a 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from fastapi import FastAPI, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tangram.client import AsyncClient, ExecResult
from tangram.model import TangramError
from tangram.protocol.errors import BAD_REQUEST, NOT_FOUND, TIMEOUT
from tangramd.gateway import jupyter, swerex
from tangramd.gateway import sandbox_fusion as sf
from tangramd.gateway.callers import CALLER, PEER_STATE, Caller
from tangramd.gateway.metrics import Metrics

log = structlog.get_logger("tangramd.gateway")

API_KEY_HEADER = "X-API-Key"
API_KEY_LOWER = API_KEY_HEADER.lower().encode()  # ASGI header names are lower-case bytes
KEY_PREFIX = "/k/"  # /k/KEY/run_code: the key in the path, for clients that send no header
SCRAPE_TIMEOUT_S = 2.0
MAX_BODY = 16 << 20  # [http] max_body's default
MAX_RUN_TIMEOUT_S = 3600.0  # [http] max_run_timeout_s's default
# a daemon's refusal outside the SWE-ReX routes (which answer SWE-ReX's 511): any other
# code is a 502
STATUS_OF_CODE = {NOT_FOUND: 404, BAD_REQUEST: 400, TIMEOUT: 504}


class Refusal(HTTPException):
    """A request refused before its route ran (body too large, JSON too deep): raised
    where the body is read, answered by Gate (or, inside FastAPI, by its handler of
    HTTPException, which FastAPI's body parsing lets through) as ``{"detail": ...}``."""


@dataclass(frozen=True, slots=True)
class FastRoute:
    """A JSON POST route Gate serves itself when the body is a valid ``model`` (the usual
    case: FastAPI's request machinery, its dependency solving and its middleware below Gate
    cost more than the route's own work); any other body goes to FastAPI unchanged, so
    its 422 and every other answer stay FastAPI's own."""

    model: type[BaseModel]
    serve: Callable[[Any], Awaitable[Response]]


class Gate:
    """The API key check, the request counters and the fast routes, as a plain ASGI
    middleware (Starlette's ``BaseHTTPMiddleware`` costs a task, two memory streams and a
    wrapped body per request, about as much as the rest of the HTTP layer together)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: Mapping[bytes, Caller],
        anyone: Caller,
        by_peer: Callable[[tuple[int, int]], Caller] | None = None,
        metrics: Metrics,
        fast: Mapping[str, FastRoute] | None = None,
        max_body: int = MAX_BODY,
    ) -> None:
        """``keys``: each accepted API key and its caller (empty: no key needed, and every
        request is ``anyone``)."""
        self.app = app
        self.keys = dict(keys)
        self.anyone = anyone
        self.by_peer = by_peer  # a Unix socket's peer (tangramd up --http-unix) -> caller
        self.max_body = max_body
        self.metrics = metrics
        self.fast = dict(fast or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        metrics = self.metrics
        caller: Caller | None = self.anyone
        peer = scope.get("state", {}).get(PEER_STATE)
        if peer is not None and self.by_peer is not None:
            caller = self.by_peer(peer)  # the socket's peer check stood for the key
        elif self.keys:
            given = next((v for k, v in scope["headers"] if k == API_KEY_LOWER), None)
            path: str = scope["path"]
            if given is None and path.startswith(KEY_PREFIX):
                given, scope = _key_from_path(scope, path)
            caller = _match(self.keys, given or b"")
            if caller is None:
                metrics.request_done("unauthorized", 401)
                denied = JSONResponse(
                    {"detail": f"missing or wrong {API_KEY_HEADER} (or /k/KEY/ path prefix)"},
                    status_code=401,
                )
                await denied(scope, receive, send)
                return
        length = _content_length(scope)
        if length is not None and length > self.max_body:  # refused before a byte is read
            too_large = _too_large(self.max_body, f"Content-Length {length}")
            metrics.request_done("too_large", too_large.status_code)
            await _answer(too_large, scope, receive, send)
            return
        receive = _limited(receive, self.max_body)  # a chunked body: counted as it comes
        status = 500  # an exception before the response started (Starlette answers 500)
        started = False

        async def send_and_note(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            await send(message)

        route_path: str | None = None
        metrics.in_flight.inc()
        token = CALLER.set(caller)
        try:
            fast = self.fast.get(scope["path"]) if scope["method"] == "POST" else None
            if fast is not None and not scope.get("root_path"):
                received: list[Message] = []
                request = await _fast_request(fast, scope, receive, received)
                if request is not None:
                    route_path = scope["path"]
                    response = await _serve_fast(fast, request)
                    await response(scope, receive, send_and_note)
                    return
                receive = _replay(received, receive)  # FastAPI reads the same messages
            await self.app(scope, receive, send_and_note)
        except Refusal as refusal:  # from ``receive``, or past FastAPI's own handler
            if started:  # the response had begun: nothing else can be said
                raise
            await _answer(refusal, scope, receive, send_and_note)
        finally:
            CALLER.reset(token)
            metrics.in_flight.dec()
            if route_path is None:
                route = scope.get("route")  # the router records the matched route in the scope
                route_path = getattr(route, "path", "unmatched")
            metrics.request_done(route_path, status)


def _match(keys: Mapping[bytes, Caller], given: bytes) -> Caller | None:
    """The caller whose key is ``given``: every key is compared, in constant time each,
    so the time taken says nothing about which key nearly matched."""
    found = None
    for key, caller in keys.items():
        if hmac.compare_digest(given, key):
            found = caller
    return found


def _content_length(scope: Scope) -> int | None:
    """The request's ``Content-Length``, if it sent one (the server checked its syntax)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.strip().isdigit() else None
    return None


def _too_large(limit: int, what: str) -> Refusal:
    detail = f"request body too large: {what} is over the gateway's limit of {limit} bytes"
    return Refusal(413, f"{detail} ([http] max_body)")


def _limited(receive: Receive, limit: int) -> Receive:
    """``receive`` that raises :class:`Refusal` (413) once the body passes ``limit``
    bytes: a chunked body is refused as it streams in, never held whole."""
    seen = 0

    async def limited() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _too_large(limit, f"the body (over {seen} bytes so far)")
        return message

    return limited


async def _answer(refusal: Refusal, scope: Scope, receive: Receive, send: Send) -> None:
    response = JSONResponse({"detail": refusal.detail}, status_code=refusal.status_code)
    await response(scope, receive, send)


def _key_from_path(scope: Scope, path: str) -> tuple[bytes, Scope]:
    """The key of a ``/k/KEY/rest`` request, and its scope as a request for ``/rest``."""
    key, _, rest = path[len(KEY_PREFIX) :].partition("/")
    rest = "/" + rest
    return key.encode(), {**scope, "path": rest, "raw_path": rest.encode()}


def _json_body(scope: Scope) -> bool:
    """Whether the request says its body is JSON (``application/json``, any parameters)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            return bool(media == b"application/json")
    return False


async def _fast_request(
    fast: FastRoute, scope: Scope, receive: Receive, received: list[Message]
) -> Any | None:
    """The body of a fast route's request as its model, or None (then FastAPI serves it,
    from the messages kept in ``received``): not JSON, not valid, or cut short."""
    if not _json_body(scope):
        return None
    chunks: list[bytes] = []
    while True:
        message = await receive()
        received.append(message)
        if message["type"] != "http.request":
            return None  # the client left: FastAPI sees the same disconnect
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    try:
        return fast.model.model_validate(json.loads(b"".join(chunks)))
    except (ValueError, ValidationError):  # JSONDecodeError, UnicodeDecodeError among them
        return None
    except RecursionError:  # FastAPI would say only "There was an error parsing the body"
        raise Refusal(400, "request body: JSON nested too deeply to parse") from None


async def _serve_fast(fast: FastRoute, request: Any) -> Response:
    try:
        return await fast.serve(request)
    except TangramError as exc:  # as the app's handler answers it on FastAPI's path
        return refusal_response(exc)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """``receive`` that first hands out ``messages`` again."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


def _over_ceiling(request: BaseModel, names: tuple[str, ...], ceiling: float) -> Response | None:
    """A 400 naming the first of ``names`` (seconds) above ``ceiling``, else None."""
    for name in names:
        value: float = getattr(request, name)
        if not value <= ceiling:  # NaN too
            detail = f"{name}: {value:g} s is above the gateway's ceiling of {ceiling:g} s"
            return JSONResponse({"detail": f"{detail} ([http] max_run_timeout_s)"}, 400)
    return None


def _client(default: AsyncClient) -> AsyncClient:
    """The request's caller's client (its key's user), else ``default``."""
    caller = CALLER.get()
    return default if caller is None else caller.client


def refusal_response(exc: TangramError) -> JSONResponse:
    """A refusal of the daemon outside the SWE-ReX routes, as JSON: 404 ``not_found``,
    400 ``bad_request``, 504 ``timeout`` (the request's wait ran out, e.g. ``POST /envs``
    waiting for memory), else 502 (the daemon behind the gateway failed it)."""
    status = STATUS_OF_CODE.get(exc.code, 502)
    return JSONResponse({"detail": f"{exc.code}: {exc.message}"}, status_code=status)


def build_app(
    socket: str | None = None,
    *,
    client: AsyncClient | None = None,
    api_key: str | None = None,
    keys: Sequence[tuple[str, AsyncClient | None]] = (),
    peer_client: Callable[[int, int], AsyncClient] | None = None,
    cpus: int = 1,
    max_body: int = MAX_BODY,
    max_run_timeout_s: float = MAX_RUN_TIMEOUT_S,
) -> FastAPI:
    """The gateway for the daemon at ``socket``, or through ``client`` (the daemon's own
    :class:`~tangramd.gateway.local.InProcessClient` under ``tangramd up --http``);
    ``keys``: more API keys (``[http] keys``), each with the client its requests go
    through (None: ``client``; another: its own user); ``peer_client``: the client for a
    Unix socket peer's (uid, gid) (``--http-unix``); ``cpus``: cores per ``/run_code``;
    ``max_body``, ``max_run_timeout_s``: ``[http]``."""
    if client is None:
        if socket is None:
            raise ValueError("build_app needs a socket or a client")
        # a caller that hangs up does not cancel its action (design.md §6.1), as in the
        # daemon's process (whose InProcessClient sends no cancel either)
        client = AsyncClient(socket, cancel_abandoned=False)
    metrics = Metrics()
    anyone = Caller("", client)
    callers: dict[bytes, Caller] = {}
    if api_key:
        callers[api_key.encode()] = Caller("key", client)
    for number, (key, own) in enumerate(keys, 1):
        if key.encode() in callers:
            raise ValueError("an API key given twice")
        callers[key.encode()] = Caller(f"key{number}", own or client)
    others = {id(c.client): c.client for c in callers.values() if c.client is not client}
    peers: dict[tuple[int, int], Caller] = {}

    def by_peer(ids: tuple[int, int]) -> Caller:
        found = peers.get(ids)
        if found is None:
            assert peer_client is not None
            own = peer_client(*ids)
            found = peers[ids] = Caller(f"uid{ids[0]}", own)
            others[id(own)] = own
        return found

    def observe(kind: str, result: ExecResult) -> None:
        metrics.observe(kind, result)

    runtimes = swerex.Runtimes(client, observe)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        for other in others.values():
            await other.close()
        await client.close()

    async def serve_run_code(request: sf.RunCodeRequest) -> Response:
        over = _over_ceiling(request, ("run_timeout", "compile_timeout"), max_run_timeout_s)
        if over is not None:
            return over
        response, results = await sf.run_code(_client(client), request, cpus=cpus)
        for result in results:
            metrics.observe(f"run_code/{request.language}", result)
        if response.status == sf.RunStatus.SandboxError and not results:
            metrics.actions.labels(f"run_code/{request.language}", "sandbox_error").inc()
        # built by the model itself: FastAPI would validate it a second time
        return Response(response.model_dump_json(), media_type="application/json")

    async def serve_run_jupyter(request: jupyter.RunJupyterRequest) -> Response:
        over = _over_ceiling(request, ("total_timeout", "cell_timeout"), max_run_timeout_s)
        if over is not None:
            return over
        response, result = await jupyter.run_jupyter(_client(client), request, cpus=cpus)
        if result is not None:
            metrics.observe("run_jupyter/python3", result)
        elif response.status == sf.RunStatus.SandboxError:
            metrics.actions.labels("run_jupyter/python3", "sandbox_error").inc()
        return Response(response.model_dump_json(), media_type="application/json")

    app = FastAPI(title="ARL-Tangram gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    fast = {
        "/run_code": FastRoute(sf.RunCodeRequest, serve_run_code),
        "/run_jupyter": FastRoute(jupyter.RunJupyterRequest, serve_run_jupyter),
    }
    app.add_middleware(
        Gate,
        keys=callers,
        anyone=anyone,
        by_peer=by_peer if peer_client is not None else None,
        metrics=metrics,
        fast=fast,
        max_body=max_body,
    )

    @app.exception_handler(swerex.RemoteError)
    async def remote_error(request: Request, exc: swerex.RemoteError) -> JSONResponse:
        return swerex.exception_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        # FastAPI's own 422, but ASCII-escaped: an error echoes its input, and a lone
        # surrogate in it (JSON's "\ud800") cannot be encoded as UTF-8 (a 500 otherwise)
        detail = json.dumps(
            {"detail": jsonable_encoder(exc.errors())}, ensure_ascii=True, separators=(",", ":")
        )
        return Response(detail, status_code=422, media_type="application/json")

    @app.exception_handler(TangramError)
    async def daemon_refused(request: Request, exc: TangramError) -> JSONResponse:
        # /envs and the like: the daemon's refusal, as JSON (the SWE-ReX routes guard theirs)
        return refusal_response(exc)

    # Gate serves well-formed JSON bodies of these two itself (FastRoute); FastAPI's routes
    # answer the rest (422s) and describe them in the OpenAPI schema.
    @app.post("/run_code", response_model=sf.RunCodeResponse)
    async def run_code(request: sf.RunCodeRequest) -> Response:
        return await serve_run_code(request)

    @app.post("/run_jupyter", response_model=jupyter.RunJupyterResponse)
    async def run_jupyter(request: jupyter.RunJupyterRequest) -> Response:
        return await serve_run_jupyter(request)

    @app.get("/metrics")
    async def scrape() -> Response:
        ops: Any = client
        try:
            status, queue = await asyncio.wait_for(
                asyncio.gather(ops.status(), ops.queue()), SCRAPE_TIMEOUT_S
            )
        except (TangramError, asyncio.TimeoutError):
            status = queue = None
        metrics.daemon(status, queue)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/health")
    async def health() -> Any:
        ops: Any = client
        try:
            pong = await asyncio.wait_for(ops.ping(), SCRAPE_TIMEOUT_S)
        except (TangramError, asyncio.TimeoutError) as exc:
            return JSONResponse({"ok": False, "detail": str(exc)}, status_code=503)
        return {"ok": True, "daemon": pong}

    app.include_router(swerex.router(runtimes))
    return app

"""The HTTP gateway's exposure and input limits against a real gateway process (and the
daemon serving ``--http`` itself): ``[http] max_body`` (413 before the body is read),
inputs that must be a 4xx naming the field rather than a 500, ``[http]
max_run_timeout_s``, and the refusal to serve a non-loopback address without an API key."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness import Stack, running_daemon

from tangram.testing import SpawnedGateway, free_port, spawn_gateway, wait_http

MAX_BODY = 256 * 1024  # room for the 100k-deep JSON case (200 kB)
MAX_RUN_TIMEOUT_S = 120
HTTP_CONFIG = f"""
[http]
max_body = {MAX_BODY}
max_run_timeout_s = {MAX_RUN_TIMEOUT_S}
"""


@pytest.fixture(scope="module", params=["separate", "in_process"])
def limited(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """A daemon and its gateway (a `tangramd http --config`, or `tangramd up --http`)
    whose config sets small ``[http]`` limits; both logs must stay free of tracebacks."""
    tmp = tmp_path_factory.mktemp("limits")
    if request.param == "in_process":
        port = free_port()
        args = ("--http", f"127.0.0.1:{port}")
        with running_daemon(tmp, *args, config=HTTP_CONFIG) as daemon:
            gw = SpawnedGateway(daemon.proc, f"http://127.0.0.1:{port}", daemon.log_path)
            wait_http(gw.url, daemon.proc, daemon.log_path)
            yield Stack(daemon, gw)
            assert daemon.proc.poll() is None, daemon.log()
        return
    config = tmp / "http.toml"
    config.write_text(HTTP_CONFIG)
    with (
        running_daemon(tmp) as daemon,
        spawn_gateway(daemon.socket, tmp, "--config", str(config)) as gw,
    ):
        yield Stack(daemon, gw)
        assert gw.proc.poll() is None, gw.log()
    assert "Traceback" not in gw.log(), gw.log()


def _connect(stack: Stack) -> socket.socket:
    host, port = stack.url.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)), timeout=10)
    return conn


def _response(conn: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of the one response read from ``conn`` (whose server may
    close it once answered: the rest of the request is never read)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, f"the gateway closed the connection without an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    want = int(headers.get("content-length", "0"))
    while len(body) < want:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body


def _send_quietly(conn: socket.socket, data: bytes) -> None:
    """Send ``data``; a server that already answered and closed may reset the connection."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        conn.sendall(data)


@pytest.mark.parametrize("path", ["/run_code", "/envs"])
def test_content_length_over_max_body_is_413_before_reading(limited: Stack, path: str) -> None:
    """A request whose Content-Length passes [http] max_body is answered 413 at once,
    though not one byte of its body was sent (so none was read)."""
    conn = _connect(limited)
    with conn:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            f"Content-Length: {100 * 1024 * 1024}\r\n\r\n"
        )
        conn.sendall(head.encode())
        status, _, body = _response(conn)
    assert status == 413, body
    detail = json.loads(body)["detail"]
    assert str(MAX_BODY) in detail and "max_body" in detail, detail


@pytest.mark.parametrize(
    ("path", "content_type"),
    [
        ("/run_code", "application/json"),  # the gateway's own fast route
        ("/run_code", "text/plain"),  # FastAPI's body parsing
        ("/envs", "application/json"),  # a SWE-ReX route
    ],
)
def test_chunked_body_is_refused_while_streaming(
    limited: Stack, path: str, content_type: str
) -> None:
    """A chunked body is answered 413 as soon as it passes [http] max_body, while the
    client is still sending: the gateway never waits for (or holds) the whole body."""
    conn = _connect(limited)
    with conn:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: {content_type}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        )
        conn.sendall(head.encode())
        piece = b"x" * 8192
        sent = 0
        while sent <= MAX_BODY + len(piece):  # past the limit, and never the final chunk
            _send_quietly(conn, b"%x\r\n%s\r\n" % (len(piece), piece))
            sent += len(piece)
        status, _, body = _response(conn)
    assert status == 413, body
    assert "max_body" in json.loads(body)["detail"]


def test_body_under_max_body_is_served(limited: Stack) -> None:
    """A body under [http] max_body, chunked or not, runs as before."""
    code = "print(len('" + "y" * (MAX_BODY // 2) + "'))"
    r = httpx.post(f"{limited.url}/run_code", json={"code": code, "language": "python"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["run_result"]["stdout"] == f"{MAX_BODY // 2}\n"

    def chunks() -> Iterator[bytes]:
        yield json.dumps({"code": "print(6 * 7)", "language": "python"}).encode()

    r = httpx.post(
        f"{limited.url}/run_code",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["run_result"]["stdout"] == "42\n"


def _post_raw(stack: Stack, path: str, body: str) -> httpx.Response:
    return httpx.post(
        f"{stack.url}{path}",
        content=body.encode("utf-8"),
        headers={"content-type": "application/json"},
        timeout=60,
    )


BAD_INPUTS = [
    # (name, path, raw JSON body, status, what the answer names)
    (
        "huge integer",
        "/run_code",
        '{"code": "print(1)", "language": "python", "memory_limit_MB": 100000000000000}',
        422,
        "memory_limit_MB",
    ),
    (
        "huge integer as a float",
        "/run_code",
        '{"code": "print(1)", "language": "python", "memory_limit_MB": 1e14}',
        422,
        "memory_limit_MB",
    ),
    (
        "lone surrogate in code",
        "/run_code",
        '{"code": "print(\\"\\ud800\\")", "language": "python"}',
        422,
        "code",
    ),
    (
        "lone surrogate in stdin",
        "/run_code",
        '{"code": "print(1)", "language": "python", "stdin": "\\udfff"}',
        422,
        "stdin",
    ),
    (
        "100k-deep JSON",
        "/run_code",
        '{"code": ' + "[" * 100_000 + "]" * 100_000 + ', "language": "python"}',
        400,
        "nested too deeply",
    ),
    (
        "run_timeout = 1e308",
        "/run_code",
        '{"code": "print(1)", "language": "python", "run_timeout": 1e308}',
        400,
        "run_timeout",
    ),
    (
        "run_timeout just above the ceiling",
        "/run_code",
        json.dumps({"code": "1", "language": "python", "run_timeout": MAX_RUN_TIMEOUT_S + 1}),
        400,
        "run_timeout",
    ),
    (
        "compile_timeout above the ceiling",
        "/run_code",
        '{"code": "int main(){}", "language": "cpp", "compile_timeout": 1e9}',
        400,
        "compile_timeout",
    ),
    (
        "jupyter: huge integer",
        "/run_jupyter",
        '{"cells": ["1"], "memory_limit_MB": 100000000000000}',
        422,
        "memory_limit_MB",
    ),
    ("jupyter: lone surrogate in a cell", "/run_jupyter", '{"cells": ["\\ud800"]}', 422, "cells"),
    (
        "jupyter: total_timeout above the ceiling",
        "/run_jupyter",
        '{"cells": ["1"], "total_timeout": 1e308}',
        400,
        "total_timeout",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "names"),
    [case[1:] for case in BAD_INPUTS],
    ids=[c[0] for c in BAD_INPUTS],
)
def test_bad_inputs_are_4xx_naming_the_field(
    limited: Stack, path: str, body: str, status: int, names: str
) -> None:
    """Inputs the daemon cannot take are a 4xx whose detail names the field (FastAPI's
    422 with its ``loc``, or a 400), never a 500 with a traceback in the log."""
    r = _post_raw(limited, path, body)
    assert r.status_code == status, r.text
    detail = r.json()["detail"]
    if status == 422:
        assert any(names in error["loc"] for error in detail), detail
    else:
        assert names in detail, detail
    assert "Traceback" not in limited.gateway.log(), limited.gateway.log()


def test_run_timeout_at_the_ceiling_is_served(limited: Stack) -> None:
    """A run_timeout equal to [http] max_run_timeout_s is still accepted."""
    body = {"code": "print(1)", "language": "python", "run_timeout": MAX_RUN_TIMEOUT_S}
    r = httpx.post(f"{limited.url}/run_code", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "Success"


def test_keyless_loopback_gateway_says_allowed_uids_are_bypassed(limited: Stack) -> None:
    """Without an API key on loopback, the gateway says at start-up that any local user
    bypasses daemon.allowed_uids through it."""
    log = limited.gateway.log()
    assert "no API key" in log and "bypassing daemon.allowed_uids" in log, log


def test_keyed_loopback_gateway_has_no_bypass_warning(tmp_path: Path) -> None:
    """With an API key the start-up bypass warning is not printed."""
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    socket_path = str(tmp_path / "no-daemon.sock")  # the gateway starts without one
    with spawn_gateway(socket_path, tmp_path, "--api-key-file", str(key)) as gw:
        log = gw.log()
    assert "every request must send X-API-Key" in log, log
    assert "bypassing" not in log, log


def _tangramd(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tangramd.main", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=cwd)


@contextlib.contextmanager
def _unbindable_port() -> Iterator[int]:
    """A port that nothing else can bind while the block runs, on any address: bound on
    loopback (IPv4 and, where there is one, IPv6) without SO_REUSEADDR and never
    listening. A gateway that failed to refuse a non-loopback address would then fail to
    bind rather than open a listener reachable from the network."""
    port = free_port()
    with contextlib.ExitStack() as held:
        v4 = held.enter_context(socket.socket(socket.AF_INET))
        v4.bind(("127.0.0.1", port))
        with contextlib.suppress(OSError):  # no IPv6 loopback in this container
            v6 = held.enter_context(socket.socket(socket.AF_INET6))
            v6.bind(("::1", port))
        yield port


@pytest.mark.parametrize("host", ["0.0.0.0", "[::]", "example.invalid"])
def test_http_refuses_non_loopback_without_key_before_binding(host: str, tmp_path: Path) -> None:
    """`tangramd http --listen` on a non-loopback address without a key exits 2 with one
    line, before binding (a bind would fail: exit 1, "address in use")."""
    with _unbindable_port() as port:
        listen = f"{host}:{port}"
        done = _tangramd("http", "--listen", listen, "--socket", "/nonexistent", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "refusing to serve" in lines[0], done.stderr
    assert "--insecure-no-auth" in lines[0] and "--api-key-file" in lines[0], lines[0]


def test_up_refuses_non_loopback_http_without_key_before_starting(tmp_path: Path) -> None:
    """`tangramd up --http 0.0.0.0:PORT` without a key exits 2 before anything starts: no
    socket, no state directory, nothing bound."""
    sock, state = tmp_path / "d.sock", tmp_path / "state"
    with _unbindable_port() as port:
        listen = f"0.0.0.0:{port}"
        args = ("up", "--socket", str(sock), "--state-dir", str(state), "--http", listen)
        done = _tangramd(*args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "refusing to serve" in done.stderr and "--http-insecure-no-auth" in done.stderr
    assert not sock.exists() and not state.exists()


def test_insecure_no_auth_passes_the_check(tmp_path: Path) -> None:
    """--insecure-no-auth (--http-insecure-no-auth) lets a keyless non-loopback gateway
    past the refusal, with a warning, up to its bind; the port is held unbindable, so the
    bind fails and no listener reachable from the network is ever opened."""
    sock, state = tmp_path / "d.sock", tmp_path / "state"
    with _unbindable_port() as port:
        listen = f"0.0.0.0:{port}"
        served = _tangramd(
            "http", "--listen", listen, "--insecure-no-auth", "--socket", str(sock), cwd=tmp_path
        )
        up = _tangramd(
            "up", "--socket", str(sock), "--state-dir", str(state),
            "--http", listen, "--http-insecure-no-auth", cwd=tmp_path,
        )  # fmt: skip
    for done in (served, up):
        assert done.returncode not in (0, 2), done.stderr  # the bind failed (uvicorn: 3)
        assert "refusing" not in done.stderr, done.stderr
        assert "without an API key" in done.stderr, done.stderr
        assert "address already in use" in done.stderr.lower(), done.stderr

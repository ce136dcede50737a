"""The gateway's exposure (issue 31, items 5-8): no keyless network listener, bounded
bodies, hostile inputs answered 4xx, against a real daemon and gateway in both
deployments (`tangramd http`, `tangramd up --http`)."""

from __future__ import annotations

import socket
import subprocess
import sys

import httpx
import pytest


@pytest.fixture(scope="module", params=["separate", "in_process"])
def gateway_in_process(request: pytest.FixtureRequest) -> bool:
    """Every test runs against a `tangramd http` and against `tangramd up --http`."""
    return bool(request.param == "in_process")


@pytest.mark.parametrize(
    "argv",
    [
        ["http", "--listen", "0.0.0.0:{port}"],
        ["up", "--http", "0.0.0.0:{port}"],
    ],
)
def test_non_loopback_without_a_key_is_refused_before_binding(argv, tmp_path):
    """A keyless gateway on a non-loopback address exits 2 at start-up, naming the way out
    (the port is held bound, not listening and without SO_REUSEADDR, so a gateway that
    failed to refuse could not bind it: the test never opens a network listener)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))  # a wildcard bind of this port now fails
        port = held.getsockname()[1]
        cmd = [sys.executable, "-m", "tangramd.main", *(a.format(port=port) for a in argv)]
        if argv[0] == "up":
            cmd += ["--socket", str(tmp_path / "s.sock"), "--state-dir", str(tmp_path / "st")]
        else:
            cmd += ["--socket", str(tmp_path / "none.sock")]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "refusing to serve 0.0.0.0 without an API key" in done.stderr
    assert "insecure-no-auth" in done.stderr


def test_loopback_without_a_key_says_local_users_bypass_allowed_uids(stack):
    """A keyless loopback gateway says at start-up that any local user bypasses
    daemon.allowed_uids."""
    assert "bypassing daemon.allowed_uids" in stack.gateway.log()


def test_body_over_max_body_is_413_on_content_length(stack):
    """A body whose Content-Length passes [http] max_body is refused 413 unread."""
    body = b"x" * (16 * 1024 * 1024 + 1)
    r = httpx.post(
        f"{stack.url}/run_code",
        content=body,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413, r.text
    assert "max_body" in r.json()["detail"]


def test_chunked_body_over_max_body_is_413_while_streaming(stack):
    """A chunked body with no Content-Length is refused 413 once it passes the limit."""
    sent = 0

    def chunks():
        nonlocal sent
        for _ in range(40):  # 40 MiB offered; refused after ~16
            sent += 1
            yield b" " * (1 << 20)

    r = httpx.post(
        f"{stack.url}/run_code",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413, r.text
    assert "max_body" in r.json()["detail"]


@pytest.mark.parametrize(
    ("name", "body", "status", "needle"),
    [
        (
            "huge memory_limit_MB",
            b'{"code": "print(1)", "language": "python", "memory_limit_MB": 100000000000000}',
            422,
            "memory_limit_MB",
        ),
        (
            "float memory_limit_MB 1e14",
            b'{"code": "print(1)", "language": "python", "memory_limit_MB": 1e14}',
            422,
            "memory_limit_MB",
        ),
        (
            "lone surrogate in code",
            b'{"code": "print(1)\\ud800", "language": "python"}',
            422,
            "lone surrogate",
        ),
        (
            "run_timeout 1e308",
            b'{"code": "print(1)", "language": "python", "run_timeout": 1e308}',
            400,
            "max_run_timeout_s",
        ),
        (
            "100k-deep JSON",
            b"[" * 100_000 + b"]" * 100_000,
            400,
            "nested too deeply",
        ),
    ],
)
def test_hostile_inputs_are_4xx_with_a_clear_message(stack, name, body, status, needle):
    """Huge integers, a lone surrogate, a run_timeout past the ceiling and 100k-deep JSON
    are each a 4xx naming the problem, never a 500."""
    r = httpx.post(
        f"{stack.url}/run_code",
        content=body,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == status, (name, r.status_code, r.text)
    assert needle in r.text, (name, r.text)
    ok = httpx.post(
        f"{stack.url}/run_code", json={"code": "print(6 * 7)", "language": "python"}, timeout=60
    )
    assert ok.status_code == 200 and ok.json()["run_result"]["stdout"] == "42\n"

"""Slow HTTP clients (issue 31, item 6): many connections that dribble their headers
neither exhaust the daemon's descriptors nor stop its socket from serving, the cap and
the read deadline are logged, and the gateway serves again once they are gone."""

from __future__ import annotations

import contextlib
import socket
import time

import httpx
import pytest

from tangram import Client
from tangram.testing import wait_for
from tangramd.gateway.conns import FD_RESERVE, connection_cap

CAP = 20
READ_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def gateway_in_process() -> bool:
    """The gateway in the daemon's own process: its descriptors are the daemon's."""
    return True


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    """A daemon serving HTTP itself with a small connection cap and read deadline."""
    from harness import running_stack

    tmp = tmp_path_factory.mktemp("slow")
    http = f"\n[http]\nmax_connections = {CAP}\nread_timeout_s = {READ_TIMEOUT_S}\n"
    with running_stack(tmp, in_process=True, config=http) as s:
        yield s


def _slow_connection(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(b"POST /run_code HTTP/1.1\r\nHost: x\r\n")  # headers never finished
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(0.01)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:  # reset
        return True


def test_cap_leaves_descriptors_to_the_daemon() -> None:
    """The cap is max_connections lowered to leave FD_RESERVE descriptors free."""
    assert connection_cap(100, 4096) == 100
    assert connection_cap(10_000, 1024) == 1024 - FD_RESERVE
    assert connection_cap(10, FD_RESERVE) == 1


def test_many_slow_connections_leave_the_socket_serving(stack):
    """Three times the cap of header-dribbling connections: the ones past the cap are
    closed at once and logged, the daemon's socket exec still works meanwhile, the rest
    are closed at the read deadline (logged), then HTTP serves again."""
    held = [_slow_connection(stack.url) for _ in range(3 * CAP)]
    try:
        for sock in held:
            with contextlib.suppress(OSError):  # one past the cap: the gateway closed it
                sock.sendall(b"X-Slow: 1\r\n")  # a header line now and then
        with Client(stack.daemon.socket, timeout_s=30) as c:
            result = c.exec(["echo", "socket ok"])
        assert result.stdout == "socket ok\n", result
        wait_for(lambda: "http_connection_refused" in stack.gateway.log(), 10, "the cap's log line")
        assert sum(_closed_by_server(s) for s in held) >= 2 * CAP - 2  # refused at once
        wait_for(lambda: all(_closed_by_server(s) for s in held), READ_TIMEOUT_S + 10, "deadline")
        assert "http_read_timeout" in stack.gateway.log()
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    ok = httpx.post(
        f"{stack.url}/run_code", json={"code": "print(6 * 7)", "language": "python"}, timeout=60
    )
    assert ok.status_code == 200 and ok.json()["run_result"]["stdout"] == "42\n", ok.text

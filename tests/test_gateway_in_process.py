"""`tangramd up --http`: the gateway served in the daemon's own process (real daemons)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from harness import running_daemon, running_stack

from tangram import Client
from tangram.testing import SpawnedDaemon, free_port, spawn_gateway, wait_for, wait_http

BODY = {"code": "print(1)", "language": "python"}


def test_api_key_status_and_a_graceful_stop_with_a_request_in_flight(tmp_path):
    """With ``--http-api-key-file``: no key or a wrong one is 401, the right one is served;
    the daemon counts the gateway as a client; SIGTERM while a /run_code runs answers it
    before the daemon exits 0, with nothing left running."""
    key_file = tmp_path / "key"
    key_file.write_text("k3y\n")
    port = free_port()
    args = ("--http", f"127.0.0.1:{port}", "--http-api-key-file", str(key_file))
    with running_daemon(tmp_path, *args) as daemon:
        st = _Stack(daemon, f"http://127.0.0.1:{port}")
        wait_http(st.url, daemon.proc, daemon.log_path)
        assert httpx.post(f"{st.url}/run_code", json=BODY).status_code == 401
        wrong = httpx.post(f"{st.url}/run_code", json=BODY, headers={"X-API-Key": "k3"})
        assert wrong.status_code == 401
        r = httpx.post(f"{st.url}/run_code", json=BODY, headers={"X-API-Key": "k3y"})
        assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "1\n"
        with Client(st.daemon.socket) as c:
            assert c.status()["clients"] == 2  # the gateway's connection and this one
        answers: list[httpx.Response] = []
        slow = {"code": "import time; time.sleep(1); print('done')", "language": "python"}
        t = threading.Thread(
            target=lambda: answers.append(
                httpx.post(
                    f"{st.url}/run_code", json=slow, headers={"X-API-Key": "k3y"}, timeout=30
                )
            )
        )
        t.start()
        _wait_running(st.daemon.socket, 1)
        assert st.daemon.stop() == 0
        t.join(10)
        assert answers and answers[0].status_code == 200
        assert answers[0].json()["run_result"]["stdout"] == "done\n"
        log = st.daemon.log()
        assert '"gateway_listening"' in log and '"daemon_stopped"' in log


def test_a_caller_that_hangs_up_does_not_cancel_its_action(tmp_path):
    """An HTTP client that disconnects mid-request: its action runs to its end (as a
    socket client's does), its core is freed after, and the gateway keeps serving."""
    with running_stack(tmp_path, in_process=True) as st:
        slow = {"code": "import time; time.sleep(1.0); print('x')", "language": "python"}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{st.url}/run_code", json=slow, timeout=0.4)
        with Client(st.daemon.socket) as c:
            assert c.status()["running"] == 1  # still running, though nobody waits
            _wait_running(st.daemon.socket, 0)
            recent = c.status()["recent"]["exec"]
            assert recent["count"] == 1
        r = httpx.post(f"{st.url}/run_code", json=BODY, timeout=30)
        assert r.json()["run_result"]["stdout"] == "1\n"


def test_http_address_in_use_and_bad_options_are_clear_errors(tmp_path):
    """An address in use exits 1 naming it, before the daemon serves its socket; a bad
    ``--http`` value and a key file without ``--http`` exit 2 naming the option."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    sock = tmp_path / "d.sock"
    base = [sys.executable, "-m", "tangramd.main", "up", "--socket", str(sock),
            "--state-dir", str(tmp_path / "state")]  # fmt: skip
    try:
        p = subprocess.run([*base, "--http", f"127.0.0.1:{port}"], capture_output=True,
                           text=True, timeout=30)  # fmt: skip
    finally:
        busy.close()
    assert p.returncode == 1, p.stderr
    assert f"cannot serve HTTP on 127.0.0.1:{port}" in p.stderr and "Traceback" not in p.stderr
    assert not sock.exists()
    p = subprocess.run([*base, "--http", "nowhere"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "want HOST:PORT" in p.stderr, p.stderr
    key = tmp_path / "key"
    key.write_text("k\n")
    p = subprocess.run([*base, "--http-api-key-file", str(key)], capture_output=True,
                       text=True, timeout=30)  # fmt: skip
    assert p.returncode == 2 and "needs --http" in p.stderr, p.stderr


def test_separate_gateway_and_in_process_one_share_a_daemon(tmp_path):
    """Both deployments in front of one daemon at once: each call is an action of it."""
    port = free_port()
    with running_daemon(tmp_path, "--http", f"127.0.0.1:{port}") as daemon:
        inside = f"http://127.0.0.1:{port}"
        wait_http(inside, daemon.proc, daemon.log_path)
        with spawn_gateway(daemon.socket, tmp_path) as gw:
            for url in (inside, gw.url, inside):
                r = httpx.post(f"{url}/run_code", json=BODY, timeout=30)
                assert r.json()["run_result"]["stdout"] == "1\n"
        with Client(daemon.socket) as c:
            assert c.status()["recent"]["exec"]["count"] == 3


@dataclass
class _Stack:
    daemon: SpawnedDaemon
    url: str


def _wait_running(sock: str, n: int, timeout_s: float = 10.0) -> None:
    with Client(sock) as c:
        wait_for(lambda: c.status()["running"] == n, timeout_s, f"{n} running")


def test_http_user_runs_http_callers_unprivileged(tmp_path):
    """``--http-user``: HTTP callers' commands run as that user (``cpu.exec_user = "peer"``)
    and cannot read root's files; without it a root daemon says at start-up that they run
    as root; an unknown user, or the option without ``--http``, exits 2."""
    from hostile_user import local_user

    with local_user() as user, tempfile.TemporaryDirectory(prefix="tgw-", dir="/tmp") as tmp:
        os.chmod(tmp, 0o755)  # the user's commands reach their environments through it
        port = free_port()
        args = ("--http", f"127.0.0.1:{port}", "--http-user", user.name)
        with running_daemon(Path(tmp), *args) as daemon:
            url = f"http://127.0.0.1:{port}"
            wait_http(url, daemon.proc, daemon.log_path)
            # the host ids it runs as: its own, or those root inside its environment maps to
            code = (
                "import os\n"
                "def host(kind, mine):\n"
                "    inside, outside, _ = open(f'/proc/self/{kind}_map').read().split()[:3]\n"
                "    return int(outside) + mine - int(inside)\n"
                "print(host('uid', os.getuid()), host('gid', os.getgid()))\n"
                "open('/etc/shadow').read()"
            )
            r = httpx.post(f"{url}/run_code", json={"code": code, "language": "python"})
            body = r.json()
            assert body["status"] == "Failed", body
            assert body["run_result"]["stdout"] == f"{user.uid} {user.gid}\n", body
            assert "PermissionError" in body["run_result"]["stderr"]
            assert "HTTP callers' commands run as root" not in daemon.log()
    port = free_port()
    with running_daemon(tmp_path / "r", "--http", f"127.0.0.1:{port}") as daemon:
        wait_http(f"http://127.0.0.1:{port}", daemon.proc, daemon.log_path)
        assert "HTTP callers' commands run as root" in daemon.log()
    base = [sys.executable, "-m", "tangramd.main", "up", "--socket", str(tmp_path / "x.sock"),
            "--state-dir", str(tmp_path / "xs")]  # fmt: skip
    p = subprocess.run([*base, "--http", "127.0.0.1:1", "--http-user", "no-such-user-x"],
                       capture_output=True, text=True, timeout=30)  # fmt: skip
    assert p.returncode == 2 and "--http-user 'no-such-user-x': no such user" in p.stderr
    for option in ("--http-user", "--http-cpus"):
        p = subprocess.run([*base, option, "1"], capture_output=True, text=True, timeout=30)
        assert p.returncode == 2 and f"{option} needs --http" in p.stderr, p.stderr

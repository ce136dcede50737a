"""`tangramd up --http-unix PATH` (issue 31, item 5): HTTP over a Unix socket, where the
daemon's peer check applies: an allowed user's commands run as its own uid without an API
key, a user outside daemon.allowed_uids is refused at connect."""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path

from harness import running_daemon
from hostile_user import in_child_as, local_user

from tangram.testing import wait_for

HOST_UID = (  # the host uid it runs as: its own, or the one root inside its box maps to
    "import os\n"
    "inside, outside, _ = open('/proc/self/uid_map').read().split()[:3]\n"
    "print(int(outside) + os.getuid() - int(inside))"
)


def _post_run_code(path: str) -> bytes:
    """POST /run_code over the Unix socket at ``path``; the raw response, or b"refused"."""
    body = json.dumps({"code": HOST_UID, "language": "python"}).encode()
    head = (
        f"POST /run_code HTTP/1.1\r\nHost: tangram\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(60)
            sock.connect(path)
            sock.sendall(head + body)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
    except OSError:
        return b"refused"
    return data or b"refused"


def test_http_unix_applies_the_peer_check_and_runs_as_the_peer():
    """Over --http-unix an allowed user's /run_code runs as that user's uid (no key); a
    user not in daemon.allowed_uids is refused at connect and it is logged."""
    with (
        local_user() as allowed,
        local_user() as stranger,
        tempfile.TemporaryDirectory(prefix="tgu-", dir="/tmp") as where,
    ):
        os.chmod(where, 0o755)  # the users reach the socket and their environments through it
        tmp = Path(where)
        path = str(tmp / "http.sock")
        config = f"\n[daemon]\nallowed_uids = [{allowed.uid}]\n"
        with running_daemon(tmp, "--http-unix", path, config=config) as daemon:
            wait_for(lambda: os.path.exists(path), 30, "the HTTP socket")
            os.chmod(path, 0o666)  # the operator opens it to local users: the peer check guards
            answer = in_child_as(*allowed.ids, lambda: _post_run_code(path))
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), answer
            result = json.loads(body)
            assert result["run_result"]["stdout"] == f"{allowed.uid}\n", result
            assert in_child_as(*stranger.ids, lambda: _post_run_code(path)) == b"refused"
            wait_for(lambda: "http_peer_refused" in daemon.log(), 10, "the refusal's log line")
        assert not os.path.exists(path)  # removed at stop

"""``tangramctl --wait SECONDS``: a command waits for a daemon that is still starting (the
README's blocks start one in the background and use it on the next line), and says why when
it waited in vain (issue 35, item 6)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tangram.client import Client
from tangram.protocol import ConnectionFailed, InfraError
from tangram.testing import free_port, spawn_daemon, wait_for

CTL = [sys.executable, "-m", "tangramctl.main"]


def test_wait_for_a_daemon_started_after_the_command(tmp_path: Path) -> None:
    """The command is already waiting when the daemon starts; it answers, exit 0."""
    sock = tmp_path / "tangramd.sock"  # where spawn_daemon puts it
    waiting = subprocess.Popen(
        [*CTL, "--socket", str(sock), "--wait", "60", "status", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    daemon = spawn_daemon(tmp_path)
    try:
        out, err = waiting.communicate(timeout=60)
    finally:
        daemon.stop()
    assert waiting.returncode == 0, err
    assert '"queued"' in out


def test_wait_in_vain_names_the_wait_and_the_reason(tmp_path: Path) -> None:
    """No daemon: after --wait, exit 2 with the reason; exec keeps its own code (125)."""
    sock = str(tmp_path / "nobody.sock")
    t0 = time.monotonic()
    r = subprocess.run(
        [*CTL, "--socket", sock, "--wait", "0.5", "status"], capture_output=True, text=True
    )
    assert time.monotonic() - t0 >= 0.5
    assert r.returncode == 2
    assert f"cannot reach tangramd at {sock}: no answer within --wait 0.5 s" in r.stderr
    assert "No such file or directory" in r.stderr
    r = subprocess.run(
        [*CTL, "--socket", sock, "--wait", "0.2", "exec", "--", "true"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 125, r.stderr
    assert "no answer within --wait 0.2 s" in r.stderr


def test_wait_for_a_node_until_it_has_joined(tmp_path: Path) -> None:
    """A node serves its socket before it has joined: --wait waits for the join, and when
    its coordinator never answers, says so."""
    sock = tmp_path / "node.sock"
    node = subprocess.Popen(
        [
            *(sys.executable, "-m", "tangramd.main", "node"),
            *("--coordinator", f"127.0.0.1:{free_port()}", "--insecure", "--name", "lonely"),
            *("--socket", str(sock), "--state-dir", str(tmp_path / "state")),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def serves_unjoined() -> bool:
            assert node.poll() is None, "the node exited"
            with Client(str(sock), connect_timeout_s=1.0) as c:
                try:
                    c.status()
                except ConnectionFailed:
                    return False
                except InfraError as exc:
                    return "not connected to the coordinator" in exc.message
            raise AssertionError("a node with no coordinator answered status")

        wait_for(serves_unjoined, 30, "the node's socket", every_s=0.05)
        r = subprocess.run(
            [*CTL, "--socket", str(sock), "--wait", "1", "status"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert node.poll() is None
    finally:
        node.terminate()
        node.wait(30)
    assert r.returncode == 2
    assert "no answer within --wait 1 s" in r.stderr
    assert "not connected to the coordinator" in r.stderr, r.stderr


def test_wait_must_be_a_number() -> None:
    r = subprocess.run([*CTL, "--wait", "soon", "status"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "--wait" in r.stderr and "soon" in r.stderr

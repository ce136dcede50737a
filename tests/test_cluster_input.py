"""An exec's input across nodes, end to end: a node keeps a large stdin and files for an
exec placed on another node, which pulls them from its input port (docs/protocol.md, A
node's input port). The link-level checks (what each message carries, bad pulls, a dying
holder) are in tests/test_link_table.py; here, real processes over TLS, and the plain
TCP of ``--insecure`` on loopback."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from cluster_harness import (
    AnyDaemon,
    InProcessCluster,
    check_clean,
    spawn_coordinator,
    spawn_node,
    stop_all,
)

from tangram import Client

CONFIG = """
[cluster]
heartbeat_s = 0.25
heartbeat_timeout_s = 5
"""
CORES = sorted(os.sched_getaffinity(0))
FILE = os.urandom(3 << 20)
STDIN = os.urandom(300 << 10)
CMD = ["sh", "-c", "sha256sum f.bin | cut -c1-64; sha256sum | cut -c1-64"]
DIGESTS = [hashlib.sha256(FILE).hexdigest(), hashlib.sha256(STDIN).hexdigest()]


def _env_on(c: Client, node_name: str, tries: int = 8) -> str:
    for _ in range(tries):
        env = c.request("env.open", {})
        if env["node"] == node_name:
            return str(env["id"])
    raise AssertionError(f"no environment landed on {node_name} in {tries} tries")


def _exec_across(a: AnyDaemon, b: AnyDaemon) -> dict[str, Any]:
    """From a's client, into an environment on b, with input above PULL_MIN_BYTES."""
    with a.client() as on_a, b.client() as on_b:
        env = _env_on(on_b, "b")
        args = {"cmd": CMD, "env": env, "stdin": STDIN, "files": {"f.bin": FILE}}
        ran = on_a.request("exec", args)
        on_b.request("env.close", {"id": env})
    return ran


def _events(daemon: AnyDaemon, name: str) -> list[dict[str, Any]]:
    rows = []
    for line in daemon.log().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("event") == name:
            rows.append(row)
    return rows


def test_a_large_input_is_pulled_across_node_processes(tmp_path: Path) -> None:
    """Coordinator and two nodes as processes (the command line, TLS): two execs run on b
    with their input intact, a logs one pull of each, over one connection (b kept it),
    and neither the coordinator nor the nodes log a failure."""
    coord = spawn_coordinator(tmp_path, CONFIG)
    a = spawn_node(tmp_path, coord, "a", cpus=str(CORES[0]))
    b = spawn_node(tmp_path, coord, "b", cpus=str(CORES[-1]))
    try:
        runs = [_exec_across(a, b), _exec_across(a, b)]
    finally:
        stop_all([b, a, coord])
    for ran in runs:
        assert ran["outcome"] == "ok" and ran["node"] == "b", ran
        assert ran["stdout"].split() == DIGESTS
    (port,) = _events(a, "input_port_open")
    assert port["tls"] is True
    pulls = _events(a, "input_pulled")
    assert len(pulls) == 2 and pulls[0]["peer"] == pulls[1]["peer"], pulls
    assert not _events(b, "input_pull_failed") and not _events(a, "input_pull_refused")
    check_clean(coord, a, b)


def test_a_large_input_is_pulled_over_plain_tcp_with_insecure(tmp_path: Path) -> None:
    """With --insecure (loopback only), the input port is plain TCP; the pull works."""
    with InProcessCluster(tmp_path) as here:
        coord = here.coordinator(CONFIG, insecure=True)
        a = here.node(coord, "a", cpus=str(CORES[0]), insecure=True)
        b = here.node(coord, "b", cpus=str(CORES[-1]), insecure=True)
        ran = _exec_across(a, b)
        here.stop_all()
        (port,) = _events(a, "input_port_open")
        assert port["tls"] is False
        assert len(_events(a, "input_pulled")) == 1
    assert ran["outcome"] == "ok" and ran["node"] == "b", ran
    assert ran["stdout"].split() == DIGESTS


def test_a_large_stdin_for_a_session_on_another_node_is_pulled(tmp_path: Path) -> None:
    """A command in a session on b, sent by a's client with 300 KiB of stdin: b pulls the
    stdin from a and the session's shell reads all of it."""
    with InProcessCluster(tmp_path) as here:
        coord = here.coordinator(CONFIG)
        a = here.node(coord, "a", cpus=str(CORES[0]))
        b = here.node(coord, "b", cpus=str(CORES[-1]))
        with a.client() as on_a, b.client() as on_b:
            env = _env_on(on_b, "b")
            session = on_b.request("session.open", {"env": env})["id"]
            ran = on_a.request(
                "exec", {"cmd": "sha256sum | cut -c1-64", "session": session, "stdin": STDIN}
            )
            on_b.request("session.close", {"id": session})
        here.stop_all()
        assert len(_events(a, "input_pulled")) == 1
    assert ran["outcome"] == "ok" and ran["node"] == "b", ran
    assert ran["stdout"].strip() == DIGESTS[1]

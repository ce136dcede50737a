"""Partitions between a node and the coordinator, through a real TCP fault proxy (the
daemons in this process: ``InProcessCluster``).

A partition shorter than the heartbeat timeout is nothing (TCP delivers late); a longer
one is a node failure, and the node, once it is back, is reconciled: it removes the
environments the coordinator no longer gives it and kills the execs it has ended.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from cluster_harness import (
    FaultProxy,
    InProcessCluster,
    check_clean,
    node_row,
    stop_all,
    wait_for,
    wait_node_state,
)
from harness import pid_alive

from tangram import Client, EnvLost
from tangramd.cluster.link import split_host_port

TIMEOUT_S = 1.0
CONFIG = f"""
[cluster]
heartbeat_s = 0.25
heartbeat_timeout_s = {TIMEOUT_S}
"""
ENV = {"TANGRAM_VALIDATE": "1"}
CORES = sorted(os.sched_getaffinity(0))


@pytest.fixture
def partitioned(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Coordinator; node ``far`` behind a fault proxy; node ``near`` direct."""
    with InProcessCluster(tmp_path, env=ENV) as here:
        coord = here.coordinator(CONFIG)
        proxy = FaultProxy(split_host_port(coord.join["coordinator"]))
        try:
            address = proxy.start()
            far = here.node(coord, "far", cpus=str(CORES[0]), address=address)
            near = here.node(coord, "near", cpus=str(CORES[-1]))
            yield {"coord": coord, "far": far, "near": near, "proxy": proxy}
        finally:
            proxy.close()
            stop_all(here.daemons)
        check_clean(*here.daemons)


def _env_on(c: Client, node: str) -> str:
    for _ in range(8):
        env = c.request("env.open", {})
        if env["node"] == node:
            return str(env["id"])
    raise AssertionError(f"no environment landed on {node}")


def _host_pid(token: str) -> int | None:
    """The host pid of the process whose command line ends with ``token``."""
    for proc in psutil.process_iter(["cmdline"]):
        if (proc.info["cmdline"] or [""])[-1] == token:
            return int(proc.pid)
    return None


def _run_in_thread(socket: str, cmd: list[str], env: str) -> tuple[threading.Thread, dict]:
    out: dict[str, Any] = {}

    def run() -> None:
        with Client(socket) as c:
            out["result"] = c.exec(cmd, env=env)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_short_partition_is_nothing(partitioned: dict[str, Any]) -> None:
    """Cut off for a quarter of the timeout: the running action finishes ok, the node
    stays ready, its environment keeps working."""
    coord, near, proxy = partitioned["coord"], partitioned["near"], partitioned["proxy"]
    with near.client() as c:
        env = _env_on(c, "far")
    thread, out = _run_in_thread(near.socket, ["sleep", "1"], env)
    wait_for(lambda: node_row(coord, "far")["running"] == 1, 10, "sleep runs on far")
    proxy.partition()
    time.sleep(TIMEOUT_S / 4)  # the fault's duration, not a synchronisation
    proxy.heal()
    thread.join(TIMEOUT_S + 10)
    assert not thread.is_alive()
    assert out["result"].outcome == "ok" and out["result"].node == "far"
    with near.client() as c:
        assert c.exec(["true"], env=env).node == "far"
    assert node_row(coord, "far")["state"] == "ready"
    assert "node_lost" not in coord.log()


def test_long_partition_is_a_node_failure_then_reconciled(partitioned: dict[str, Any]) -> None:
    """Cut off for twice the timeout: the action ends infra_error, the env is lost; healed,
    the node rejoins, removes the environment it no longer owns and takes new work."""
    coord, far, near = partitioned["coord"], partitioned["far"], partitioned["near"]
    proxy: FaultProxy = partitioned["proxy"]
    with near.client() as c:
        env = _env_on(c, "far")
    env_dir = Path(far.state_dir) / "process" / "envs" / env
    assert env_dir.is_dir()
    # found by its command line from the host (inside an isolated environment the host's
    # paths and pids are not the command's)
    token = f"30.{os.getpid()}"
    cmd = ["sleep", token]
    thread, out = _run_in_thread(near.socket, cmd, env)
    wait_for(lambda: node_row(coord, "far")["running"] == 1, 10, "sleep runs on far")
    pid = wait_for(lambda: _host_pid(token), 10, "the sleep's pid")
    proxy.partition()
    started = time.monotonic()
    thread.join(TIMEOUT_S + 10)
    assert not thread.is_alive(), "the action behind the partition hangs"
    assert time.monotonic() - started < TIMEOUT_S + 5
    result = out["result"]
    assert result.outcome == "infra_error" and "node far lost" in result.detail
    with near.client() as c, pytest.raises(EnvLost, match="node far"):
        c.exec(["true"], env=env)
    wait_node_state(coord, "far", "lost", 5)
    time.sleep(TIMEOUT_S)  # keep the partition up past the timeout on both ends
    proxy.heal()
    wait_node_state(coord, "far", "ready", 30, node=far)
    wait_for(lambda: not env_dir.exists(), 10, "far removes the environment it lost")
    assert f'"env": "{env}"' in far.log() and "env_not_owned_removed" in far.log()
    # the exec the coordinator ended is killed, not left to run its 30 s
    wait_for(lambda: not pid_alive(pid), 10, "far kills the exec the coordinator ended")
    assert "exec_cancelled" in far.log()
    with near.client() as c:
        fresh = _env_on(c, "far")
        assert c.exec(["true"], env=fresh).node == "far"

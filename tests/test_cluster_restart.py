"""Coordinator and node failure: SIGKILL and restart on the same state dir (and port).

The registry (join token, node credentials and capacities, persistent environments and
their nodes) is in SQLite, profiles in profiles.json: the restarted coordinator takes its
nodes back as they reconnect, and environments on them keep working. A node records the
environments it holds in its envs.json: restarted within the heartbeat timeout, it
re-adopts them and they keep their files.

The coordinator's restart runs as subprocesses, end to end (the command line, a real
SIGKILL); the others in this process (``InProcessCluster``: a killed daemon there drops
its links with no goodbye, and a new one starts on the same state dir and port).
"""

from __future__ import annotations

import os
import socket
import sqlite3
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
from cluster_harness import (
    AnyDaemon,
    InProcessCluster,
    check_clean,
    node_row,
    spawn_coordinator,
    spawn_node,
    stop_all,
    wait_for,
    wait_node_state,
)

from tangram import Client, EnvLost, InfraError
from tangramd.records import RecordJournal

CONFIG = """
[cluster]
heartbeat_s = 0.25
heartbeat_timeout_s = 3
"""
ENV = {"TANGRAM_VALIDATE": "1"}
CORES = sorted(os.sched_getaffinity(0))
PROFILE = {
    "name": "unit",
    "dop": {"1": 2.0},
    "t1_s": 2.0,
    "eff": {"1": 1.0},
    "speedup": {"1": 1.0},
    "elastic": False,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_coordinator_restart_keeps_nodes_envs_profiles_and_token(tmp_path: Path) -> None:
    """After SIGKILL, requests through a node fail infra_error at once; after a restart
    both nodes are ready again, their environments run, the profile and token are kept.
    End to end: the coordinator and node a are subprocesses (node b is in this process)."""
    listen = f"127.0.0.1:{_free_port()}"
    with InProcessCluster(tmp_path, env=ENV) as here:
        coord = spawn_coordinator(tmp_path, CONFIG, listen=listen, env=ENV)
        daemons: list[AnyDaemon] = [coord]
        try:
            a = spawn_node(tmp_path, coord, "a", cpus=str(CORES[0]), env=ENV)
            daemons.append(a)
            b = here.node(coord, "b", cpus=str(CORES[-1]))
            daemons.append(b)
            with a.client() as c:
                envs = {}
                while len(envs) < 2:
                    opened = c.request("env.open", {})
                    envs.setdefault(opened["node"], opened["id"])
                c.request("profile.save", PROFILE)
            db = Path(coord.state_dir) / "coordinator.db"
            assert stat.S_IMODE(db.stat().st_mode) == 0o600
            with sqlite3.connect(db) as conn:
                stored = dict(conn.execute("SELECT id, node FROM envs").fetchall())
            assert {stored[envs["a"]], stored[envs["b"]]} == {"a", "b"}
            join = coord.join

            coord.kill()
            for node in (a, b):
                with node.client() as c, pytest.raises(InfraError, match="coordinator"):
                    c.exec(["true"])  # answered at once, not held until the coordinator is back
            coord = spawn_coordinator(tmp_path, CONFIG, listen=listen, env=ENV)
            daemons.append(coord)
            assert coord.join == join  # same token, same CA (nodes keep their pin)
            for name, node in (("a", a), ("b", b)):
                wait_node_state(coord, name, "ready", 30, node=node)
            with b.client() as c:
                for node_name, env in envs.items():
                    result = c.exec(["true"], env=env)
                    assert result.outcome == "ok" and result.node == node_name
                assert c.profile_get("unit")["t1_s"] == 2.0
                fresh = c.env_open()
                assert fresh not in envs.values()  # ids continue after the restored ones
            for node in (a, b):
                assert "env_not_owned_removed" not in node.log()
        finally:
            stop_all(daemons)
        check_clean(*daemons)


def test_node_that_never_returns_after_a_restart_is_lost(tmp_path: Path) -> None:
    """A node known before the restart that does not come back: its environment answers a
    retryable infra_error during the timeout, env_lost after it."""
    listen = f"127.0.0.1:{_free_port()}"
    config = CONFIG.replace("heartbeat_timeout_s = 3", "heartbeat_timeout_s = 1.5")
    with InProcessCluster(tmp_path, env=ENV) as here:
        coord = here.coordinator(config, listen=listen)
        a = here.node(coord, "a", cpus=str(CORES[0]))
        with a.client() as c:
            env = c.env_open()
        coord.kill()
        a.kill()
        coord = here.coordinator(config, listen=listen)
        with coord.client() as c:
            with pytest.raises(InfraError, match="has not reconnected"):
                c.exec(["true"], env=env)
            wait_for(lambda: "not back after a restart" in coord.log(), 15, "a lost")
            with pytest.raises(EnvLost, match="node a"):
                c.exec(["true"], env=env)
        assert node_row(coord, "a")["state"] == "lost"


def test_node_restart_keeps_its_environments(tmp_path: Path) -> None:
    """Kill a node and start it again on the same state dir within the heartbeat timeout:
    its environment (and the files in it) is re-adopted and kept; the exec that was
    running there when it died ends infra_error."""
    config = CONFIG.replace("heartbeat_timeout_s = 3", "heartbeat_timeout_s = 15")
    with InProcessCluster(tmp_path, env=ENV) as here:
        coord = here.coordinator(config)
        a = here.node(coord, "a", cpus=str(CORES[0]))
        with coord.client() as c:
            env = c.env_open()
            assert c.exec(["sh", "-c", "echo kept > f"], env=env).outcome == "ok"
            throwaway = c.exec(["true"])
            assert throwaway.outcome == "ok"
        records = RecordJournal(Path(a.state_dir) / "envs.json", valid=bool, problem="bad")
        wait_for(  # throwaway environments come and go (removed after the answer)
            lambda: list(records.load()) == [env], 10, "envs.json + envs.journal"
        )
        box: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: box.update(r=Client(coord.socket).exec(["sleep", "30"], env=env))
        )
        thread.start()
        wait_for(lambda: node_row(coord, "a")["running"] == 1, 10, "sleep runs on a")
        a.kill()
        a = here.node(coord, "a", cpus=str(CORES[0]), wait_ready=False)
        thread.join(30)
        assert box["r"].outcome == "infra_error", box  # the restarted node never ran it
        # The node answers infra_error at once until it has joined again (no waiting), and
        # the coordinator still lists the old one ready: wait_node_state also needs a
        # request through the new one's own socket served.
        wait_node_state(coord, "a", "ready", 30, node=a)
        with a.client() as c:
            result = c.exec(["cat", "f"], env=env)
        assert (result.outcome, result.stdout, result.node) == ("ok", "kept\n", "a"), result
        assert node_row(coord, "a")["envs"] == 1
        assert "envs_readopted" in a.log() and "env_not_owned_removed" not in a.log()
        assert "node_lost" not in coord.log()
        stop_all(here.daemons)
        check_clean(*here.daemons)

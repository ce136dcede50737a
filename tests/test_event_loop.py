"""The daemons' event loop (``[daemon] event_loop``): uvloop by default where it is
installed (a dependency on Linux), the standard library's asyncio on request; real daemons
serve execs on either, and their ready lines say which loop they run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cluster_harness import check_clean, spawn_coordinator, spawn_node, stop_all

from tangram.testing import spawn_daemon


def _ready_loop(log: str, event: str) -> str:
    for text in log.splitlines():
        if text.startswith("{") and (line := json.loads(text))["event"] == event:
            return str(line["event_loop"])
    raise AssertionError(f"no {event} line in:\n{log}")


@pytest.mark.parametrize(("setting", "expected"), [("auto", "uvloop"), ("asyncio", "asyncio")])
def test_the_daemon_serves_execs_on_the_loop_it_is_given(
    tmp_path: Path, setting: str, expected: str
) -> None:
    daemon = spawn_daemon(tmp_path, f'[daemon]\nevent_loop = "{setting}"\n')
    try:
        with daemon.client() as c:
            env = c.env_open()
            result = c.exec(["sh", "-c", "echo hi; exit 3"], env=env, cpus=1)
            assert (result.outcome, result.exit_code, result.stdout) == ("failed", 3, "hi\n")
            c.env_close(env)
    finally:
        assert daemon.stop() == 0
    log = daemon.log()
    assert _ready_loop(log, "daemon_ready") == expected
    assert "Traceback" not in log


def test_a_cluster_runs_on_uvloop_by_default_and_on_asyncio_when_asked(tmp_path: Path) -> None:
    """A coordinator on asyncio and a node on uvloop (the default) work together."""
    coord = spawn_coordinator(tmp_path, '[daemon]\nevent_loop = "asyncio"\n')
    daemons = [coord]
    try:
        node = spawn_node(tmp_path, coord, "a")
        daemons.append(node)
        with node.client() as c:
            env = c.env_open()
            assert c.exec(["true"], env=env, cpus=1).outcome == "ok"
    finally:
        stop_all(daemons)
    check_clean(*daemons)
    assert _ready_loop(coord.log(), "coordinator_ready") == "asyncio"
    assert _ready_loop(node.log(), "node_started") == "uvloop"

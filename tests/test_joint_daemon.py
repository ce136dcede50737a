"""Joint admission on a real ``tangramd up`` (issue 34, item 3): an exec with ``api``
needs a core and a slot of that API together. With ``concurrency = 1`` three such execs,
submitted at once, run one at a time (the commands' own clocks say so) though cores are
free, and a waiting one says it waits for the API."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from harness import API_HELD, api_execs_wait_then_run_one_at_a_time, assert_clean_log

from tangram.client import Client
from tangram.protocol.errors import BadRequest, NotFound
from tangram.testing import spawn_daemon, wait_for

CONFIG = """
[sched]
coalesce_ms = 1.0

[[api]]
name = "search"
concurrency = 1
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = spawn_daemon(tmp_path_factory.mktemp("joint"), CONFIG, env={"TANGRAM_VALIDATE": "1"})
    try:
        yield d
    finally:
        if d.proc.poll() is None:
            d.stop()
    assert_clean_log(d.log())


def test_three_cores_and_api_execs_run_one_at_a_time(daemon) -> None:
    with Client(daemon.socket) as c:
        lease = c.acquire_lease("search")  # the one slot is held: every exec must wait

        def while_waiting(rows: list[dict]) -> None:  # the story says why; only the lease runs
            story = c.story(rows[0]["action_id"])
            assert story["state"] == "queued" and story["waiting_for"] == API_HELD
            assert [r["action_id"] for r in c.queue()["running"]] == [lease]

        results = api_execs_wait_then_run_one_at_a_time(daemon.socket, c, lease, while_waiting)
        story = c.story(results[0].action_id)
        events = " ".join(str(e) for e in story["events"])
        assert "also holds" in events and "api:search" in events, story
        assert c.queue()["running"] == [] and c.queue()["waiting"] == []
        lease = c.acquire_lease("search")  # the slot came back with the last exec's end
        c.release_lease(lease)


def test_an_unknown_api_is_refused(daemon) -> None:
    with Client(daemon.socket) as c:
        with pytest.raises(NotFound, match="api: 'nope' not found \\(configured: search\\)"):
            c.exec("true", api="nope")
        with pytest.raises(BadRequest, match="api"):
            c.exec("true", api="")
        assert c.exec("true").outcome == "ok"  # the daemon is still fine


def test_tangramctl_exec_api_waits_for_the_slot(daemon) -> None:
    """`tangramctl exec --api search` holds the slot with its cores: while a lease holds
    the only slot it waits (queue says for what), then runs once the lease is released;
    an unknown API exits 2 naming the configured ones."""
    ctl = [sys.executable, "-m", "tangramctl.main", "--socket", daemon.socket, "exec"]
    with Client(daemon.socket) as c:
        lease = c.acquire_lease("search")
        proc = subprocess.Popen(
            [*ctl, "--api", "search", "--json", "--", "echo", "ran"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            held = "api search: 1 of 1 slots held"
            wait_for(
                lambda: [w["waiting_for"] for w in c.queue()["waiting"]] == [held],
                30,
                "the CLI's exec waiting for the API",
            )
            c.release_lease(lease)
            out, _ = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert proc.returncode == 0 and json.loads(out)["stdout"] == "ran\n", out
    bad = subprocess.run([*ctl, "--api", "nope", "--", "true"], capture_output=True, text=True)
    assert bad.returncode == 2 and "configured: search" in bad.stderr, bad.stderr

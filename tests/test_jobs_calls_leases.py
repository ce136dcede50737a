"""Jobs on GPU calls and API leases on a real ``tangramd up`` (issue 34 item 1): ``job=``
per call and per lease, the client's job and ``$TANGRAM_JOB``; ``tangramctl call --job``
and its ``--json``; ``jobs --json`` counts a job's running call (its GPU) and lease (its
API slot); the scheduler serves a higher-priority job's call and lease first."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from harness import running_daemon

from tangram.client import Client
from tangram.testing import wait_for
from tangramctl.main import cli

SERVICES = Path(__file__).parent / "data" / "services"
CONFIG = """
[gpu]
simulated = { count = 1, mem_gb = 0.1 }
nvml = false

[[job]]
name = "hi"
priority = 1
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("jobs-calls"), config=CONFIG) as d:
        with d.client() as c:
            service = {"name": "s", "runtime": "torch", "mem_gb": 0.01}
            c.request(
                "service.register",
                {**service, "entry": "tiny_services:small", "path": str(SERVICES)},
            )
        yield d


def ctl(sock: str, *args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(cli, ["--socket", sock, *args], env=env, catch_exceptions=False)


def jobs(sock: str) -> dict[str, dict]:
    r = ctl(sock, "jobs", "--json")
    assert r.exit_code == 0, r.output
    return {row["name"]: row for row in json.loads(r.output)["jobs"]}


def in_thread(fn) -> dict:
    """Run ``fn`` in a thread: ``box["result"]`` and ``box["done"]`` (monotonic) at its end."""
    box: dict = {}

    def run() -> None:
        box["result"] = fn()
        box["done"] = time.monotonic()

    box["thread"] = threading.Thread(target=run, daemon=True)
    box["thread"].start()
    return box


def test_a_calls_gpu_and_a_leases_slot_count_against_their_jobs(daemon, tmp_path):
    """While a call of job grpo-a runs and a lease of grpo-b is held, `jobs --json` shows
    grpo-a holding the GPU and grpo-b the slot (a share > 0); `call --job` and
    $TANGRAM_JOB name the job in the call's --json, and the job its ACT."""
    sock = daemon.socket
    started = tmp_path / "started"
    payload = {"x": 1, "started": str(started), "sleep": 3.0}
    with Client(sock, job="grpo-a") as a, daemon.client() as b:
        call = in_thread(lambda: a.call("s", payload))
        wait_for(started.exists, 60, "the call in its handler")
        lease = b.acquire_lease("search", ttl_s=60, job="grpo-b")
        rows = jobs(sock)
        assert (rows["grpo-a"]["running"], rows["grpo-a"]["gpus"]) == (1, 1), rows
        assert rows["grpo-a"]["share"] > 0, rows
        assert (rows["grpo-b"]["running"], rows["grpo-b"]["gpus"]) == (1, 0), rows
        assert rows["grpo-b"]["share"] > 0, rows  # its API slot counts
        assert b.story(lease)["job"] == "grpo-b"
        call["thread"].join(60)
        assert call["result"].outcome == "ok", call["result"]
        b.release_lease(lease)

    r = ctl(sock, "call", "s", "--job", "grpo-c", "--json", "--", '{"x": 2}')
    assert r.exit_code == 0, r.output
    answer = json.loads(r.output)
    assert (answer["outcome"], answer["job"]) == ("ok", "grpo-c"), answer
    r = ctl(sock, "call", "s", "--json", "--", '{"x": 2}', env={"TANGRAM_JOB": "grpo-d"})
    assert r.exit_code == 0 and json.loads(r.output)["job"] == "grpo-d", r.output
    rows = jobs(sock)
    for name in ("grpo-a", "grpo-c", "grpo-d"):
        assert rows[name]["running"] == 0 and rows[name]["act_p50"] > 0, rows[name]
    r = ctl(sock, "call", "s", "--job", "bad name", "--", '{"x": 2}')
    assert r.exit_code == 2 and "job" in r.output, r.output


def test_a_higher_priority_jobs_call_and_lease_are_served_first(daemon, tmp_path):
    """With the one GPU busy, a call of job lo and then one of job hi (priority 1) wait: hi's
    runs first. With the one slot of API strict held, hi's lease is granted before lo's."""
    sock = daemon.socket
    started = tmp_path / "busy"
    with Client(sock) as c:
        busy = in_thread(
            lambda: Client(sock, job="lo").call("s", {"x": 1, "started": str(started), "sleep": 2})
        )
        wait_for(started.exists, 60, "the first call in its handler")
        lo = in_thread(lambda: Client(sock, job="lo").call("s", {"x": 1, "sleep": 0.5}))
        wait_for(lambda: jobs(sock)["lo"]["queued"] == 1, 30, "lo's call queued")
        hi = in_thread(lambda: Client(sock, job="hi").call("s", {"x": 1, "sleep": 0.5}))
        wait_for(lambda: jobs(sock)["hi"]["queued"] == 1, 30, "hi's call queued")
        for box in (busy, lo, hi):
            box["thread"].join(60)
            assert box["result"].outcome == "ok", box["result"]
        assert hi["done"] < lo["done"]  # one GPU: hi's call ran before lo's

        held = c.acquire_lease("strict", ttl_s=60, policy="wait", job="lo")
        c_lo, c_hi = Client(sock, job="lo"), Client(sock, job="hi")
        lo_lease = in_thread(lambda: c_lo.acquire_lease("strict", ttl_s=60, policy="wait"))
        wait_for(lambda: jobs(sock)["lo"]["queued"] == 1, 30, "lo's lease waiting")
        hi_lease = in_thread(lambda: c_hi.acquire_lease("strict", ttl_s=60, policy="wait"))
        wait_for(lambda: jobs(sock)["hi"]["queued"] == 1, 30, "hi's lease waiting")
        c.release_lease(held)
        hi_lease["thread"].join(30)
        rows = jobs(sock)
        assert (rows["hi"]["running"], rows["lo"]["queued"]) == (1, 1), rows
        c_hi.release_lease(hi_lease["result"])
        lo_lease["thread"].join(30)
        c_lo.release_lease(lo_lease["result"])
        c_lo.close()
        c_hi.close()

"""`tangramd up` as a real subprocess: exec, pinning, environments, leases, SIGTERM."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import threading
import time

import pytest
from harness import running_daemon

from tangram import AsyncClient, _native
from tangram.model import Unschedulable
from tangram.protocol.errors import NotFound, QuotaExceeded, Timeout
from tangram.testing import wait_for


def cpus_allowed(stdout: str) -> str:
    for line in stdout.splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(stdout)


def test_exec_is_pinned_to_allocated_cores(daemon):
    """The exec'd process sees exactly the cores the result reports, and TANGRAM_CPUS."""
    with daemon.client() as c:
        for cpus in (1, 2):
            r = c.exec(
                ["sh", "-c", "grep Cpus_allowed_list /proc/self/status; echo n=$TANGRAM_CPUS"],
                cpus=cpus,
            )
            assert r.outcome == "ok", r
            assert len(r.cores) == cpus
            expected = (
                ",".join(str(x) for x in r.cores) if cpus == 1 else f"{min(r.cores)}-{max(r.cores)}"
            )
            assert cpus_allowed(r.stdout) == expected
            assert f"n={cpus}" in r.stdout
            assert r.act_s >= r.exec_s > 0


def test_exit_codes_timeouts_and_state(daemon):
    """Exit codes map to outcomes, timeouts return partial output, env state persists."""
    with daemon.client() as c:
        env = c.env_open()
        assert c.exec("echo hello > state.txt", env=env).outcome == "ok"
        r = c.exec("cat state.txt; exit 7", env=env)
        assert (r.outcome, r.exit_code, r.stdout) == ("failed", 7, "hello\n")
        r = c.exec("echo partial; sleep 10", env=env, timeout_s=0.5)
        assert r.outcome == "timeout"
        assert "partial" in r.stdout
        assert r.exec_s < 5
        other = c.env_open()
        assert c.exec("cat state.txt", env=other).outcome == "failed"  # isolated
        assert {e["id"] for e in c.env_list()} >= {env, other}
        c.env_close(env)
        c.env_close(other)
        with pytest.raises(NotFound):
            c.exec("true", env=env)
        assert c.status()["pools"]["cpu:local"]["free"] == 2


def test_no_core_serves_two_actions_under_100_trajectories(daemon):
    """100 concurrent trajectories on 2 cores: per core, action intervals never overlap."""
    script = (
        "s=$(date +%s%N); c=$(grep Cpus_allowed_list /proc/self/status | cut -f2); "
        "i=0; while [ $i -lt 2000 ]; do i=$((i+1)); done; e=$(date +%s%N); echo $s $e $c"
    )

    async def run_trajectories() -> list:
        async with AsyncClient(daemon.socket) as c:

            async def traj(k: int) -> list:
                out = []
                env = await c.env_open(trajectory=f"t{k}")
                for _ in range(3):
                    await asyncio.sleep(0.001 * (k % 7))  # "think time"
                    out.append(await c.exec(["sh", "-c", script], cpus=1, env=env))
                await c.env_close(env)
                return out

            results = await asyncio.gather(*(traj(k) for k in range(100)))
        return [r for rs in results for r in rs]

    results = asyncio.run(run_trajectories())
    assert len(results) == 300
    per_core: dict[str, list[tuple[int, int]]] = {}
    for r in results:
        assert r.outcome == "ok", r
        start, end, core = r.stdout.split()
        assert core == str(r.cores[0])
        per_core.setdefault(core, []).append((int(start), int(end)))
    for core, spans in per_core.items():
        spans.sort()
        for (_, e0), (s1, _) in itertools.pairwise(spans):
            assert s1 >= e0, f"core {core} ran two actions at once"
    with daemon.client() as c:
        st = c.status()
        assert st["pools"]["cpu:local"]["free"] == 2 and st["queued"] == 0 and st["running"] == 0
        # the daemon's process chose its core as this one did (tangram/_native.py)
        assert st["core"] == ("compiled" if _native.ACTIVE else "interpreted")


def test_impossible_and_bad_demands_are_typed_errors(daemon):
    """More cores than the node, negative, NaN and absurd amounts never reach the queue."""
    from tangram.protocol.errors import BadRequest

    with daemon.client() as c:
        with pytest.raises(Unschedulable):
            c.exec("true", cpus=64)
        for bad in (-1, float("nan"), 10**9, [3, 1], "two"):
            with pytest.raises(BadRequest):
                c.request("exec", {"cmd": "true", "cpus": bad})
        with pytest.raises(BadRequest):
            c.request("exec", {"cmd": "true", "timeout_s": -5})
        assert c.exec("true").outcome == "ok"
        assert c.status()["pools"]["cpu:local"]["free"] == 2


def test_leases_concurrency_ttl_and_policies(daemon):
    """At most `concurrency` leases at once; TTL reclaims; reject and deadline policies."""
    held = []
    peak = 0
    lock = threading.Lock()

    def worker():
        nonlocal peak
        with daemon.client() as c, c.lease("search") as lease_id:
            with lock:
                held.append(lease_id)
                peak = max(peak, len(held))
            time.sleep(0.1)  # the work done under the lease: six holders contend for two
            with lock:
                held.remove(lease_id)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert peak == 2
    with daemon.client() as c:
        # TTL: a forgotten lease comes back after ttl_s (2 s in the test config)
        c.acquire_lease("search", ttl_s=0.3)
        c.acquire_lease("search", ttl_s=0.3)
        t0 = time.monotonic()
        lid = c.acquire_lease("search", ttl_s=5)
        assert 0.2 < time.monotonic() - t0 < 3
        c.release_lease(lid)
        # reject policy: strict has concurrency 1
        first = c.acquire_lease("strict")
        with pytest.raises(QuotaExceeded):
            c.acquire_lease("strict")
        # deadline policy
        with pytest.raises(Timeout):
            c.acquire_lease("strict", policy="deadline", deadline_s=0.2)
        c.release_lease(first)
        rows = {a["name"]: a for a in c.api_list()}
        assert rows["strict"]["in_use"] == 0


def test_dead_client_returns_its_lease(daemon):
    """A client that dies holding a lease loses it at once; others get the capacity."""
    c1 = daemon.client()
    c1.acquire_lease("strict")
    with daemon.client() as c2:
        assert {a["name"]: a for a in c2.api_list()}["strict"]["in_use"] == 1
        c1.close()
        wait_for(
            lambda: {a["name"]: a for a in c2.api_list()}["strict"]["in_use"] == 0,
            5,
            "the dead client's lease returned",
        )
        lid = c2.acquire_lease("strict")  # policy reject: succeeds only if the unit is free
        c2.release_lease(lid)


def test_release_withdraws_a_waiting_lease(daemon):
    """lease.release of a lease still waiting for its API's one slot withdraws it (answered
    so): it leaves the queue, its lease.acquire fails not_found, its story ends cancelled,
    and the slot, once given back, goes to nobody."""
    answer: dict[str, object] = {}

    def acquire() -> None:
        with daemon.client() as waiter:
            try:
                answer["lease"] = waiter.acquire_lease("strict", policy="wait")
            except NotFound as exc:
                answer["error"] = exc

    with daemon.client() as holder, daemon.client() as c:
        held = holder.acquire_lease("strict")  # concurrency 1: the slot is taken
        thread = threading.Thread(target=acquire)
        thread.start()

        def waiting_lease() -> list[dict[str, object]] | None:
            rows = [r for r in c.queue()["waiting"] if r["kind"] == "api"]
            return rows or None

        waiting = str(wait_for(waiting_lease, 10, "the second lease waiting")[0]["action_id"])
        released = c.request("lease.release", {"lease_id": waiting})
        assert released == {"released": True, "state": "withdrawn"}, released
        thread.join(10)
        assert "lease" not in answer and "withdrawn" in str(answer.get("error")), answer
        assert waiting_lease() is None
        assert c.story(waiting)["outcome"] == "cancelled"
        released = holder.request("lease.release", {"lease_id": held})
        assert released == {"released": True, "state": "released"}, released
        assert {a["name"]: a for a in c.api_list()}["strict"]["in_use"] == 0
        lid = c.acquire_lease("strict")  # policy reject: succeeds only if the slot is free
        c.release_lease(lid)


def test_story_tells_what_happened(daemon):
    """`story` lists submission, environment, queue, placement (cores, node), run and outcome."""
    with daemon.client() as c:
        r = c.exec("true", cpus=2)
        story = c.story(r.action_id)
        events = [e["event"] for e in story["events"]]
        assert events == ["submitted", "waiting_env", "queued", "placed", "running", "finished"]
        assert story["outcome"] == "ok" and story["state"] == "done"
        placed = story["events"][events.index("placed")]
        assert f"units={list(r.cores)}" in placed["detail"]
        assert f"node={r.node}" in placed["detail"] and r.node == "local"
        times = [e["t"] for e in story["events"]]
        assert times == sorted(times) and times[0] > 0
        assert all(e["cause"] > 0 for e in story["events"])
        assert "outcome=" not in events and story["events"][-1]["detail"].startswith("ok")


def test_sigterm_ends_inflight_actions_and_exits_zero(tmp_path):
    """SIGTERM: in-flight exec ends with a typed outcome, socket removed, exit status 0."""
    with running_daemon(tmp_path) as d:
        box = {}

        def long_exec():
            with d.client() as c:
                box["r"] = c.exec("sleep 30")

        t = threading.Thread(target=long_exec)
        t.start()
        with d.client() as c:
            wait_for(lambda: c.status()["running"] == 1, 10, "the exec running")
        assert d.stop(signal.SIGTERM) == 0
        t.join(10)
        assert box["r"].outcome == "infra_error"
        assert box["r"].detail == "daemon shutting down"  # the daemon's why reaches the client
        assert not os.path.exists(d.socket)

"""Dynamic batching on a real `tangramd up` (issue 33, item 3): concurrent calls to one
resident replica run as one forward pass (`handle_batch`), each caller gets its own answer.

One simulated GPU holds every service, so while one call holds it the others queue and
the next placement takes them along as riders (up to `max_batch`).
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import assert_clean_log

from tangram import Client
from tangram.client import CallResult
from tangram.client.aio import AsyncClient
from tangram.protocol import BadRequest
from tangram.testing import SpawnedDaemon, spawn_daemon, wait_for_async

SERVICES = Path(__file__).parent / "data" / "services"
sys.path.insert(0, str(SERVICES))
from batch_services import expected  # noqa: E402  # the services' own formula, without torch

CONFIG = f"""
[sched]
coalesce_ms = 1.0

[gpu]
simulated = {{ count = 1, mem_gb = 0.3, h2d_gbps = 1 }}
nvml = false

[[service]]
name = "b8"
entry = "batch_services:small"
path = "{SERVICES}"
mem_gb = 0.06
max_batch = 8

[[service]]
name = "b3"
entry = "batch_services:medium"
path = "{SERVICES}"
mem_gb = 0.06
max_batch = 3

[[service]]
name = "win"
entry = "batch_services:small"
path = "{SERVICES}"
mem_gb = 0.06
max_batch = 4
batch_window_ms = 5000
"""
SIZES = {"b8": (1000, 0.5), "b3": (3000, 1.5), "win": (1000, 0.5)}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SpawnedDaemon]:
    """A daemon whose config registers three batching services on one GPU."""
    d = spawn_daemon(
        tmp_path_factory.mktemp("batchd"),
        CONFIG,
        env={"TANGRAM_VALIDATE": "1"},
        ready_timeout_s=120,
    )
    try:
        yield d
    finally:
        assert d.stop() == 0, d.log()
        assert_clean_log(d.log())


async def call_many(socket: str, jobs: list[tuple[str, dict[str, Any]]]) -> list[CallResult]:
    async with AsyncClient(socket) as c:
        return list(await asyncio.gather(*(c.call(name, body) for name, body in jobs)))


def listed(socket: str) -> dict[str, dict[str, Any]]:
    with Client(socket, timeout_s=60) as c:
        return {row["name"]: row for row in c.service_list()}


def check_answer(name: str, body: dict[str, Any], result: CallResult) -> None:
    assert result.outcome == "ok", result
    assert result.result is not None
    assert result.result["id"] == body["id"], (body, result.result)  # its own caller's
    n, bias = SIZES[name]
    want = expected(n, bias, body["x"])
    assert abs(result.result["y"] - want) <= 1e-5 * abs(want), (body, result.result)
    # the pass the handler saw is the batch the call reports
    assert result.batch == result.result["batch"], result
    assert result.gpus == (0,) and result.node == "local", result


def test_200_concurrent_calls_are_batched_and_each_caller_gets_its_answer(
    daemon: SpawnedDaemon,
) -> None:
    """200 concurrent calls with distinct payloads to two batching services: every call is
    `ok` with its own answer, forward passes merged several calls (never more than each
    service's `max_batch`), and `service list` counts the batches."""
    before = listed(daemon.socket)
    jobs = [
        ("b8" if i % 3 else "b3", {"x": float(i) + 0.25, "id": f"call-{i}", "sleep": 0.01})
        for i in range(200)
    ]
    results = asyncio.run(call_many(daemon.socket, jobs))
    for (name, body), result in zip(jobs, results, strict=True):
        check_answer(name, body, result)
        assert 1 <= result.batch <= {"b8": 8, "b3": 3}[name], result
    sizes = Counter((name, r.batch) for (name, _), r in zip(jobs, results, strict=True))
    assert any(size > 1 for _, size in sizes), sizes
    assert any(size == 8 for name, size in sizes if name == "b8"), sizes  # the limit is reached
    after = listed(daemon.socket)
    for name in ("b8", "b3"):
        mine = [r for (n, _), r in zip(jobs, results, strict=True) if n == name]
        batched = [r for r in mine if r.batch > 1]
        row, old = after[name], before[name]
        assert row["calls"] - old["calls"] == len(mine), row
        assert row["batched_calls"] - old["batched_calls"] == len(batched), row
        assert row["batches"] - old["batches"] == round(sum(1 / r.batch for r in batched)), row
        (replica,) = row["replicas"]
        assert replica["node"] == "local" and replica["restores"] >= 1, replica


def test_a_full_batch_does_not_wait_out_its_window(daemon: SpawnedDaemon) -> None:
    """Four calls to a service with max_batch 4 and a 5 s window run as one batch of four,
    sent as soon as it is full, not when the window ends."""
    jobs = [("win", {"x": float(i), "id": f"w-{i}"}) for i in range(4)]
    results = asyncio.run(call_many(daemon.socket, jobs))
    for (name, body), result in zip(jobs, results, strict=True):
        check_answer(name, body, result)
    assert [r.batch for r in results] == [4, 4, 4, 4], results
    assert max(r.act_s for r in results) < 4.0, results


def test_a_handle_batch_that_raises_fails_its_calls_not_the_daemon(
    daemon: SpawnedDaemon, tmp_path: Path
) -> None:
    """A `handle_batch` that raises ends every call of its batch `failed` with the error;
    the service and the daemon answer on."""
    started = tmp_path / "started"
    jobs = [("b8", {"x": 1.0, "id": "slow", "sleep": 0.5, "started": str(started)})]
    jobs += [("b8", {"x": float(i), "id": f"f-{i}", "boom": i == 2}) for i in range(5)]

    async def run() -> list[CallResult]:
        async with AsyncClient(daemon.socket) as c:
            slow = asyncio.ensure_future(c.call(*jobs[0]))
            # the first pass holds the GPU: the rest queue
            await wait_for_async(started.exists, 60, "the first pass started")
            rest = await asyncio.gather(*(c.call(name, body) for name, body in jobs[1:]))
            return [await slow, *rest]

    first, *rest = asyncio.run(run())
    assert first.outcome == "ok", first
    assert {r.outcome for r in rest} == {"failed"}, rest
    for r in rest:
        assert r.error is not None and "boom in a batch of 5" in r.error, r
        assert r.batch == 5, r
    again = asyncio.run(call_many(daemon.socket, [("b8", {"x": 2.0, "id": "after"})]))
    check_answer("b8", {"x": 2.0, "id": "after"}, again[0])


def test_max_batch_needs_handle_batch(daemon: SpawnedDaemon) -> None:
    """Registering a module without `handle_batch` with max_batch > 1 is refused, naming
    what is missing; with max_batch 1 it registers."""
    with Client(daemon.socket, timeout_s=120) as c:
        with pytest.raises(BadRequest, match="handle_batch"):
            c.service_register(
                "single",
                mem_gb=0.01,
                entry="batch_services:single",
                path=str(SERVICES),
                max_batch=2,
            )
        assert "single" not in {row["name"] for row in c.service_list()}
        c.service_register("single", mem_gb=0.01, entry="batch_services:single", path=str(SERVICES))
        result = c.call("single", {"x": 2})
        assert result.outcome == "ok" and result.batch == 1, result


def test_an_http_engine_is_sent_a_batch_at_once(daemon: SpawnedDaemon, tmp_path: Path) -> None:
    """An http service with max_batch 4 gets the calls of a batch as concurrent requests
    (the engine batches them itself): each caller gets its own answer, and a batch of
    more than one call happened."""
    cmd = (
        f"{sys.executable} -m tangramd.services.worker --name h --entry batch_services:small "
        f"--path {SERVICES} --http-port {{port}}"
    )
    started = tmp_path / "started"
    with Client(daemon.socket, timeout_s=120) as c:
        c.service_register("h", runtime="http", mem_gb=0.01, cmd=cmd, route="/x", max_batch=4)
    jobs = [("h", {"x": 1.0, "id": "slow", "sleep": 0.5, "started": str(started)})]
    jobs += [("h", {"x": float(i), "id": f"h-{i}"}) for i in range(6)]

    async def run() -> list[CallResult]:
        async with AsyncClient(daemon.socket) as c:
            slow = asyncio.ensure_future(c.call(*jobs[0]))
            # the first call holds the GPU: the rest queue
            await wait_for_async(started.exists, 60, "the first call started")
            rest = await asyncio.gather(*(c.call(name, body) for name, body in jobs[1:]))
            return [await slow, *rest]

    results = asyncio.run(run())
    for (_, body), result in zip(jobs, results, strict=True):
        assert result.outcome == "ok", result
        assert result.result is not None and result.result["id"] == body["id"], result
        want = expected(*SIZES["b8"], body["x"])
        assert abs(result.result["y"] - want) <= 1e-5 * abs(want), result
        assert 1 <= result.batch <= 4, result
    assert max(r.batch for r in results[1:]) > 1, results
    with Client(daemon.socket, timeout_s=120) as c:
        assert c.service_remove("h")["removed"] is True


def test_cancel_a_rider_and_then_the_leader_of_a_running_pass(
    daemon: SpawnedDaemon, tmp_path: Path
) -> None:
    """Four calls to `win` run as one pass whose handler sleeps 30 s. Cancelling a rider
    detaches it (it ends `cancelled` at once; the pass runs on); cancelling the leader
    (the call that holds the GPU) stops the whole pass: the worker is killed, the leader
    and the riders left end `cancelled`; the next call restarts the replica."""
    started = tmp_path / "started"
    jobs = [("win", {"x": 1.0, "id": "p-0", "sleep": 30.0, "started": str(started)})]
    jobs += [("win", {"x": float(i), "id": f"p-{i}"}) for i in range(1, 4)]

    def stories(c: Client) -> dict[str, str]:
        """Each running call's id -> its story as text."""
        return {r["action_id"]: str(c.story(r["action_id"])) for r in c.queue()["running"]}

    async def run() -> tuple[list[CallResult], dict[str, Any], dict[str, Any], int]:
        async with AsyncClient(daemon.socket) as ac:
            calls = [asyncio.ensure_future(ac.call(name, body)) for name, body in jobs]
            await wait_for_async(started.exists, 60, "the pass in its handler")
            with Client(daemon.socket) as c:
                told = stories(c)
                assert len(told) == 4, told
                (leader,) = [a for a, s in told.items() if "batched with" not in s]
                rider = next(a for a in told if a != leader)
                pid = next(
                    int(r["pid"])
                    for row in c.service_list()
                    if row["name"] == "win"
                    for r in row["replicas"]
                    if r.get("pid")
                )
                detached = await asyncio.to_thread(c.cancel, rider)
                assert sorted(stories(c)) == sorted(a for a in told if a != rider)
                stopped = await asyncio.to_thread(c.cancel, leader)
            results = list(await asyncio.gather(*calls))
            return results, detached, stopped | {"leader": leader, "rider": rider}, pid

    results, detached, stopped, pid = asyncio.run(run())
    assert detached["outcome"] == "cancelled" and detached["state"] == "done", detached
    assert stopped["outcome"] == "cancelled" and stopped["state"] == "done", stopped
    assert [r.outcome for r in results] == ["cancelled"] * 4, results
    assert all(r.result is None for r in results), results
    with Client(daemon.socket) as c:
        rider_story = str(c.story(stopped["rider"]))
        assert "detached from its batch" in rider_story, rider_story
        assert "stopping its forward pass" in str(c.story(stopped["leader"]))
    again = asyncio.run(call_many(daemon.socket, [("win", {"x": 2.0, "id": "after"})]))
    check_answer("win", {"x": 2.0, "id": "after"}, again[0])
    assert again[0].result is not None and again[0].result["pid"] != pid, again  # restarted

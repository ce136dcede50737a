"""A wait an API's quota window holds back is woken when the next window opens (issue 34).

The pool says when that is (``ApiPool.next_window_at``, a pure function of ``now``); each
pass that leaves a pool's quota used up records it (``PassBook.windows``), and the core's
next wake-up, hence a pass, comes then. Before, nothing did: an exec with ``api`` waited
for whatever else made a pass due, and a waiting lease made the daemon tick in a loop
without a pass until one did.
"""

from __future__ import annotations

import asyncio
import math
import os

import pytest
from harness import TEST_CONFIG, assert_clean_log

from tangram.client import AsyncClient
from tangram.pools.api import ApiPool
from tangram.pools.cpu import CpuCluster, CpuNodePool
from tangram.protocol.results import ExecResult, ExecSpec
from tangram.testing import spawn_daemon, wait_for_async
from tangramd import events as ev
from tangramd.state import Core, CoreConfig

PERIOD_S = 2.0
GIB = 1 << 30


# ------------------------------------------------------------------ the pool, pure
@pytest.mark.parametrize(
    ("quota", "concurrency", "taken", "now", "expected"),
    [
        (0, 4, 1, 0.5, None),  # no quota: never the window
        (2, 4, 1, 0.5, None),  # quota left in this window
        (1, 4, 1, 0.5, 2.0),  # used up: the next window's start
        (1, 4, 1, 1.999, 2.0),
        (1, 1, 1, 0.5, None),  # concurrency is full too: only a release helps
        (1, 4, 1, 2.5, None),  # a window the pool has not rolled to: quota is back
    ],
)
def test_next_window_at(quota, concurrency, taken, now, expected):
    pool = ApiPool("q", concurrency=concurrency, quota=quota, period_s=PERIOD_S)
    pool.advance(0.1)
    for i in range(taken):
        pool.allocate(f"a{i}", (i,))
    assert pool.next_window_at(now) == expected


@pytest.mark.parametrize("period", [0.1, 0.3, 1 / 3, 7.7])
@pytest.mark.parametrize("k", [3, 10, 1234567])
def test_the_window_it_names_is_open_at_that_moment(period, k):
    """Never a moment early, whatever the rounding: at the time it gives, the pool rolls
    to the next window and has its quota back."""
    pool = ApiPool("q", concurrency=4, quota=1, period_s=period)
    now = (k + 0.5) * period
    pool.advance(now)
    pool.allocate("a", (0,))
    at = pool.next_window_at(now)
    assert at is not None and at > now and math.isclose(at, (k + 1) * period)
    pool.advance(math.nextafter(at, -math.inf))
    assert pool.free_units() == 0
    pool.advance(at)
    assert pool.free_units() == 1


# ------------------------------------------------------------------ the core, pure
def make_core() -> Core:
    cluster = CpuCluster([CpuNodePool("local", [[0, 1]], 8 * GIB)])
    apis = {"q": ApiPool("q", concurrency=4, quota=1, period_s=PERIOD_S)}
    return Core(cluster, apis, CoreConfig())


def ready_env(core: Core) -> str:
    (create,) = core.handle(ev.OpenEnv(token=1), 0.0)
    core.handle(ev.EnvCreated(env_id=create.env_id), 0.0)
    return create.env_id


def test_an_exec_held_by_the_quota_runs_when_the_window_opens():
    core = make_core()
    env = ready_env(core)
    spec = ExecSpec(cmd="sleep 30", env=env, api="q")
    core.handle(ev.SubmitExec(spec=spec, token=2), 0.5)
    (first,) = core.handle(ev.Tick(), 0.5)
    assert isinstance(first, ev.RunExec)
    core.handle(ev.SubmitExec(spec=ExecSpec(cmd="true", env=env, api="q"), token=3), 0.6)
    assert core.handle(ev.Tick(), 0.6) == []  # a core is free, the quota is not
    assert core.next_wakeup(0.7) == PERIOD_S  # the window's start, nothing else
    assert core.handle(ev.Tick(), 1.0) == []  # (an early tick changes nothing)
    (second,) = core.handle(ev.Tick(), PERIOD_S)
    assert isinstance(second, ev.RunExec) and second.spec.cmd == "true"
    core.validate()
    (reply,) = core.handle(
        ev.ExecFinished(action_id=second.action_id, result=ExecResult("ok", exit_code=0)), 2.1
    )
    assert reply.result["queue_s"] == pytest.approx(PERIOD_S - 0.6)


def test_a_lease_held_by_the_quota_is_granted_when_the_window_opens():
    core = make_core()
    core.handle(ev.AcquireLease(token=1, api="q"), 0.1)
    (granted,) = core.handle(ev.Tick(), 0.1)
    assert granted.result["lease_id"]
    core.handle(ev.AcquireLease(token=2, api="q"), 0.2)
    assert core.handle(ev.Tick(), 0.2) == []
    assert core.next_wakeup(0.3) == PERIOD_S
    (second,) = core.handle(ev.Tick(), PERIOD_S)
    assert second.token == 2 and second.result["queue_s"] == pytest.approx(PERIOD_S - 0.2)
    # the window after is used up too, with nobody waiting: one more look, then quiet
    assert core.next_wakeup(PERIOD_S) == 2 * PERIOD_S
    assert core.handle(ev.Tick(), 2 * PERIOD_S) == []
    assert core.next_wakeup(2 * PERIOD_S) == 60.1  # the first lease's TTL, nothing sooner


# ------------------------------------------------------------------ a real daemon
CORES = sorted(os.sched_getaffinity(0))[:2]
CONFIG = (
    TEST_CONFIG
    + f"""
[cpu]
cores = {CORES}

[[api]]
name = "q"
concurrency = 4
quota = 1
period_s = {PERIOD_S}
"""
)


def test_the_second_api_exec_starts_within_a_window_on_a_real_daemon(tmp_path):
    """Two execs with ``api="q"`` (one grant per 2 s window) and nothing else: the second
    starts within a window of being queued, while the first still runs (so no end of an
    exec makes the pass that starts it). Without the wake-up it waited for its queue
    timeout (four windows) and ended ``timeout``."""
    daemon = spawn_daemon(tmp_path, CONFIG, env={"TANGRAM_VALIDATE": "1"})
    try:

        async def scenario() -> tuple[ExecResult, dict]:
            c = AsyncClient(daemon.socket)
            try:
                first = asyncio.ensure_future(c.exec("sleep 60", api="q", ref="first"))

                async def first_runs() -> bool:
                    return bool((await c.queue())["running"])

                await wait_for_async(first_runs, 20, "the first exec running")
                second = await c.exec("true", api="q", queue_timeout_s=4 * PERIOD_S)
                queue = await c.queue()
                first.cancel()
                await asyncio.gather(first, return_exceptions=True)
                return second, queue
            finally:
                await c.close()

        second, seen = asyncio.run(scenario())
        assert second.outcome == "ok", second
        # queued right after the first took the window's grant: it waits for the next
        # window, at most one window (plus a generous margin for a loaded host)
        assert second.queue_s <= PERIOD_S + 1.0, second
        assert len(seen["running"]) == 1 and not seen["waiting"]  # the first still runs
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert_clean_log(daemon.log())

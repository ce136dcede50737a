"""A straggler left alone on its node after a burst takes the cores that pay, on a real
`tangramd up` (the environment cap of the priced rule, tangram/sched/price.py)."""

from __future__ import annotations

import asyncio

import pytest

from tangram import AsyncClient
from tangram.testing import spawn_daemon

# a test run that the scheduler expects to take 4 s on one core and 1.3x less on two
# (the command itself is short: only the declared durations enter the price)
RUN = {"cmd": "sleep 0.2", "cpus": [1, 2], "t1_s": 4.0, "eff": {1: 1.0, 2: 0.65}}
CROWD = 6


async def _straggler_cores(sock: str, close_crowd: bool) -> int:
    async with AsyncClient(sock) as c:
        crowd = [await c.env_open() for _ in range(CROWD)]
        results = await asyncio.gather(*(c.exec(env=env, **RUN) for env in crowd))
        assert all(r.outcome == "ok" for r in results), results
        if close_crowd:
            for env in crowd:
                await c.env_close(env)
        straggler = await c.env_open()
        r = await c.exec(env=straggler, **RUN)
        assert r.outcome == "ok", r
        return len(r.cores)


@pytest.mark.parametrize(("close_crowd", "cores"), [(True, 2), (False, 1)])
def test_straggler_after_a_burst(tmp_path, close_crowd: bool, cores: int) -> None:
    """Six test runs start within a second on a 2-core node, so for the next 20 s the load
    meter forecasts about one run in service (Little's law). When the six environments
    are closed, the straggler that comes next is alone on the node: nobody can share its
    run and it takes both cores. While they stay open they could send more, the forecast
    stands, and one core prices cheaper."""
    daemon = spawn_daemon(tmp_path, "[cpu]\ncores = [0, 1]\n")  # the 2-core node
    try:
        with daemon.client() as c:
            assert c.status()["pools"]["cpu:local"]["capacity"] == 2
        assert asyncio.run(_straggler_cores(daemon.socket, close_crowd)) == cores
    finally:
        daemon.stop()

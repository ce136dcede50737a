"""200 concurrent GPU calls on a real `tangramd up` with 4 simulated GPUs.

Two 4 GB services share an 8 GB GPU, an 8 GB one needs a GPU whole, and a 16 GB one runs
on two GPUs (8 GB each), so the pool's restore plans often evict two services from one GPU
at once, or a 2-GPU instance from a GPU next to the call's, where another call may be
placed at once. The host must carry out every eviction the pool planned, and a restore must
wait until the copies leaving its GPUs have left; otherwise the pool believes a GPU free
that the host does not, and the restore ends ``infra_error`` ("Oversubscribed ... evict
first"): 58 of 200 calls (two services on one GPU, one kept resident) and 12-17 of 200
(a 2-GPU instance still being evicted) in the first reproductions.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from pathlib import Path

from harness import assert_clean_log

from tangram.client import CallResult
from tangram.client.aio import AsyncClient
from tangram.testing import spawn_daemon

SERVICES = Path(__file__).parent / "data" / "services"
sys.path.insert(0, str(SERVICES))
from tiny_services import expected  # noqa: E402  # the services' own formula, without torch

CONFIG = """
[sched]
coalesce_ms = 1.0

[gpu]
simulated = { count = 4, mem_gb = 8, h2d_gbps = 25 }
nvml = false
"""
# name -> (factory, (n, bias) of its Scaler, mem_gb, GPUs): two "half"s share a GPU, "whole"
# fills one, "pair" fills two
SERVICES_UNDER_TEST = {
    "half1": ("small", (1000, 0.5), 4.0, 1),
    "half2": ("medium", (3000, 1.5), 4.0, 1),
    "whole": ("large", (5000, 2.5), 8.0, 1),
    "pair": ("medium", (3000, 1.5), 16.0, 2),
}
CALLS = 200


async def call_all(socket: str) -> tuple[list[tuple[str, float]], list[CallResult], list[dict]]:
    async with AsyncClient(socket) as c:
        for name, (factory, _, mem_gb, gpus) in SERVICES_UNDER_TEST.items():
            await c.service_register(
                name, mem_gb=mem_gb, gpus=gpus, entry=f"tiny_services:{factory}", path=str(SERVICES)
            )
        names = list(SERVICES_UNDER_TEST)
        # every caller has its own x, so an answer matched to the wrong caller shows
        jobs = [(names[(i * 7 + i // 5) % len(names)], float(i + 1)) for i in range(CALLS)]
        results = await asyncio.gather(*(c.call(name, {"x": x}) for name, x in jobs))
        return jobs, list(results), await c.service_list()


def test_200_concurrent_calls_that_evict_shared_gpus_all_succeed(tmp_path: Path) -> None:
    """200 concurrent calls to services that share GPUs all end ``ok`` with their own
    caller's answer: every eviction the pool plans really happens on the host, before a
    restore onto the GPUs it frees."""
    daemon = spawn_daemon(tmp_path, CONFIG, env={"TANGRAM_VALIDATE": "1"}, ready_timeout_s=120)
    try:
        jobs, results, listed = asyncio.run(call_all(daemon.socket))
    finally:
        assert daemon.stop() == 0, daemon.log()
    outcomes = Counter(r.outcome for r in results)
    bad = [
        (job, r.outcome, r.error) for job, r in zip(jobs, results, strict=True) if r.outcome != "ok"
    ]
    assert outcomes == {"ok": CALLS}, (outcomes, bad[:3])
    for (name, x), result in zip(jobs, results, strict=True):
        _, (n, bias), _, _ = SERVICES_UNDER_TEST[name]
        assert result.result is not None
        assert abs(result.result["y"] - expected(n, bias, x)) <= 1e-5 * abs(expected(n, bias, x))
    # the calls really made the host evict and restore (the path the test protects)
    assert sum(row["evictions"] for row in listed) > 0, listed
    assert sum(row["calls"] for row in listed) == CALLS, listed
    assert_clean_log(daemon.log())

"""Jobs in cluster mode (issue 34): a coordinator with [[job]] and three nodes; execs sent
through a node carry their job, and under contention the coordinator holds cores 2:1."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_harness import InProcessCluster, InProcessDaemon, check_clean, stop_all, wait_for

from tangram import AsyncClient

CONFIG = """
[cluster]
heartbeat_s = 0.25
heartbeat_timeout_s = 2.0

[[job]]
name = "big"
weight = 2.0

[[job]]
name = "small"
weight = 1.0
"""
ENV = {"TANGRAM_VALIDATE": "1"}
CORES = sorted(os.sched_getaffinity(0))[:2]
CPUS = ",".join(str(c) for c in CORES)  # every node offers the same host cores
TOTAL = 3 * len(CORES)
N = 30  # sleeps per job: ten waiting on each node
MEM = 64 << 20  # each exec's throwaway environment


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, InProcessDaemon]]:
    with InProcessCluster(tmp_path, env=ENV) as here:
        coord = here.coordinator(CONFIG)
        daemons = {"coordinator": coord}
        for name in ("a", "b", "c"):
            daemons[name] = here.node(coord, name, cpus=CPUS)
        yield daemons
        stop_all(list(daemons.values()))
        check_clean(*daemons.values())


def test_two_jobs_share_the_cluster_2_to_1(cluster: dict[str, InProcessDaemon]) -> None:
    """Every core held by a blocker, then thirty 1-core sleeps per job sent through node a:
    once the blockers end, while both jobs have execs queued and every core is held, the
    coordinator holds `big`:`small` at 2:1."""
    coord, node = cluster["coordinator"], cluster["a"]
    samples: list[tuple[int, int]] = []

    def jobs() -> dict:
        with coord.client() as c:
            return {j["name"]: j for j in c.jobs()}

    def sample() -> bool:
        rows = jobs()
        big, small, blocker = rows["big"], rows["small"], rows["default"]
        full = big["cores"] + small["cores"] == TOTAL
        # after each job's first exec ended: the blockers end one by one, and the first
        # round is placed one freed core at a time (a 3:3 start is as fair at that moment)
        settled = big["act_p50"] is not None and small["act_p50"] is not None
        if not blocker["running"] and full and settled:
            # an exec runs on its environment's node: the share is the scheduler's to
            # keep while both jobs have execs waiting on every node
            with coord.client() as c:
                waiting = c.queue()["waiting"]
            on = {(r["waiting_for"].rsplit(" ", 1)[-1], r["job"]) for r in waiting}
            if all((n, j) in on for n in ("a", "b", "c") for j in ("big", "small")):
                samples.append((big["cores"], small["cores"]))
        return not (big["queued"] or small["queued"])

    async def scenario() -> list:
        blocker = AsyncClient(node.socket)
        clients = [AsyncClient(node.socket, job="big"), AsyncClient(node.socket, job="small")]
        blocks = [asyncio.ensure_future(blocker.exec("sleep 3", mem=MEM)) for _ in range(TOTAL)]
        await asyncio.to_thread(
            lambda: wait_for(lambda: jobs()["default"]["running"] == TOTAL, 60, "blockers")
        )
        runs = [
            asyncio.ensure_future(c.exec("sleep 1", mem=MEM)) for _ in range(N) for c in clients
        ]
        await asyncio.to_thread(
            lambda: wait_for(
                lambda: jobs()["big"]["queued"] + jobs()["small"]["queued"] == 2 * N, 60, "queued"
            )
        )
        await asyncio.to_thread(lambda: wait_for(sample, 120, "the backlogs", every_s=0.05))
        results = await asyncio.gather(*blocks, *runs)
        for c in (blocker, *clients):
            await c.close()
        return results

    results = asyncio.run(scenario())
    assert all(r.outcome == "ok" for r in results), results
    assert samples, "no sample while both jobs waited"
    share = TOTAL * 2 // 3
    at_share = sum(1 for big, small in samples if (big, small) == (share, TOTAL - share))
    assert at_share >= 0.8 * len(samples), sorted(Counter(samples).items())
    rows = jobs()
    assert rows["big"]["weight"] == 2.0 and rows["big"]["act_p50"] is not None

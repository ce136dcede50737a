"""Work-arounds for behaviours of the shared pools that the simulator cannot wait for.

Each one is a subclass (never a branch in production code) and names the behaviour it works
around; ``docs/results.md`` ("Findings") and ``tests/test_sim_findings.py`` describe them.
"""

from __future__ import annotations

from collections.abc import Sequence

from tangram.model import Action
from tangram.pools.buddy import choose_chunk
from tangram.pools.gpu import GPU_STRIDE, GpuCluster
from tangram.sched import chunk_level


class PackingGpuCluster(GpuCluster):
    """``GpuCluster`` whose ``pick_units`` falls back to residency-blind buddy packing.

    Work-around: ``GpuCluster.pick_units`` prefers chunks where the service is resident and
    can thereby split a free chunk that a later request of the same pass needed, failing
    for requests that the scheduler's ``ChunkOperator`` rightly found feasible. Packing the
    requests largest first into the smallest fitting chunk always succeeds then.
    """

    fallbacks = 0

    def pick_units(self, requests: Sequence[tuple[Action, int]]) -> list[tuple[int, ...]]:
        try:
            return super().pick_units(requests)
        except ValueError:
            self.fallbacks += 1
        copies = [node.buddy.copy() for node in self.nodes]
        out: list[tuple[int, ...]] = [() for _ in requests]
        order = sorted(range(len(requests)), key=lambda i: (-chunk_level(requests[i][1]), i))
        for i in order:
            size = chunk_level(requests[i][1])
            chosen = choose_chunk([(c, None) for c in copies], size)
            if chosen is None:
                raise ValueError(f"gpu: requests {list(requests)} do not fit the free chunks")
            index, start = chosen
            copies[index].split(start, size)
            out[i] = tuple(index * GPU_STRIDE + g for g in range(start, start + size))
        return out

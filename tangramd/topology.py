"""What this host offers the CPU manager: usable cores grouped by NUMA node, and memory.

Cores are those in the daemon's own affinity mask (a daemon started under `taskset` or in a
cpuset cgroup manages only what it was given), grouped by the NUMA node that sysfs lists
them under; without NUMA information all usable cores form one node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import psutil

SYS_NODES = Path("/sys/devices/system/node")


@dataclass(frozen=True, slots=True)
class HostTopology:
    """Usable cores per NUMA node (empty nodes omitted) and total memory in bytes."""

    cores_by_numa: tuple[tuple[int, ...], ...]
    mem_bytes: int

    @property
    def cores(self) -> tuple[int, ...]:
        return tuple(c for node in self.cores_by_numa for c in node)


def parse_cpulist(text: str) -> tuple[int, ...]:
    """Parse a kernel cpulist such as ``0-3,8,10-11`` into sorted core ids."""
    cores: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return tuple(sorted(cores))


def numa_cpulists(sys_nodes: Path = SYS_NODES) -> list[tuple[int, ...]]:
    """Cores per NUMA node as sysfs lists them, ordered by node id; [] if unavailable."""
    nodes = []
    try:
        entries = list(sys_nodes.glob("node[0-9]*"))
    except OSError:
        return []
    for node in sorted(entries, key=lambda p: int(p.name[4:])):
        try:
            nodes.append(parse_cpulist((node / "cpulist").read_text()))
        except (OSError, ValueError):
            continue
    return nodes


def build_topology(numa: list[tuple[int, ...]], allowed: set[int], mem_bytes: int) -> HostTopology:
    """Intersect sysfs NUMA node lists with the affinity mask (pure; unit-tested)."""
    grouped = [tuple(c for c in node if c in allowed) for node in numa]
    grouped = [g for g in grouped if g]
    seen = {c for g in grouped for c in g}
    rest = tuple(sorted(allowed - seen))  # cores sysfs did not list (no NUMA info)
    if rest:
        grouped.append(rest)
    return HostTopology(tuple(grouped), mem_bytes)


def discover(sys_nodes: Path = SYS_NODES) -> HostTopology:
    """The topology of this host as seen by this process."""
    try:
        allowed = set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = set(range(psutil.cpu_count() or 1))
    return build_topology(numa_cpulists(sys_nodes), allowed, psutil.virtual_memory().total)

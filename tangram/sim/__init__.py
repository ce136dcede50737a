"""Discrete-event simulator: the real scheduler and pure pools under a virtual clock.

``simulate(cluster, trajectories, policy)`` (``tangram.sim.engine``) replays a trace;
``tangram.sim.workloads`` generates the paper's workloads; ``tangram.sim.trace`` parses and
writes the trace format of ``docs/trace-format.md``; ``tangram.sim.cluster`` reads cluster
files. The CLI is ``tangramctl simulate`` (also ``python -m tangram.sim``).
"""

from tangram.sim.cluster import ClusterSpec, load_cluster, parse_cluster
from tangram.sim.engine import Engine, SimError, simulate
from tangram.sim.metrics import SimResult
from tangram.sim.policy import Policy, parse_policy
from tangram.sim.trace import TraceError, Trajectory, load_trace, parse_lines
from tangram.sim.workloads import WORKLOADS, generate

__all__ = [
    "WORKLOADS",
    "ClusterSpec",
    "Engine",
    "Policy",
    "SimError",
    "SimResult",
    "TraceError",
    "Trajectory",
    "generate",
    "load_cluster",
    "load_trace",
    "parse_cluster",
    "parse_lines",
    "parse_policy",
    "simulate",
]

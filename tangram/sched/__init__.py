"""The elastic scheduler: pool protocol, load meter, priced DoP, candidates, greedy eviction,
objective replay, dp_arrange, operators."""

from tangram.sched.dp import Arrangement, DPTable, InfeasibleArrangement, dp_arrange
from tangram.sched.load import LoadMeter, PoolLoad
from tangram.sched.operators import BaseOperator, ChunkOperator, Operator, chunk_level
from tangram.sched.pool import SchedPool
from tangram.sched.schedule import (
    ORDERS,
    RULES,
    Decision,
    Infeasible,
    Placement,
    SchedConfig,
    Snapshot,
    pool_of,
    schedule,
)
from tangram.sched.share import Job, fair_order

__all__ = [
    "ORDERS",
    "RULES",
    "Arrangement",
    "BaseOperator",
    "ChunkOperator",
    "DPTable",
    "Decision",
    "Infeasible",
    "InfeasibleArrangement",
    "Job",
    "LoadMeter",
    "Operator",
    "Placement",
    "PoolLoad",
    "SchedConfig",
    "SchedPool",
    "Snapshot",
    "chunk_level",
    "dp_arrange",
    "fair_order",
    "pool_of",
    "schedule",
]

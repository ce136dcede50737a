"""What the scheduling passes remember between them (the pass itself is
:mod:`tangramd.state.handlers.scheduling`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tangram.model import TrajectoryId
from tangram.sched.share import DecayedUsage
from tangramd.state.deadlines import Deadlines


@dataclass
class PassBook:
    """What the passes remember between them."""

    dirty: bool = False  # an arrival or a completion since the last pass
    due: float | None = None  # when the next pass is due (None: none is)
    last: float = float("-inf")  # when the last pass ran
    passes: int = 0
    short: int = 0  # passes that read only a prefix of the queue
    full_pools: int = 0  # short passes with no free core: no scheduler run
    # What the short-cut pass relies on (``short_waiting``): the affinity and pools the
    # previous pass saw, and whether every action it left queued was an exec with a node.
    seen_affinity: dict[TrajectoryId, str] | None = None
    seen_pools: tuple[tuple[str, int], ...] = ()
    seen_plain: bool = False
    # envs.affinity() until it may change (None: read it afresh), and the environments per
    # CPU node derived from it (the priced rule's bound, ``PoolLoad.envs``)
    affinity: dict[TrajectoryId, str] | None = None
    envs_on: Counter[str] = field(default_factory=Counter)
    # each job's decayed usage for the fair share ([sched] share_half_life_s > 0)
    decay: DecayedUsage | None = None
    # API pool id -> when its next quota window opens, for a pool whose quota held its
    # waiters back at the last pass (``ApiPool.next_window_at``): a pass is due then
    windows: Deadlines = field(default_factory=Deadlines)

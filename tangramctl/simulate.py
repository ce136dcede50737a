"""``tangramctl simulate``: the simulator's command, defined in ``tangram.sim.cli``."""

from tangram.sim.cli import simulate

__all__ = ["simulate"]

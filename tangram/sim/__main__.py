"""``python -m tangram.sim``: the ``tangramctl simulate`` command without the group."""

from tangram.sim.cli import simulate

simulate(prog_name="python -m tangram.sim")

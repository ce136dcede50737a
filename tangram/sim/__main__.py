"""``python -m tangram.sim``: the ``tangramctl simulate`` command without the group."""

from tangramctl.simulate import simulate

simulate(prog_name="python -m tangram.sim")

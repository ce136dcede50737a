"""Where the core's commands take effect: one protocol (:class:`~tangramd.run.effects.Effects`),
two back ends. :class:`~tangramd.run.local.LocalEffects` carries them out on this host (its
backend and GPU service host): ``tangramd up`` and every cluster node use it.
:class:`~tangramd.run.remote.RemoteEffects` sends them to the node that holds the
environment: the coordinator uses it. The executor (``tangramd.executor``) is the same over
either."""

"""What each event does: one module per resource, each registering its handlers in the
dispatch table (:mod:`tangramd.state.dispatch`). Handlers take the core as the
:class:`tangramd.state.context.Core` protocol, the event, ``now`` and the list of
commands to append to; they raise a typed error to refuse a request."""

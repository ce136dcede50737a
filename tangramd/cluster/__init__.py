"""Cluster mode: ``tangramd coordinator`` and ``tangramd node`` (docs/design.md §6.1).

``pki`` (the CA, server certificate and the node's pin check), ``link`` (framed msgpack
over TLS between node and coordinator), ``registry`` (join token, node credentials, node
records), ``coordinator`` (the global core with nodes for a backend), ``node`` (a host's
executor and forwarding client socket), ``config`` (``[cluster]``), ``daemon`` (start-up).
"""

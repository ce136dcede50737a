"""Where the daemon's socket is: one rule for the daemon that listens and the clients.

``$TANGRAM_SOCKET`` if set; else the system socket ``/run/tangram/tangramd.sock`` when
running as root or when that socket exists (a root daemon serving the host's users); else
``$XDG_RUNTIME_DIR/tangram/tangramd.sock``; else ``/tmp/tangram-<uid>/tangramd.sock``.
"""

from __future__ import annotations

import os
from typing import Final

SYSTEM_SOCKET: Final = "/run/tangram/tangramd.sock"
SOCKET_ENV: Final = "TANGRAM_SOCKET"


def default_socket_path() -> str:
    """The socket path by the rule of this module's docstring."""
    from_env = os.environ.get(SOCKET_ENV)
    if from_env:
        return from_env
    if os.geteuid() == 0 or os.path.exists(SYSTEM_SOCKET):
        return SYSTEM_SOCKET
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir:
        return os.path.join(runtime_dir, "tangram", "tangramd.sock")
    return f"/tmp/tangram-{os.getuid()}/tangramd.sock"

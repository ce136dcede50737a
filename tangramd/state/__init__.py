"""The daemon's pure state machine: a router (:class:`Core`) over one book per resource.

Importing this package loads no I/O: no asyncio, socket, subprocess, threading, logging
or service runtime (``tests/test_state.py`` checks it in a fresh interpreter).
"""

from tangramd.state.config import CoreConfig
from tangramd.state.core import Core
from tangramd.state.story import IllegalTransition

__all__ = ["Core", "CoreConfig", "IllegalTransition"]

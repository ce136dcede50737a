"""Start a real ``tangramd up`` subprocess on a temp socket (shared by the daemon tests)."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator
from pathlib import Path

import msgpack

from tangram.testing import SpawnedDaemon, spawn_daemon

TEST_CONFIG = """
[sched]
coalesce_ms = 1.0

[[api]]
name = "search"
concurrency = 2
quota = 0
period_s = 60
ttl_s = 2

[[api]]
name = "strict"
concurrency = 1
overflow = "reject"
"""


@contextlib.contextmanager
def running_daemon(tmp: Path, *args: str, config: str = "") -> Iterator[SpawnedDaemon]:
    """A daemon that checks its invariants after every event; its log must stay clean."""
    daemon = spawn_daemon(tmp, TEST_CONFIG + config, *args, env={"TANGRAM_VALIDATE": "1"})
    try:
        yield daemon
    finally:
        if daemon.proc.poll() is None:
            daemon.stop()
    assert "invariant_violated" not in daemon.log(), daemon.log()
    assert "Traceback" not in daemon.log(), daemon.log()


def frame(obj: object) -> bytes:
    """One protocol frame of ``obj``, as a raw client would write it."""
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body

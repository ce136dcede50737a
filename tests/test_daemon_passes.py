"""When `tangramd up` runs its scheduling passes: once per turn of its event loop for a
burst of arrivals, at once after a completion (its freed cores wait for that pass)."""

from __future__ import annotations

import socket
import time

from harness import frame

from tangram.protocol.codec import FrameDecoder
from tangram.testing import spawn_daemon, wait_for

N = 12


def test_a_burst_is_scheduled_in_one_pass_and_each_completion_starts_the_next(tmp_path):
    """Twelve execs written in one ``sendall`` are read in one turn of the daemon's loop:
    one pass places the first two on the two free cores and queues the rest (no time
    window: ``coalesce_ms = 0``). Each completion then starts the next at once: every exec
    ends ``ok``, one core's worth of time after another."""
    daemon = spawn_daemon(tmp_path, "[sched]\ncoalesce_ms = 0\n", env={"TANGRAM_VALIDATE": "1"})
    try:
        with daemon.client() as c:
            envs = [c.env_open() for _ in range(N)]
            st = c.status()
            free, before = st["pools"]["cpu:local"]["free"], st["passes"]
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(daemon.socket)
        burst = b"".join(
            frame({"id": i, "op": "exec", "args": {"cmd": "sleep 0.4", "cpus": 1, "env": env}})
            for i, env in enumerate(envs, 1)
        )
        started = time.monotonic()
        s.sendall(burst)
        with daemon.client() as c:  # read and placed; none has ended yet (each takes 0.4 s)
            st = wait_for(
                lambda: (now := c.status())["running"] + now["queued"] == N and now,
                5,
                "all twelve read and placed or queued before the first ended",
            )
        assert (st["running"], st["queued"]) == (free, N - free), st
        assert st["passes"] - before == 1, st
        dec = FrameDecoder()
        replies: dict[int, dict] = {}
        while len(replies) < N:
            data = s.recv(65536)
            assert data, "the daemon closed the connection"
            dec.feed(data)
            while (msg := dec.next_message()) is not None:
                replies[msg["id"]] = msg
        took = time.monotonic() - started
        s.close()
        assert all(r["ok"] and r["result"]["outcome"] == "ok" for r in replies.values()), replies
        waves = -(-N // free)
        assert took >= waves * 0.4, took
        with daemon.client() as c:
            st = c.status()
        # the burst's pass, then one per completion that found work queued
        assert st["passes"] - before <= 1 + N, st
        assert st["pools"]["cpu:local"]["free"] == free
    finally:
        daemon.stop()
    assert "invariant_violated" not in daemon.log(), daemon.log()
    assert "Traceback" not in daemon.log(), daemon.log()

"""The test suite's daemons: a real ``tangramd up`` (and ``tangramd http``) with the test
config, invariants checked after every event, and logs that must stay clean.

The spawning itself is ``tangram.testing``'s (shared with bench/ and examples/); the
fixtures built on these helpers are in ``conftest.py``.
"""

from __future__ import annotations

import contextlib
import itertools
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from tangram.client import Client, ExecResult
from tangram.testing import (
    SpawnedDaemon,
    SpawnedGateway,
    free_port,
    spawn_daemon,
    spawn_gateway,
    wait_for,
    wait_http,
)

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


def assert_clean_log(log: str) -> None:
    """No invariant violation and no traceback in a daemon's (or gateway's) log."""
    assert "invariant_violated" not in log, log
    assert "Traceback" not in log, log


@contextlib.contextmanager
def running_daemon(tmp: Path, *args: str, config: str = "") -> Iterator[SpawnedDaemon]:
    """A daemon that checks its invariants after every event; its log must stay clean."""
    daemon = spawn_daemon(tmp, TEST_CONFIG + config, *args, env={"TANGRAM_VALIDATE": "1"})
    try:
        yield daemon
    finally:
        if daemon.proc.poll() is None:
            daemon.stop()
    assert_clean_log(daemon.log())


def frame(obj: object) -> bytes:
    """One protocol frame of ``obj``, as a raw client would write it."""
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


@dataclass
class Stack:
    """A daemon and the HTTP gateway in front of it."""

    daemon: SpawnedDaemon
    gateway: SpawnedGateway

    @property
    def url(self) -> str:
        return self.gateway.url


@contextlib.contextmanager
def running_stack(
    tmp: Path, *gateway_args: str, in_process: bool = False, config: str = ""
) -> Iterator[Stack]:
    """Daemon and gateway; the gateway's log must stay free of tracebacks. ``in_process``:
    the daemon serves the gateway itself (``tangramd up --http``; ``gateway_args`` are its
    ``--http-*`` options, ``config`` more of its TOML), and ``Stack.gateway`` is the
    daemon's process and log."""
    if in_process:
        port = free_port()
        address = f"127.0.0.1:{port}"
        with running_daemon(tmp, "--http", address, *gateway_args, config=config) as daemon:
            gw = SpawnedGateway(daemon.proc, f"http://127.0.0.1:{port}", daemon.log_path)
            wait_http(gw.url, daemon.proc, daemon.log_path)
            yield Stack(daemon, gw)
            assert daemon.proc.poll() is None, daemon.log()
        return  # running_daemon checks the log
    with running_daemon(tmp) as daemon, spawn_gateway(daemon.socket, tmp, *gateway_args) as gw:
        yield Stack(daemon, gw)
        assert gw.proc.poll() is None, gw.log()
    assert "Traceback" not in gw.log(), gw.log()


# prints its start and end on the host clock (the daemons of a test run on this host)
TIMED = "date +%s.%N; sleep 0.3; date +%s.%N"
API_HELD = "api search: 1 of 1 slots held"


def api_execs_wait_then_run_one_at_a_time(
    socket: str,
    c: Client,
    lease: str,
    while_waiting: Callable[[list[dict[str, Any]]], None],
    n: int = 3,
) -> list[ExecResult]:
    """Joint admission's scenario (issue 34, item 3): with ``lease`` holding the only slot
    of the API ``search``, ``n`` execs with ``api="search"`` sent through ``socket`` all
    wait for it (``queue`` says so: cores are free), ``while_waiting(rows)`` checks more;
    once the lease is released they run one at a time by their commands' own clocks."""
    results: list[ExecResult] = []

    def submit() -> None:
        with Client(socket) as own:
            results.append(own.exec(TIMED, api="search", timeout_s=60))

    threads = [threading.Thread(target=submit) for _ in range(n)]
    for t in threads:
        t.start()

    def all_wait_for_the_api() -> list[dict[str, Any]] | None:
        rows = c.queue()["waiting"]
        waits = [r["waiting_for"] for r in rows]
        return rows if len(rows) == n and waits == [API_HELD] * n else None

    while_waiting(wait_for(all_wait_for_the_api, 30, f"{n} execs waiting for the API"))
    c.release_lease(lease)
    for t in threads:
        t.join(60)
    assert len(results) == n and all(r.outcome == "ok" for r in results), results
    spans = sorted(tuple(float(x) for x in r.stdout.split()) for r in results)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end, spans  # never two at once
    return results


def pid_alive(pid: int) -> bool:
    """Running (a zombie its parent has not reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def service_worker_pid(c: Any, name: str = "s") -> int | None:
    """The pid of service ``name``'s replica (None: none with a process yet; through a
    coordinator, as last told by the node: its rows come with its heartbeats)."""
    for row in c.service_list():
        for replica in row["replicas"] if row["name"] == name else ():
            if replica.get("pid"):
                return int(replica["pid"])
    return None

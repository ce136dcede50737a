"""``tangramctl top``: a live view of pools, queues, running actions and recent ACT per kind.

One frame per interval from two cheap inline ops (``status``, ``queue``). On a terminal the
screen is redrawn in place and ``q`` quits (the terminal is put in cbreak mode for the
duration and restored); elsewhere frames are printed one after another. ``--json`` prints
one JSON object per line and frame (``{"status", "queue"}``), for scripts.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Iterator
from typing import Any

import click

from tangramctl.render import table

CLEAR = "\x1b[H\x1b[2J"
ROWS = 12  # running / waiting actions shown per frame


def frame(status: dict[str, Any], queue: dict[str, Any]) -> str:
    """One screen: a header line, the pools, recent ACT per kind, running and waiting."""
    head = (
        f"tangramd {status.get('version', '?')}  backend={status.get('backend', '?')}  "
        f"up {status.get('uptime_s', 0):.0f}s  passes={status.get('passes', 0)}  "
        f"queued={status.get('queued', 0)}  running={status.get('running', 0)}  "
        f"envs={status.get('environments', 0)}  leases={status.get('leases', 0)}"
    )
    pools = [
        {"pool": name, "capacity": p.get("capacity"), "free": p.get("free"),
         "busy": (p.get("capacity") or 0) - (p.get("free") or 0)}
        for name, p in sorted((status.get("pools") or {}).items())
    ]  # fmt: skip
    recent = [{"kind": kind, **row} for kind, row in sorted((status.get("recent") or {}).items())]
    running = list(queue.get("running") or [])
    waiting = list(queue.get("waiting") or [])
    cols = ("action_id", "kind", "pool", "units", "waiting_s", "trajectory")
    parts = [
        head,
        "",
        table(pools, ("pool", "capacity", "busy", "free")),
        "",
        "recent ACT per kind (s):",
        table(recent, ("kind", "count", "queue_s", "exec_s", "act_s"), empty="(none yet)"),
        "",
        f"running ({len(running)}):",
        table(running[:ROWS], cols, empty="(none)"),
        "",
        f"waiting ({len(waiting)}):",
        table(waiting[:ROWS], cols, empty="(none)"),
    ]
    return "\n".join(parts)


@contextlib.contextmanager
def _keys() -> Iterator[bool]:
    """cbreak mode on a terminal stdin (yields whether keys can be read)."""
    if not sys.stdin.isatty():
        yield False
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _quit_pressed(wait_s: float, keys: bool) -> bool:
    """Wait up to ``wait_s``; True if ``q`` was typed meanwhile."""
    if not keys:
        time.sleep(wait_s)
        return False
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([sys.stdin], [], [], left)
        if ready and os.read(sys.stdin.fileno(), 1) in (b"q", b"Q"):
            return True
    return False


def run_top(client: Any, interval: float, iterations: int | None, as_json: bool) -> None:
    redraw = sys.stdout.isatty() and not as_json
    shown = 0
    with _keys() as keys:
        while iterations is None or shown < iterations:
            status, queue = client.status(), client.queue()
            if as_json:
                click.echo(json.dumps({"status": status, "queue": queue}, default=str))
            else:
                text = frame(status, queue)
                click.echo((CLEAR + text) if redraw else text + "\n")
                if keys and redraw:
                    click.echo("(q quits)")
            shown += 1
            if iterations is not None and shown >= iterations:
                break
            if _quit_pressed(interval, keys):
                break

"""A session's terminal for SWE-ReX's interactive commands (stdlib only, Python 3.7+).

The gateway (``swerex.py``) starts it as a background job of the session's shell, with
the environment's ``python3 -c``: ``swerex_pty.py DIR COMMAND`` runs ``bash -c COMMAND``
on a new pseudo-terminal (echo off, as SWE-ReX's pexpect shell has it; the program's
controlling terminal, so ^C interrupts it) and answers requests on the socket ``DIR/s``,
one at a time (``swerex_pty_client.py`` sends each from a session command)::

    {"send": text | null, "kill": bool, "expect": [regex], "timeout": s | null}
      -> {"matched": i, "output": what came before the match}
       | {"exited": status, "output": the rest}  (the program ended: SWE-ReX's prompt)
       | {"timeout": true, "output": ""}
       | {"gone": status, "output": the rest}  (it had ended before: the line is not sent)

The earliest match among the patterns wins (pexpect's rule); what follows it stays for
the next request. Once it has told that the program exited it removes DIR and exits.
"""

from __future__ import annotations

import codecs
import json
import os
import pty
import re
import select
import signal
import socket
import sys
import termios
import time
from typing import Any

decoder = codecs.getincrementaldecoder("utf-8")("backslashreplace")
state: dict[str, Any] = {"buf": "", "status": None}


def pump(wait: float) -> None:
    """Read what the program printed (at most ``wait`` s for it); note its exit."""
    if state["status"] is not None:
        return
    ready, _, _ = select.select([FD], [], [], wait)
    if not ready:
        return
    try:
        data = os.read(FD, 65536)
    except OSError:  # EIO: the terminal's other end has closed
        data = b""
    if data:
        state["buf"] += decoder.decode(data)
        return
    _, status = os.waitpid(PID, 0)
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
    state["status"] = code


def answer(req: dict[str, Any]) -> dict[str, Any]:
    if req.get("send") is not None:
        while state["status"] is None and select.select([FD], [], [], 0)[0]:
            pump(0)  # what is there already; has the program ended?
        if state["status"] is not None:  # the line is not sent: the session's shell runs it
            out, state["buf"] = state["buf"], ""
            return {"gone": state["status"], "output": out}
        os.write(FD, req["send"].encode())
    if req.get("kill") and state["status"] is None:
        os.kill(PID, signal.SIGKILL)
    patterns = [re.compile(p) for p in req.get("expect") or []]
    end = None if req.get("timeout") is None else time.monotonic() + req["timeout"]
    while True:
        best: tuple[int, re.Match[str]] | None = None
        for i, pattern in enumerate(patterns):
            m = pattern.search(state["buf"])
            if m and (best is None or m.start() < best[1].start()):
                best = (i, m)
        if best is not None:
            out, state["buf"] = state["buf"][: best[1].start()], state["buf"][best[1].end() :]
            return {"matched": best[0], "output": out}
        if state["status"] is not None:
            out, state["buf"] = state["buf"], ""
            return {"exited": state["status"], "output": out}
        if end is not None and time.monotonic() >= end:
            return {"timeout": True, "output": ""}
        pump(0.5 if end is None else max(0.0, min(0.5, end - time.monotonic())))


def serve() -> None:
    server = socket.socket(socket.AF_UNIX)
    server.bind(os.path.join(DIR, "s"))
    server.listen(1)
    while True:
        conn, _ = server.accept()
        with conn:
            reply = answer(json.loads(conn.makefile().readline()))
            conn.sendall((json.dumps(reply) + "\n").encode())
        if state["status"] is not None:
            server.close()
            os.unlink(os.path.join(DIR, "s"))
            os.rmdir(DIR)
            return


if __name__ == "__main__":  # (never on import)
    DIR, COMMAND = sys.argv[1], sys.argv[2]
    PID, FD = pty.fork()
    if PID == 0:
        attrs = termios.tcgetattr(0)
        attrs[3] &= ~termios.ECHO
        termios.tcsetattr(0, termios.TCSANOW, attrs)
        os.execvp("bash", ["bash", "--noprofile", "--norc", "-c", COMMAND])
    serve()

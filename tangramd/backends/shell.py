"""Persistent shell sessions of the process backend.

A session is one long-lived ``bash`` (its own session and process group) in an
environment's directory, so the state a command leaves (cwd, variables, functions,
background jobs) is there for the next one. Each ``run`` is still one exec action:

- before the command starts, the shell and every process it left are re-pinned with
  ``sched_setaffinity`` to exactly the cores allocated for this run (no cgroup: the
  per-core exec cgroups are emptied after every exec, which would kill the shell);
- the command is fed to the shell as ``eval`` of one single-quoted word (no fork: a
  ``$(cat <<EOF …)`` here cost ~2 ms a command) with stdin at ``/dev/null`` (or the run's
  input), followed by a line that prints a random marker and the exit status on stdout
  and stderr; the run ends when both markers arrive;
- the shell is an interactive ``bash`` (no line editing, empty prompts, no history
  expansion) because only an interactive shell treats SIGINT as ^C: it abandons the rest
  of the command and reads the next line, where a non-interactive one would either exit
  or run on. Background jobs it starts print ``[1] PID`` on stderr, as in a terminal;
- a timeout or ``interrupt`` sends SIGINT to the shell and to the processes started since
  the run began (then SIGKILL to those after ``SIGTERM_GRACE_S``), so the session stays
  usable; if the marker still does not come, the shell is ended and the session is dead.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tangramd.backends.base import (
    SIGTERM_GRACE_S,
    ExecRequest,
    ExecResult,
    OutputBuffer,
    infra_error,
    outcome_for,
)

MARKER_WAIT_S = 2.0  # after a kill, how long the shell has to print its marker
OPEN_TIMEOUT_S = 10.0
_READ_CHUNK = 1 << 16


class _Stream:
    """One pipe of the shell: bytes up to the run's marker go to the run's buffer."""

    def __init__(self) -> None:
        self.pending = b""
        self.buffer: OutputBuffer | None = None
        self.marker: re.Pattern[bytes] | None = None
        self.done = asyncio.Event()
        self.status: int | None = None
        self.eof = False

    def start(self, buffer: OutputBuffer, marker: re.Pattern[bytes]) -> None:
        self.buffer, self.marker, self.status = buffer, marker, None
        self.done.clear()

    def feed(self, data: bytes) -> None:
        if self.buffer is None or self.marker is None:
            return  # output of a background job between runs: nobody to give it to
        self.pending += data
        match = self.marker.search(self.pending)
        if match is not None:
            self.buffer.feed(self.pending[: match.start()])
            self.status = int(match.group(1))
            self.pending = b""
            self.buffer = self.marker = None
            self.done.set()
            return
        keep = 96  # longer than any marker line: it may be arriving in pieces
        if len(self.pending) > keep:
            self.buffer.feed(self.pending[:-keep])
            self.pending = self.pending[-keep:]

    def close(self) -> None:
        self.eof = True
        if self.buffer is not None:
            self.buffer.feed(self.pending)
            self.pending = b""
        self.done.set()


@dataclass(eq=False)
class Shell:
    """One session's shell process and its pipes."""

    session_id: str
    env_id: str
    popen: subprocess.Popen[bytes]
    out: _Stream = field(default_factory=_Stream)
    err: _Stream = field(default_factory=_Stream)
    older: frozenset[int] | None = None  # pids the shell had before the current run
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # set between runs when the shell was found with no descendant (see _note_idle)
    idle_alone: bool = False
    busy: bool = False
    # (an isolated environment's session) its own cpuset cgroup: a run's cores are
    # written there, and root inside cannot widen them
    cpuset: str | None = None

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None and not self.out.eof


async def open_shell(
    session_id: str,
    env_id: str,
    cwd: Path,
    env: dict[str, str],
    user: tuple[int, int] | None,
    wrap: Callable[[list[str]], list[str]] | None = None,
    cpuset: str | None = None,
) -> Shell:
    """Start the session's shell in ``cwd``, watch its pipes, wait until it answers.
    ``wrap`` turns the shell's argv into the one to start (entering an environment)."""
    bash = shutil.which("bash", path=env.get("PATH")) or "/bin/bash"
    argv = [bash, "--noprofile", "--norc", "--noediting", "-i"]
    popen = subprocess.Popen(
        wrap(argv) if wrap is not None else argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env=env,
        start_new_session=True,
        umask=0o077,
        user=None if user is None else user[0],
        group=None if user is None else user[1],
        extra_groups=None if user is None else [],
    )
    shell = Shell(session_id, env_id, popen, cpuset=cpuset)
    loop = asyncio.get_running_loop()
    assert popen.stdin is not None
    os.set_blocking(popen.stdin.fileno(), False)
    for pipe, stream in ((popen.stdout, shell.out), (popen.stderr, shell.err)):
        assert pipe is not None
        fd = pipe.fileno()
        os.set_blocking(fd, False)
        loop.add_reader(fd, _on_readable, loop, fd, stream)
    # Quiet prompts, no history expansion; then a first marker: its start-up chatter
    # ("no job control in this shell") is over before the first run listens.
    result = await run(
        shell,
        ExecRequest(env_id, "true", (min(os.sched_getaffinity(0)),), timeout_s=OPEN_TIMEOUT_S),
        setup=SETUP,
    )
    if result.outcome != "ok":
        close(shell)
        raise OSError(f"the shell did not start: {result.detail or result.stderr}")
    return shell


def _on_readable(loop: asyncio.AbstractEventLoop, fd: int, stream: _Stream) -> None:
    try:
        data = os.read(fd, _READ_CHUNK)
    except BlockingIOError:
        return
    except OSError:
        data = b""
    if data:
        stream.feed(data)
    else:
        loop.remove_reader(fd)
        stream.close()


# Quiet prompts, no history expansion: the first lines every session's shell gets.
SETUP = "set +H; PS1=; PS2=; PS0=; PS4=; unset PROMPT_COMMAND\n"


def script(req: ExecRequest, token: str, setup: str = "") -> str:
    """The lines that run ``req.cmd`` in the shell and then print the markers (also what
    the Docker backend's in-container agent feeds its sessions)."""
    cmd = req.cmd if isinstance(req.cmd, str) else " ".join(_quote(a) for a in req.cmd)
    delim = f"TANGRAM_EOF_{token}"
    pinned = f"export TANGRAM_CPUS={len(req.cores)} TANGRAM_CORES={','.join(map(str, req.cores))}"
    exports = "".join(f"export {k}={_quote(v)}\n" for k, v in req.env_vars.items())
    cd = f"cd {_quote(req.cwd)} && " if req.cwd else ""
    # The run's input travels base64-encoded in a here-document: exact bytes, and nothing
    # the command leaves unread can reach the shell's own command stream.
    stdin = "/dev/null"
    if req.stdin:
        data = base64.encodebytes(req.stdin).decode()
        stdin = f"<(base64 -d <<'{delim}_IN'\n{data}{delim}_IN\n)"
    lines = (
        f"{setup}{pinned}\n{exports}"
        f"{cd}eval {_quote(cmd)} < {stdin}\n"
        f"__tangram_rc=$?; printf '\\n%s%d%s\\n' {token}: $__tangram_rc :{token}; "
        f"printf '\\n%s%d%s\\n' {token}: $__tangram_rc :{token} >&2\n"
    )
    return lines


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def _descendant_pids(root: int) -> list[int]:
    """Pids of ``root``'s descendants: one pass over ``/proc/*/stat`` (parent pids), then
    the tree from ``root``. (psutil's ``children(recursive=True)`` does the same pass with
    an object per process: 2-3x the time, and this runs on every session command.)"""
    kids: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{name}/stat", os.O_RDONLY)
            try:
                data = os.read(fd, 1024)
            finally:
                os.close(fd)
            ppid = int(data[data.rindex(b")") + 2 :].split(b" ", 2)[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        kids.setdefault(ppid, []).append(int(name))
    found: list[int] = []
    todo = [root]
    while todo:
        for pid in kids.get(todo.pop(), ()):
            found.append(pid)
            todo.append(pid)
    return found


def _descendants(shell: Shell) -> list[psutil.Process]:
    procs = []
    for pid in _descendant_pids(shell.popen.pid):
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    return procs


def pin(shell: Shell, cores: tuple[int, ...], pids: list[int]) -> str:
    """Re-pin the shell and ``pids`` (all it left running) to ``cores``; '' if done."""
    if shell.cpuset is not None:  # the cgroup moves every member at once
        try:
            with open(os.path.join(shell.cpuset, "cpuset.cpus"), "w") as f:
                f.write(",".join(map(str, cores)))
        except OSError as e:
            return f"cannot pin the session to cores {list(cores)}: {e}"
        return ""
    try:
        os.sched_setaffinity(shell.popen.pid, cores)
    except OSError as e:
        return f"cannot pin the session's shell to cores {list(cores)}: {e}"
    for pid in pids:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(pid, cores)
    return ""


def _note_idle(shell: Shell) -> None:
    """After a run, off its reply's path: whether the shell has any descendant left (a
    background job). The shell then waits for its next line and forks nothing, and with
    no descendant nothing else can add one to its tree: the next run need not look
    (``Shell.idle_alone``)."""
    if shell.busy or not shell.alive:
        return
    shell.idle_alone = not _descendant_pids(shell.popen.pid)


def interrupt(shell: Shell, sig: int = signal.SIGINT) -> int:
    """Signal the processes the current run started (not older jobs), and with SIGINT the
    shell too: an interactive bash then abandons the rest of the command, as after ^C."""
    if shell.older is None:
        return 0
    hit = 0
    if sig == signal.SIGINT:
        with contextlib.suppress(OSError):
            os.kill(shell.popen.pid, sig)
    for proc in _descendants(shell):
        if proc.pid in shell.older:
            continue
        with contextlib.suppress(psutil.Error, OSError):
            proc.send_signal(sig)
            hit += 1
    return hit


async def run(shell: Shell, req: ExecRequest, setup: str = "") -> ExecResult:
    """Run one command in the session (the caller serialises runs with ``shell.lock``)."""
    if not shell.alive:
        return infra_error(f"session {shell.session_id} has ended")
    # what earlier runs left running (background jobs): re-pinned with the shell, and
    # spared by this run's timeout; none when the shell was last seen without any
    older = [] if shell.idle_alone else _descendant_pids(shell.popen.pid)
    shell.idle_alone = False
    problem = pin(shell, req.cores, older)
    if problem:
        return infra_error(problem)
    token = secrets.token_hex(8)
    marker = re.compile(rb"\n" + token.encode() + rb":(-?\d+):" + token.encode() + rb"\n")
    out, err = OutputBuffer(req.max_output), OutputBuffer(req.max_output)
    shell.out.start(out, marker)
    shell.err.start(err, marker)
    stdin = shell.popen.stdin
    assert stdin is not None
    shell.older = frozenset(older)
    shell.busy = True
    started = time.monotonic()
    try:
        await _write(stdin.fileno(), script(req, token, setup).encode())
    except OSError as e:
        shell.older = None
        shell.busy = False
        return infra_error(f"session {shell.session_id}: cannot write to its shell: {e}")
    both = asyncio.gather(shell.out.done.wait(), shell.err.done.wait())
    timed_out = False
    try:
        await asyncio.wait_for(asyncio.shield(both), req.timeout_s)
    except asyncio.TimeoutError:
        timed_out = True
        interrupt(shell, signal.SIGINT)
        try:
            await asyncio.wait_for(asyncio.shield(both), SIGTERM_GRACE_S)
        except asyncio.TimeoutError:
            interrupt(shell, signal.SIGKILL)
            try:
                await asyncio.wait_for(asyncio.shield(both), MARKER_WAIT_S)
            except asyncio.TimeoutError:
                close(shell)
                await both
    exec_s = time.monotonic() - started
    shell.older = None
    shell.busy = False
    loop = asyncio.get_running_loop()  # two hops: after the task's done callback (the reply)
    loop.call_soon(loop.call_soon, _note_idle, shell)
    status = shell.out.status
    if status is None:  # the shell itself ended (``exit`` in the command, or killed)
        code = shell.popen.wait()
        code = 128 - code if code < 0 else code
        detail = f"session {shell.session_id}: its shell exited"
        if timed_out:
            detail = f"killed after {req.timeout_s} s; {detail}"
        return ExecResult(
            "timeout" if timed_out else "failed", code, out.text(), err.text(), exec_s,
            out.truncated or err.truncated, detail,
        )  # fmt: skip
    return ExecResult(
        outcome_for(status, timed_out), status, out.text(), err.text(), exec_s,
        out.truncated or err.truncated, f"killed after {req.timeout_s} s" if timed_out else "",
    )  # fmt: skip


def _set_once(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _write(fd: int, data: bytes) -> None:
    """All of ``data`` to the shell's stdin (non-blocking: a script fits the pipe at once;
    a longer one waits for the shell to read)."""
    view = memoryview(data)
    loop = asyncio.get_running_loop()
    while view:
        try:
            view = view[os.write(fd, view) :]
            continue
        except BlockingIOError:
            pass
        ready: asyncio.Future[None] = loop.create_future()
        loop.add_writer(fd, _set_once, ready)
        try:
            await ready
        finally:
            loop.remove_writer(fd)


def close(shell: Shell) -> None:
    """End the shell and everything it started; stop watching its pipes."""
    procs = _descendants(shell)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(shell.popen.pid, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(psutil.Error, OSError):
            proc.kill()
    with contextlib.suppress(OSError):
        shell.popen.kill()
    loop = asyncio.get_running_loop()
    for pipe in (shell.popen.stdout, shell.popen.stderr, shell.popen.stdin):
        if pipe is None:
            continue
        with contextlib.suppress(OSError, ValueError):
            loop.remove_reader(pipe.fileno())
        with contextlib.suppress(OSError):
            pipe.close()
    shell.out.close()
    shell.err.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        shell.popen.wait(1)

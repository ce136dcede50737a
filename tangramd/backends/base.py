"""The execution-backend interface of the node daemon, and what every backend shares.

A backend owns *environments* (a container, or a per-environment directory) and runs
*execs* in them, each pinned to exactly the cores the scheduler allocated for that one
action (docs/design.md §5.2, allocate-on-execution). Backends never raise for a failed command:
every exec ends with one `ExecResult` whose `outcome` says what happened —

- ``ok``: exit status 0;
- ``failed``: the command ran and exited non-zero (or could not be found: 127);
- ``timeout``: the deadline passed; the whole process group was killed and the partial
  output is returned;
- ``infra_error``: the environment or the engine failed (container gone, dockerd down,
  daemon shutting down). The command's own behaviour never produces this outcome.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from tangram.protocol.results import ExecResult as ExecResult  # re-exported: backends use it
from tangram.protocol.results import ExecSpec, Outcome

DEFAULT_MAX_OUTPUT = 1 << 20  # bytes kept per stream
TRUNCATION_MARKER = "\n[tangram: output truncated, {dropped} bytes dropped]\n"
SIGTERM_GRACE_S = 0.5  # between SIGTERM and SIGKILL of a timed-out process group
SHUTDOWN_DETAIL = "daemon shutting down"
# Sandboxed commands are the first the kernel's OOM killer picks (the daemon runs at -500
# under systemd): under memory pressure a command dies, never the daemon.
EXEC_OOM_SCORE_ADJ = 1000

_ENV_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class EnvError(RuntimeError):
    """An environment could not be created (bad image, engine down, bad id)."""


class PathEscape(ValueError):
    """A path given for an environment leaves it (``..``, or a symlink pointing out)."""


def confine(root: Path, path: str) -> Path:
    """``path`` inside the directory ``root``, symlinks resolved; raise PathEscape if the
    result is not ``root`` or below it. Relative paths start at ``root``; an absolute one
    must already lie inside it. The last part need not exist yet."""
    return Path(confine_real(os.path.realpath(root), path))


def confine_real(base: str, path: str) -> str:
    """:func:`confine` for a ``base`` that is already a real path (``os.path.realpath``:
    absolute, no symlink, no ``..``), as a string: only the parts of ``path`` below
    ``base`` are looked at (one ``lstat`` each; a full ``realpath`` as soon as one is a
    symlink), for callers that resolved their root once."""
    if "\0" in path or ".." in path.split("/"):
        raise PathEscape(f"{path!r}: '..' and NUL are not allowed")
    top = base.rstrip("/")
    if not os.path.isabs(path):
        parts = [part for part in path.split("/") if part and part != "."]
        here = top
        for part in parts:
            here = f"{here}/{part}"
            try:
                if stat.S_ISLNK(os.lstat(here).st_mode):
                    break  # resolve it all, below
            except OSError:  # missing (or not a directory): nothing below is a link
                return f"{top}/{'/'.join(parts)}" if parts else base
        else:  # no symlink on the way: the path is real as it is
            return f"{top}/{'/'.join(parts)}" if parts else base
    resolved = os.path.realpath(os.path.join(base, path))  # follows every symlink that exists
    if resolved != base and not resolved.startswith(top + "/"):
        raise PathEscape(f"{path!r} leaves the environment")
    return resolved


def check_env_id(env_id: str) -> str:
    """Return `env_id` if it is safe as a path component and container-name part."""
    if not _ENV_ID_RE.match(env_id):
        raise EnvError(f"invalid environment id {env_id!r}: want [A-Za-z0-9][A-Za-z0-9_.-]*")
    return env_id


@dataclass(frozen=True, slots=True)
class ExecRequest:
    """One action's command, with the cores allocated to it for this exec only."""

    env_id: str
    cmd: list[str] | str  # a str runs through /bin/sh -c
    cores: tuple[int, ...]  # host core ids
    timeout_s: float | None = None
    elastic: bool = True  # False: the action opted out of the pytest -n rewrite
    env_vars: dict[str, str] = field(default_factory=dict)
    max_output: int = DEFAULT_MAX_OUTPUT  # bytes kept per stream
    action_id: str = ""
    # (uid, gid) the command runs as: the connecting peer's, or the configured sandbox
    # user's; None = the backend's default (its sandbox user, else the daemon's own user).
    run_as: tuple[int, int] | None = None
    stdin: bytes | None = None  # the command's standard input (None: empty)
    cwd: str | None = None  # inside the environment (confined by the backend)
    session: str | None = None  # run in this open shell session instead of a fresh process
    # bytes: this exec's own memory limit, below its environment's (process backend, isolated)
    mem_limit: int | None = None
    # moved by ``files.exec_with_files`` around the backend's exec (same action)
    files: Mapping[str, bytes] = field(default_factory=dict)
    fetch: tuple[str, ...] = ()

    @classmethod
    def for_action(
        cls,
        spec: ExecSpec,
        *,
        env_id: str,
        cores: tuple[int, ...],
        max_output: int,
        action_id: str,
        run_as: tuple[int, int] | None = None,
    ) -> ExecRequest:
        """The backend's view of an exec action's spec, once its cores are allocated."""
        return cls(
            env_id=env_id,
            cmd=spec.cmd,
            cores=cores,
            timeout_s=spec.timeout_s,
            elastic=spec.rewrite_allowed,
            env_vars=dict(spec.env_vars or {}),
            max_output=max_output,
            action_id=action_id,
            run_as=run_as,
            stdin=spec.stdin,
            cwd=spec.cwd,
            session=spec.session,
            files=dict(spec.files or {}),
            fetch=tuple(spec.fetch or ()),
        )

    def __post_init__(self) -> None:
        if not self.cores:
            raise ValueError("an exec needs at least one core")
        if len(set(self.cores)) != len(self.cores) or min(self.cores) < 0:
            raise ValueError(f"bad core list {self.cores!r}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        if self.max_output < 0:
            raise ValueError("max_output must be >= 0")
        if self.run_as is not None and (len(self.run_as) != 2 or min(self.run_as) < 0):
            raise ValueError(f"bad run_as {self.run_as!r}: want (uid, gid)")


def infra_error(
    detail: str, *, stdout: str = "", stderr: str = "", exec_s: float = 0.0
) -> ExecResult:
    """An `ExecResult` for a failure of the environment or engine, not of the command."""
    return ExecResult("infra_error", None, stdout, stderr, exec_s, False, detail)


def outcome_for(exit_code: int, timed_out: bool) -> Outcome:
    """Map a finished command to its outcome."""
    if timed_out:
        return "timeout"
    return "ok" if exit_code == 0 else "failed"


def exit_code_from_returncode(returncode: int) -> int:
    """Signal deaths as the shell reports them (128+N), so every backend agrees."""
    return 128 - returncode if returncode < 0 else returncode


@runtime_checkable
class Backend(Protocol):
    """What the node daemon needs from an execution backend."""

    name: str

    async def create_env(
        self,
        env_id: str,
        image: str | None,
        mem_bytes: int | None,
        owner: tuple[int, int] | None = None,
    ) -> None:
        """Create an environment owned by `owner` (uid, gid; None: the default user).

        Raises `EnvError` if it cannot."""
        ...

    async def exec(self, req: ExecRequest) -> ExecResult:
        """Run one command pinned to `req.cores`; never raises for the command's failure."""
        ...

    async def close_env(self, env_id: str) -> None:
        """Remove an environment and everything in it; unknown ids are ignored."""
        ...

    async def reconcile(
        self, keep: Mapping[str, tuple[int, int] | None] | None = None
    ) -> list[str]:
        """Adopt what a previous run left of the environments in ``keep`` (id -> owner),
        remove everything else of ours; returns what was done."""
        ...

    async def shutdown(self, keep: Collection[str] = ()) -> None:
        """End in-flight execs with `infra_error` ("daemon shutting down"); remove our
        environments except those in ``keep`` (persistent ones, for the next daemon)."""
        ...

    def env_exists(self, env_id: str) -> bool:
        """Whether the environment is known and, as far as the backend last saw, alive."""
        ...

    async def put(self, env_id: str, path: str, data: bytes, *, tar: bool = False) -> int:
        """Write a file, or extract a tar stream into a directory, inside the environment.

        Raises `PathEscape` for a path that leaves it, `EnvError` for an unknown one."""
        ...

    async def get(self, env_id: str, path: str, *, max_bytes: int) -> tuple[bytes, bool]:
        """``(bytes, False)`` for a file, ``(tar stream, True)`` for a directory.

        Raises `FileNotFoundError`, `PathEscape` or ``files.TooLarge``."""
        ...

    async def open_session(
        self, env_id: str, session_id: str, run_as: tuple[int, int] | None = None
    ) -> None:
        """Start a persistent shell in the environment; execs naming it run there."""
        ...

    async def interrupt_session(self, session_id: str) -> bool:
        """Interrupt the session's running command; whether there was one."""
        ...

    async def close_session(self, session_id: str) -> None:
        """End the session's shell; unknown ids are ignored."""
        ...

    async def cancel(self, action_id: str) -> bool:
        """Kill what the running exec of ``action_id`` started (its exec then ends as a
        command killed by SIGKILL); whether one was running. For a cluster node whose
        coordinator already ended the action (the node was lost and came back)."""
        ...


# --- output capping -------------------------------------------------------------------


class OutputBuffer:
    """Keeps the first `limit` bytes of a stream and counts the rest."""

    __slots__ = ("_chunks", "_kept", "dropped", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._chunks: list[bytes] = []
        self._kept = 0
        self.dropped = 0

    def feed(self, data: bytes) -> None:
        room = self.limit - self._kept
        if room > 0:
            keep = data[:room]
            self._chunks.append(keep)
            self._kept += len(keep)
            self.dropped += len(data) - len(keep)
        else:
            self.dropped += len(data)

    @property
    def truncated(self) -> bool:
        return self.dropped > 0

    def text(self) -> str:
        out = b"".join(self._chunks).decode("utf-8", errors="replace")
        if self.dropped:
            out += TRUNCATION_MARKER.format(dropped=self.dropped)
        return out


def cap_output(data: bytes, limit: int) -> tuple[str, bool]:
    """Decode `data` keeping its first `limit` bytes; returns (text, truncated)."""
    buf = OutputBuffer(limit)
    buf.feed(data)
    return buf.text(), buf.truncated


# --- elastic DoP: pytest -n rewrite ---------------------------------------------------

_PYTHON_RE = re.compile(r"^python(?:3(?:\.\d+)?)?$")
_SHELL_PREFIX_RE = re.compile(
    r"""^(?P<head>\s*(?:cd\s+(?:"[^"]*"|'[^']*'|\S+)\s*&&\s*)?
         (?:\S*/)?(?:pytest|py\.test|python(?:3(?:\.\d+)?)?\s+-m\s+pytest))
        (?=\s|$|[;&|<>])""",
    re.VERBOSE,
)
_SHELL_OPERATOR_RE = re.compile(r"[;&|<>()`\n]")
_SHELL_NUMPROC_RE = re.compile(
    r"[ \t]+(?:-n[ \t]*|--numprocesses(?:=|[ \t]+))(?:\d+|auto|logical)(?=\s|$)"
)
_NUMPROC_VALUE_RE = re.compile(r"^(?:\d+|auto|logical)$")


def _pytest_arg_start(argv: list[str]) -> int | None:
    """Index of the first pytest argument in `argv`, or None if it does not run pytest."""
    if not argv:
        return None
    prog = argv[0].rsplit("/", 1)[-1]
    if prog in ("pytest", "py.test"):
        return 1
    if _PYTHON_RE.match(prog) and argv[1:3] == ["-m", "pytest"]:
        return 3
    return None


def _strip_numprocesses(args: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg in ("-n", "--numprocesses") and i + 1 < len(args):
            skip = True
            continue
        if arg.startswith("--numprocesses=") or (
            arg.startswith("-n") and _NUMPROC_VALUE_RE.match(arg[2:])
        ):
            continue
        out.append(arg)
    return out


def rewrite_pytest(cmd: list[str] | str, cores: int, elastic: bool) -> list[str] | str:
    """Make a pytest command use all `cores` through pytest-xdist (docs/design.md §5.2).

    Applies to ``pytest``, ``py.test``, ``python -m pytest`` and ``python3 -m pytest``
    (argv lists, or shell strings starting with them, optionally after ``cd DIR &&``) when
    more than one core is allocated and the action did not opt out. Any ``-n N``/``-nN``/
    ``--numprocesses`` already present is replaced. Anything else is returned unchanged.
    """
    if cores <= 1 or not elastic:
        return cmd
    if isinstance(cmd, list):
        start = _pytest_arg_start(cmd)
        if start is None:
            return cmd
        return [*cmd[:start], "-n", str(cores), *_strip_numprocesses(cmd[start:])]
    m = _SHELL_PREFIX_RE.match(cmd)
    if m is None:
        return cmd
    head, rest = m.group("head"), cmd[m.end("head") :]
    op = _SHELL_OPERATOR_RE.search(rest)
    args, tail = (rest[: op.start()], rest[op.start() :]) if op else (rest, "")
    kept = args.rstrip(" \t")
    spacing = args[len(kept) :]
    return f"{head} -n {cores}{_SHELL_NUMPROC_RE.sub('', kept)}{spacing}{tail}"

"""The exec action's two wire shapes, each defined once: what is asked, what happened.

:class:`ExecSpec` is an ``exec`` request. The client builds it, the daemon parses it from the
validated args, and the very same object travels through the core (``SubmitExec``, the
action record, ``RunExec``) to the execution backend.

:class:`ExecResult` is how an exec ended. A backend fills in what it knows (outcome, exit
code, output, run time, detail); the core adds the scheduling facts (action id, queue and
completion times, cores, node) with :meth:`ExecResult.placed`; both clients parse it with
:meth:`ExecResult.from_wire`. The op table documents its fields from this class, so the
documentation, the daemon and the clients cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Final, Literal, get_args

from tangram.protocol.errors import BadRequest
from tangram.protocol.messages import MalformedResponse

Outcome = Literal["ok", "failed", "timeout", "rejected", "infra_error", "cancelled"]
OUTCOMES: Final[tuple[str, ...]] = get_args(Outcome)

Command = list[str] | str  # an argv list, or a shell command string (/bin/sh -c)
MAX_FILES_BYTES: Final = 8 << 20  # exec's files in, and its fetched files out, in all


def _dop_keys(table: Mapping[Any, float] | None) -> dict[str, float] | None:
    """Tables keyed by DoP travel with str keys (msgpack maps here are keyed by str)."""
    return None if table is None else {str(key): float(value) for key, value in table.items()}


@dataclass(frozen=True, slots=True)
class ExecSpec:
    """One ``exec`` request, exactly as it crosses the wire (see the op table)."""

    cmd: Command
    env: str | None = None  # run in this open environment, else a throwaway one
    image: str | None = None  # image of the throwaway environment
    cpus: int | tuple[int, int] | None = None  # fixed, or elastic (min, max); None: 1
    mem: int | None = None  # bytes
    timeout_s: float | None = None
    profile: str | None = None
    elastic: bool | None = None  # False: never rewrite to more workers
    trajectory: str | None = None
    task: str | None = None
    t1_s: float | None = None
    eff: Mapping[str, float] | None = None  # efficiency per DoP (str keys)
    env_vars: Mapping[str, str] | None = None
    stdin: bytes | None = None  # fed to the command's standard input
    cwd: str | None = None  # working directory, relative to the environment's own
    session: str | None = None  # run in this open shell session (see ``session.open``)
    # one-shot file transfer, inside the same action: written before the command runs,
    # read back after it ends (paths relative to the environment's root, no '..')
    files: Mapping[str, bytes] | None = None
    fetch: list[str] | None = None
    # the most it may wait to start (queue, memory, environment); None: ``timeout_s``
    # bounds the wait and the run together (the command gets what the wait left)
    queue_timeout_s: float | None = None
    # the client's name for the action, unique on its connection: ``cancel``'s ``ref``
    # finds it before the client knows its action id (``AsyncClient`` sets one per exec)
    ref: str | None = None
    # the job the action belongs to (fair share across jobs, issue 34); None: "default"
    job: str | None = None
    # hold one slot of this API (``[[api]]``) while it runs, taken with its cores (joint
    # admission, issue 34): it starts only when both are free, and gives both back at its end
    api: str | None = None

    def __post_init__(self) -> None:
        if self.cwd is not None:
            check_env_path(self.cwd, "cwd")
        for path in self.files or ():
            check_env_path(path, f"files[{path!r}]")
        for index, path in enumerate(self.fetch or ()):
            check_env_path(path, f"fetch[{index}]")
        if self.files is not None and sum(len(d) for d in self.files.values()) > MAX_FILES_BYTES:
            raise BadRequest(f"files: more than {MAX_FILES_BYTES} bytes in all")
        if isinstance(self.fetch, tuple):
            object.__setattr__(self, "fetch", list(self.fetch))
        if isinstance(self.cmd, tuple):
            object.__setattr__(self, "cmd", list(self.cmd))
        if isinstance(self.cpus, list):
            object.__setattr__(self, "cpus", tuple(self.cpus))
        if self.eff is not None:
            object.__setattr__(self, "eff", _dop_keys(self.eff))

    @classmethod
    def from_wire(cls, args: Mapping[str, Any]) -> ExecSpec:
        """The spec of validated ``exec`` args (``validate_args`` has checked the types)."""
        if not _SPEC_NAMES.issuperset(args):
            unknown = sorted(set(args) - _SPEC_NAMES)
            raise BadRequest(f"exec: unknown arg(s) {unknown}")
        return cls(**{key: value for key, value in args.items() if value is not None})

    def to_wire(self) -> dict[str, Any]:
        """The ``exec`` args (``None`` fields left out, tuples as lists)."""
        out: dict[str, Any] = {}
        for name in _SPEC_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, Mapping):
                value = dict(value)
            out[name] = value
        return out

    @property
    def rewrite_allowed(self) -> bool:
        """Whether a backend may widen the command to its cores (``pytest -n K``)."""
        return self.elastic is not False


def check_env_path(path: str, what: str = "path") -> str:
    """``path`` if it names a place inside an environment: no ``..`` part, no NUL.

    Relative paths are taken from the environment's working directory. Backends still
    resolve symlinks and refuse a path that leaves the environment; this check refuses
    the obvious escapes before anything is scheduled.
    """
    if not path or "\0" in path:
        raise BadRequest(f"{what}: expected a path inside the environment, got {path!r}")
    if ".." in path.split("/"):
        raise BadRequest(f"{what}: {path!r} may not contain '..'")
    return path


def _text(value: object, key: str) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, str):
        return value
    raise MalformedResponse(f"exec result: {key}: expected str, got {type(value).__name__}")


def _outcome(result: object, what: str) -> Outcome:
    """The outcome of a ``what`` result map; MalformedResponse if it is not such a map."""
    if not isinstance(result, Mapping):
        raise MalformedResponse(f"{what} result must be a map, got {type(result).__name__}")
    outcome = result.get("outcome")
    if outcome not in OUTCOMES:
        raise MalformedResponse(f"{what} result: unknown outcome {outcome!r}")
    return outcome  # type: ignore[no-any-return]  # checked against OUTCOMES just above


def _ints(result: Mapping[str, Any], key: str, what: str) -> tuple[int, ...]:
    """``result[key]`` as a tuple of ints (bools excluded); missing or null is empty."""
    items = result.get(key) or ()
    if not isinstance(items, list | tuple) or not all(
        isinstance(item, int) and not isinstance(item, bool) for item in items
    ):
        raise MalformedResponse(f"{what} result: {key} must be a list of ints")
    return tuple(items)


def _batch(result: Mapping[str, Any]) -> int:
    """``batch`` of a call result: an int >= 1 (missing: 1, a daemon that does not batch)."""
    value = result.get("batch", 1)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MalformedResponse("call result: batch must be an int >= 1")
    return value


def _seconds(result: Mapping[str, Any], key: str) -> float:
    value = result.get(key, 0.0)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MalformedResponse(f"exec result: {key} must be a number")
    return float(value)


_SPEC_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(ExecSpec))  # in declared order
_SPEC_NAMES: frozenset[str] = frozenset(_SPEC_FIELDS)


@dataclass(frozen=True, slots=True)
class ExecResult:
    """How one exec action ended. Times in seconds; ``cores`` are host core ids.

    ``exec_s`` is the command's own run time (spawn to exit), ``queue_s`` the time from
    submission to placement, ``act_s`` their sum. ``detail`` says why an ``infra_error``,
    ``timeout`` or ``rejected`` happened. The first seven fields are what a backend knows.
    ``files`` holds what the spec's ``fetch`` asked for: each path that was a regular file
    after the command, with its bytes (others are left out, as SandboxFusion does).
    """

    outcome: Outcome
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    exec_s: float = 0.0
    truncated: bool = False
    detail: str = ""
    action_id: str = ""
    queue_s: float = 0.0
    act_s: float = 0.0
    cores: tuple[int, ...] = ()
    node: str | None = None
    files: Mapping[str, bytes] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """The command ran and exited 0."""
        return self.outcome == "ok" and self.exit_code == 0

    def placed(
        self, *, action_id: str, queue_s: float, cores: tuple[int, ...], node: str | None
    ) -> ExecResult:
        """This result with the scheduling facts the core knows added."""
        return replace(
            self,
            action_id=action_id,
            queue_s=queue_s,
            act_s=queue_s + self.exec_s,
            cores=tuple(cores),
            node=node,
        )

    @classmethod
    def from_wire(cls, result: Mapping[str, Any]) -> ExecResult:
        """Parse the ``exec`` result map; raise MalformedResponse if it is not one."""
        outcome = _outcome(result, "exec")
        exit_code = result.get("exit_code")
        if exit_code is not None and (
            isinstance(exit_code, bool) or not isinstance(exit_code, int)
        ):
            raise MalformedResponse("exec result: exit_code must be int or null")
        cores = _ints(result, "cores", "exec")
        node = result.get("node")
        files = result.get("files") or {}
        if not isinstance(files, Mapping) or not all(
            isinstance(k, str) and isinstance(v, bytes) for k, v in files.items()
        ):
            raise MalformedResponse("exec result: files must be a map of str to bytes")
        return cls(
            outcome=outcome,
            exit_code=exit_code,
            stdout=_text(result.get("stdout", ""), "stdout"),
            stderr=_text(result.get("stderr", ""), "stderr"),
            exec_s=_seconds(result, "exec_s"),
            truncated=bool(result.get("truncated", False)),
            detail=_text(result.get("detail") or "", "detail"),
            action_id=str(result.get("action_id", "")),
            queue_s=_seconds(result, "queue_s"),
            act_s=_seconds(result, "act_s"),
            cores=cores,
            node=None if node is None else str(node),
            files=dict(files),
        )

    def to_wire(self) -> dict[str, Any]:
        """The result map (``cores`` as a list), as the daemon sends it. Every field is a
        plain value: a shallow copy (``asdict`` deep-copies, a cost on every answer)."""
        out = {name: getattr(self, name) for name in EXEC_RESULT_FIELDS}
        out["cores"] = list(self.cores)
        out["files"] = dict(self.files)
        return out


EXEC_RESULT_FIELDS: Final[tuple[str, ...]] = tuple(f.name for f in fields(ExecResult))


def cancelled(result: ExecResult, why: str) -> ExecResult:
    """The result of a running exec that a ``cancel`` killed: outcome ``cancelled``, with
    the output it had written; one that had already exited 0 stays ``ok`` (it finished)."""
    if result.outcome == "ok":
        return result
    detail = f"{why}; {result.detail}" if result.detail else why
    return replace(result, outcome="cancelled", detail=detail)


EXEC_ARG_FIELDS: Final[tuple[str, ...]] = tuple(f.name for f in fields(ExecSpec))


# --------------------------------------------------------------------------- service calls


@dataclass(frozen=True, slots=True)
class CallSpec:
    """One ``call`` request: ``payload`` goes to the service's handler as it is."""

    name: str
    payload: Mapping[str, Any]
    timeout_s: float | None = None
    job: str | None = None  # the job it belongs to (fair share, issue 34); None: "default"
    gpus: int | None = None  # run at exactly this many GPUs; None: the scheduler picks
    # the client's name for the call, as an exec's ``ref``: ``cancel``'s ``ref`` finds it
    # on its connection before its action id is known (the clients set one per call)
    ref: str | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "payload": dict(self.payload)}
        if self.timeout_s is not None:
            out["timeout_s"] = self.timeout_s
        if self.job is not None:
            out["job"] = self.job
        if self.gpus is not None:
            out["gpus"] = self.gpus
        if self.ref is not None:
            out["ref"] = self.ref
        return out


@dataclass(frozen=True, slots=True)
class CallResult:
    """How one service call ended. Times in seconds; ``gpus`` are the node's local GPU ids.

    ``queue_s`` is submission to placement, ``restore_s`` the time to make the service
    resident on ``gpus`` (0.0 when it already was), ``exec_s`` the handler's own run time and
    ``act_s`` submission to completion. ``batch`` is the number of calls in the forward pass
    this one ran in (1: alone; dynamic batching merges concurrent calls to one replica).
    ``result`` is the handler's answer (``ok``); ``error`` says why it is not (the handler's
    message for ``failed``).
    """

    outcome: Outcome
    result: Mapping[str, Any] | None = None
    error: str | None = None
    queue_s: float = 0.0
    restore_s: float = 0.0
    exec_s: float = 0.0
    act_s: float = 0.0
    gpus: tuple[int, ...] = ()
    node: str | None = None
    action_id: str = ""
    batch: int = 1

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    @classmethod
    def from_wire(cls, result: Mapping[str, Any]) -> CallResult:
        """Parse the ``call`` result map; raise MalformedResponse if it is not one."""
        outcome = _outcome(result, "call")
        answer = result.get("result")
        if answer is not None and not isinstance(answer, Mapping):
            raise MalformedResponse("call result: result must be a map or null")
        error = result.get("error")
        gpus = _ints(result, "gpus", "call")
        node = result.get("node")
        return cls(
            outcome=outcome,
            result=None if answer is None else dict(answer),
            error=None if error is None else _text(error, "error"),
            queue_s=_seconds(result, "queue_s"),
            restore_s=_seconds(result, "restore_s"),
            exec_s=_seconds(result, "exec_s"),
            act_s=_seconds(result, "act_s"),
            gpus=gpus,
            node=None if node is None else str(node),
            action_id=str(result.get("action_id") or ""),
            batch=_batch(result),
        )

    def to_wire(self) -> dict[str, Any]:
        """The result map as the daemon sends it."""
        out = asdict(self)
        out["result"] = None if self.result is None else dict(self.result)
        out["gpus"] = list(self.gpus)
        return out


CALL_RESULT_FIELDS: Final[tuple[str, ...]] = tuple(f.name for f in fields(CallResult))

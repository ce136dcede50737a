"""The op table (docs/design.md §6): every op the daemon serves, documented once.

Each :class:`Op` lists its arguments with a small type language (:class:`ArgType`) that
both validates incoming args (:func:`validate_args`) and renders ``docs/protocol.md``
(:func:`render_markdown`). Units: memory in bytes, durations in seconds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from tangram.protocol.errors import BadRequest, UnknownOp
from tangram.protocol.results import (
    CALL_RESULT_FIELDS,
    EXEC_RESULT_FIELDS,
    OUTCOMES,
    check_env_path,
)

PROTOCOL_VERSION: Final = "1"

# --------------------------------------------------------------------------- arg types


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


class ArgType:
    """A wire type: ``check`` raises BadRequest naming the field, ``doc`` describes it."""

    doc: str = "any"

    def check(self, name: str, value: object) -> None:
        """Raise BadRequest if ``value`` is not of this type."""

    def _fail(self, name: str, value: object, why: str = "") -> BadRequest:
        detail = why or f"got {_type_name(value)}"
        return BadRequest(f"{name}: expected {self.doc}, {detail}")


class AnyType(ArgType):
    """Any msgpack value."""


@dataclass(frozen=True, slots=True, eq=False)
class Str(ArgType):
    """A string; non-empty unless ``allow_empty``."""

    allow_empty: bool = False

    @property
    def doc(self) -> str:  # type: ignore[override]  # computed, not a class constant
        return "str" if self.allow_empty else "non-empty str"

    def check(self, name: str, value: object) -> None:
        if not isinstance(value, str):
            raise self._fail(name, value)
        if not value and not self.allow_empty:
            raise self._fail(name, value, "got an empty string")


@dataclass(frozen=True, slots=True, eq=False)
class Bool(ArgType):
    """``true`` or ``false`` (integers are not booleans)."""

    doc = "bool"

    def check(self, name: str, value: object) -> None:
        if not isinstance(value, bool):
            raise self._fail(name, value)


@dataclass(frozen=True, slots=True, eq=False)
class Bytes(ArgType):
    """Raw bytes (msgpack bin), at most ``max_len`` of them if given."""

    max_len: int | None = None

    @property
    def doc(self) -> str:  # type: ignore[override]  # computed, not a class constant
        return "bytes" if self.max_len is None else f"bytes (at most {self.max_len})"

    def check(self, name: str, value: object) -> None:
        if not isinstance(value, bytes):
            raise self._fail(name, value)
        if self.max_len is not None and len(value) > self.max_len:
            raise self._fail(name, value, f"got {len(value)} bytes")


@dataclass(frozen=True, slots=True, eq=False)
class Int(ArgType):
    """A whole number (bool excluded), optionally bounded below."""

    min: int | None = None
    unit: str = ""

    @property
    def doc(self) -> str:  # type: ignore[override]  # computed, not a class constant
        text = "int" if self.min is None else f"int >= {self.min}"
        return f"{text} ({self.unit})" if self.unit else text

    def check(self, name: str, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._fail(name, value)
        if self.min is not None and value < self.min:
            raise self._fail(name, value, f"got {value}")


@dataclass(frozen=True, slots=True, eq=False)
class Number(ArgType):
    """A finite int or float (NaN and infinities rejected), optionally bounded below."""

    min: float | None = None
    exclusive: bool = False  # min itself is not allowed
    unit: str = ""

    @property
    def doc(self) -> str:  # type: ignore[override]  # computed, not a class constant
        text = "finite number"
        if self.min is not None:
            text += f" {'>' if self.exclusive else '>='} {self.min:g}"
        return f"{text} ({self.unit})" if self.unit else text

    def check(self, name: str, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._fail(name, value)
        if isinstance(value, float) and not math.isfinite(value):
            raise self._fail(name, value, f"got {value}")
        if self.min is not None and (value < self.min or (self.exclusive and value == self.min)):
            raise self._fail(name, value, f"got {value}")


@dataclass(frozen=True, slots=True, eq=False)
class Enum(ArgType):
    """One of a fixed set of strings."""

    values: tuple[str, ...]

    @property
    def doc(self) -> str:  # type: ignore[override]  # computed, not a class constant
        return "one of " + "|".join(repr(v) for v in self.values)

    def check(self, name: str, value: object) -> None:
        if not isinstance(value, str) or value not in self.values:
            raise self._fail(name, value, f"got {value!r}")


@dataclass(frozen=True, slots=True, eq=False)
class ListOf(ArgType):
    """A list whose items all have type ``item``, with at least ``min_len`` items."""

    item: ArgType
    min_len: int = 0

    @property
    def doc(self) -> str:  # type: ignore[override]  # computed, not a class constant
        text = f"list[{self.item.doc}]"
        return f"non-empty {text}" if self.min_len == 1 else text

    def check(self, name: str, value: object) -> None:
        if not isinstance(value, list):
            raise self._fail(name, value)
        if len(value) < self.min_len:
            raise self._fail(name, value, f"got {len(value)} item(s)")
        for index, item in enumerate(value):
            self.item.check(f"{name}[{index}]", item)


@dataclass(frozen=True, slots=True, eq=False)
class MapOf(ArgType):
    """A map from str keys (matching ``key_pattern`` if given) to values of type ``value``."""

    value: ArgType
    key_pattern: str = ""
    key_doc: str = "str"

    @property
    def doc(self) -> str:  # type: ignore[override]  # computed, not a class constant
        return f"map[{self.key_doc} -> {self.value.doc}]"

    def check(self, name: str, value: object) -> None:
        if not isinstance(value, dict):
            raise self._fail(name, value)
        for key, item in value.items():
            if not isinstance(key, str) or (
                self.key_pattern and re.fullmatch(self.key_pattern, key) is None
            ):
                raise self._fail(name, value, f"got key {key!r}")
            self.value.check(f"{name}.{key}", item)


@dataclass(frozen=True, slots=True, eq=False)
class IntRange(ArgType):
    """``[min, max]``: two ints with ``lo <= min <= max``."""

    lo: int = 0

    @property
    def doc(self) -> str:  # type: ignore[override]  # computed, not a class constant
        return f"[min, max] with {self.lo} <= min <= max"

    def check(self, name: str, value: object) -> None:
        if not isinstance(value, list) or len(value) != 2:
            raise self._fail(name, value)
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int):
                raise self._fail(name, value, f"got item {item!r}")
        if not self.lo <= value[0] <= value[1]:
            raise self._fail(name, value, f"got {value}")


@dataclass(frozen=True, slots=True, eq=False)
class OneOf(ArgType):
    """Any of several types (tried in order)."""

    options: tuple[ArgType, ...]

    @property
    def doc(self) -> str:  # type: ignore[override]  # computed, not a class constant
        return " or ".join(option.doc for option in self.options)

    def check(self, name: str, value: object) -> None:
        for option in self.options:
            try:
                option.check(name, value)
            except BadRequest:
                continue
            return
        raise self._fail(name, value, f"got {_type_name(value)} {value!r}"[:200])


# --------------------------------------------------------------------------- the table

_DOP_KEY = r"[1-9][0-9]{0,5}"  # a degree of parallelism, as a decimal string


def _dop_map(value: ArgType) -> MapOf:
    return MapOf(value, key_pattern=_DOP_KEY, key_doc="dop (decimal str)")


NAME = Str()
ID = Str()
BYTES = Int(min=0, unit="bytes")
POSITIVE_S = Number(min=0, exclusive=True, unit="seconds")
SECONDS = Number(min=0, unit="seconds")
FRACTION = Number(min=0, exclusive=True)
LEASE_POLICIES: Final = ("wait", "reject", "deadline")


PROFILE_FIELDS: Final = (
    "name: str",
    "dop: map[dop -> seconds]",
    "t1_s: float",
    "eff: map[dop -> fraction]",
    "speedup: map[dop -> fraction]",
    "elastic: bool",
)


@dataclass(frozen=True, slots=True)
class Arg:
    """One argument of an op."""

    name: str
    type: ArgType
    required: bool = False
    doc: str = ""


@dataclass(frozen=True, slots=True)
class Op:
    """One op: its arguments, the fields of its result map, which error codes it may raise.

    ``result`` items are ``"name"`` or ``"name: type"``; the names are exactly the keys the
    daemon sends (a test holds the daemon to it).
    """

    name: str
    doc: str
    args: tuple[Arg, ...] = ()
    result: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()
    operator_only: bool = False  # others get `forbidden` (docs/protocol.md, Roles)
    # a second form of the result: (when it is sent, its fields), e.g. cancel of a job
    variant: tuple[str, tuple[str, ...]] | None = None
    check: Callable[[Mapping[str, Any]], None] | None = None
    by_name: dict[str, Arg] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_name", {arg.name: arg for arg in self.args})

    @property
    def result_fields(self) -> tuple[str, ...]:
        """The keys of the result map."""
        return tuple(item.split(":", 1)[0].strip() for item in self.result)

    @property
    def result_doc(self) -> str:
        return "{" + ", ".join(self.result) + "}"


def _check_lease_acquire(args: Mapping[str, Any]) -> None:
    policy, deadline = args.get("policy"), args.get("deadline_s")
    if policy == "deadline" and deadline is None:
        raise BadRequest("deadline_s: required when policy is 'deadline'")
    if deadline is not None and policy not in (None, "deadline"):
        raise BadRequest(f"deadline_s: only allowed with policy 'deadline', not {policy!r}")


MAX_TRANSFER: Final = 8 << 20  # bytes one env.put may carry (one frame holds it)
PATH_DOC: Final = (
    "inside the environment: relative to its home; absolute, on an isolated environment its"
    " own root's (`/testbed`, `/tmp`, as a command's `cwd`), else within its directory"
)


def _check_env_path(args: Mapping[str, Any]) -> None:
    check_env_path(args["path"], "path")


MAX_FORK: Final = 256  # children of one env.fork


def _check_fork(args: Mapping[str, Any]) -> None:
    n = args.get("n", 1)
    if n > MAX_FORK:
        raise BadRequest(f"n: expected int from 1 to {MAX_FORK}, got {n}")


# ``ref`` of exec and call: one declaration, one check (a string) for both; the daemon
# finds the action by it on the connection that sent it (``cancel`` with ``ref``)
REF_ARG: Final = Arg(
    "ref",
    Str(),
    doc="the client's name for this action, unique on its connection: `cancel` with "
    "`ref` on the same connection cancels it before its action id is known",
)

_EXEC_ARGS: Final = (
    Arg(
        "cmd",
        OneOf((ListOf(Str(allow_empty=True), min_len=1), Str())),
        True,
        "argv list, or a shell command string",
    ),
    Arg("env", ID, doc="run in this open environment (else a throwaway one)"),
    Arg("image", NAME, doc="image of the throwaway environment"),
    Arg("cpus", OneOf((Int(min=1), IntRange(lo=1))), doc="cores: fixed, or elastic [min, max]"),
    Arg("mem", BYTES, doc="memory limit"),
    Arg("timeout_s", POSITIVE_S, doc="wall-clock limit of the command"),
    Arg("profile", NAME, doc="elasticity profile to use (see profile.save)"),
    Arg("elastic", Bool(), doc="let the scheduler pick the core count in cpus"),
    Arg("trajectory", ID, doc="trajectory this action belongs to"),
    Arg("task", NAME, doc="task name (history estimator key)"),
    Arg("t1_s", POSITIVE_S, doc="inline elasticity: duration on one core"),
    Arg("eff", _dop_map(FRACTION), doc="inline elasticity: efficiency per dop"),
    Arg("env_vars", MapOf(Str(allow_empty=True)), doc="environment variables of the command"),
    Arg("stdin", Bytes(), doc="standard input of the command (else empty)"),
    Arg("cwd", Str(), doc="working directory inside the environment (no '..')"),
    Arg("session", ID, doc="run in this open shell session (its env; see session.open)"),
    Arg(
        "files",
        MapOf(Bytes()),
        doc="files written into the environment before the command runs (path -> bytes, "
        "paths relative to its root, no '..'; 8 MiB in all)",
    ),
    Arg(
        "fetch",
        ListOf(Str()),
        doc="paths read back after the command ends: result.files holds those that are "
        "regular files (8 MiB in all)",
    ),
    Arg(
        "queue_timeout_s",
        POSITIVE_S,
        doc="most it may wait to start (cores, memory, its environment), then outcome "
        "timeout; unset: timeout_s bounds the wait and the run together",
    ),
    REF_ARG,
    Arg("job", NAME, doc="the job it belongs to (fair share across jobs; default 'default')"),
    Arg(
        "api",
        NAME,
        doc="hold one slot of this API (an [[api]] of the config) while it runs: it starts "
        "only when its cores and a slot are both free, and gives both back at its end",
    ),
)

CANCEL_RESULT: Final = (
    "action_id: str",
    "cancelled: bool",  # this cancel (or an earlier one) ended it
    "state: str",  # done (a running exec or call is answered once it has ended)
    "outcome: str|null",  # its final outcome once done
)


# ``cancel`` with ``job`` and ``all``: every action of the job it cancelled or found running
CANCEL_JOB_RESULT: Final = (
    "job: str",
    "actions: [{action_id, cancelled, state, outcome}]",  # one per action, as cancel's result
)


def _check_cancel(args: Mapping[str, Any]) -> None:
    given = [key for key in ("id", "ref", "job") if args.get(key) is not None]
    if len(given) != 1:
        raise BadRequest("id: give exactly one of id (the action id), ref, or job with all")
    if given == ["job"] and args.get("all") is not True:
        raise BadRequest("all: required (true) with job: it cancels every action of the job")
    if args.get("all") is not None and given != ["job"]:
        raise BadRequest("all: only with job (give job and all, without id or ref)")


_STATUS_FIELDS: Final = (
    "queued: int",
    "waiting_env: int",  # actions waiting for their environment (created, or memory)
    "waiting_mem: int",  # environments waiting for memory
    "mem_wait: str|null",  # what the first of them needs ("memory: needs 1 GiB, 0.3 GiB free")
    "running: int",
    "environments: int",
    "leases: int",
    "passes: int",
    "recent: map[kind -> {count, queue_s, exec_s, act_s}]",
    "pools: map[pool -> {capacity, free}]",
    "version: str",
    "uptime_s: float",
    "backend: str",
    "socket: str",
    "nodes: int",
    "clients: int",
    "core: str",  # "compiled" (mypyc) or "interpreted": where the scheduling core runs from
)

SERVICE_RUNTIMES: Final = ("torch", "http")
# One service as `service.register` and `service.list` describe it (the shape, plus
# the bytes moved, evictions, the module's measured size and the last load error).
SERVICE_FIELDS: Final = (
    "name: str",
    "runtime: str",
    "mem_gb: float",
    "gpus: [int]",
    "eff: str|null",
    "min_resident: int",
    "warm: int",
    "replicas: [{gpus, state, node, restores, ...}]",
    "calls: int",
    "max_batch: int",
    "batches: int",
    "batched_calls: int",
    "restores: int",
    "restore_s_total: float",
    "restore_bytes: int",
    "evictions: int",
    "module_bytes: int|null",
    "error: str|null",
)
_GPU_COUNT = Int(min=1)

_SERVICE_ARGS: Final = (
    Arg("name", NAME, True, "service name: 1-64 of letters, digits, '_.-'"),
    Arg("runtime", Enum(SERVICE_RUNTIMES), True, "torch: a module in a worker; http: a server"),
    Arg("mem_gb", Number(min=0, exclusive=True, unit="GB"), True, "state of one instance"),
    Arg(
        "gpus",
        OneOf((_GPU_COUNT, ListOf(_GPU_COUNT, min_len=1))),
        doc="GPUs per instance: a count or the allowed counts (1, 2, 4, 8; default 1)",
    ),
    Arg("entry", NAME, doc="torch: MODULE:FACTORY; FACTORY() returns the module"),
    Arg("path", NAME, doc="torch: absolute directory added to the worker's import path"),
    Arg("cmd", NAME, doc="http: server command line with {port}"),
    Arg("route", NAME, doc="http: path calls are POSTed to"),
    Arg("api", NAME, doc="http: sleep/wake flavour (vllm, sglang)"),
    Arg("env", MapOf(Str(allow_empty=True)), doc="environment variables of the replicas"),
    Arg(
        "eff",
        OneOf((Str(), MapOf(Number(min=0, exclusive=True), key_pattern=r"^[0-9]+$"))),
        doc="speed-up per GPU count: '1:1,2:1.8' or {\"2\": 1.8}; counts in gpus",
    ),
    Arg("max_batch", Int(min=1), doc="calls merged into one forward pass, at most (default 1)"),
    Arg(
        "batch_window_ms",
        Number(min=0, unit="ms"),
        doc="how long a batch that is not full waits for more calls (default 0)",
    ),
    Arg("min_resident", Int(min=0), doc="replicas kept on GPUs when there is room (default 0)"),
)


OPS: Final[dict[str, Op]] = {
    op.name: op
    for op in (
        Op("ping", "liveness check", result=("pong: true", "version: str")),
        Op("status", "daemon summary: uptime, capacity, usage, counts", result=_STATUS_FIELDS),
        Op(
            "nodes",
            "nodes with capacity, free resources and heartbeat age; each row has name, "
            "state (ready|draining|lost), cores, free_cores, mem_gb, envs, running, "
            "heartbeat_age_s",
            result=("nodes: [map]",),
        ),
        Op(
            "node.drain",
            "stop placing new trajectories on a node (its environments keep working)",
            (Arg("name", NAME, True),),
            result=("name: str", "draining: bool"),
            errors=("not_found",),
            operator_only=True,
        ),
        Op(
            "node.undrain",
            "place new trajectories on a drained node again",
            (Arg("name", NAME, True),),
            result=("name: str", "draining: bool"),
            errors=("not_found",),
            operator_only=True,
        ),
        Op(
            "node.lost",
            "declare a node lost now, as a missed heartbeat timeout would: its running "
            "actions end infra_error, its environments are lost (for a monitor that knows "
            "the host is gone, such as `tangramctl ray`; served on the coordinator's own "
            "socket only). A node that is in fact alive reconnects and joins afresh",
            (
                Arg("name", NAME, True),
                Arg("why", Str(), doc="the reason, for the node's actions and the log"),
            ),
            result=("name: str", "already_lost: bool"),
            errors=("not_found", "unknown_op"),
            operator_only=True,
        ),
        Op(
            "node.forget",
            "forget a node name's credential, so that a join token may join that name "
            "again (a reinstalled host); a node connected under it is declared lost first "
            "(served on the coordinator's own socket only)",
            (Arg("name", NAME, True),),
            result=("name: str", "forgotten: bool"),
            errors=("unknown_op",),
            operator_only=True,
        ),
        Op(
            "cluster.join",
            "what a new host needs to join this coordinator (served by the coordinator)",
            (Arg("rotate", Bool(), doc="replace the join token first (joined nodes stay)"),),
            result=("coordinator: str", "token: str", "ca_sha256: str"),
            errors=("unknown_op",),
            operator_only=True,
        ),
        Op(
            "queue",
            "waiting and running actions (a waiting one says what it waits for), and the "
            "environments waiting for memory; a non-operator sees its own, and in `others` "
            "how many of each it does not",
            result=("waiting: [map]", "running: [map]", "envs: [map]", "others: map"),
        ),
        Op(
            "story",
            "what happened to one action, environment, session or lease: every transition "
            "with its time and cause (bounded log)",
            (
                Arg(
                    "action_id",
                    ID,
                    True,
                    doc="the record's id: action, call, lease, environment or session",
                ),
            ),
            result=(
                "action_id: str",
                "id: str",
                "kind: str",
                "job: str|null",
                "state: str",
                "waiting_for: str|null",
                "outcome: str|null",
                "events: [map]",
            ),
            errors=("not_found",),
        ),
        Op(
            "env.open",
            "open a persistent environment (sandbox)",
            (
                Arg("image", NAME, doc="container image (default from config)"),
                Arg("mem", BYTES, doc="memory limit"),
                Arg("trajectory", ID, doc="trajectory owning the environment"),
                Arg(
                    "timeout_s",
                    POSITIVE_S,
                    doc="most it may wait for memory, then error timeout (unset: no limit)",
                ),
            ),
            result=("id: str", "node: str"),
            errors=("infra_error", "unschedulable", "timeout"),
        ),
        Op(
            "env.close",
            "close an environment and free its resources",
            (Arg("id", ID, True),),
            result=("closed: bool",),
            errors=("not_found", "infra_error"),
        ),
        Op(
            "env.fork",
            "new environments that start from a copy-on-write snapshot of an open one's "
            "files (processes are not copied; refused while it runs an action or has a "
            "session open); each child holds the source's memory, on its node",
            (
                Arg("env", ID, True, doc="the source environment"),
                Arg("n", Int(min=1), doc=f"how many children, 1 to {MAX_FORK} (default 1)"),
            ),
            result=("ids: [str]", "fork_s: float"),
            errors=("not_found", "bad_request", "unschedulable", "infra_error"),
            check=_check_fork,
        ),
        Op(
            "env.reset",
            "put an environment's files back as they were at its fork point (or, never "
            "forked, at its opening); refused while it runs an action or has a session open",
            (Arg("env", ID, True, doc="the environment"),),
            result=("id: str", "reset: bool"),
            errors=("not_found", "bad_request", "infra_error"),
        ),
        Op(
            "env.list",
            "open environments (a non-operator's own; `others` counts the rest)",
            result=("envs: [map]", "others: int"),
        ),
        Op(
            "env.put",
            "write a file into an environment (with tar: extract a tar stream into a directory),"
            " as its user: what it makes is the environment's user's",
            (
                Arg("id", ID, True),
                Arg("path", Str(), True, doc=PATH_DOC),
                Arg("data", Bytes(MAX_TRANSFER), True, doc="the file's bytes, or a tar stream"),
                Arg("tar", Bool(), doc="data is a tar stream to extract at path (a directory)"),
            ),
            result=("path: str", "bytes: int"),
            errors=("not_found", "bad_request", "infra_error"),
            check=_check_env_path,
        ),
        Op(
            "env.get",
            "read a file from an environment (a directory comes as a tar stream of its contents),"
            " as its user",
            (
                Arg("id", ID, True),
                Arg("path", Str(), True, doc=PATH_DOC),
            ),
            result=("path: str", "data: bytes", "tar: bool"),
            errors=("not_found", "bad_request", "infra_error"),
            check=_check_env_path,
        ),
        Op(
            "session.open",
            "start a persistent shell in an open environment; exec with session runs in it",
            (Arg("env", ID, True, doc="the environment"),),
            result=("id: str", "env: str"),
            errors=("not_found", "infra_error"),
        ),
        Op(
            "session.interrupt",
            "interrupt the command running in a session (the shell stays)",
            (Arg("id", ID, True),),
            result=("interrupted: bool",),
            errors=("not_found",),
        ),
        Op(
            "session.close",
            "end a session's shell",
            (Arg("id", ID, True),),
            result=("closed: bool",),
            errors=("not_found",),
        ),
        Op(
            "exec",
            "run one command as an exec action; the outcome ("
            + "|".join(OUTCOMES)
            + ") is data, not an error",
            _EXEC_ARGS,
            result=EXEC_RESULT_FIELDS,
            errors=("not_found", "unschedulable", "infra_error", "shutting_down"),
        ),
        Op(
            "cancel",
            "cancel an exec or call: a waiting one leaves the queue and never runs; a running "
            "exec is killed with everything it started (its process group and cgroup) and "
            "answered when it is gone. Its outcome is cancelled, which its own client gets "
            "too (a running exec that had already exited 0 stays ok). An action that had "
            "already ended is answered with its outcome (cancelled false), not an error. A "
            "running GPU call is stopped: its replica's workers are killed (its next call "
            "restarts it), its GPUs stay held until that is done, and it is answered then. "
            "A call riding another's forward pass (a batch's rider) is detached at once, "
            "the pass running on for the others; cancelling the pass's leader (the call "
            "that holds the GPUs) stops the whole pass, its riders ending cancelled too. "
            "On a cluster the coordinator has the call's node stop it (stop_call) and "
            "answers once the node confirms. Only the user who submitted "
            "it, or root, may cancel it: another user's action is not_found. A lease is "
            "given back with lease.release. With job and all: every queued and running exec "
            "and call of that job the caller may see (an operator: all of them; others: "
            "their own) in one step, answered once the running ones among them are gone",
            (
                Arg("id", ID, doc="the action id (`action_id` of queue, story, exec's result)"),
                Arg(
                    "ref",
                    ID,
                    doc="the exec's or call's `ref`, on the connection that sent that request",
                ),
                Arg("job", NAME, doc="cancel this job's actions (with all; not with id or ref)"),
                Arg("all", Bool(), doc="true: every action of job (required with job)"),
            ),
            result=CANCEL_RESULT,
            variant=("with job and all", CANCEL_JOB_RESULT),
            errors=("not_found", "bad_request"),
            check=_check_cancel,
        ),
        Op(
            "lease.acquire",
            "take one unit of an API quota",
            (
                Arg("api", NAME, True),
                Arg("ttl_s", POSITIVE_S, doc="auto-release after this long"),
                Arg(
                    "policy", Enum(LEASE_POLICIES), doc="when the quota is exhausted (default wait)"
                ),
                Arg("deadline_s", SECONDS, doc="give up after this long (policy 'deadline')"),
                Arg("job", NAME, doc="the job it belongs to (fair share; default 'default')"),
            ),
            result=("lease_id: str", "api: str", "ttl_s: float", "queue_s: float"),
            errors=("not_found", "quota_exceeded", "timeout"),
            check=_check_lease_acquire,
        ),
        Op(
            "lease.release",
            "give a lease back (state released), or withdraw one still waiting (state "
            "withdrawn: it leaves the queue and its lease.acquire fails not_found); a lease "
            "that had just ended answers released false and its state (expired, failed)",
            (Arg("lease_id", ID, True),),
            result=("released: bool", "state: str"),
            errors=("not_found",),
        ),
        Op(
            "lease.renew",
            "extend a lease: it now expires ttl_s from now (a waiting lease gets ttl_s when "
            "granted)",
            (
                Arg("lease", ID, True, "the lease id (lease.acquire's lease_id)"),
                Arg("ttl_s", POSITIVE_S, True, "its new time to live, from now"),
            ),
            result=("lease_id: str", "ttl_s: float", "state: str"),
            errors=("not_found", "bad_request"),
        ),
        Op("api.list", "API endpoints with quota and usage", result=("apis: [map]",)),
        Op(
            "jobs",
            "the jobs (configured [[job]] or seen on an action): weight, priority, caps, "
            "queued and running actions, cores and GPUs held, share (dominant share over "
            "weight), done (its actions ended) and recent ACT p50/p99 (null before one "
            "finished; done and the ACTs survive a restart)",
            result=("jobs: [map]",),
        ),
        Op(
            "profile.save",
            "store a measured elasticity profile",
            (
                Arg("name", NAME, True),
                Arg("dop", _dop_map(SECONDS), True, doc="median duration per dop"),
                Arg("t1_s", POSITIVE_S, True, doc="duration on one core"),
                Arg("eff", _dop_map(FRACTION), True, doc="efficiency per dop"),
                Arg("speedup", _dop_map(FRACTION), True, doc="speedup per dop"),
                Arg("elastic", Bool(), True, doc="worth scheduling elastically"),
            ),
            result=("name: str", "saved: bool"),
            errors=("bad_request",),
            operator_only=True,
        ),
        Op(
            "profile.get",
            "one stored profile",
            (Arg("name", NAME, True),),
            result=PROFILE_FIELDS,
            errors=("not_found",),
        ),
        Op("profile.list", "stored profiles", result=("profiles: [map]",)),
        Op(
            "service.register",
            "register a GPU model service and load its host backup; persists in the state dir",
            _SERVICE_ARGS,
            result=SERVICE_FIELDS,
            errors=("bad_request", "infra_error", "shutting_down"),
            operator_only=True,
        ),
        Op(
            "service.list",
            "registered GPU services with their replicas and restore counts",
            result=("services: [map]",),
        ),
        Op(
            "service.set_eff",
            "give a registered service a new speed-up table (what `tangramctl service profile`"
            " measured): calls submitted from then on are scheduled by it; persists",
            (
                Arg("name", NAME, True, "the service"),
                Arg(
                    "eff",
                    OneOf((Str(), MapOf(Number(min=0, exclusive=True), key_pattern=r"^[0-9]+$"))),
                    True,
                    "speed-up per GPU count: '1:1,2:1.8' or {\"2\": 1.8}; counts in gpus",
                ),
            ),
            result=SERVICE_FIELDS,
            errors=("not_found", "bad_request"),
            operator_only=True,
        ),
        Op(
            "service.remove",
            "remove a service: its queued calls end rejected, its replicas stop",
            (Arg("name", NAME, True),),
            result=("name: str", "removed: bool", "rejected: int"),
            errors=("not_found",),
            operator_only=True,
        ),
        Op(
            "call",
            "call a service as one GPU action; the outcome ("
            + "|".join(OUTCOMES)
            + ") is data, not an error",
            (
                Arg("name", NAME, True, "the service"),
                Arg("payload", MapOf(AnyType()), True, "handed to the service's handler"),
                Arg(
                    "timeout_s", POSITIVE_S, doc="limit of the handler's run (default from config)"
                ),
                Arg("job", NAME, doc="the job it belongs to (fair share; default 'default')"),
                Arg(
                    "gpus",
                    _GPU_COUNT,
                    doc="run at exactly this many GPUs, one of the service's counts "
                    "(default: the scheduler picks, by the service's eff)",
                ),
                REF_ARG,
            ),
            result=CALL_RESULT_FIELDS,
            errors=("not_found", "unschedulable", "shutting_down"),
        ),
    )
}


def check_values(where: str, noun: str, declared: Iterable[Arg], values: Mapping[str, Any]) -> None:
    """Each declared value present when required and of its type, else BadRequest naming
    ``where`` and the value (``noun``: what a missing one is called). ``None`` means "not
    given". Shared by the op table's args and the link table's message fields."""
    for arg in declared:
        value = values.get(arg.name)
        if value is None:
            if arg.required:
                raise BadRequest(f"{where}: missing {noun} {arg.name!r} ({arg.type.doc})")
            continue
        arg.type.check(f"{where}: {arg.name}", value)


def validate_args(op: str, args: Mapping[str, Any]) -> None:
    """Check ``args`` against the op table; raise UnknownOp or BadRequest naming the field.

    A ``null`` value for an optional arg means "not given".
    """
    spec = OPS.get(op)
    if spec is None:
        raise UnknownOp(f"unknown op {op!r}")
    check_values(op, "required arg", spec.args, args)
    unknown = [name for name in args if name not in spec.by_name]
    if unknown:
        allowed = ", ".join(spec.by_name) or "none"
        raise BadRequest(f"{op}: unknown arg(s) {sorted(unknown)} (allowed: {allowed})")
    if spec.check is not None:
        try:
            spec.check(args)
        except BadRequest as exc:
            raise BadRequest(f"{op}: {exc.message}") from None


# --------------------------------------------------------------------------- sizes

_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtp]?)(i?b?)\s*", re.IGNORECASE)
_SIZE_SHIFT: Final = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40, "p": 50}


def parse_size(text: str | int) -> int:
    """Bytes from ``"512M"``, ``"2GiB"``, ``"1.5g"`` or a plain int (binary units).

    Raises BadRequest for anything else (negative, NaN, unknown suffix).
    """
    if isinstance(text, bool):
        raise BadRequest(f"size: expected bytes or a size like '512M', got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise BadRequest(f"size: negative size {text}")
        return text
    if not isinstance(text, str):
        raise BadRequest(f"size: expected bytes or a size like '512M', got {type(text).__name__}")
    match = _SIZE.fullmatch(text)
    if match is None:
        raise BadRequest(f"size: expected bytes or a size like '512M', got {text!r}")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * (1 << _SIZE_SHIFT[unit]))


# --------------------------------------------------------------------------- docs


def render_markdown() -> str:
    """The op table as Markdown (the op section of ``docs/protocol.md``)."""
    lines: list[str] = []
    for op in OPS.values():
        lines += [f"### `{op.name}`", "", op.doc[0].upper() + op.doc[1:] + ".", ""]
        if op.args:
            lines += ["| arg | type | required | meaning |", "|---|---|---|---|"]
            for arg in op.args:
                typ = arg.type.doc.replace("|", "\\|")
                lines.append(
                    f"| `{arg.name}` | {typ} | {'yes' if arg.required else 'no'} | {arg.doc} |"
                )
        else:
            lines.append("Args: none.")
        lines += ["", f"Result: `{op.result_doc}`", ""]
        if op.variant is not None:
            when, fields = op.variant
            lines += [f"Result {when}: `{{{', '.join(fields)}}}`", ""]
        codes = (*op.errors, "forbidden") if op.operator_only else op.errors
        errors = ", ".join(f"`{code}`" for code in codes) or "none beyond the common ones"
        lines += [f"Errors: {errors}.", ""]
        if op.operator_only:
            lines += ["Operators only (see Roles).", ""]
    return "\n".join(lines)

"""The link table: every message between a cluster node and its coordinator, declared once.

The link carries the client protocol's frames (a 4-byte length, then one msgpack map);
each message is a map whose ``"t"`` key names it. :data:`LINK_MESSAGES` says, for each
name, who sends it, what it is for and its fields, each declared as an op's argument is
(an ``ops.Arg``: name, type, required, doc) and checked by the same ``ops.check_values``.
From it:

- :func:`make_message` builds a message to send, refusing an undeclared name or field (a
  typo fails where it is made, not on the peer);
- :func:`check_message` checks a received map in full (name, required fields, types);
- :func:`render_markdown` writes the "Link messages" section of ``docs/protocol.md``.

:data:`PEER_MESSAGES` declares, the same way, the two-message exchange on a node's input
port: another node pulls the stdin and files of an exec that the node it came from kept
(``req``'s ``ticket``, ``run_exec``'s ``fetch``), so they go node to node, never through
the coordinator (:func:`make_peer_message`, ``check_message(msg, PEER_MESSAGES)``).

Each end dispatches what it receives after the join through a table from message name to
handler (``RECEIVES`` in ``tangramd.cluster.node`` and ``tangramd.cluster.coordinator``);
``tests/test_link_table.py`` holds those tables, and every message each end builds, to
this one. ``null`` for an optional field
means "not given".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from tangram.protocol.errors import BadRequest
from tangram.protocol.ops import (
    AnyType,
    Arg,
    Bool,
    Bytes,
    Enum,
    Int,
    ListOf,
    MapOf,
    Number,
    Str,
    check_values,
)

Sender = Literal["coordinator", "node", "both", "puller", "holder"]
End = Literal["coordinator", "node"]

# The exec args that a node keeps when it forwards an exec (``req``'s ``held``): when the
# exec runs on that node, its ``run_exec`` leaves them out (``held``) and the node puts
# them back, so they cross the link once, not there and back.
EXEC_INPUT: Final = ("stdin", "files")
# An exec's input of at least this many bytes, bound for an environment that is not on
# the client's node, stays on that node too (``req``'s ``ticket``): the node that runs it
# pulls it from there (``run_exec``'s ``fetch``). Below it, the input rides in the ``req``:
# a pull opens a connection (a TLS handshake) of its own, which costs more time than
# relaying a small input costs the coordinator (docs/architecture.md §4.3).
PULL_MIN_BYTES: Final = 256 << 10
# The most a pull request (``pull``) may weigh: a ticket, nothing more.
PULL_REQUEST_MAX: Final = 4 << 10


@dataclass(frozen=True, slots=True)
class LinkMessage:
    """One message kind: who sends it, whether it belongs to the join handshake (read in
    order, before anything else) or to the joined link (dispatched by name), its fields."""

    name: str
    sender: Sender
    doc: str
    fields: tuple[Arg, ...] = ()
    join: bool = False
    field_names: frozenset[str] = field(init=False, repr=False, compare=False)
    required: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "field_names", frozenset(f.name for f in self.fields))
        object.__setattr__(self, "required", frozenset(f.name for f in self.fields if f.required))

    def sent_by(self, end: End) -> bool:
        return self.sender in (end, "both")

    def received_by(self, end: End) -> bool:
        return self.sender != end


# --------------------------------------------------------------------------- field types

ID = Str()
TEXT = Str(allow_empty=True)
BYTES = Int(min=0, unit="bytes")
UID_GID = ListOf(Int(min=0))  # [uid, gid]
IDS = ListOf(Str())
MAP = MapOf(AnyType())
ERROR_TEXT = Str(allow_empty=True)


def _key(prefix: str, what: str) -> Arg:
    return Arg(
        "key",
        ID,
        True,
        f"`{prefix}:<{what}>`: the outcome's key, kept by the node until the coordinator's"
        " `ack` of it",
    )


_RUN_AS = Arg("run_as", UID_GID, doc="[uid, gid] to run as (default: the environment's owner)")
_ENV_ID = Arg("env_id", ID, True, "the environment")
_SESSION_ID = Arg("session_id", ID, True, "the session")
_ACTION_ID = Arg("action_id", ID, True, "the exec action")
_SERVICE = Arg("name", ID, True, "the service")
_GPUS = Arg("gpus", ListOf(Int(min=0), min_len=1), True, "the node's local GPU ids (one chunk)")

# --------------------------------------------------------------------------- the table

LINK_MESSAGES: Final[dict[str, LinkMessage]] = {
    m.name: m
    for m in (
        # ------------------------------------------------------------- the join
        LinkMessage(
            "ca",
            "coordinator",
            "the first message on a link: the CA the node checks against its pinned hash"
            " before any secret leaves it",
            (
                Arg("pem", TEXT, True, "the coordinator's CA certificate (empty: --insecure)"),
                Arg("version", Str(), doc="the coordinator's tangram version"),
            ),
            join=True,
        ),
        LinkMessage(
            "reject",
            "node",
            "the coordinator failed the node's check (pin, certificate): why, then the node"
            " closes and gives up",
            (Arg("reason", TEXT, True, "what failed"),),
            join=True,
        ),
        LinkMessage(
            "hello",
            "node",
            "who the node is, what it offers, what it holds and what it still owes",
            (
                Arg("name", ID, True, "the node's name (1-64 printable characters)"),
                Arg("version", Str(), True, "the node's tangram version"),
                Arg("cores_by_numa", ListOf(ListOf(Int(min=0))), True, "core ids per NUMA node"),
                Arg("mem_bytes", BYTES, True, "memory it offers"),
                Arg(
                    "gpus",
                    ListOf(MAP),
                    True,
                    "its GPUs: {name, mem_bytes, h2d_bytes_per_s, simulated}",
                ),
                Arg("backend", Str(), True, "its backend (process, docker)"),
                Arg("envs", IDS, True, "the environments it holds"),
                Arg("running", IDS, True, "the exec actions and service calls it still runs"),
                Arg("outbox", IDS, True, "keys of the outcomes it holds, not yet acknowledged"),
                Arg("credential", Str(), doc="the credential a welcome gave it earlier"),
                Arg("token", Str(), doc="the join token (its first join)"),
                Arg(
                    "input_addr",
                    Str(),
                    doc="`host:port` of its input port, where other nodes pull the input it"
                    " keeps (`req`'s `ticket`); absent: it keeps none for other nodes",
                ),
                Arg(
                    "input_pin",
                    Str(),
                    doc="`sha256:<hex>` of the key of the input port's TLS certificate (a"
                    " fresh self-signed one per start); absent with `--insecure` (plain TCP,"
                    " loopback only)",
                ),
            ),
            join=True,
        ),
        LinkMessage(
            "refused",
            "coordinator",
            "the join is refused: why, and whether to retry; then the coordinator closes",
            (
                Arg("reason", TEXT, True, "why"),
                Arg("retry", Bool(), True, "true: retry later (e.g. the name is in use)"),
            ),
            join=True,
        ),
        LinkMessage(
            "welcome",
            "coordinator",
            "the node has joined: its timings, and what it keeps of what it said it holds",
            (
                Arg("name", ID, True, "the node's name"),
                Arg("credential", Str(), doc="the credential to join with from now on"),
                Arg(
                    "heartbeat_s",
                    Number(min=0, exclusive=True, unit="seconds"),
                    True,
                    "how often the node sends `hb`",
                ),
                Arg(
                    "heartbeat_timeout_s",
                    Number(min=0, exclusive=True, unit="seconds"),
                    True,
                    "silence after which either end counts the other as gone",
                ),
                Arg("keep", IDS, True, "environments the node still owns; it removes the rest"),
                Arg("cancel", IDS, True, "actions the coordinator has ended; it kills them"),
                Arg(
                    "services",
                    ListOf(MAP),
                    doc="the GPU services registered (`ServiceSpec.to_json`), sent to a node"
                    " with GPUs: it loads each (replacing one it holds under another spec)"
                    " and removes any other",
                ),
                Arg(
                    "services_reset",
                    Bool(),
                    doc="the coordinator had lost this node and forgot its GPUs' residency:"
                    " the node evicts every replica it still holds",
                ),
            ),
            join=True,
        ),
        # ------------------------------------------------------------- the joined link
        LinkMessage(
            "hb",
            "both",
            "heartbeat: the node sends one every heartbeat_s and the coordinator answers each",
        ),
        LinkMessage("bye", "node", "the node is stopping: it is lost now, not after the timeout"),
        LinkMessage(
            "req",
            "node",
            "a request from a client of the node's socket, served by the coordinator's op handlers",
            (
                Arg("id", Int(), True, "the node's id for it, echoed in the `resp`"),
                Arg("conn", Int(), True, "the client connection it came on"),
                Arg("op", Str(), True, "the op (docs: Ops)"),
                Arg("args", MAP, True, "its args"),
                Arg(
                    "peer",
                    UID_GID,
                    doc="[uid, gid] of the client, as the node's socket saw it (SO_PEERCRED);"
                    " the node is the authority on it: the coordinator runs the request as"
                    ' that caller (`cpu.exec_user = "peer"`), as `tangramd up` does',
                ),
                Arg(
                    "held",
                    Bool(),
                    doc="an `exec` whose stdin and files the node keeps until its placement"
                    " or its answer (the coordinator may leave them out of a `run_exec` to it)",
                ),
                Arg(
                    "withheld",
                    Bool(),
                    doc="`held`, and `args` lack the stdin and files of an `exec` (or carry an"
                    " empty `data` for an `env.put`): the environment is on this node, so the"
                    " work runs here (`run_exec`'s or `transfer`'s `held`) or not at all;"
                    " with `ticket`, anywhere",
                ),
                Arg(
                    "ticket",
                    Str(),
                    doc="with `withheld`: the exec may run on any node (the put go to any"
                    " environment); a node elsewhere pulls the input (the data) from this"
                    " node's input port with this one-time secret (`run_exec`'s or"
                    " `transfer`'s `fetch`), so it never passes through the coordinator",
                ),
            ),
        ),
        LinkMessage(
            "resp",
            "coordinator",
            "the answer to a `req`",
            (
                Arg("id", Int(), True, "the `req`'s id"),
                Arg("ok", Bool(), True, "true: `result`; false: `error`"),
                Arg("result", AnyType(), doc="the op's result"),
                Arg("error", MAP, doc="{code, message}, as in a client response"),
            ),
        ),
        LinkMessage(
            "conn_closed",
            "node",
            "a client connection of the node's socket closed",
            (Arg("conn", Int(), True, "as in its `req`s"),),
        ),
        LinkMessage(
            "create_env",
            "coordinator",
            "create an environment (the node answers `env_created`)",
            (
                _ENV_ID,
                Arg("image", Str(), doc="its image (default: the backend's)"),
                Arg("mem", BYTES, doc="its memory limit"),
                Arg("owner", UID_GID, doc="[uid, gid] owning it"),
            ),
        ),
        LinkMessage(
            "remove_env",
            "coordinator",
            "remove an environment (the node answers `env_removed`)",
            (_ENV_ID,),
        ),
        LinkMessage(
            "run_exec",
            "coordinator",
            "run a placed exec action (the node answers `exec_done`)",
            (
                _ACTION_ID,
                Arg("env_id", ID, True, "the environment it runs in"),
                Arg("cores", ListOf(Int(min=0)), True, "the cores it is pinned to"),
                Arg("spec", MAP, True, "the exec's args (`ExecSpec.to_wire`)"),
                Arg("max_output", BYTES, True, "limit of stdout and of stderr"),
                _RUN_AS,
                Arg(
                    "reply",
                    MAP,
                    doc="{id, queue_s}: the exec came from this node's own client, request"
                    " `id`; the node answers it itself when the exec ends (see `exec_done`)",
                ),
                Arg(
                    "held",
                    Bool(),
                    doc="`spec` lacks its stdin and files: the node takes them from request"
                    " `reply.id`, which it holds (`req`'s `held`)",
                ),
                Arg(
                    "fetch",
                    MAP,
                    doc="{node, addr, pin, ticket}: `spec` lacks its stdin and files; the node"
                    " pulls them from node `node`'s input port `addr` (TLS, its certificate's"
                    " key hashing to `pin`) with `ticket` (Node to node, below), and ends the"
                    " exec `infra_error` if it cannot: it never runs without them",
                ),
            ),
        ),
        LinkMessage(
            "cancel_exec",
            "coordinator",
            "kill a running exec (a client's `cancel`): its process group and cgroup, all it"
            " started; its end comes back as its `exec_done`, which (and any answer the node"
            " gives its client itself) says `cancelled` unless the command had exited 0",
            (
                _ACTION_ID,
                Arg("session", Str(), doc="the exec runs in this shell session: interrupt it"),
            ),
        ),
        LinkMessage(
            "transfer",
            "coordinator",
            "put or get a file in an environment (the node answers `transfer_done`)",
            (
                Arg("tid", ID, True, "the transfer's id"),
                _ENV_ID,
                Arg("direction", Enum(("put", "get")), True, "into or out of the environment"),
                Arg("path", Str(), True, "inside the environment"),
                Arg("data", Bytes(), doc="what to put (a tar stream when `tar`)"),
                Arg("tar", Bool(), True, "a directory as a tar stream"),
                Arg("max_bytes", BYTES, True, "the most a get may return"),
                Arg(
                    "held",
                    Int(),
                    doc="a put whose `data` is the node's own: that of its request `held`"
                    " (`req`'s `withheld`), which it kept",
                ),
                Arg(
                    "fetch",
                    MAP,
                    doc="{node, addr, pin, ticket}: a put whose `data` another node kept"
                    " (`req`'s `ticket`): pulled as `run_exec`'s `fetch` is; if it cannot"
                    " be, the transfer fails `infra_error`, never writes an empty file",
                ),
            ),
        ),
        LinkMessage(
            "open_session",
            "coordinator",
            "start a shell session in an environment (the node answers `session_opened`)",
            (_SESSION_ID, _ENV_ID, _RUN_AS),
        ),
        LinkMessage(
            "interrupt_session",
            "coordinator",
            "interrupt what a session's shell runs (no answer)",
            (_SESSION_ID,),
        ),
        LinkMessage(
            "close_session",
            "coordinator",
            "end a session's shell (the node answers `session_closed`)",
            (_SESSION_ID,),
        ),
        LinkMessage(
            "load_service",
            "coordinator",
            "register a GPU service on the node (torch: its fork server runs the factory and"
            " makes the host backup); the node answers `service_loaded`. A node with GPUs"
            " gets each registration, and those made while it was away with its `welcome`",
            (Arg("spec", MAP, True, "the registration (`ServiceSpec.to_json`)"),),
        ),
        LinkMessage(
            "unload_service",
            "coordinator",
            "remove a GPU service from the node: its replicas stop, calls in them end"
            " `rejected` (the node answers `service_unloaded`)",
            (_SERVICE,),
        ),
        LinkMessage(
            "run_call",
            "coordinator",
            "carry out the gpu pool's restore plan on the node's GPUs (the evictions, then"
            " the restore, which the pool timed with the node's restore bandwidth) and run"
            " the call there, its riders in the same forward pass; the node answers one"
            " `call_done` per call, the riders' first, within the call's `timeout_s` plus"
            " `[gpu] restore_timeout_s` plus `[cluster] node_request_timeout_s`, else the node"
            " is drained as suspect and told to stop each call left (`stop_call`), which then"
            " fails `infra_error`",
            (
                Arg("action_id", ID, True, "the call that holds the GPUs"),
                _SERVICE,
                _GPUS,
                Arg(
                    "evicted",
                    ListOf(ListOf(AnyType())),
                    True,
                    "`[gpu, service, dop]`: the replicas to drop first (local GPU ids)",
                ),
                Arg("payload", MAP, True, "the call's payload"),
                Arg(
                    "timeout_s",
                    Number(min=0, exclusive=True, unit="seconds"),
                    True,
                    "limit of the handler's run",
                ),
                Arg(
                    "riders",
                    ListOf(ListOf(AnyType())),
                    doc="`[action_id, payload]` of the calls batched with it",
                ),
            ),
        ),
        LinkMessage(
            "stop_call",
            "coordinator",
            "stop a call past its deadline (the coordinator gave up on it): the node kills the"
            " workers of the replica running it (its riders' too: one forward pass) and frees"
            " their residency, as `tangramd up` does with a call past its timeout (the next"
            " call restarts the replica); a call still waiting there never runs. The node"
            " answers `call_stopped`; until then the call's GPUs stay held, and a node that"
            " has not answered within `[cluster] node_request_timeout_s` is lost",
            (Arg("action_id", ID, True, "the call (the `run_call`'s or a rider's)"),),
        ),
        LinkMessage(
            "warm_service",
            "coordinator",
            "restore a replica with no call (`min_resident`): the pool found the memory free"
            " there, so nothing is evicted (no answer)",
            (_SERVICE, _GPUS),
        ),
        LinkMessage(
            "env_created",
            "node",
            "outcome of a `create_env`",
            (
                _key("c", "env_id"),
                _ENV_ID,
                Arg("error", ERROR_TEXT, doc="why it failed (absent or null: created)"),
            ),
        ),
        LinkMessage(
            "env_removed",
            "node",
            "outcome of a `remove_env`",
            (_key("r", "env_id"), _ENV_ID),
        ),
        LinkMessage(
            "exec_done",
            "node",
            "outcome of a `run_exec`, sent in the turn the exec ends; the coordinator"
            " defers its `ack` to ride with its next message to that node",
            (
                _key("x", "action_id"),
                _ACTION_ID,
                Arg("result", MAP, True, "the `ExecResult` map"),
                Arg("env_lost", Bool(), True, "its environment is gone (infra_error)"),
                Arg("answered", Bool(), True, "the node answered the client (`reply`) itself"),
            ),
        ),
        LinkMessage(
            "exec_started",
            "node",
            "these `run_exec`s have started (a batch, sent at most every 50 ms; an exec that"
            " ended meanwhile is acknowledged by its `exec_done`): until then each has"
            " `[cluster] node_request_timeout_s`, from then on its `timeout_s` plus that"
            " much to end, else it fails `infra_error` and the node is drained as suspect",
            (Arg("action_ids", IDS, True, "the exec actions"),),
        ),
        LinkMessage(
            "transfer_done",
            "node",
            "outcome of a `transfer`",
            (
                _key("t", "tid"),
                Arg("tid", ID, True, "the `transfer`'s tid"),
                Arg("result", MAP, doc="the op's result map"),
                Arg("error", ListOf(Str(allow_empty=True)), doc="[code, message]"),
            ),
        ),
        LinkMessage(
            "session_opened",
            "node",
            "outcome of an `open_session`",
            (
                _key("so", "session_id"),
                _SESSION_ID,
                Arg("error", ERROR_TEXT, doc="why it failed (absent or null: open)"),
            ),
        ),
        LinkMessage(
            "session_closed",
            "node",
            "outcome of a `close_session`",
            (_key("sc", "session_id"), _SESSION_ID),
        ),
        LinkMessage(
            "service_loaded",
            "node",
            "outcome of a `load_service`",
            (
                _key("sl", "name"),
                _SERVICE,
                Arg("info", MAP, doc="its `service list` row on this node (loaded)"),
                Arg("error", ERROR_TEXT, doc="why it could not be loaded (absent or null: loaded)"),
                Arg(
                    "code",
                    Str(),
                    doc="with `error`: the registering client's error code (`bad_request`: the"
                    " spec or its module; `infra_error`: the node)",
                ),
            ),
        ),
        LinkMessage(
            "service_unloaded",
            "node",
            "outcome of an `unload_service`",
            (_key("su", "name"), _SERVICE),
        ),
        LinkMessage(
            "call_stopped",
            "node",
            "answer to a `stop_call`: the call runs on none of the node's GPUs now (the"
            " coordinator frees them); its `call_done`, if it ended meanwhile, is dropped",
            (
                _key("cs", "action_id"),
                Arg("action_id", ID, True, "the call named by the `stop_call`"),
                Arg(
                    "was",
                    Enum(("running", "waiting", "ended")),
                    True,
                    "the node's view when the stop came: its workers were killed, it had not"
                    " started (it never will), or it had ended already (its `call_done` sent)",
                ),
            ),
        ),
        LinkMessage(
            "call_done",
            "node",
            "outcome of one call of a `run_call`, sent as it ends; the coordinator defers its"
            " `ack` to ride with its next message to that node",
            (
                _key("cd", "action_id"),
                Arg("action_id", ID, True, "the call (the `run_call`'s or a rider's)"),
                Arg(
                    "outcome",
                    Enum(("ok", "failed", "timeout", "rejected", "infra_error")),
                    True,
                    "how it ended",
                ),
                Arg("result", MAP, doc="the handler's answer (`ok`)"),
                Arg("error", ERROR_TEXT, doc="why it is not `ok`"),
                Arg("exec_s", Number(min=0, unit="seconds"), True, "the handler's run"),
                Arg("restore_s", Number(min=0, unit="seconds"), True, "the evictions and restore"),
                Arg(
                    "h2d_bytes_per_s",
                    Number(min=0, exclusive=True),
                    doc="the restore's measured bandwidth (real GPUs only): it feeds the"
                    " pool's restore-time estimate for this node",
                ),
                Arg("batch", Int(min=1), True, "calls in its forward pass"),
            ),
        ),
        LinkMessage(
            "services_state",
            "node",
            "the node's GPU services as `service list` shows them, one row per service with"
            " its replicas here: sent after each change (a load, a call, a warm-up), the"
            " latest replacing the one before (no `ack`)",
            (Arg("services", ListOf(MAP), True, "the rows"),),
        ),
        LinkMessage(
            "ack",
            "coordinator",
            "the coordinator has an outcome: the node forgets it",
            (Arg("key", ID, True, "the outcome's key"),),
        ),
    )
}


# The exchange on a node's input port (see the module doc): per pull, one message each
# way; the puller keeps the connection for its next pull to that node (the holder closes
# it after a minute idle, or after a malformed pull).
PEER_MESSAGES: Final[dict[str, LinkMessage]] = {
    m.name: m
    for m in (
        LinkMessage(
            "pull",
            "puller",
            "a pull: the ticket of the input the puller was told to fetch (`run_exec`'s or"
            " `transfer`'s `fetch`); the holder answers `input` or `gone`, each ticket once",
            (Arg("ticket", Str(), True, "`run_exec`'s `fetch.ticket`"),),
        ),
        LinkMessage(
            "input",
            "holder",
            "the exec's stdin and files (or the put's data), as its client sent them; the"
            " holder forgets them",
            (
                Arg("stdin", Bytes(), doc="an exec's stdin"),
                Arg("files", MapOf(Bytes()), doc="an exec's carried files, path: contents"),
                Arg("data", Bytes(), doc="an `env.put`'s data"),
            ),
        ),
        LinkMessage(
            "gone",
            "holder",
            "the holder has no input under that ticket (taken, answered, its link to the"
            " coordinator dropped meanwhile), or the pull was malformed: the exec ends"
            " `infra_error`",
            (Arg("reason", TEXT, True, "why"),),
        ),
    )
}


def sent_by(end: End) -> frozenset[str]:
    """The names of the messages ``end`` sends."""
    return frozenset(name for name, m in LINK_MESSAGES.items() if m.sent_by(end))


def received_by(end: End, *, join: bool | None = None) -> frozenset[str]:
    """The names of the messages ``end`` receives (``join``: only those of the handshake,
    or only those after it)."""
    return frozenset(
        name
        for name, m in LINK_MESSAGES.items()
        if m.received_by(end) and (join is None or m.join == join)
    )


# --------------------------------------------------------------------------- build, check


def make_message(name: str, /, **fields: Any) -> dict[str, Any]:
    """``{"t": name, **fields}``; ValueError for an undeclared message, a field it does not
    declare or a required field left out (a bug of the sender, not a wire error)."""
    return _make(LINK_MESSAGES, name, fields)


def make_peer_message(name: str, /, **fields: Any) -> dict[str, Any]:
    """As :func:`make_message`, for a message of a node's input port (``PEER_MESSAGES``)."""
    return _make(PEER_MESSAGES, name, fields)


def _make(table: Mapping[str, LinkMessage], name: str, fields: dict[str, Any]) -> dict[str, Any]:
    spec = table.get(name)
    if spec is None:
        raise ValueError(f"undeclared link message {name!r}")
    if not spec.field_names.issuperset(fields) or not spec.required.issubset(fields):
        unknown = sorted(set(fields) - spec.field_names)
        missing = sorted(spec.required - set(fields))
        raise ValueError(f"link message {name!r}: unknown fields {unknown}, missing {missing}")
    return {"t": name, **fields}


def check_message(
    msg: Mapping[str, Any], table: Mapping[str, LinkMessage] = LINK_MESSAGES
) -> LinkMessage:
    """The declaration of a received message (of ``table``: the link's, or a node's input
    port's), once it is checked in full: raise BadRequest naming what is wrong (an unknown
    name, a missing, unknown or mistyped field)."""
    name = msg.get("t")
    spec = table.get(name) if isinstance(name, str) else None
    if spec is None:
        raise BadRequest(f"unknown link message {str(name)[:40]!r}")
    check_values(spec.name, "field", spec.fields, msg)
    unknown = sorted(k for k in msg if k != "t" and k not in spec.field_names)
    if unknown:
        raise BadRequest(f"{spec.name}: unknown field(s) {unknown}")
    return spec


# --------------------------------------------------------------------------- docs

_SENDER_DOC: Final = {
    "coordinator": "coordinator → node",
    "node": "node → coordinator",
    "both": "both ways",
    "puller": "pulling node → holding node",
    "holder": "holding node → pulling node",
}


def render_markdown() -> str:
    """The link table as Markdown (the "Link messages" section of ``docs/protocol.md``,
    below its introduction)."""
    lines: list[str] = []
    sections = (
        ("The join", [m for m in LINK_MESSAGES.values() if m.join]),
        ("The joined link", [m for m in LINK_MESSAGES.values() if not m.join]),
        ("Node to node: a node's input port", list(PEER_MESSAGES.values())),
    )
    for title, messages in sections:
        lines += [f"### {title}", ""]
        for m in messages:
            doc = m.doc[0].upper() + m.doc[1:] + "."
            lines += [f"#### `{m.name}` ({_SENDER_DOC[m.sender]})", "", doc, ""]
            if m.fields:
                lines += ["| field | type | required | meaning |", "|---|---|---|---|"]
                for f in m.fields:
                    typ = f.type.doc.replace("|", "\\|")
                    lines.append(
                        f"| `{f.name}` | {typ} | {'yes' if f.required else 'no'} | {f.doc} |"
                    )
            else:
                lines.append("Fields: none.")
            lines.append("")
    return "\n".join(lines)

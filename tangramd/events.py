"""Events fed to ``Core.handle`` and the commands it returns (small frozen values).

``token`` identifies a pending client request (the executor maps it to a reply future).
Every command carries ``cause``: the stimulus id the core gave the event that produced it
(one id per ``handle`` call, also written into the stories), so a log line of the executor
can be traced back to the event that caused it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tangram.pools.gpu import Eviction
from tangram.protocol.results import CallSpec, ExecResult, ExecSpec
from tangramd.services.spec import ServiceSpec


@dataclass(frozen=True, slots=True)
class Event:
    pass


# ---------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class SubmitExec(Event):
    spec: ExecSpec
    token: int | None = None
    conn: int | None = None
    peer: tuple[int, int] | None = None  # (uid, gid) of the client (SO_PEERCRED)


@dataclass(frozen=True, slots=True)
class OpenEnv(Event):
    token: int | None = None
    image: str | None = None
    mem: int | None = None
    trajectory: str | None = None
    conn: int | None = None
    peer: tuple[int, int] | None = None
    timeout_s: float | None = None  # the most it may wait for memory (then error timeout)


@dataclass(frozen=True, slots=True)
class CloseEnv(Event):
    token: int | None = None
    env_id: str = ""
    peer: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class ForkEnv(Event):
    """``env.fork``: ``n`` new environments from a copy-on-write snapshot of ``env_id``."""

    token: int | None = None
    env_id: str = ""
    n: int = 1
    peer: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class ResetEnv(Event):
    """``env.reset``: ``env_id``'s files back to its fork point (or its opening)."""

    token: int | None = None
    env_id: str = ""
    peer: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class EnvCreated(Event):
    env_id: str = ""
    error: str | None = None  # None: created


@dataclass(frozen=True, slots=True)
class EnvRemoved(Event):
    env_id: str = ""


@dataclass(frozen=True, slots=True)
class ExecFinished(Event):
    action_id: str
    result: ExecResult
    env_lost: bool = False  # the backend no longer has the environment


@dataclass(frozen=True, slots=True)
class AcquireLease(Event):
    token: int | None = None
    api: str = ""
    ttl_s: float | None = None
    policy: str | None = None
    deadline_s: float | None = None
    conn: int | None = None
    job: str | None = None  # the job it belongs to (None: "default")


@dataclass(frozen=True, slots=True)
class ReleaseLease(Event):
    token: int | None = None
    lease_id: str = ""


@dataclass(frozen=True, slots=True)
class RenewLease(Event):
    """``lease.renew``: the lease now expires ``ttl_s`` from now."""

    token: int | None = None
    lease_id: str = ""
    ttl_s: float = 0.0


@dataclass(frozen=True, slots=True)
class CancelAction(Event):
    """``cancel``: end an exec or call, by its id or by the ``ref`` its exec or call
    carried on connection ``conn``; ``peer`` must own it (or be root). With ``job``: every
    queued and running exec and call of that job ``peer`` owns (all of them when
    ``everyone``, an operator's cancel)."""

    token: int | None = None
    action_id: str | None = None
    ref: str | None = None
    conn: int | None = None
    peer: tuple[int, int] | None = None
    job: str | None = None
    everyone: bool = False


@dataclass(frozen=True, slots=True)
class SaveProfile(Event):
    """A measured elasticity profile from ``profile.save`` (validated by the op table)."""

    name: str
    profile: Mapping[str, Any]
    token: int | None = None


@dataclass(frozen=True, slots=True)
class ProfileUnsaved(Event):
    """The state dir had no room for a saved profile: put back what ``name`` was before
    (``previous``; None: it was not there), as a restart would find it."""

    name: str
    previous: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ProfilesLoaded(Event):
    """The profiles the state dir kept from an earlier run (fed once at start-up)."""

    profiles: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class JobStatsLoaded(Event):
    """The jobs' ACT statistics the state dir kept from an earlier run (fed once at
    start-up; ``tangramd.state.jobstats`` has the shape)."""

    stats: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EnvsRecovered(Event):
    """Persistent environments an earlier run of the daemon left and the backend still has
    (fed once at start-up, from the records ``PersistEnvs`` wrote)."""

    envs: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class PutFile(Event):
    """``env.put``: write ``data`` (a file, or with ``tar`` a tar stream) at ``path``."""

    token: int | None = None
    env_id: str = ""
    path: str = ""
    data: bytes = b""
    tar: bool = False
    peer: tuple[int, int] | None = None  # (uid, gid) of the client


@dataclass(frozen=True, slots=True)
class GetFile(Event):
    """``env.get``: read the file, or the directory as a tar stream, at ``path``."""

    token: int | None = None
    env_id: str = ""
    path: str = ""
    peer: tuple[int, int] | None = None  # (uid, gid) of the client


@dataclass(frozen=True, slots=True)
class TransferDone(Event):
    """The backend finished a ``RunTransfer``: the op's result map, or an error."""

    token: int | None = None
    env_id: str = ""
    result: Mapping[str, Any] | None = None
    error: tuple[str, str] | None = None


@dataclass(frozen=True, slots=True)
class OpenSession(Event):
    """``session.open``: a persistent shell in an open environment."""

    token: int | None = None
    env_id: str = ""
    peer: tuple[int, int] | None = None  # (uid, gid) of the client


@dataclass(frozen=True, slots=True)
class SessionOpened(Event):
    session_id: str = ""
    error: str | None = None  # None: the shell is running


@dataclass(frozen=True, slots=True)
class InterruptSession(Event):
    token: int | None = None
    session_id: str = ""
    peer: tuple[int, int] | None = None  # (uid, gid) of the client


@dataclass(frozen=True, slots=True)
class CloseSession(Event):
    token: int | None = None
    session_id: str = ""
    peer: tuple[int, int] | None = None  # (uid, gid) of the client


@dataclass(frozen=True, slots=True)
class SessionClosed(Event):
    session_id: str = ""


@dataclass(frozen=True, slots=True)
class RegisterService(Event):
    """``service.register``: the spec as sent (the core validates it)."""

    args: Mapping[str, Any]
    token: int | None = None


@dataclass(frozen=True, slots=True)
class ServiceLoaded(Event):
    """The service host loaded ``spec`` (``error`` None) or could not (``error`` says why;
    ``code`` is the error code the registering client gets)."""

    spec: ServiceSpec
    info: Mapping[str, Any] = field(default_factory=dict)
    error: str | None = None
    code: str = "bad_request"


@dataclass(frozen=True, slots=True)
class ServicesRecovered(Event):
    """The registrations the state dir kept, after the host reloaded them (fed at start-up)."""

    specs: tuple[ServiceSpec, ...] = ()


@dataclass(frozen=True, slots=True)
class RemoveService(Event):
    name: str
    token: int | None = None


@dataclass(frozen=True, slots=True)
class SetServiceEff(Event):
    """``service.set_eff``: a registered service's new speed-up table (``tangramctl service
    profile`` saves what it measured); the host keeps it with the registration."""

    name: str
    eff: Any
    token: int | None = None


@dataclass(frozen=True, slots=True)
class ServiceUnloaded(Event):
    """The host stopped the service's replicas and forgot its registration."""

    name: str


@dataclass(frozen=True, slots=True)
class SubmitCall(Event):
    spec: CallSpec
    token: int | None = None
    conn: int | None = None
    peer: tuple[int, int] | None = None  # (uid, gid) of the client (who may cancel it)


@dataclass(frozen=True, slots=True)
class CallFinished(Event):
    """A service call ended on the host (``outcome`` as ``ServiceHost.call`` gave it).

    ``h2d_bytes_per_s`` is the bandwidth a restore on real GPUs measured (None: no
    restore, or simulated GPUs, whose restore time is the declared one)."""

    action_id: str
    outcome: str
    result: Mapping[str, Any] | None = None
    error: str | None = None
    exec_s: float = 0.0
    restore_s: float = 0.0
    h2d_bytes_per_s: float | None = None
    batch: int = 1  # calls in the forward pass it ran in


@dataclass(frozen=True, slots=True)
class ConnClosed(Event):
    conn: int = 0


@dataclass(frozen=True, slots=True)
class NodeJoined(Event):
    """A node's link came up (cluster mode): its cores and memory join the pools.

    A node that is still known (its link dropped and came back within the heartbeat
    timeout) keeps its pool as it is.
    """

    node: str
    cores_by_numa: tuple[tuple[int, ...], ...] = ()
    mem_bytes: int = 0


@dataclass(frozen=True, slots=True)
class NodeGpus(Event):
    """A joined node's GPUs (cluster mode), fed once its welcome is on its way: a node the
    gpu pool does not hold joins it (``count`` GPUs of ``mem_per_gpu`` bytes, restored at
    ``h2d_bytes_per_s``) with no replica resident, and ``min_resident`` replicas are
    restored where there is room. A node still held (back within the heartbeat timeout)
    keeps its residency."""

    node: str
    count: int
    mem_per_gpu: int
    h2d_bytes_per_s: float


@dataclass(frozen=True, slots=True)
class NodeLost(Event):
    """A node missed its heartbeats for the timeout (or its link stayed closed that long)."""

    node: str
    why: str = "missed heartbeats"


@dataclass(frozen=True, slots=True)
class EnvsRestored(Event):
    """Persistent environments a restarted coordinator read back from its store: maps
    with ``id``, ``trajectory``, ``node``, ``image``, ``mem``, ``lost_node``."""

    envs: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class DrainNode(Event):
    """``node.drain`` / ``node.undrain``: stop (or resume) placing new trajectories there."""

    node: str
    drain: bool = True
    token: int | None = None


@dataclass(frozen=True, slots=True)
class Tick(Event):
    pass


@dataclass(frozen=True, slots=True)
class Shutdown(Event):
    pass


# ---------------------------------------------------------------------------- commands


@dataclass(frozen=True, slots=True, kw_only=True)
class Command:
    cause: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply(Command):
    token: int
    result: Any = None
    error: tuple[str, str] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateEnv(Command):
    env_id: str
    node: str
    image: str | None
    mem: int | None  # bytes (None: the backend's default; a node's message may omit it)
    owner: tuple[int, int] | None = None  # the user its files belong to (None: backend's)
    fork_of: str | None = None  # a fork: a copy-on-write copy of this environment's files


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoveEnv(Command):
    env_id: str
    node: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RunExec(Command):
    action_id: str
    env_id: str
    node: str
    cores: tuple[int, ...]
    spec: ExecSpec
    max_output: int
    run_as: tuple[int, int] | None = None  # (uid, gid), None: the backend's sandbox user


@dataclass(frozen=True, slots=True, kw_only=True)
class KillExec(Command):
    """Kill a running exec (``cancel``): its process group and cgroup, everything it
    started; an exec in a shell session is interrupted instead (the shell stays). Its end
    is reported as usual (``ExecFinished``)."""

    action_id: str
    node: str
    session: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PersistProfiles(Command):
    """Write every profile to the state dir (after a change, before the reply counts);
    ``changed``: the name saved and what it was before (put back if the write fails)."""

    profiles: Mapping[str, Mapping[str, Any]]
    changed: tuple[str, Mapping[str, Any] | None] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PersistJobStats(Command):
    """Write the jobs' ACT statistics to the state dir (at most every few seconds after a
    change, and at shutdown); no reply waits for it, and a write that fails is only logged."""

    stats: Mapping[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class PersistEnvs(Command):
    """Write the records of every persistent environment to the state dir (they outlive the
    daemon process: a restarted daemon re-adopts them)."""

    envs: tuple[Mapping[str, Any], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordEnv(Command):
    """Record one persistent environment's change in the state dir before the reply that
    acknowledges it: ``record`` is its new record, None when it is gone. One change costs
    the same however many environments are open (``PersistEnvs`` rewrites all of them)."""

    env_id: str
    record: Mapping[str, Any] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunTransfer(Command):
    """Put or get a file in an environment (``direction`` "put" or "get"), or reset its
    files to its fork point (``direction`` "reset", ``path`` empty)."""

    token: int | None
    env_id: str
    node: str
    direction: str
    path: str
    data: bytes = b""
    tar: bool = False
    max_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StartShell(Command):
    session_id: str
    env_id: str
    node: str
    run_as: tuple[int, int] | None = None  # the shell's (uid, gid); None: the backend's default


@dataclass(frozen=True, slots=True, kw_only=True)
class InterruptShell(Command):
    session_id: str
    node: str


@dataclass(frozen=True, slots=True, kw_only=True)
class EndShell(Command):
    session_id: str
    node: str


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadService(Command):
    """Register ``spec`` with the service host (torch: run the factory, make the backup)."""

    spec: ServiceSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class UnloadService(Command):
    """Stop the service's replicas and forget it (its in-flight calls end ``rejected``)."""

    name: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RunCall(Command):
    """Carry out the pool's restore plan on ``node`` (evict, then make ``service`` resident
    on ``gpus``, the node's local ids) and call it with ``payload``."""

    action_id: str
    service: str
    node: str
    gpus: tuple[int, ...]
    evicted: tuple[Eviction, ...]  # the copies to drop first, with local GPU ids
    payload: Mapping[str, Any]
    timeout_s: float
    # dynamic batching: more calls (action id, payload) merged into the same forward pass
    # on the same replica; each ends with its own ``CallFinished`` (riders before the
    # call that holds the GPUs)
    riders: tuple[tuple[str, Mapping[str, Any]], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class StopCall(Command):
    """Stop the forward pass that runs call ``action_id`` (``cancel``; its ``RunCall``'s
    leader) on ``node``, as a call past its timeout is stopped: the replica's workers are
    killed (its next call restarts it). Its calls' ends are reported as usual
    (``CallFinished``, once the replica holds nothing), and only then are its GPUs free."""

    action_id: str
    node: str


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmService(Command):
    """Make ``service`` resident on ``gpus`` of ``node`` with no call (``min_resident``):
    the pool found the memory free there, so the restore evicts nothing. Nothing is
    reported back; a restore that fails leaves the replica to be restarted by its next
    call."""

    service: str
    node: str
    gpus: tuple[int, ...]

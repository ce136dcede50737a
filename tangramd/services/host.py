"""``ServiceHost``: the node's GPU services, carrying out the pure pool's decisions.

The host never chooses a chunk or a victim. ``tangram.pools.gpu.GpuNodePool`` decides
(``pick_chunk``/``allocate_gpus`` for the chunk, ``restore`` for the LRU evictions); the
executor then calls ``apply(name, gpus, plan.evicted)`` and ``call(...)`` here. The host
checks every decision against its own memory accounting and refuses one that would
oversubscribe a GPU (``Oversubscribed``) instead of silently running it.

Replicas: a torch replica is one process per GPU of its chunk, forked from the service's
fork server (not bound to GPUs: restored onto any chunk of its size; all replicas share the
one host backup; on k GPUs each of its k workers holds a shard, ``services/shards.py``); an
http replica is a model server bound to one chunk (``--tensor-parallel-size k``). A replica
is named by the chunk it is resident on, so the interface speaks ``(name, gpus)``, as the
pool does.
GPU ids are node-local (``0..n-1``, the inventory's order); ``GpuCluster`` ids map to them
with ``GpuCluster.locate``.

Restores of replicas on different GPUs run concurrently (separate processes; nothing here
serialises them). On simulated GPUs the restore really copies the bytes on the CPU and then
waits out the rest of ``mem_bytes / (h2d_bytes_per_s * dop)``, so measured restore times
match the pool's model of the declared inventory.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from tangramd.services.http_runtime import HttpReplica
from tangramd.services.inventory import Gpu, Inventory
from tangramd.services.runtime_base import (
    Moved,
    Replica,
    ReplicaCrashed,
    ServiceError,
    ServiceLoadError,
)
from tangramd.services.spec import ServiceRegistry, ServiceSpec
from tangramd.services.torch_runtime import ForkServer, TorchReplica

STATES = ("loading", "resident", "backed_up", "failed")


class ServiceNotFound(ServiceError, KeyError):
    """No service of that name is registered."""

    def __str__(self) -> str:
        return str(self.args[0])


class Oversubscribed(ServiceError):
    """A restore would put more bytes on a GPU than it has (the pool must evict first)."""


class EvictionLike(Protocol):
    """``tangram.pools.gpu.Eviction``: the variant ``(service, dop)`` leaves ``gpu``."""

    @property
    def gpu(self) -> int: ...
    @property
    def service(self) -> str: ...
    @property
    def dop(self) -> int: ...


class Restored(NamedTuple):
    """What making a replica resident took: ``needed`` False when it already was."""

    needed: bool
    nbytes: int
    seconds: float  # wall time as the caller waited for it (restore_s)
    copy_s: float  # the copy itself, measured inside the replica


class HostResult(NamedTuple):
    """One service call: ``outcome`` is ok | failed | timeout | rejected | infra_error."""

    outcome: str
    result: dict[str, Any] | None
    error: str | None
    exec_s: float
    restore_s: float = 0.0
    batch: int = 1  # calls in the forward pass it ran in


@dataclass(eq=False)
class Slot:
    """One replica and where it is: ``gpus`` is its chunk (``()`` for an idle torch worker)."""

    replica: Replica
    gpus: tuple[int, ...] = ()
    state: str = "loading"
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    error: str | None = None
    last_used: float = 0.0
    restores: int = 0  # restores onto a chunk this replica made


@dataclass(eq=False)
class Hosted:
    spec: ServiceSpec
    slots: list[Slot] = field(default_factory=list)
    calls: int = 0
    batches: int = 0  # forward passes that merged two calls or more
    batched_calls: int = 0  # the calls that ran in those
    restores: int = 0
    restore_s_total: float = 0.0
    restore_bytes: int = 0
    copy_s_total: float = 0.0
    evictions: int = 0
    loads: int = 0
    module_bytes: int | None = None
    server: ForkServer | None = None  # torch: makes the backup once, forks the replicas
    load_error: str | None = None
    removed: bool = False
    serial: int = 0


class ServiceHost:
    """Registered services, their replicas, and the evict / restore / call operations."""

    def __init__(
        self,
        inventory: Inventory,
        state_dir: str | Path,
        *,
        load_timeout_s: float = 300.0,
        http_load_timeout_s: float = 900.0,
        restore_timeout_s: float = 600.0,
        declared: Sequence[ServiceSpec] = (),
        node: str = "local",
    ) -> None:
        self.inventory = inventory
        self.declared = tuple(declared)  # the config's [[service]] entries
        self.node = node  # the name ``service list`` gives this host's replicas
        self.state_dir = Path(state_dir)
        self.registry = ServiceRegistry(self.state_dir)
        self.load_timeout_s = load_timeout_s
        self.http_load_timeout_s = http_load_timeout_s
        self.restore_timeout_s = restore_timeout_s
        self._services: dict[str, Hosted] = {}
        self._watchers: set[asyncio.Task[None]] = set()
        # gpu -> evictions under way that free it (``apply`` waits for them before a restore)
        self._leaving: dict[int, set[asyncio.Task[Moved]]] = {}

    # ------------------------------------------------------------------ registrations

    async def start(self) -> dict[str, str]:
        """Load the persisted registrations and the config's (``declared``: they replace a
        persisted one of the same name, and are persisted in turn); ``{name: error}`` for
        those that failed to load (they stay registered, in state ``failed``, and are
        retried on their next use)."""
        by_name = {spec.name: spec for spec in self.registry.load()}
        by_name.update((spec.name, spec) for spec in self.declared)
        specs = list(by_name.values())
        for spec in self.declared:
            self.registry.add(spec)
        loaded = await asyncio.gather(
            *(self.register(spec, persist=False) for spec in specs), return_exceptions=True
        )
        errors: dict[str, str] = {}
        for spec, outcome in zip(specs, loaded, strict=True):
            if isinstance(outcome, ServiceLoadError):
                errors[spec.name] = str(outcome)
            elif isinstance(outcome, BaseException):
                raise outcome
        return errors

    async def register(self, spec: ServiceSpec, *, persist: bool = True) -> dict[str, Any]:
        """Add a service and make its host backup (torch: the fork server runs the factory,
        and one replica is forked, backed up); ``ServiceLoadError`` naming the service when
        the factory fails (a new registration is then not kept). Re-registering the same
        spec is a no-op; a different spec under a known name is a ``ValueError``."""
        known = self._services.get(spec.name)
        if known is not None:
            if replace(known.spec, eff=spec.eff) == spec and known.spec != spec:
                known.spec = spec  # a new speed-up table (service.set_eff): kept,
                if persist:  # persisted where registrations are (a node's are not)
                    self.registry.add(spec)
            elif known.spec != spec:
                raise ValueError(f"service {spec.name!r} is already registered; remove it first")
            return self._describe(known)
        hosted = Hosted(spec)
        self._services[spec.name] = hosted
        if spec.runtime == "torch":
            log = self.state_dir / "services" / f"{spec.name}.log"
            hosted.server = ForkServer(spec, log, load_timeout_s=self.load_timeout_s)
            slot = Slot(self._new_replica(hosted))
            hosted.slots.append(slot)
            try:
                await self._load(hosted, slot)
            except ServiceLoadError as exc:
                await hosted.server.close()
                if persist:  # a bad new registration leaves nothing behind
                    del self._services[spec.name]
                    raise
                hosted.load_error = str(exc)
                raise
        if persist:
            self.registry.add(spec)
        return self._describe(hosted)

    async def remove(self, name: str) -> list[tuple[int, ...]]:
        """Forget the service: stop its replicas (their in-flight calls end ``rejected``) and
        drop the registration; returns the chunks it was resident on."""
        hosted = self._hosted(name)
        hosted.removed = True
        del self._services[name]
        self.registry.remove(name)
        chunks = [slot.gpus for slot in hosted.slots if slot.state == "resident" and slot.gpus]
        await asyncio.gather(*(slot.replica.close() for slot in hosted.slots))
        if hosted.server is not None:
            await hosted.server.close()
        return chunks

    def specs(self) -> list[ServiceSpec]:
        return [hosted.spec for hosted in self._services.values()]

    # ------------------------------------------------------------------ decisions

    async def apply(
        self, name: str, gpus: Sequence[int], evicted: Iterable[EvictionLike] = ()
    ) -> Restored:
        """Carry out ``GpuNodePool.restore``'s plan: the evictions, then the restore.

        The pool counts a victim's memory free as soon as it plans the eviction, and a
        multi-GPU victim also leaves GPUs outside this chunk, where the next call may be
        placed before the copy has left. So every eviction is started and recorded on each
        GPU it frees before the first ``await``, and a restore first waits for all the
        evictions still leaving its GPUs: its own plan's and earlier plans'.
        """
        # One eviction per (service, chunk): a multi-GPU variant is listed once per GPU it
        # leaves, and one chunk can hold several services (keyed by the chunk alone, all
        # but one victim of a shared GPU stayed resident here while the pool freed them).
        victims = {(ev.service, _chunk_of(ev.gpu, ev.dop)) for ev in evicted}
        mine = [self._start_eviction(svc, chunk) for svc, chunk in sorted(victims)]
        leaving = {task for gpu in gpus for task in self._leaving.get(gpu, ())}
        if mine or leaving:
            await asyncio.wait({*mine, *leaving})
        for task in mine:
            task.result()  # an eviction that failed unexpectedly fails this call, as before
        return await self.ensure_resident(name, gpus)

    def _start_eviction(self, name: str, chunk: tuple[int, ...]) -> asyncio.Task[Moved]:
        """``evict`` as a task, recorded on the GPUs it frees until it has finished."""
        task = asyncio.get_running_loop().create_task(self.evict(name, chunk))
        for gpu in chunk:
            self._leaving.setdefault(gpu, set()).add(task)

        def left(done: asyncio.Task[Moved]) -> None:
            for gpu in chunk:
                tasks = self._leaving.get(gpu)
                if tasks is not None:
                    tasks.discard(done)
                    if not tasks:
                        del self._leaving[gpu]

        task.add_done_callback(left)
        return task

    async def ensure_resident(self, name: str, gpus: Sequence[int]) -> Restored:
        """Make ``name`` resident on exactly ``gpus`` (restart a crashed replica if needed)."""
        hosted = self._hosted(name)
        slot = self._claim(hosted, self._chunk(hosted.spec, gpus))
        async with slot.lock:
            return await self._make_resident(hosted, slot)

    async def evict(self, name: str, gpus: Sequence[int]) -> Moved:
        """Drop the device copy of the replica resident on ``gpus`` (none there: a no-op)."""
        hosted = self._services.get(name)
        chunk = tuple(sorted(gpus))
        slot = None if hosted is None else _find(hosted, chunk)
        if hosted is None or slot is None:
            return Moved(0, 0.0)
        async with slot.lock:
            if slot.state == "failed" and hosted.spec.runtime == "torch" and slot.gpus == chunk:
                slot.gpus = ()  # a crashed replica the pool now evicts: nothing to drop
            if slot.state != "resident" or slot.gpus != chunk:
                return Moved(0, 0.0)
            try:
                moved = await slot.replica.evict()
            except ReplicaCrashed as exc:
                await self._fail(slot, str(exc))
                return Moved(0, 0.0)
            slot.state = "backed_up"
            if hosted.spec.runtime == "torch":
                slot.gpus = ()  # the worker can be restored onto any chunk next time
            hosted.evictions += 1
            return moved

    async def call(
        self, name: str, gpus: Sequence[int], payload: dict[str, Any], timeout: float
    ) -> HostResult:
        """One call on the replica at ``gpus`` (see :meth:`call_batch`)."""
        (result,) = await self.call_batch(name, gpus, [payload], timeout)
        return result

    async def call_batch(
        self, name: str, gpus: Sequence[int], payloads: Sequence[dict[str, Any]], timeout: float
    ) -> list[HostResult]:
        """Calls on the replica at ``gpus`` as one forward pass (torch: ``handle_batch``,
        one payload: ``handle``; http: sent to the server at once), restoring it first if
        it is not resident. One result per payload, in order, each with ``batch`` =
        ``len(payloads)``.

        Never raises for what happens at run time: a handler rejection is ``failed`` (a
        ``handle_batch`` that raises fails every call of its batch), a crash or a failed
        (re)load ``infra_error``, a call on a service being removed ``rejected``. Unknown
        services (``ServiceNotFound``) and decisions that would oversubscribe a GPU
        (``Oversubscribed``) are the caller's bugs and do raise. ``timeout`` bounds the
        handler (``exec_s``); a restore is bounded by ``restore_timeout_s`` and one that
        overruns it is an ``infra_error``.
        """
        hosted = self._hosted(name)
        slot = self._claim(hosted, self._chunk(hosted.spec, gpus))
        restore_s, n = 0.0, len(payloads)

        def ended(outcome: str, error: str) -> list[HostResult]:
            return [self._ended(hosted, outcome, error, restore_s, n) for _ in range(n)]

        async with slot.lock:
            if hosted.removed:  # queued behind the lock while the service was removed
                return ended("rejected", "")
            try:
                restored = await asyncio.wait_for(
                    self._make_resident(hosted, slot), self.restore_timeout_s
                )
                restore_s = restored.seconds
            except TimeoutError:
                error = f"restore took longer than {self.restore_timeout_s} s"
                await self._fail(slot, error)
                return ended("infra_error", error)
            except (ReplicaCrashed, ServiceLoadError) as exc:
                await self._fail(slot, str(exc))
                return ended("infra_error", str(exc))
            try:
                replies = await slot.replica.call_batch(list(payloads), timeout)
            except TimeoutError:
                if not slot.replica.alive:  # torch: the stuck worker was stopped
                    await self._fail(slot, "a call timed out; the worker was stopped")
                return ended("timeout", f"no answer within {timeout} s")
            except ReplicaCrashed as exc:
                await self._fail(slot, str(exc))
                return ended("infra_error", str(exc))
        slot.last_used = time.monotonic()
        hosted.calls += n
        if n > 1:
            hosted.batches += 1
            hosted.batched_calls += n
        outcomes = ["ok" if reply.ok else "failed" for reply in replies]
        return [
            HostResult(outcome, reply.result, reply.error, reply.exec_s, restore_s, n)
            for outcome, reply in zip(outcomes, replies, strict=True)
        ]

    async def stop(self, name: str, gpus: Sequence[int]) -> bool:
        """Stop the replica at ``gpus`` whatever it runs (a call its caller gave up on):
        its workers are killed and it is marked failed, so its GPUs hold nothing of it and
        its next call restarts it, as after a call past its timeout. False: no replica of
        ``name`` there (or the service is gone)."""
        hosted = self._services.get(name)
        slot = None if hosted is None else _find(hosted, tuple(sorted(gpus)))
        if slot is None:
            return False
        await self._fail(slot, "stopped: the coordinator gave up on its call")
        return True

    # ------------------------------------------------------------------ reading

    def list(self) -> list[dict[str, Any]]:
        """``service list``: one map per service in the issue's shape (plus extra keys)."""
        return [self._describe(hosted) for hosted in self._services.values()]

    def measured(self, name: str) -> dict[str, Any]:
        """What the pool can learn: the module's real size and the restores' bandwidth."""
        hosted = self._hosted(name)
        return {
            "module_bytes": hosted.module_bytes,
            "restores": hosted.restores,
            "restore_bytes": hosted.restore_bytes,
            "restore_s_total": hosted.restore_s_total,
            "copy_s_total": hosted.copy_s_total,
        }

    def resident_bytes(self, gpu: int) -> int:
        """Bytes this host accounts on ``gpu`` (resident and loading replicas)."""
        return sum(
            _shard(hosted.spec, slot.gpus)
            for hosted in self._services.values()
            for slot in hosted.slots
            if gpu in slot.gpus and slot.state in ("resident", "loading")
        )

    async def close(self) -> None:
        slots = [slot for hosted in self._services.values() for slot in hosted.slots]
        await asyncio.gather(*(slot.replica.close() for slot in slots))
        servers = [h.server for h in self._services.values() if h.server is not None]
        await asyncio.gather(*(server.close() for server in servers))
        for task in list(self._watchers):
            task.cancel()

    # ------------------------------------------------------------------ internals

    def _hosted(self, name: str) -> Hosted:
        try:
            return self._services[name]
        except KeyError:
            raise ServiceNotFound(f"service {name!r} is not registered") from None

    def _chunk(self, spec: ServiceSpec, gpus: Sequence[int]) -> tuple[int, ...]:
        chunk = tuple(sorted(gpus))
        n = len(self.inventory)
        if not chunk or chunk != tuple(range(chunk[0], chunk[0] + len(chunk))):
            raise ValueError(f"service {spec.name!r}: GPUs {tuple(gpus)} are not one chunk")
        if chunk[0] < 0 or chunk[-1] >= n or chunk[0] % len(chunk):
            raise ValueError(f"service {spec.name!r}: {chunk} is not an aligned chunk of {n} GPUs")
        if len(chunk) not in spec.gpus:
            raise ValueError(
                f"service {spec.name!r} runs on {', '.join(map(str, spec.gpus))} GPUs, "
                f"not {len(chunk)}"
            )
        return chunk

    def _claim(self, hosted: Hosted, chunk: tuple[int, ...]) -> Slot:
        """The slot that will serve ``chunk``, marked so concurrent claims find it too.

        Synchronous (no await), so the memory check and the reservation are atomic.
        """
        slot = _find(hosted, chunk)
        if slot is not None and slot.state in ("resident", "loading"):
            return slot
        self._check_fits(hosted.spec, chunk)
        if slot is None and hosted.spec.runtime == "torch":  # an idle one of this size
            slot = next(
                (
                    s
                    for s in hosted.slots
                    if not s.gpus and not s.lock.locked() and _ranks(s) == len(chunk)
                ),
                None,
            )
        if slot is None:
            slot = Slot(self._new_replica(hosted, len(chunk)), state="backed_up")
            hosted.slots.append(slot)
        slot.gpus = chunk
        if slot.state != "resident":
            slot.state = "loading"
        return slot

    def _check_fits(self, spec: ServiceSpec, chunk: tuple[int, ...]) -> None:
        shard = _shard(spec, chunk)
        for gpu in chunk:
            used, cap = self.resident_bytes(gpu), self.inventory.gpu(gpu).mem_bytes
            if used + shard > cap:
                residents = [
                    f"{h.spec.name}@{s.gpus}"
                    for h in self._services.values()
                    for s in h.slots
                    if gpu in s.gpus and s.state in ("resident", "loading")
                ]
                raise Oversubscribed(
                    f"service {spec.name!r} needs {shard} bytes on GPU {gpu}, which has "
                    f"{cap - used} of {cap} free (resident: {', '.join(residents)}); "
                    "evict first (GpuNodePool.restore plans the evictions)"
                )

    async def _make_resident(self, hosted: Hosted, slot: Slot) -> Restored:
        """With ``slot.lock`` held: start the replica if needed, then restore it."""
        if slot.state == "resident" and slot.replica.alive:
            return Restored(False, 0, 0.0, 0.0)
        gpus = tuple(self.inventory.gpu(i) for i in slot.gpus)
        start = time.perf_counter()
        slot.state = "loading"
        if not slot.replica.alive:
            await slot.replica.close()  # reap what is left of a crashed process
            slot.replica = self._new_replica(hosted, len(slot.gpus) or _ranks(slot))
            await self._load(hosted, slot, gpus)
            if hosted.spec.runtime == "http":  # a server starts awake: that was the restore
                seconds = time.perf_counter() - start
                slot.state = "resident"
                return Restored(True, hosted.spec.mem_bytes, seconds, seconds)
            slot.state = "loading"
        try:
            moved = await slot.replica.restore(gpus)
        except ReplicaCrashed:
            slot.state = "failed"
            raise
        await _pace(hosted.spec, gpus, start)
        seconds = time.perf_counter() - start
        slot.state = "resident"
        slot.restores += 1
        hosted.restores += 1
        hosted.restore_s_total += seconds
        hosted.restore_bytes += moved.nbytes
        hosted.copy_s_total += moved.seconds
        return Restored(True, moved.nbytes, seconds, moved.seconds)

    async def _load(self, hosted: Hosted, slot: Slot, gpus: tuple[Gpu, ...] = ()) -> None:
        try:
            await slot.replica.start(gpus)
        except ServiceLoadError as exc:
            slot.state, slot.error = "failed", str(exc)
            hosted.load_error = str(exc)
            raise
        if hosted.spec.max_batch > 1 and getattr(slot.replica, "batches", True) is False:
            await slot.replica.close()
            slot.state = "failed"
            error = (
                f"service {hosted.spec.name!r}: max_batch={hosted.spec.max_batch} needs "
                "handle_batch(self, payloads: list[dict]) -> list[dict] on the module "
                "(or max_batch = 1)"
            )
            slot.error = hosted.load_error = error
            raise ServiceLoadError(error)
        hosted.loads += 1
        hosted.load_error = None
        nbytes = slot.replica.nbytes
        if nbytes is not None:
            hosted.module_bytes = nbytes
            if nbytes > hosted.spec.mem_bytes:
                await slot.replica.close()
                slot.state = "failed"
                raise ServiceLoadError(
                    f"service {hosted.spec.name!r}: the module holds {nbytes} bytes, more than "
                    f"mem_gb={hosted.spec.mem_gb} accounts for ({hosted.spec.mem_bytes} bytes)"
                )
        if slot.state == "loading" and not slot.gpus:
            slot.state = "backed_up"
        self._watch(slot)

    def _new_replica(self, hosted: Hosted, ranks: int = 1) -> Replica:
        """A replica for a chunk of ``ranks`` GPUs (torch: that many workers)."""
        hosted.serial += 1
        log = self.state_dir / "services" / f"{hosted.spec.name}.{hosted.serial}.log"
        if hosted.spec.runtime == "torch":
            return TorchReplica(
                hosted.spec,
                log,
                server=hosted.server,
                load_timeout_s=self.load_timeout_s,
                ranks=ranks,
            )
        return HttpReplica(hosted.spec, log, load_timeout_s=self.http_load_timeout_s)

    def _watch(self, slot: Slot) -> None:
        """Mark the slot failed as soon as its process exits, even while idle."""
        replica = slot.replica
        proc = getattr(replica, "proc", None)
        exited = getattr(replica, "wait_exit", None)
        if exited is None and proc is None:
            return

        async def wait() -> None:
            await (exited() if exited is not None else proc.wait())  # type: ignore[union-attr]
            if slot.replica is replica and slot.state != "failed":
                slot.state = "failed"
                slot.error = "process exited"

        task = asyncio.get_running_loop().create_task(wait())
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _fail(self, slot: Slot, error: str) -> None:
        slot.state, slot.error = "failed", error
        await slot.replica.close()

    def _ended(
        self, hosted: Hosted, outcome: str, error: str, restore_s: float, batch: int = 1
    ) -> HostResult:
        if hosted.removed:
            outcome, error = "rejected", f"service {hosted.spec.name!r} was removed"
        else:
            hosted.calls += 1
        return HostResult(outcome, None, error, 0.0, restore_s, batch)

    def _describe(self, hosted: Hosted) -> dict[str, Any]:
        spec = hosted.spec
        replicas = []
        for slot in hosted.slots:
            entry: dict[str, Any] = {
                "gpus": list(slot.gpus),
                "state": slot.state,
                "node": self.node,
                "restores": slot.restores,
            }
            pid = getattr(slot.replica, "pid", None) or getattr(
                getattr(slot.replica, "proc", None), "pid", None
            )
            if pid is not None and slot.state != "failed":
                entry["pid"] = pid
                port = getattr(slot.replica, "port", None)
                if port is not None:
                    entry["port"] = port
                workers = getattr(slot.replica, "workers", None)
                if workers is not None:  # torch: one process per GPU, each with a shard
                    entry["workers"] = workers()
            if slot.error and slot.state == "failed":
                entry["error"] = slot.error
            replicas.append(entry)
        return {
            **spec.list_fields(),
            "warm": sum(1 for slot in hosted.slots if slot.state == "resident" and slot.gpus),
            "replicas": replicas,
            "calls": hosted.calls,
            "batches": hosted.batches,
            "batched_calls": hosted.batched_calls,
            "restores": hosted.restores,
            "restore_s_total": hosted.restore_s_total,
            "restore_bytes": hosted.restore_bytes,
            "evictions": hosted.evictions,
            "module_bytes": hosted.module_bytes,
            "error": hosted.load_error,
        }


def _ranks(slot: Slot) -> int:
    """The GPUs a torch replica's workers are for (1 for any other replica)."""
    return int(getattr(slot.replica, "ranks", 1))


def _find(hosted: Hosted, chunk: tuple[int, ...]) -> Slot | None:
    return next((slot for slot in hosted.slots if slot.gpus == chunk), None)


def _chunk_of(gpu: int, dop: int) -> tuple[int, ...]:
    first = gpu - gpu % dop
    return tuple(range(first, first + dop))


def _shard(spec: ServiceSpec, chunk: tuple[int, ...]) -> int:
    return -(-spec.mem_bytes // max(len(chunk), 1))


async def _pace(spec: ServiceSpec, gpus: tuple[Gpu, ...], start: float) -> None:
    """On simulated GPUs, make the restore last as long as the declared link would."""
    if not gpus or not all(gpu.simulated for gpu in gpus):
        return
    floor = spec.mem_bytes / (min(gpu.h2d_bytes_per_s for gpu in gpus) * len(gpus))
    remaining = floor - (time.perf_counter() - start)
    if remaining > 0 and math.isfinite(remaining):
        await asyncio.sleep(remaining)

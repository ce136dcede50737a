"""GPU services: register, load, remove, unload, and the calls to them."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tangram.jobs import DEFAULT_JOB, check_job_name
from tangram.model import ActionId, make_action
from tangram.pools.gpu import GpuCluster
from tangram.protocol.errors import BadRequest, NotFound, ShuttingDown
from tangram.protocol.results import CallResult, ExecResult
from tangramd import events as ev
from tangramd.services.spec import ServiceSpec, SpecError
from tangramd.state.actions import ActionRec
from tangramd.state.batches import send_batch
from tangramd.state.dispatch import handles
from tangramd.state.handlers.actions import finish_action
from tangramd.state.services import Batch, gpu_place
from tangramd.state.story import note

if TYPE_CHECKING:
    from tangramd.state.context import Core

MIN_WORK_S = 1e-6  # a call too fast to time still has a positive duration (t1_s > 0)


# ---------------------------------------------------------------------- handlers
@handles(ev.RegisterService)
def register_service(core: Core, e: ev.RegisterService, now: float, out: list[ev.Command]) -> None:
    """Validate the spec; the host loads it (``LoadService``) and only once it has
    (``ServiceLoaded``) does the pool learn the service and the client get its answer."""
    if core.shutting_down:
        raise ShuttingDown("daemon is shutting down")
    if core.gpu is None:
        raise BadRequest(
            "this daemon has no GPUs: declare [gpu] simulated = { count = N, mem_gb = G } "
            "or run it on a host with NVML GPUs"
        )
    try:
        spec = ServiceSpec.from_json(e.args)
    except SpecError as exc:
        raise BadRequest(str(exc)) from None
    name = spec.name
    if name in core.services.registering or name in core.services.removing:
        what = "registered" if name in core.services.registering else "removed"
        raise BadRequest(f"service {name!r} is being {what}; try again when that is done")
    known = core.services.specs.get(name)
    if known is not None and known != spec:
        raise BadRequest(f"service {name!r} is already registered differently; remove it first")
    if not core.gpu.nodes:  # a coordinator whose nodes with GPUs are all away
        raise BadRequest(
            f"service {name!r}: no node with GPUs has joined this coordinator (start one with"
            " [gpu] simulated = { count = N, mem_gb = G } or NVML GPUs)"
        )
    pool_spec = spec.pool_spec()
    if not any(node.fits_memory(pool_spec, k) for node in core.gpu.nodes for k in spec.gpus):
        largest = max(node.mem_per_gpu for node in core.gpu.nodes)
        raise BadRequest(
            f"service {name!r}: mem_gb={spec.mem_gb:g} does not fit on "
            f"{'/'.join(map(str, spec.gpus))} GPU(s) of {largest} bytes each "
            f"(a node has {core.gpu.max_single()} GPUs)"
        )
    core.services.registering[name] = e.token
    out.append(ev.LoadService(spec=spec, cause=core.stimulus))


@handles(ev.ServiceLoaded)
def service_loaded(core: Core, e: ev.ServiceLoaded, now: float, out: list[ev.Command]) -> None:
    token = core.services.registering.pop(e.spec.name, None)
    if e.error is None:
        add_service(core, e.spec)
        if token is not None:
            out.append(core.reply(token, result=dict(e.info)))
        keep_warm(core, out)
    elif token is not None:
        out.append(core.reply(token, error=(e.code, e.error)))


@handles(ev.ServicesRecovered)
def services_recovered(
    core: Core, e: ev.ServicesRecovered, now: float, out: list[ev.Command]
) -> None:
    for spec in e.specs:
        add_service(core, spec)
    keep_warm(core, out)


def add_service(core: Core, spec: ServiceSpec) -> None:
    assert core.gpu is not None, "services need the gpu pool"
    core.gpu.register_service(spec.pool_spec())
    core.services.specs[spec.name] = spec


@handles(ev.RemoveService)
def remove_service(core: Core, e: ev.RemoveService, now: float, out: list[ev.Command]) -> None:
    """Queued calls end ``rejected`` at once; running ones end when the host stops the
    service's replicas (``UnloadService``), which also answers the client."""
    if e.name not in core.services.specs:
        raise NotFound(f"service {e.name!r} is not registered")
    del core.services.specs[e.name]
    for batch in core.services.forming.pop(e.name, []):
        send_batch(core, batch, out)  # (the host ends them rejected)
    rejected = 0
    for rec in list(core.actions.queue.values()):
        if rec.call is not None and rec.call.name == e.name:
            why = f"service {e.name!r} was removed"
            finish_action(core, rec, now, out, outcome="rejected", detail=why)
            rejected += 1
    assert core.gpu is not None, "a registered service implies the gpu pool"
    core.gpu.unregister_service(e.name)
    core.services.removing[e.name] = (e.token, rejected)
    out.append(ev.UnloadService(name=e.name, cause=core.stimulus))


@handles(ev.ServiceUnloaded)
def service_unloaded(core: Core, e: ev.ServiceUnloaded, now: float, out: list[ev.Command]) -> None:
    token, rejected = core.services.removing.pop(e.name, (None, 0))
    if token is not None:
        answer = {"name": e.name, "removed": True, "rejected": rejected}
        out.append(core.reply(token, result=answer))
    keep_warm(core, out)  # its memory is free now


@handles(ev.SetServiceEff)
def set_service_eff(core: Core, e: ev.SetServiceEff, now: float, out: list[ev.Command]) -> None:
    """A new speed-up table for a registered service: the host persists the spec with it
    (``LoadService``, a registration that differs only in ``eff``) and calls submitted
    from then on are scheduled by it."""
    spec = core.services.specs.get(e.name)
    if spec is None:
        raise NotFound(f"service {e.name!r} is not registered (see `tangramctl service list`)")
    if e.name in core.services.registering or e.name in core.services.removing:
        raise BadRequest(f"service {e.name!r} is being registered or removed; try again")
    try:
        updated = replace(spec, eff=e.eff)
    except SpecError as exc:
        raise BadRequest(str(exc)) from None
    core.services.registering[e.name] = e.token
    out.append(ev.LoadService(spec=updated, cause=core.stimulus))


@handles(ev.SubmitCall)
def submit_call(core: Core, e: ev.SubmitCall, now: float, out: list[ev.Command]) -> None:
    if core.shutting_down:
        raise ShuttingDown("daemon is shutting down")
    name = e.spec.name
    core.actions.check_ref(e.conn, e.spec.ref)
    job = DEFAULT_JOB if e.spec.job is None else check_job_name(e.spec.job)
    spec = core.services.specs.get(name)
    if spec is None or core.gpu is None:
        raise NotFound(f"service {name!r} is not registered (see `tangramctl service list`)")
    # The GPU counts whose shard fits a GPU. With a speed-up table (``eff``) covering two
    # of them or more the call is elastic: the scheduler picks the count (the chunk DP),
    # each count's duration the history's work over its speed-up. Without one it runs at
    # the smallest count (its minimum); ``gpus`` in the call pins the count.
    largest, pool_spec = core.gpu.max_single(), spec.pool_spec()
    counts = [
        k
        for k in spec.gpus
        if k <= largest and any(node.fits_memory(pool_spec, k) for node in core.gpu.nodes)
    ] or [min(spec.gpus)]
    pinned = e.spec.gpus
    if pinned is not None:
        if pinned not in counts:
            raise BadRequest(
                f"service {name!r}: gpus={pinned} is not one of the counts it can run at "
                f"here ({', '.join(map(str, counts))})"
            )
        counts = [pinned]
    demand: Any = counts[0] if len(counts) == 1 else {"set": counts}
    klass = f"service/{name}"
    work = max(core.history.estimate(klass), MIN_WORK_S)  # seconds at speed-up 1
    t1_s, eff = spec.elastic(counts, work)
    dur_s = work / spec.speedup(counts[0]) if spec.eff and not eff else None
    aid = ActionId(core.new_id("c"))
    action = make_action(
        aid,
        "service",
        f"call-{aid}",
        {"gpu": demand},
        service=name,
        job=job,
        seq=core.actions.next_seq(),
        submitted_at=now,
        klass=klass,
        capacity={"gpu": largest},
        t1_s=t1_s if eff else None,
        eff=eff or None,
        dur_s=dur_s,
    )
    core.jobs_seen.add(job)
    timeout = e.spec.timeout_s if e.spec.timeout_s is not None else core.cfg.call_timeout_s
    call = replace(e.spec, timeout_s=timeout)
    rec = core.actions.add(
        action, now, token=e.token, env=None, conn=e.conn, call=call, owner=e.peer
    )
    detail = f"call service={name} gpus={counts} timeout_s={timeout:g} job={job}"
    if action.elastic:
        detail += f" elastic over {list(action.allowed_units())}"
    note(rec, now, "submitted", detail, core.stimulus)
    if not join_batch(core, rec, now, out):
        core.enqueue(rec, now)


def start_call(core: Core, rec: ActionRec, now: float, out: list[ev.Command]) -> None:
    """Placed on GPUs: ask the pool for the restore plan (LRU evictions on those GPUs,
    then the restore) and send it with the call to the node's service host.

    A service with ``max_batch`` > 1 takes queued calls to it along (riders, in queue
    order; not those this pass places itself) into the same forward pass; one with a
    ``batch_window_ms`` that is not full yet waits that long for more (``forming``)."""
    assert core.gpu is not None and rec.call is not None, "calls hold GPUs and a spec"
    core.services.gpu_tick += 1
    plan = core.gpu.restore_for(rec.action.id, rec.call.name, core.services.gpu_tick)
    node, local = gpu_place(core.gpu, rec.units)
    evicted = tuple(v._replace(gpu=core.gpu.locate(v.gpu)[1]) for v in plan.evicted)
    if plan.needed:
        victims = sorted({f"{v.service}@{v.dop}" for v in evicted})
        why = f"restore onto node={node} gpus={list(local)} est_s={plan.seconds:.3g}"
        why += f" evicting {victims}" if victims else ""
    else:
        why = f"resident on node={node} gpus={list(local)}"
    core.actions.move(rec, "running", now, why, core.stimulus)
    spec = core.services.specs.get(rec.call.name)
    limit = spec.max_batch if spec is not None else 1
    window = spec.batch_window_ms / 1000.0 if spec is not None else 0.0
    batch = Batch(rec, node, local, evicted, limit, now + window)
    if limit > 1:
        riders: list[ActionRec] = []
        for other in core.actions.queue.values():  # (FCFS order; read, then taken)
            if len(riders) >= limit - 1:
                break
            if (
                other.call is not None
                and other.call.name == rec.call.name
                and other.action.id not in core.services.placing
            ):
                riders.append(other)
        for other in riders:
            ride(core, batch, other, now)
    if batch.size < limit and window > 0:
        core.services.forming.setdefault(rec.call.name, []).append(batch)
        return
    send_batch(core, batch, out)


def ride(core: Core, batch: Batch, rec: ActionRec, now: float) -> None:
    """A queued call joins ``batch``: it runs in the leader's forward pass, on its GPUs."""
    core.actions.unqueue(rec.action.id)
    rec.started_at = now
    leader = batch.leader.action.id
    why = f"batched with {leader} on node={batch.node} gpus={list(batch.gpus)}"
    core.actions.move(rec, "running", now, why, core.stimulus)
    core.services.riding[rec.action.id] = (batch.node, batch.gpus)
    batch.riders.append(rec)


def join_batch(core: Core, rec: ActionRec, now: float, out: list[ev.Command]) -> bool:
    """A new call joins an open batch of its service with room (True), else it queues."""
    assert rec.call is not None, "calls have a spec"
    open_batches = core.services.forming.get(rec.call.name)
    if not open_batches:
        return False
    batch = open_batches[0]
    core.enqueue(rec, now)
    ride(core, batch, rec, now)
    if batch.size >= batch.limit:  # full: no need to wait any longer
        open_batches.pop(0)
        if not open_batches:
            del core.services.forming[rec.call.name]
        send_batch(core, batch, out)
    return True


def send_batches(core: Core, now: float | None, out: list[ev.Command]) -> None:
    """Send the open batches whose window has passed (``now`` None: all of them)."""
    for name in list(core.services.forming):
        batches = core.services.forming[name]
        due = [b for b in batches if now is None or b.due <= now]
        left = [b for b in batches if b not in due]
        if left:
            core.services.forming[name] = left
        else:
            del core.services.forming[name]
        for batch in due:
            send_batch(core, batch, out)


@handles(ev.CallFinished)
def call_done(core: Core, e: ev.CallFinished, now: float, out: list[ev.Command]) -> None:
    rec = core.actions.get(e.action_id)
    if rec is None or rec.state != "running":
        return
    riding = core.services.riding.pop(rec.action.id, None)
    if rec.cancelling and e.outcome != "ok":  # its pass was stopped (``StopCall``); one
        # that had finished first stays ``ok``, as a killed exec that had exited 0
        why = "cancelled: stopped while running" + (f" ({e.error})" if e.error else "")
        e = replace(e, outcome="cancelled", result=None, error=why)
    if e.outcome in ("ok", "failed") and riding is None:  # once per forward pass
        # kept as work at speed-up 1: the pass's seconds times its GPUs' speed-up
        spec = core.services.specs.get(rec.call.name) if rec.call is not None else None
        work = e.exec_s * (spec.speedup(len(rec.units) or 1) if spec is not None else 1.0)
        core.history.observe(rec.action.klass, work)
        if e.batch > 1:  # what a pass of this size takes (``send_batch``'s estimate)
            core.history.observe(f"{rec.action.klass}@{e.batch}", work)
    if e.h2d_bytes_per_s and core.gpu is not None:
        node = core.gpu.node_of_action(rec.action.id)
        if node is not None:
            core.gpu.node(node).observe_h2d(e.h2d_bytes_per_s)
    call = CallResult(
        e.outcome,  # type: ignore[arg-type]  # the host's outcomes are OUTCOMES
        result=e.result,
        error=e.error,
        restore_s=e.restore_s,
        exec_s=e.exec_s,
        batch=e.batch,
        node=None if riding is None else riding[0],
        gpus=() if riding is None else riding[1],
    )
    detail = f"restore_s={e.restore_s:.4f} exec_s={e.exec_s:.4f} {e.error or ''}".strip()
    finish_action(
        core,
        rec,
        now,
        out,
        outcome=e.outcome,
        result=ExecResult(call.outcome, exec_s=e.restore_s + e.exec_s, detail=detail),
        detail=detail,
        call=call,
    )
    keep_warm(core, out)  # its GPUs are free again


# ---------------------------------------------------------------------- warm replicas
def keep_warm(core: Core, out: list[ev.Command]) -> None:
    """``min_resident``: restore replicas that a service lacks onto free GPUs with room.

    Only when no call waits for GPUs (they come first), only onto chunks no action holds
    and whose memory is free without evicting anything; a warm replica is marked resident
    at once (a call placed on it waits for the host's restore) and is an LRU entry like
    any other, so a later restore may evict it, and the next time there is room it is
    restored again.
    """
    gpu = core.gpu
    wanted = [spec for spec in core.services.specs.values() if spec.min_resident > 0]
    if gpu is None or not wanted or not gpu.free_units():
        return  # (every GPU held: no chunk to warm; checked before the queue is read)
    if any(rec.call is not None for rec in core.actions.queue.values()):
        return
    for spec in wanted:
        missing = spec.min_resident - warm_replicas(gpu, spec)
        while missing > 0:
            room = room_for(gpu, spec)
            if room is None:
                break
            node, chunk = room
            core.services.gpu_tick += 1
            plan = gpu.node(node).restore(gpu.services[spec.name], chunk, core.services.gpu_tick)
            assert not plan.evicted, "room_for found the memory free"
            out.append(
                ev.WarmService(service=spec.name, node=node, gpus=chunk, cause=core.stimulus)
            )
            missing -= 1


def warm_replicas(gpu: GpuCluster, spec: ServiceSpec) -> int:
    """Instances of ``spec`` the pool holds resident, over its GPU counts and the nodes."""
    return sum(
        1
        for node in gpu.nodes
        for k in spec.gpus
        if k <= node.n_gpus
        for start in range(0, node.n_gpus, k)
        if node.resident_gpus((spec.name, k), start, k) == k
    )


def room_for(gpu: GpuCluster, spec: ServiceSpec) -> tuple[str, tuple[int, ...]] | None:
    """``(node, chunk)`` where an instance at its smallest fitting GPU count fits with no
    eviction on GPUs no action holds; None when there is no such chunk."""
    pool_spec = gpu.services[spec.name]
    for k in spec.gpus:
        shard = pool_spec.mem_per_gpu(k)
        for node in gpu.nodes:
            if not node.fits_memory(pool_spec, k):
                continue
            for start in range(0, node.n_gpus, k):
                chunk = tuple(range(start, start + k))
                if all(node.holder(g) is None and node.mem_free(g) >= shard for g in chunk):
                    return node.node_id, chunk
    return None

"""The daemon core as a pure state machine: feed events, assert the exact commands."""

from __future__ import annotations

import pytest

from tangram.pools.api import ApiPool
from tangram.pools.cpu import CpuCluster, CpuNodePool
from tangram.protocol.results import ExecResult, ExecSpec
from tangramd import events as ev
from tangramd.state import Core, CoreConfig
from tangramd.state.envs import ENV_EDGES
from tangramd.state.story import IllegalTransition, transition

GIB = 1 << 30


@pytest.fixture(autouse=True)
def validate_after_every_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every core test checks the core's invariants after each event it feeds."""
    handle = Core.handle

    def checked(self: Core, event: ev.Event, now: float) -> list[ev.Command]:
        out = handle(self, event, now)
        self.validate()
        return out

    monkeypatch.setattr(Core, "handle", checked)


def submit(token: int, cmd: str, env: str | None = None, **spec) -> ev.SubmitExec:
    return ev.SubmitExec(spec=ExecSpec(cmd=cmd, env=env, **spec), token=token)


def make_core(cores: int = 2, **cfg) -> Core:
    cluster = CpuCluster([CpuNodePool("local", [list(range(cores))], 8 * GIB)])
    apis = {"search": ApiPool("search", concurrency=1, quota=0, period_s=60.0)}
    return Core(cluster, apis, CoreConfig(**cfg))


def acting(commands: list[ev.Command]) -> list[ev.Command]:
    """The commands other than writing the environment records (tested on their own)."""
    return [c for c in commands if not isinstance(c, ev.PersistEnvs | ev.RecordEnv)]


def ready_env(core: Core, now: float = 0.0) -> str:
    out = core.handle(ev.OpenEnv(token=1), now)
    (create,) = out
    assert isinstance(create, ev.CreateEnv)
    (reply,) = acting(core.handle(ev.EnvCreated(env_id=create.env_id), now))
    assert reply.result["id"] == create.env_id
    return create.env_id


def tick(core: Core, now: float) -> list[ev.Command]:
    return core.handle(ev.Tick(), now)


def test_exec_lifecycle_commands():
    """Submit → (coalesced) pass → RunExec on one core → finish → reply with timings."""
    core = make_core()
    env = ready_env(core)
    assert core.handle(submit(7, "true", env), 1.0) == []
    assert core.next_wakeup(1.0) == 1.0  # a quiet core schedules a lone action at once
    (run,) = tick(core, 1.001)
    assert isinstance(run, ev.RunExec) and run.cores == (0,) and run.env_id == env
    (reply,) = core.handle(
        ev.ExecFinished(action_id=run.action_id, result=ExecResult("ok", exit_code=0, exec_s=0.5)),
        1.6,
    )
    assert reply.token == 7
    assert reply.result["outcome"] == "ok"
    assert reply.result["queue_s"] == pytest.approx(0.001)
    assert reply.result["act_s"] == pytest.approx(0.501)
    assert core.cpu.pool("local").free_units() == 2
    core.validate()


def test_burst_is_scheduled_in_one_pass():
    """Twenty arrivals in one coalescing window cost one scheduling pass."""
    core = make_core()
    env = ready_env(core)
    for i in range(20):
        core.handle(submit(100 + i, "true", env), 1.0 + i * 1e-5)
    runs = tick(core, 1.01)
    assert core.passes == 1
    assert len([c for c in runs if isinstance(c, ev.RunExec)]) == 2  # two cores
    core.validate()


def test_lost_environment_is_recreated_for_the_next_action():
    """infra_error with the env gone marks it lost; the next action recreates it first."""
    core = make_core()
    env = ready_env(core)
    core.handle(submit(2, "true", env), 0.0)
    (run,) = tick(core, 0.01)
    (reply,) = core.handle(
        ev.ExecFinished(
            action_id=run.action_id,
            env_lost=True,
            result=ExecResult("infra_error", detail="container gone"),
        ),
        0.1,
    )
    assert reply.result["outcome"] == "infra_error"
    out = core.handle(submit(3, "true", env), 0.2)
    assert [type(c) for c in out] == [ev.CreateEnv]
    core.handle(ev.EnvCreated(env_id=env), 0.3)
    (run2,) = tick(core, 0.31)
    assert isinstance(run2, ev.RunExec)


def test_throwaway_env_closed_after_its_exec():
    """An exec without --env opens a throwaway env and removes it when done."""
    core = make_core()
    (create,) = core.handle(submit(1, "true"), 0.0)
    core.handle(ev.EnvCreated(env_id=create.env_id), 0.1)
    (run,) = tick(core, 0.2)
    out = core.handle(
        ev.ExecFinished(action_id=run.action_id, result=ExecResult("ok", exit_code=0)), 0.3
    )
    assert [type(c) for c in out] == [ev.Reply, ev.RemoveEnv]


def test_lease_ttl_reclaims_unit():
    """A granted lease that is never released expires at its TTL and frees the unit."""
    core = make_core()
    core.handle(ev.AcquireLease(token=1, api="search", ttl_s=5.0), 0.0)
    (grant,) = tick(core, 0.01)
    assert grant.result["lease_id"]
    assert core.apis["search"].free_units() == 0
    assert core.next_wakeup(1.0) == pytest.approx(5.01)
    tick(core, 5.01)
    assert core.apis["search"].free_units() == 1
    core.validate()


def test_shutdown_rejects_waiting_work():
    """Shutdown ends queued actions with the typed outcome `rejected`."""
    core = make_core(cores=1)
    env = ready_env(core)
    core.handle(submit(1, "sleep 9", env), 0.0)
    core.handle(submit(2, "true", env), 0.0)
    tick(core, 0.01)
    (reply,) = acting(core.handle(ev.Shutdown(), 0.5))
    assert reply.token == 2 and reply.result["outcome"] == "rejected"


def test_illegal_transition_raises_with_history():
    """An edge missing from the table raises and shows the entity's recent history."""
    core = make_core()
    env_id = ready_env(core)
    env = core.envs.get(env_id)
    with pytest.raises(IllegalTransition, match=r"ready -> creating .*history.*backend created it"):
        transition(env, "creating", ENV_EDGES, 1.0, "bogus", cause=0)


def test_idle_environment_is_closed_after_ttl():
    """An environment idle for env_idle_ttl_s is removed and its memory returned."""
    core = make_core(env_idle_ttl_s=60.0)
    env = ready_env(core, now=0.0)
    assert core.cpu.pool("local").mem_reserved > 0
    assert core.next_wakeup(1.0) == pytest.approx(60.0)
    assert tick(core, 30.0) == []
    (remove,) = tick(core, 60.0)
    assert isinstance(remove, ev.RemoveEnv) and remove.env_id == env
    core.handle(ev.EnvRemoved(env_id=env), 60.1)
    assert core.cpu.pool("local").mem_reserved == 0


def test_environment_waits_for_memory_in_fifo_order():
    """When memory is short, env.open waits and is created once another env is removed."""
    core = make_core(default_env_mem=5 * GIB)  # the node has 8 GiB: one at a time
    first = ready_env(core)
    assert core.handle(ev.OpenEnv(token=9), 1.0) == []  # waits, nothing created yet
    core.handle(ev.CloseEnv(token=10, env_id=first), 2.0)
    (create,) = acting(core.handle(ev.EnvRemoved(env_id=first), 2.1))[1:]
    assert isinstance(create, ev.CreateEnv)
    (reply,) = acting(core.handle(ev.EnvCreated(env_id=create.env_id), 2.2))
    assert reply.token == 9


def test_story_records_every_transition_and_the_placement():
    """An action's story holds submission, env wait, queue, placement (cores, node), outcome."""
    core = make_core()
    (create,) = core.handle(submit(1, "true", cpus=2), 0.0)
    core.handle(ev.EnvCreated(env_id=create.env_id), 0.1)
    (run,) = tick(core, 0.2)
    core.handle(ev.ExecFinished(action_id=run.action_id, result=ExecResult("ok", 0)), 0.5)
    story = core.read.story(run.action_id, origin=0.0)
    steps = [(e["t"], e["event"]) for e in story["events"]]
    assert steps == [
        (0.0, "submitted"),
        (0.0, "waiting_env"),
        (0.1, "queued"),
        (0.2, "placed"),
        (0.2, "running"),
        (0.5, "finished"),
    ]
    placed = story["events"][3]["detail"]
    assert placed == (  # text when read
        "pool=cpu:local units=[0, 1] node=local expected_s=1; dop 2: fixed (one core count allowed)"
    )
    assert (story["state"], story["outcome"]) == ("done", "ok")


def test_commands_carry_the_stimulus_id_of_their_event():
    """Each handled event gets a fresh id; its commands and story entries carry it."""
    core = make_core()
    (create,) = core.handle(submit(1, "true"), 0.0)
    (reply,) = core.handle(ev.CloseEnv(token=5, env_id="nope"), 0.0)
    assert create.cause > 0 and reply.cause == create.cause + 1
    core.handle(ev.EnvCreated(env_id=create.env_id), 0.1)
    (run,) = tick(core, 0.2)
    story = core.read.story(run.action_id, origin=0.0)["events"]
    assert story[0]["cause"] == create.cause and story[-1]["cause"] == run.cause


def test_profiles_enter_as_events_and_are_saved_by_a_command():
    """profile.save is an event; the core answers and emits PersistProfiles with all profiles."""
    core = make_core()
    core.handle(
        ev.ProfilesLoaded(
            profiles={"old": {"dop": {"1": 1.0}, "t1_s": 1.0, "eff": {"1": 1.0}, "elastic": False}}
        ),
        0.0,
    )
    prof = {"dop": {"1": 2.0, "2": 1.1}, "t1_s": 2.0, "eff": {"1": 1.0, "2": 0.9},
            "speedup": {"1": 1.0, "2": 1.8}, "elastic": True}  # fmt: skip
    persist, reply = core.handle(ev.SaveProfile(name="suite", profile=prof, token=3), 1.0)
    assert isinstance(persist, ev.PersistProfiles) and sorted(persist.profiles) == ["old", "suite"]
    assert reply.token == 3 and reply.result == {"name": "suite", "saved": True}
    assert core.read.profile("suite")["t1_s"] == 2.0
    assert [p["name"] for p in core.read.profile_rows()] == ["old", "suite"]


def test_shutdown_goes_through_the_core_and_keeps_persistent_envs():
    """Shutdown removes throwaway environments (busy ones when their action ends) and keeps
    persistent ones, writing their records for the next daemon."""
    core = make_core()
    persistent = ready_env(core)
    (create,) = core.handle(submit(1, "sleep 9"), 0.0)  # a throwaway env
    core.handle(ev.EnvCreated(env_id=create.env_id), 0.0)
    (run,) = tick(core, 0.01)
    out = core.handle(ev.Shutdown(), 0.5)
    assert [type(c) for c in out] == [ev.PersistEnvs]  # nothing removed yet
    assert [r["id"] for r in out[0].envs] == [persistent]
    result = ExecResult("infra_error", detail="daemon shutting down")
    stats, reply, remove = core.handle(ev.ExecFinished(action_id=run.action_id, result=result), 0.6)
    assert isinstance(stats, ev.PersistJobStats)  # an ACT while it stops: written at once
    assert reply.result["outcome"] == "infra_error"
    assert isinstance(remove, ev.RemoveEnv) and remove.env_id == create.env_id
    core.handle(ev.EnvRemoved(env_id=create.env_id), 0.7)
    assert core.read.env_ids() == [persistent]


def test_persistent_envs_are_recorded_and_readopted():
    """Opening and closing a persistent env records that one change (before the reply to
    the open); a new core adopts the records, reserves their memory and never reuses
    their ids."""
    core = make_core()
    (create,) = core.handle(ev.OpenEnv(token=1, trajectory="t1"), 0.0)
    persist, reply = core.handle(ev.EnvCreated(env_id=create.env_id), 0.1)
    assert isinstance(persist, ev.RecordEnv) and reply.result["id"] == create.env_id
    record = persist.record
    assert record is not None and persist.env_id == create.env_id
    assert record["trajectory"] == "t1" and record["node"] == "local"
    (other,) = core.handle(ev.OpenEnv(token=2, trajectory="t2"), 0.2)
    core.handle(ev.EnvCreated(env_id=other.env_id), 0.3)
    (remove,) = core.handle(ev.CloseEnv(token=3, env_id=other.env_id), 0.4)
    reply, forget = core.handle(ev.EnvRemoved(env_id=remove.env_id), 0.5)
    assert isinstance(forget, ev.RecordEnv) and forget.env_id == other.env_id
    assert forget.record is None and reply.result == {"closed": True}

    fresh = make_core()
    assert fresh.handle(ev.EnvsRecovered(envs=(record,)), 5.0) == []
    assert fresh.read.env_ids() == [create.env_id]
    assert fresh.cpu.pool("local").mem_reserved == record["mem"]
    (run_create,) = fresh.handle(submit(2, "true"), 5.1)  # a new env: a new id
    assert run_create.env_id != create.env_id
    fresh.handle(submit(3, "true", create.env_id), 5.2)
    (run,) = tick(fresh, 5.3)
    assert isinstance(run, ev.RunExec) and run.env_id == create.env_id


def test_passes_are_immediate_when_quiet_and_batched_under_a_burst():
    """The first arrival after a quiet spell is scheduled at once; arrivals within
    coalesce_s of a pass wait for the end of that window and share one pass."""
    core = make_core(cores=2, coalesce_s=0.001)
    env = ready_env(core)
    core.handle(submit(1, "true", env), 1.0)
    assert core.next_wakeup(1.0) == 1.0
    tick(core, 1.0)
    assert core.passes == 1
    for i in range(5):
        core.handle(submit(10 + i, "true", env), 1.0002 + i * 1e-5)
    assert core.next_wakeup(1.0003) == pytest.approx(1.001)
    tick(core, 1.001)
    assert core.passes == 2


# ---------------------------------------------------------------------- GPU services


def gpu_core(n_gpus: int = 2) -> Core:
    from tangram.pools.gpu import GpuCluster, GpuNodePool

    cluster = CpuCluster([CpuNodePool("local", [[0, 1]], 8 * GIB)])
    node = GpuNodePool("local", n_gpus, mem_per_gpu=100, h2d_bytes_per_s=1000.0)
    return Core(cluster, {}, CoreConfig(), gpu=GpuCluster([node], {}))


def register(core: Core, name: str, now: float = 0.0) -> None:
    """Register a torch service of 60 bytes (mem_gb is decimal GB) through the core."""
    args = {"name": name, "runtime": "torch", "mem_gb": 60e-9, "entry": "m:f"}
    (load,) = core.handle(ev.RegisterService(args=args, token=1), now)
    assert isinstance(load, ev.LoadService) and load.spec.name == name
    (reply,) = core.handle(ev.ServiceLoaded(spec=load.spec, info={"name": name}), now)
    assert reply.token == 1 and reply.result == {"name": name}


def call(core: Core, token: int, name: str, now: float) -> ev.RunCall:
    from tangram.protocol.results import CallSpec

    assert core.handle(ev.SubmitCall(spec=CallSpec(name, {"x": token}), token=token), now) == []
    (run,) = tick(core, now)
    assert isinstance(run, ev.RunCall)
    return run


def test_service_call_lifecycle_restores_then_evicts_lru():
    """A call is placed on a GPU with the pool's restore plan; a third service on two full
    GPUs evicts the least recently used one; the reply carries the call's timings."""
    core = gpu_core()
    for name in ("a", "b", "c"):
        register(core, name)
    first = call(core, 1, "a", 1.0)
    assert first.gpus == (0,) and first.evicted == () and first.payload == {"x": 1}
    second = call(core, 2, "b", 1.1)
    assert second.gpus == (1,) and second.evicted == ()
    (reply,) = core.handle(
        ev.CallFinished(action_id=first.action_id, outcome="ok", result={"y": 1}, exec_s=0.2,
                        restore_s=0.1), 1.5,
    )  # fmt: skip
    assert reply.token == 1
    assert reply.result["outcome"] == "ok" and reply.result["result"] == {"y": 1}
    assert reply.result["gpus"] == [0] and reply.result["node"] == "local"
    assert reply.result["queue_s"] == pytest.approx(0.0)
    assert reply.result["act_s"] == pytest.approx(0.5)
    third = call(core, 3, "c", 2.0)
    assert third.gpus == (0,)
    assert [(v.gpu, v.service) for v in third.evicted] == [(0, "a")]
    story = core.read.story(third.action_id, origin=0.0)["events"]
    assert any("evicting ['a@1']" in e["detail"] for e in story if e["event"] == "running")


def test_register_without_gpus_or_with_bad_spec_is_refused():
    """Registration needs a GPU pool and a valid spec; the error names the field."""
    core = make_core()
    args = {"name": "a", "runtime": "torch", "mem_gb": 1, "entry": "m:f"}
    (reply,) = core.handle(ev.RegisterService(args=args, token=1), 0.0)
    assert reply.error[0] == "bad_request" and "no GPUs" in reply.error[1]
    core = gpu_core()
    (reply,) = core.handle(ev.RegisterService(args={**args, "entry": "nocolon"}, token=2), 0.0)
    assert reply.error[0] == "bad_request" and "'entry'" in reply.error[1]
    (reply,) = core.handle(ev.RegisterService(args={**args, "mem_gb": 1.0}, token=3), 0.0)
    assert reply.error[0] == "bad_request" and "does not fit" in reply.error[1]


def test_failed_load_is_an_error_and_registers_nothing():
    """A factory failure reported by the host answers the client and leaves no service."""
    core = gpu_core()
    args = {"name": "a", "runtime": "torch", "mem_gb": 60e-9, "entry": "m:f"}
    (load,) = core.handle(ev.RegisterService(args=args, token=1), 0.0)
    error = "service 'a': factory m:f failed: RuntimeError: boom"
    (reply,) = core.handle(ev.ServiceLoaded(spec=load.spec, error=error), 0.1)
    assert reply.error == ("bad_request", error)
    assert core.services.specs == {} and "a" not in core.gpu.services


def test_remove_rejects_queued_calls_and_answers_after_unload():
    """Removing a service ends its queued calls rejected at once; the remove is answered
    when the host has unloaded it."""
    from tangram.protocol.results import CallSpec

    core = gpu_core(n_gpus=1)
    register(core, "a")
    running = call(core, 1, "a", 1.0)
    assert core.handle(ev.SubmitCall(spec=CallSpec("a", {}), token=2), 1.1) == []
    assert tick(core, 1.1) == []  # the only GPU is busy: it waits
    out = core.handle(ev.RemoveService(name="a", token=3), 1.2)
    rejected, unload = out
    assert rejected.token == 2 and rejected.result["outcome"] == "rejected"
    assert isinstance(unload, ev.UnloadService) and unload.name == "a"
    (done,) = core.handle(
        ev.CallFinished(action_id=running.action_id, outcome="rejected", error="removed"), 1.3
    )
    assert done.token == 1 and done.result["outcome"] == "rejected"
    (reply,) = core.handle(ev.ServiceUnloaded(name="a"), 1.4)
    assert reply.result == {"name": "a", "removed": True, "rejected": 1}
    assert core.gpu.free_units() == 1


def test_call_of_a_multi_gpu_service_runs_at_the_smallest_count_that_fits():
    """A service of 150 bytes on 100-byte GPUs, allowed 1 or 2 GPUs, runs on a 2-GPU chunk."""
    core = gpu_core()
    args = {"name": "big", "runtime": "torch", "mem_gb": 150e-9, "entry": "m:f", "gpus": [1, 2]}
    (load,) = core.handle(ev.RegisterService(args=args, token=1), 0.0)
    core.handle(ev.ServiceLoaded(spec=load.spec), 0.0)
    run = call(core, 2, "big", 1.0)
    assert run.gpus == (0, 1) and run.evicted == ()


def test_core_feeds_the_load_meter_of_the_priced_rule():
    """Elastic arrivals and starts reach the scheduler's load meter; finished work leaves it."""
    core = make_core(cores=2)
    env = ready_env(core)
    assert core.cfg.sched.rule == "priced"
    core.handle(submit(1, "pytest -q", env, cpus=(1, 2), t1_s=4.0, eff={1: 1.0, 2: 0.9}), 1.0)
    (run,) = tick(core, 1.0)
    load = core.meter.load("cpu:local", 1.5)
    assert load.elastic_per_s > 0
    assert (load.elastic_running, load.elastic_units) == (1, len(run.cores))
    core.handle(ev.ExecFinished(action_id=run.action_id, result=ExecResult("ok", 0)), 2.0)
    assert core.meter.load("cpu:local", 2.5).elastic_units == 0


def test_an_empty_pass_does_not_delay_the_next_lone_action():
    """A completion's pass over an empty queue is no pass: the next lone action right after
    it is still scheduled at once."""
    core = make_core(cores=2, coalesce_s=0.001)
    env = ready_env(core)
    core.handle(submit(1, "true", env), 1.0)
    (run,) = tick(core, 1.0)
    core.handle(ev.ExecFinished(action_id=run.action_id, result=ExecResult("ok", 0)), 1.0009)
    tick(core, 1.0009)  # the completion's pass finds nothing queued
    core.handle(submit(2, "true", env), 1.0015)  # 1.5 ms after the last real pass
    assert core.next_wakeup(1.0015) == 1.0015

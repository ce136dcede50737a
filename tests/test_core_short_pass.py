"""The short-cut scheduling pass decides exactly what the full pass decides.

Two cores, one with ``short_passes`` and one without, are fed the same random life (execs
of 1, 2 and elastic core counts on two nodes, persistent and throwaway environments,
leases, disconnects, time passing); every command either emits must be equal, and the
short-cut path must actually have been taken.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest

from tangram.model import EnvId
from tangram.pools.api import ApiPool
from tangram.pools.cpu import CpuCluster, CpuNodePool
from tangram.protocol.results import ExecResult, ExecSpec
from tangramd import events as ev
from tangramd.state import Core, CoreConfig

GIB = 1 << 30


def counting_env_ids() -> Callable[[], EnvId]:
    """``e1``, ``e2``, ...: both cores of a comparison mint the same ids (not random ones)."""
    ids = itertools.count(1)
    return lambda: EnvId(f"e{next(ids)}")


def make_core(short: bool) -> Core:
    cluster = CpuCluster(
        [CpuNodePool("n1", [[0, 1, 2]], 4 * GIB), CpuNodePool("n2", [[0, 1], [2, 3]], 4 * GIB)]
    )
    apis = {"search": ApiPool("search", concurrency=2, quota=0, period_s=60.0)}
    return Core(cluster, apis, CoreConfig(short_passes=short), new_env_id=counting_env_ids())


class World:
    """Feeds both cores the same events and carries out core A's commands."""

    def __init__(self, seed: int, leases: bool = True, wide: float = 0.3) -> None:
        self.rng = random.Random(seed)
        self.with_leases = leases
        self.wide = wide  # share of execs asking for 2 cores or elastic
        self.a, self.b = make_core(True), make_core(False)
        self.now = 0.0
        self.tokens = iter(range(1, 10**9))
        self.running: list[str] = []  # action ids sent to the backend
        self.creating: list[str] = []
        self.removing: list[str] = []
        self.envs: list[str] = []  # ready persistent environments
        self.leases: list[str] = []

    def feed(self, event: ev.Event) -> None:
        out_a = self.a.handle(event, self.now)
        out_b = self.b.handle(event, self.now)
        assert out_a == out_b, f"{event} at {self.now}"
        self.a.validate()
        for cmd in out_a:
            if isinstance(cmd, ev.RunExec):
                self.running.append(cmd.action_id)
            elif isinstance(cmd, ev.CreateEnv):
                self.creating.append(cmd.env_id)
            elif isinstance(cmd, ev.RemoveEnv):
                self.removing.append(cmd.env_id)
            elif (
                isinstance(cmd, ev.Reply)
                and isinstance(cmd.result, dict)
                and "lease_id" in cmd.result
            ):
                self.leases.append(cmd.result["lease_id"])
        # as the executor: a pass due now runs before anything else happens
        due_a, due_b = self.a.next_wakeup(self.now), self.b.next_wakeup(self.now)
        assert due_a == due_b
        if due_a is not None and due_a <= self.now and not isinstance(event, ev.Tick):
            self.feed(ev.Tick())

    def step(self) -> None:
        rng = self.rng
        self.now += rng.choice((0.0, 0.0002, 0.0005, 0.0011, 0.003))
        due = self.a.next_wakeup(self.now)
        if due is not None and due <= self.now:
            self.feed(ev.Tick())
        roll = rng.random()
        if roll < 0.35 and self.envs:
            cpus = rng.choice((2, (1, 2))) if rng.random() < self.wide else 1
            env = rng.choice(self.envs)
            spec = ExecSpec(cmd="true", env=env, cpus=cpus, t1_s=0.1 if cpus == (1, 2) else None)
            self.feed(ev.SubmitExec(spec=spec, token=next(self.tokens), conn=rng.randrange(4)))
        elif roll < 0.40:
            spec = ExecSpec(cmd="true", cpus=rng.choice((1, 2)), mem=rng.choice((None, 8 * GIB)))
            self.feed(ev.SubmitExec(spec=spec, token=next(self.tokens), conn=rng.randrange(4)))
        elif roll < 0.72 and self.running:
            aid = self.running.pop(rng.randrange(len(self.running)))
            res = ExecResult("ok", exit_code=0, exec_s=rng.choice((0.001, 0.01, 0.2)))
            self.feed(ev.ExecFinished(action_id=aid, result=res))
        elif roll < 0.80 and self.creating:
            self.feed(ev.EnvCreated(env_id=self.creating.pop(0)))
        elif roll < 0.84 and self.removing:
            self.feed(ev.EnvRemoved(env_id=self.removing.pop(0)))
        elif roll < 0.87 and len(self.envs) < 12:
            n_before = len(self.creating)
            self.feed(ev.OpenEnv(token=next(self.tokens), mem=GIB // 4))
            if len(self.creating) > n_before:
                env_id = self.creating.pop()
                self.feed(ev.EnvCreated(env_id=env_id))
                self.envs.append(env_id)
        elif roll < 0.89 and len(self.envs) > 2:
            env = rng.choice(self.envs)
            rec = self.a.envs.get(env)
            if rec is not None and not rec.active:  # (closing a busy one: not this test's)
                self.envs.remove(env)
                self.feed(ev.CloseEnv(token=next(self.tokens), env_id=env))
        elif roll < 0.93 and self.with_leases:
            self.feed(ev.AcquireLease(token=next(self.tokens), api="search", conn=rng.randrange(4)))
        elif roll < 0.96 and self.leases:
            lease = self.leases.pop(rng.randrange(len(self.leases)))
            self.feed(ev.ReleaseLease(token=next(self.tokens), lease_id=lease))
        elif roll < 0.965:
            self.feed(ev.ConnClosed(conn=rng.randrange(4)))
        else:
            self.feed(ev.Tick())


@pytest.mark.parametrize(
    ("seed", "leases", "wide"), [(s, s % 2 == 0, 0.3 - s / 20) for s in range(6)]
)
def test_short_pass_decides_as_the_full_pass(seed: int, leases: bool, wide: float) -> None:
    world = World(seed, leases, wide)
    for _ in range(3):  # a few trajectories' environments to start with
        world.feed(ev.OpenEnv(token=next(world.tokens), mem=GIB // 4))
        env_id = world.creating.pop()
        world.feed(ev.EnvCreated(env_id=env_id))
        world.envs.append(env_id)
    for _ in range(3000):
        world.step()
    assert world.a.passes == world.b.passes
    if not leases:  # (a waiting lease keeps every pass full)
        assert world.a.passer.short > 0.2 * world.a.passes, (
            world.a.passer.short,
            world.a.passes,
        )
    assert world.b.passer.short == 0


def test_short_pass_under_a_flood_of_one_core_execs() -> None:
    """The load benchmark's shape: one node, deep queue of 1-core execs, one completion at
    a time; nearly every pass is a short one and both cores place the same actions."""
    world = World(99)
    world.rng.random = lambda: 0.1  # type: ignore[method-assign]
    for _ in range(8):
        world.feed(ev.OpenEnv(token=next(world.tokens), mem=GIB // 4))
        env_id = world.creating.pop()
        world.feed(ev.EnvCreated(env_id=env_id))
        world.envs.append(env_id)
    for i in range(400):
        env = world.envs[i % len(world.envs)]
        world.now += 0.0004
        world.feed(ev.SubmitExec(spec=ExecSpec(cmd="true", env=env, cpus=1), token=10_000 + i))
        if i % 2 and world.running:
            aid = world.running.pop(0)
            world.feed(ev.ExecFinished(action_id=aid, result=ExecResult("ok", 0, exec_s=0.001)))
    while world.running:
        world.now += 0.002
        aid = world.running.pop(0)
        world.feed(ev.ExecFinished(action_id=aid, result=ExecResult("ok", 0, exec_s=0.001)))
    assert not world.a.actions.queue and not world.b.actions.queue
    assert world.a.passer.short >= 0.8 * world.a.passes, (world.a.passer.short, world.a.passes)
    assert world.b.passer.full_pools == 0


def test_arrivals_at_full_nodes_run_no_scheduler_and_decide_the_same() -> None:
    """The load benchmark's rhythm: each completion's pass places one queued exec, and
    the next arrival finds every core busy. That arrival's pass runs no scheduler
    (``_nothing_fits``) yet decides as the full pass does, and rejects at once an exec that
    can never fit its environment's node (4 cores asked on the 2-core node)."""
    cores = {
        short: Core(
            CpuCluster(
                [
                    CpuNodePool("n1", [[0, 1]], 64 * GIB),
                    CpuNodePool("n2", [[0, 1], [2, 3]], 64 * GIB),
                ]
            ),
            {},
            CoreConfig(short_passes=short),
            new_env_id=counting_env_ids(),
        )
        for short in (True, False)
    }
    now = 0.0
    running: list[str] = []
    tokens = iter(range(1, 10**6))

    def feed(event: ev.Event) -> list[ev.Command]:
        outs = [core.handle(event, now) for core in cores.values()]
        assert outs[0] == outs[1], event
        for core in cores.values():
            core.validate()
        running.extend(c.action_id for c in outs[0] if isinstance(c, ev.RunExec))
        if (due := cores[True].next_wakeup(now)) is not None and due <= now:
            outs[0] += feed(ev.Tick())
        return outs[0]

    envs: list[str] = []
    for _ in range(16):
        feed(ev.OpenEnv(token=next(tokens), mem=GIB))
        env_id = next(e.id for e in cores[True].envs if e.id not in envs)
        feed(ev.EnvCreated(env_id=env_id))
        envs.append(env_id)
    small = [e for e in envs if cores[True].envs.get(e).node == "n1"]
    assert small and len(small) < len(envs)  # environments on both nodes
    for i in range(60):  # a deep queue, as 256 clients make it
        feed(ev.SubmitExec(spec=ExecSpec(cmd="true", env=envs[i % 16], cpus=1), token=next(tokens)))
    rejected = 0
    for i in range(300):
        now += 0.002
        feed(ev.ExecFinished(action_id=running.pop(0), result=ExecResult("ok", 0, exec_s=0.001)))
        now += 0.0003  # its client asks again: every core is busy by then
        if i % 50 == 7:  # now and then one that can never fit its node
            spec = ExecSpec(cmd="true", env=small[i % len(small)], cpus=4)
        else:
            spec = ExecSpec(cmd="true", env=envs[i % 16], cpus=1)
        out = feed(ev.SubmitExec(spec=spec, token=next(tokens)))
        now += 0.0011  # past the coalescing window: the arrival's pass is due
        out += feed(ev.Tick())
        rejected += sum(
            isinstance(c, ev.Reply) and c.error is not None and c.error[0] == "unschedulable"
            for c in out
        )
    short, full = cores[True], cores[False]
    assert rejected == 6
    assert short.passes == full.passes
    assert short.passer.full_pools >= 0.4 * short.passes, (short.passer.full_pools, short.passes)
    assert full.passer.full_pools == 0

"""``CancelAction`` and ``RenewLease`` in the pure core: who may cancel, what each state of
an action answers, the commands it returns (no I/O: the executor kills, the core decides)."""

from __future__ import annotations

import pytest

from tangram.pools.api import ApiPool
from tangram.pools.cpu import CpuCluster, CpuNodePool
from tangram.protocol.errors import NotFound
from tangram.protocol.results import ExecResult, ExecSpec
from tangramd import events as ev
from tangramd.state import Core, CoreConfig

GIB = 1 << 30
ALICE, BOB, ROOT = (1000, 1000), (1001, 1001), (0, 0)


def make_core() -> Core:
    cluster = CpuCluster([CpuNodePool("local", [[0]], 8 * GIB)])  # one core
    apis = {"search": ApiPool("search", concurrency=1, quota=0, period_s=60.0)}
    return Core(cluster, apis, CoreConfig())


def handle(core: Core, event: ev.Event, now: float) -> list[ev.Command]:
    out = core.handle(event, now)
    core.validate()
    return out


def replies(out: list[ev.Command]) -> dict[int, ev.Reply]:
    return {c.token: c for c in out if isinstance(c, ev.Reply)}


def running_and_queued(core: Core) -> tuple[str, str]:
    """Alice's exec runs (token 1) on the one core; her second one (token 2) waits."""
    (create,) = handle(core, ev.OpenEnv(token=9, peer=ALICE), 0.0)
    handle(core, ev.EnvCreated(env_id=create.env_id), 0.1)
    spec = ExecSpec(cmd="sleep 9", env=create.env_id, ref="r1")
    handle(core, ev.SubmitExec(spec=spec, token=1, conn=7, peer=ALICE), 0.2)
    (run,) = [c for c in handle(core, ev.Tick(), 0.3) if isinstance(c, ev.RunExec)]
    spec2 = ExecSpec(cmd="sleep 9", env=create.env_id, ref="r2")
    handle(core, ev.SubmitExec(spec=spec2, token=2, conn=7, peer=ALICE), 0.4)
    handle(core, ev.Tick(), 0.5)
    (queued,) = core.actions.queue
    return run.action_id, queued


def test_another_user_cannot_cancel_root_and_owner_can() -> None:
    """Bob's cancel of Alice's action is not found (nothing changes); Alice's own cancel by
    ``ref`` on her connection ends the waiting one; root's cancel kills the running one."""
    core = make_core()
    running, queued = running_and_queued(core)
    for target in (running, queued):
        with pytest.raises(NotFound, match=target):
            core.handle(ev.CancelAction(action_id=target, peer=BOB), 1.0)
    out = handle(core, ev.CancelAction(token=3, action_id=queued, peer=BOB), 1.0)
    assert replies(out)[3].error[0] == "not_found"
    assert core.actions.get(queued).state == "queued"

    out = handle(core, ev.CancelAction(token=4, ref="r2", conn=7, peer=ALICE), 1.1)
    assert replies(out)[4].result == {
        "action_id": queued,
        "cancelled": True,
        "state": "done",
        "outcome": "cancelled",
    }
    assert replies(out)[2].result["outcome"] == "cancelled"  # its own client is told
    assert not any(isinstance(c, ev.RunExec) for c in out)
    # a ref names an action on its own connection only
    with pytest.raises(NotFound):
        core.handle(ev.CancelAction(ref="r1", conn=8, peer=ALICE), 1.2)

    out = handle(core, ev.CancelAction(token=5, action_id=running, peer=ROOT), 1.3)
    (kill,) = [c for c in out if isinstance(c, ev.KillExec)]
    assert (kill.action_id, kill.node, kill.session) == (running, "local", None)
    assert 5 not in replies(out)  # answered once the exec is gone
    again = handle(core, ev.CancelAction(token=6, action_id=running, peer=ALICE), 1.4)
    assert not any(isinstance(c, ev.KillExec) for c in again)
    killed = ExecResult("failed", exit_code=137, exec_s=1.0)
    out = handle(core, ev.ExecFinished(action_id=running, result=killed), 1.5)
    got = replies(out)
    assert got[1].result["outcome"] == "cancelled" and got[1].result["exit_code"] == 137
    assert got[5].result["outcome"] == got[6].result["outcome"] == "cancelled"
    assert core.cpu.nodes[0].free_units() == 1
    # ended: its outcome for its owner, not found for another user
    out = handle(core, ev.CancelAction(token=7, action_id=running, peer=ALICE), 1.6)
    assert replies(out)[7].result["state"] == "done"
    with pytest.raises(NotFound):
        core.handle(ev.CancelAction(action_id=running, peer=BOB), 1.7)


def test_a_killed_exec_that_had_exited_zero_stays_ok() -> None:
    """The kill raced the command's own end: it finished, so its outcome is ok."""
    core = make_core()
    running, _ = running_and_queued(core)
    handle(core, ev.CancelAction(token=5, action_id=running), 1.0)
    done = ExecResult("ok", exit_code=0, exec_s=1.0)
    out = handle(core, ev.ExecFinished(action_id=running, result=done), 1.1)
    assert replies(out)[5].result == {
        "action_id": running,
        "cancelled": False,
        "state": "done",
        "outcome": "ok",
    }


def test_renew_moves_a_granted_leases_expiry_and_a_waiting_ones_ttl() -> None:
    """A granted lease expires ttl_s after its renewal; a waiting one gets the new TTL when
    granted; an ended one is not found."""
    core = make_core()
    handle(core, ev.AcquireLease(api="search", ttl_s=1.0, token=1), 0.0)
    (grant,) = handle(core, ev.Tick(), 0.0)
    lease = grant.result["lease_id"]
    handle(core, ev.AcquireLease(api="search", ttl_s=1.0, token=2), 0.1)
    waiting = next(iter(core.actions.queue))
    out = handle(core, ev.RenewLease(token=3, lease_id=lease, ttl_s=5.0), 0.5)
    assert replies(out)[3].result == {"lease_id": lease, "ttl_s": 5.0, "state": "granted"}
    handle(core, ev.RenewLease(token=4, lease_id=waiting, ttl_s=2.0), 0.5)
    handle(core, ev.Tick(), 1.5)
    assert core.leases.get(lease).state == "granted"  # its first TTL has passed
    assert core.next_wakeup(1.5) == pytest.approx(5.5)
    out = handle(core, ev.Tick(), 5.5)
    assert core.read.story(lease, 0.0)["outcome"] == "expired"
    assert replies(out)[2].result["ttl_s"] == 2.0  # the waiting one, granted now
    with pytest.raises(NotFound, match=lease):
        core.handle(ev.RenewLease(lease_id=lease, ttl_s=1.0), 6.0)

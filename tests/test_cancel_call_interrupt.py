"""Ctrl-C on a blocking GPU service call cancels it, as it does an exec: a real
``tangramd up`` with one simulated GPU and a tiny torch service (tests/data/services).

SIGINT to a ``tangramctl call`` whose handler runs stops its forward pass (the replica's
worker is killed) and exits 130; one queued behind it leaves the queue and never runs.
``call`` carries a ``ref`` that ``cancel`` finds it by, on its own connection only; a
cancelled ``AsyncClient.call`` coroutine cancels its call.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from harness import pid_alive, running_daemon, service_worker_pid

from tangram.client import AsyncClient
from tangram.protocol.errors import BadRequest, NotFound
from tangram.testing import wait_for, wait_for_async

SERVICES = Path(__file__).parent / "data" / "services"
ONE_GPU = "[gpu]\nsimulated = { count = 1, mem_gb = 0.1 }\nnvml = false\n"
CTL = [sys.executable, "-m", "tangramctl.main"]
SPEC = {"name": "s", "runtime": "torch", "mem_gb": 0.01, "entry": "tiny_services:small"}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """One simulated GPU: a second call waits for the first; service s registered."""
    with running_daemon(tmp_path_factory.mktemp("cancel-call"), config=ONE_GPU) as d:
        with d.client() as c:
            c.request("service.register", {**SPEC, "path": str(SERVICES)})
        yield d


def _ctl_call(sock: str, payload: dict, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*CTL, "--socket", sock, "call", "s", *flags, "--", json.dumps(payload)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_ctrl_c_on_tangramctl_call_cancels_a_running_and_a_queued_call(daemon, tmp_path):
    """SIGINT to a `tangramctl call` queued behind another that holds the only GPU: exit
    130, it never runs (its handler's marker file never appears). SIGINT to the running
    one (its handler sleeps 30 s): exit 130 once the call has ended, its story says
    cancelled, its worker is gone; the next call restarts the replica and answers."""
    sock = daemon.socket
    started, never = tmp_path / "started", tmp_path / "never"
    running = _ctl_call(sock, {"x": 1, "sleep": 30.0, "started": str(started)})
    procs = [running]
    try:
        with daemon.client() as c:
            wait_for(started.exists, 60, "the call in its handler")
            running_id = c.queue()["running"][0]["action_id"]
            pid = wait_for(
                lambda: service_worker_pid(c), 30, "the worker in service list", every_s=0.2
            )

            queued = _ctl_call(sock, {"x": 1, "started": str(never)}, "--json")
            procs.append(queued)
            rows = wait_for(lambda: c.queue()["waiting"], 30, "the second call queued")
            queued_id = rows[0]["action_id"]
            queued.send_signal(signal.SIGINT)
            out, err = queued.communicate(timeout=30)
            assert queued.returncode == 130, err
            answer = json.loads(out)
            assert (answer["action_id"], answer["outcome"]) == (queued_id, "cancelled"), answer
            assert "interrupted (Ctrl-C)" in answer["error"], answer
            assert c.story(queued_id)["outcome"] == "cancelled"
            assert [r["action_id"] for r in c.queue()["running"]] == [running_id]

            running.send_signal(signal.SIGINT)
            _, err = running.communicate(timeout=30)
            assert running.returncode == 130, err
            assert "tangramctl: cancelled: interrupted (Ctrl-C)" in err, err
            assert not pid_alive(pid)  # the replica's worker was killed before the answer
            story = c.story(running_id)
            assert story["outcome"] == "cancelled", story
            assert any(event["event"] == "cancel" for event in story["events"]), story

            again = c.call("s", {"x": 2.0})
            assert again.outcome == "ok" and again.gpus == (0,), again
            assert again.result is not None and again.result["pid"] != pid, again
            assert not never.exists()  # the interrupted queued call never ran
            assert c.queue()["running"] == [] and c.queue()["waiting"] == []
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def test_cancel_finds_a_call_by_its_ref_on_its_own_connection(daemon, tmp_path):
    """A `call` with `ref` is cancelled by `cancel {"ref"}` on its connection; the same
    ref on another connection, or an unknown one, is not_found (as for exec); a ref that
    is not a string, or one naming another live action on the connection, is a
    bad_request naming the field (free again once that action ends). Cancelling an
    `AsyncClient.call` coroutine (it sets its own ref) stops the running call."""
    started = tmp_path / "started"

    async def scenario() -> str:
        async with AsyncClient(daemon.socket) as ac, AsyncClient(daemon.socket) as other:
            payload = {"x": 1, "sleep": 30.0, "started": str(started)}
            task = asyncio.ensure_future(ac.call("s", payload, ref="mine"))
            await wait_for_async(lambda: started.exists() or task.done(), 60, "its handler")
            assert not task.done(), task
            with pytest.raises(NotFound, match="mine"):
                await other.request("cancel", {"ref": "mine"})
            with pytest.raises(NotFound, match="nobody-has-this"):
                await ac.request("cancel", {"ref": "nobody-has-this"})
            with pytest.raises(BadRequest, match="ref"):
                await ac.request("call", {"name": "s", "payload": {"x": 1}, "ref": 5})
            # a ref names one live action on its connection: a second is refused
            with pytest.raises(BadRequest, match="ref: 'mine' already names live action"):
                await ac.request("call", {"name": "s", "payload": {"x": 1}, "ref": "mine"})
            answer = await ac.request("cancel", {"ref": "mine"})
            assert answer["cancelled"] is True and answer["outcome"] == "cancelled", answer
            res = await task
            assert res.outcome == "cancelled" and res.action_id == answer["action_id"], res
            # ... until that action ends: then the ref is free again
            again = await ac.call("s", {"x": 1}, ref="mine")
            assert again.outcome == "ok" and again.action_id != res.action_id, again

            started.unlink()
            task = asyncio.ensure_future(ac.call("s", payload))
            await wait_for_async(lambda: started.exists() or task.done(), 60, "its handler")
            assert not task.done(), task
            rows = (await other.queue())["running"]
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return rows[0]["action_id"]

    action_id = asyncio.run(scenario())
    with daemon.client() as c:
        story = wait_for(
            lambda: (s := c.story(action_id))["outcome"] is not None and s,
            30,
            "the abandoned call ended",
        )
        assert story["outcome"] == "cancelled", story
        assert c.call("s", {"x": 1.0}).outcome == "ok"

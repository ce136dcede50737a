"""``cancel`` and ``lease.renew`` on a real ``tangramd up`` with one core (issue 34, item 4).

A queued exec leaves the queue and never runs; a running one is killed with everything it
started (no process of it is left when the cancel is answered); both end ``cancelled``, as
their own clients are told. A running GPU call is stopped (its replica's worker killed; the
next call restarts it). Cancelling an ``AsyncClient.exec`` coroutine cancels its action.
A renewed lease outlives its first TTL; an unrenewed one expires.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
import time
import uuid
from pathlib import Path

import msgpack
import psutil
import pytest
from harness import frame, pid_alive, running_daemon, service_worker_pid
from hostile_user import in_child_as, local_user

from tangram.client import AsyncClient
from tangram.protocol.codec import FrameDecoder
from tangram.protocol.errors import BadRequest, NotFound
from tangram.testing import spawn_daemon, wait_for

CORE = min(os.sched_getaffinity(0))
ONE_CORE = f"\n[cpu]\ncores = [{CORE}]\n"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """One core: a second exec waits for the first."""
    with running_daemon(tmp_path_factory.mktemp("cancel"), config=ONE_CORE) as d:
        yield d


def marker() -> str:
    """A number no other process has on its command line (``sleep 300.<it>``)."""
    return str(uuid.uuid4().int % 10**9)


def sleeper(mark: str) -> str:
    """A command that sleeps in the foreground and leaves a background child."""
    return f"sleep 300.{mark} & sleep 301.{mark}; wait"


def processes_with(mark: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if mark in " ".join(proc.info["cmdline"] or ()):
            found.append(proc)
    return found


def in_thread(fn):
    """Run ``fn`` in a thread; ``box["result"]`` (or ``box["error"]``) when it ends."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except Exception as exc:  # pragma: no cover - shown by the assertion
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    box["thread"] = thread
    return box


def running_action(c) -> str:
    rows = wait_for(lambda: c.queue()["running"], 20, "an exec running")
    return rows[0]["action_id"]


def test_cancel_a_queued_and_a_running_exec(daemon):
    running_mark, queued_mark = marker(), marker()
    first = in_thread(lambda: daemon.client().exec(sleeper(running_mark)))
    with daemon.client() as c:
        running_id = running_action(c)
        wait_for(lambda: len(processes_with(running_mark)) >= 2, 20, "both sleeps started")
        second = in_thread(lambda: daemon.client().exec(f"sleep 302.{queued_mark}"))
        waiting = wait_for(lambda: c.queue()["waiting"], 20, "the second exec queued")
        queued_id = waiting[0]["action_id"]

        # the queued one leaves the queue, never runs, and its client is told
        answer = c.cancel(queued_id)
        assert answer == {
            "action_id": queued_id,
            "cancelled": True,
            "state": "done",
            "outcome": "cancelled",
        }
        second["thread"].join(10)
        res = second["result"]
        assert (res.outcome, res.exit_code, res.exec_s) == ("cancelled", None, 0.0), res
        assert res.action_id == queued_id
        assert c.queue()["waiting"] == []
        assert not processes_with(queued_mark)

        # the running one is killed, background child and all, before the answer
        started = time.monotonic()
        answer = c.cancel(running_id)
        assert answer["cancelled"] is True and answer["outcome"] == "cancelled", answer
        assert time.monotonic() - started < 10
        assert processes_with(running_mark) == []
        first["thread"].join(10)
        res = first["result"]
        assert res.outcome == "cancelled" and res.action_id == running_id, res
        assert "cancelled" in res.detail
        story = c.story(running_id)
        assert story["outcome"] == "cancelled"
        assert any(event["event"] == "cancel" for event in story["events"]), story

        # the core is free again; an ended action answers its outcome, no error
        assert c.exec("true").outcome == "ok"
        again = c.cancel(running_id)
        assert (again["state"], again["outcome"]) == ("done", "cancelled")
        ok = c.exec("true")
        assert c.cancel(ok.action_id) == {
            "action_id": ok.action_id,
            "cancelled": False,
            "state": "done",
            "outcome": "ok",
        }
        assert c.status()["running"] == 0


def test_cancel_bad_input_is_a_typed_error(daemon):
    with daemon.client() as c:
        with pytest.raises(NotFound, match="a7777777"):
            c.cancel("a7777777")
        with pytest.raises(BadRequest, match="id"):
            c.request("cancel", {"id": 5})
        with pytest.raises(BadRequest, match="id"):
            c.request("cancel", {})
        with pytest.raises(BadRequest, match="id"):
            c.request("cancel", {"id": "a1", "ref": "r"})
        with pytest.raises(BadRequest, match="unknown arg"):
            c.request("cancel", {"id": "a1", "what": 1})
        with pytest.raises(NotFound):
            c.request("cancel", {"ref": "nobody-has-this"})
        lease = c.acquire_lease("search", ttl_s=5)
        with pytest.raises(BadRequest, match=r"lease\.release"):
            c.cancel(lease)
        c.release_lease(lease)
        assert c.exec("true").outcome == "ok"


def test_cancelling_the_async_exec_coroutine_kills_its_action(daemon):
    mark = marker()

    async def scenario():
        async with AsyncClient(daemon.socket) as ac:
            task = asyncio.ensure_future(ac.exec(sleeper(mark)))
            await asyncio.to_thread(
                wait_for, lambda: len(processes_with(mark)) >= 2, 20, "the exec running"
            )
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # the connection stays usable, and the action is gone
            await asyncio.to_thread(wait_for, lambda: not processes_with(mark), 10, "killed")
            return await ac.exec("true")

    after = asyncio.run(scenario())
    assert after.outcome == "ok"
    with daemon.client() as c:
        wait_for(lambda: c.status()["running"] == 0, 10, "nothing running")
        story = c.story(_previous(after.action_id))
        assert story["outcome"] == "cancelled", story


def _previous(action_id: str) -> str:
    """The id the daemon gave the action before ``action_id`` (ids count up in hex)."""
    prefix, number = action_id[0], int(action_id[1:], 16)
    return f"{prefix}{number - 1:x}"


def test_cancelling_a_waiting_async_exec_withdraws_it(daemon):
    running_mark, waiting_mark = marker(), marker()

    async def scenario():
        async with AsyncClient(daemon.socket) as ac:
            first = asyncio.ensure_future(ac.exec(f"sleep 3.{running_mark}"))
            second = asyncio.ensure_future(ac.exec(f"sleep 300.{waiting_mark}"))
            with daemon.client() as c:
                await asyncio.to_thread(
                    wait_for, lambda: c.queue()["waiting"], 20, "the second exec queued"
                )
                second.cancel()
                await asyncio.to_thread(wait_for, lambda: not c.queue()["waiting"], 10, "withdrawn")
            return await first

    first = asyncio.run(scenario())
    assert first.outcome == "ok"
    assert not processes_with(waiting_mark)


def test_a_ref_names_one_live_exec_on_its_connection(daemon):
    """A second exec with the ref of a live one on the same connection is a bad_request
    naming the ref; another connection may use it (its exec waits for the one core), and
    so may this one once the first has ended."""
    mark = marker()

    async def scenario():
        async with AsyncClient(daemon.socket) as ac, AsyncClient(daemon.socket) as other:
            first = asyncio.ensure_future(ac.exec(sleeper(mark), ref="r"))
            await asyncio.to_thread(
                wait_for, lambda: len(processes_with(mark)) >= 2, 20, "the exec running"
            )
            with pytest.raises(BadRequest, match="ref: 'r' already names live action"):
                await ac.exec(f"true {mark}-dup", ref="r")
            queued = asyncio.ensure_future(other.exec("true", ref="r"))  # one core: it waits
            with daemon.client() as c:
                await asyncio.to_thread(
                    wait_for, lambda: c.queue()["waiting"], 20, "the other connection's exec"
                )
            answer = await ac.request("cancel", {"ref": "r"})
            done, elsewhere = await first, await queued
            again = await ac.exec("true", ref="r")
            return elsewhere, answer, done, again

    elsewhere, answer, done, again = asyncio.run(scenario())
    assert elsewhere.outcome == "ok", elsewhere
    assert answer["outcome"] == "cancelled" and done.outcome == "cancelled", (answer, done)
    assert again.outcome == "ok" and again.action_id != done.action_id, again


def _raw_as(path: str, uid: int, gid: int, request: dict) -> dict:
    def work() -> bytes:
        import socket

        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(path)
        s.sendall(frame(request))
        dec = FrameDecoder()
        while (msg := dec.next_message()) is None:
            dec.feed(s.recv(65536))
        return msgpack.packb(msg)

    return msgpack.unpackb(in_child_as(uid, gid, work))


def test_another_users_action_is_not_found():
    """Only the user who submitted an action (or root) may cancel it."""
    mark = marker()
    with local_user() as user, tempfile.TemporaryDirectory(prefix="tgc-", dir="/tmp") as tmp:
        os.chmod(tmp, 0o755)
        d = spawn_daemon(tmp, ONE_CORE)
        try:
            os.chown(d.socket, 0, user.gid)  # the operator lets the user's group connect
            running = in_thread(lambda: d.client().exec(sleeper(mark)))
            with d.client() as c:
                aid = running_action(c)
                wait_for(lambda: len(processes_with(mark)) >= 2, 20, "both sleeps started")
                msg = _raw_as(d.socket, *user.ids, {"id": 1, "op": "cancel", "args": {"id": aid}})
                assert not msg["ok"] and msg["error"]["code"] == "not_found", msg
                assert aid in msg["error"]["message"]
                assert len(processes_with(mark)) >= 2  # untouched
                assert c.cancel(aid)["outcome"] == "cancelled"  # its owner (root) may
                running["thread"].join(10)
                assert running["result"].outcome == "cancelled"
                # an ended action of another user is not found either
                msg = _raw_as(d.socket, *user.ids, {"id": 1, "op": "cancel", "args": {"id": aid}})
                assert not msg["ok"] and msg["error"]["code"] == "not_found", msg
        finally:
            d.stop()
            log = d.log()
    assert "Traceback" not in log


def test_lease_renew_outlives_its_first_ttl(daemon):
    with daemon.client() as c:
        renewed = c.acquire_lease("search", ttl_s=1.0)
        plain = c.acquire_lease("search", ttl_s=1.0)
        answer = c.lease_renew(renewed, 3.0)
        assert answer == {"lease_id": renewed, "ttl_s": 3.0, "state": "granted"}
        time.sleep(1.6)
        assert c.story(plain)["outcome"] == "expired"
        assert c.story(renewed)["state"] == "running"
        assert c.lease_renew(renewed, 1.0)["state"] == "granted"
        with pytest.raises(NotFound, match=plain):
            c.lease_renew(plain, 5.0)
        with pytest.raises(NotFound, match="l999999"):
            c.lease_renew("l999999", 5.0)
        for bad in (0, -1, "x", float("nan"), None):
            with pytest.raises(BadRequest, match="ttl_s"):
                c.request("lease.renew", {"lease": renewed, "ttl_s": bad})
        with pytest.raises(BadRequest, match="lease"):
            c.request("lease.renew", {"ttl_s": 1.0})
        wait_for(lambda: c.story(renewed)["outcome"] == "expired", 5, "the renewed lease expired")
        assert c.api_list()  # still serving


def test_cancel_a_running_exec_in_a_session_keeps_the_shell(daemon):
    """An exec in a shell session is interrupted, not the shell: it ends cancelled and the
    session runs the next command."""
    mark = marker()
    with daemon.client() as c:
        env = c.env_open()
        session = c.session_open(env)
        running = in_thread(lambda: daemon.client().exec(f"sleep 300.{mark}", session=session))
        aid = running_action(c)
        wait_for(lambda: processes_with(mark), 20, "the sleep started")
        answer = c.cancel(aid)
        assert answer["outcome"] == "cancelled", answer
        assert processes_with(mark) == []
        running["thread"].join(10)
        assert running["result"].outcome == "cancelled"
        assert c.exec("echo still", session=session).stdout == "still\n"
        c.session_close(session)
        c.env_close(env)


SERVICES = Path(__file__).parent / "data" / "services"
ONE_GPU = "[gpu]\nsimulated = { count = 1, mem_gb = 0.1 }\nnvml = false\n"


def test_cancel_a_queued_call_and_a_running_one(tmp_path):
    """A GPU call waiting for the one GPU leaves the queue (its caller gets cancelled); a
    running call (its handler sleeps 30 s) is stopped: the cancel answers once it has
    ended, its replica's worker is gone, it ends `cancelled` for its caller and in its
    story; the next call restarts the replica on the freed GPU and answers right."""
    started = tmp_path / "started"
    with running_daemon(tmp_path, config=ONE_GPU) as d, d.client() as c:
        spec = {"name": "s", "runtime": "torch", "mem_gb": 0.01, "entry": "tiny_services:small"}
        c.request("service.register", {**spec, "path": str(SERVICES)})
        payload = {"x": 1, "sleep": 30.0, "started": str(started)}
        running = in_thread(lambda: d.client().call("s", payload, timeout_s=120))
        wait_for(started.exists, 60, "the call in its handler")
        running_id = c.queue()["running"][0]["action_id"]
        pid = wait_for(lambda: service_worker_pid(c), 30, "the worker in service list", every_s=0.2)
        queued = in_thread(lambda: d.client().call("s", {"x": 1}))
        rows = wait_for(lambda: c.queue()["waiting"], 20, "the second call queued")
        assert c.cancel(rows[0]["action_id"])["outcome"] == "cancelled"
        queued["thread"].join(10)
        assert queued["result"].outcome == "cancelled"
        assert c.cancel(running_id) == {
            "action_id": running_id,
            "cancelled": True,
            "state": "done",
            "outcome": "cancelled",
        }
        assert not pid_alive(pid)
        running["thread"].join(20)
        res = running["result"]
        assert res.outcome == "cancelled" and res.result is None, res
        story = c.story(running_id)
        assert story["outcome"] == "cancelled", story
        assert any(event["event"] == "cancel" for event in story["events"]), story
        again = c.call("s", {"x": 2.0})
        assert again.outcome == "ok" and again.gpus == (0,), again
        assert again.result is not None and again.result["pid"] != pid, again  # restarted
        assert again.result["y"] == pytest.approx(2.0 * sum(i / 1000 for i in range(1000)) + 0.5)
        assert c.queue()["running"] == []


def test_cancel_of_a_job_takes_only_what_the_caller_may_see():
    """`cancel` with job and all from another user leaves root's running exec of that job
    alone (an empty list: nothing of theirs); root, an operator, cancels it."""
    mark = marker()
    with local_user() as user, tempfile.TemporaryDirectory(prefix="tgc-", dir="/tmp") as tmp:
        os.chmod(tmp, 0o755)
        d = spawn_daemon(tmp, ONE_CORE)
        try:
            os.chown(d.socket, 0, user.gid)  # the operator lets the user's group connect
            running = in_thread(lambda: d.client().exec(sleeper(mark), job="shared"))
            with d.client() as c:
                aid = running_action(c)
                wait_for(lambda: len(processes_with(mark)) >= 2, 20, "both sleeps started")
                args = {"job": "shared", "all": True}
                msg = _raw_as(d.socket, *user.ids, {"id": 1, "op": "cancel", "args": args})
                assert msg["ok"] and msg["result"] == {"job": "shared", "actions": []}, msg
                assert len(processes_with(mark)) >= 2  # untouched
                answer = c.cancel_job("shared")
                assert answer["actions"] == [
                    {"action_id": aid, "cancelled": True, "state": "done", "outcome": "cancelled"}
                ]
                assert not processes_with(mark)
                running["thread"].join(10)
                assert running["result"].outcome == "cancelled"
                for bad in ({"job": "shared"}, {"all": True}, {"id": aid, "all": True}):
                    with pytest.raises(BadRequest, match="all"):
                        c.request("cancel", bad)
                with pytest.raises(BadRequest, match="exactly one"):
                    c.request("cancel", {"id": aid, "job": "shared", "all": True})
        finally:
            d.stop()
            log = d.log()
    assert "Traceback" not in log


SLOW_GPU = "[gpu]\nsimulated = { count = 1, mem_gb = 0.1, h2d_gbps = 0.015 }\nnvml = false\n"


def test_cancel_a_call_during_its_restore(tmp_path):
    """A call cancelled while its replica restores (0.06 GB at 0.015 GB/s: 4 s) ends
    `cancelled` without running its handler, and the daemon logs no failure of its own
    (no `call_failed` traceback); the next call restores afresh and answers."""
    started = tmp_path / "started"
    with running_daemon(tmp_path, config=SLOW_GPU) as d, d.client() as c:
        spec = {"name": "s", "runtime": "torch", "mem_gb": 0.06, "entry": "tiny_services:small"}
        c.request("service.register", {**spec, "path": str(SERVICES)})
        running = in_thread(lambda: d.client().call("s", {"x": 1, "started": str(started)}))
        aid = wait_for(lambda: c.queue()["running"], 30, "the call placed")[0]["action_id"]
        answer = c.cancel(aid)
        assert answer["outcome"] == "cancelled", answer
        running["thread"].join(30)
        assert running["result"].outcome == "cancelled", running["result"]
        assert not started.exists()  # its handler never ran
        again = c.call("s", {"x": 2})
        assert again.outcome == "ok" and again.restore_s > 0.0, again
        assert "call_failed" not in d.log()

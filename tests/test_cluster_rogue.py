"""A rogue node (issue 31, item 4): a client of the real link that joins a real coordinator
with the join token, answers what the test lets it answer and never the rest. Every
coordinator->node request it leaves unanswered ends within `[cluster]
node_request_timeout_s` (`infra_error` for what the client waits on) and the node is
drained as suspect; an exec it said it started has its own timeout plus that grace, and
a service call its timeout plus `[gpu] restore_timeout_s` plus that grace."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from cluster_harness import node_row, spawn_coordinator, stop_all

from tangram.client import Client
from tangram.protocol.errors import InfraError
from tangram.protocol.link import make_message
from tangram.testing import wait_for
from tangram.version import __version__
from tangramd.cluster.link import Link, split_host_port
from tangramd.cluster.pki import client_context

TIMEOUT_S = 1.0
CONFIG = f"[cluster]\nnode_request_timeout_s = {TIMEOUT_S}\nheartbeat_timeout_s = 60.0\n"
RESTORE_TIMEOUT_S = 0.5
GPU_CONFIG = f"{CONFIG}[gpu]\nrestore_timeout_s = {RESTORE_TIMEOUT_S}\n"
ONE_GPU = [{"mem_bytes": 1 << 30, "h2d_bytes_per_s": 1e9, "simulated": True}]


class RogueNode:
    """A node of its own making on its own loop: it answers ``create_env`` (so that the
    client has an environment there), heartbeats, and whatever ``answers`` lets it:
    ``exec_started`` (say each exec started, never that it ended), ``open_session``,
    ``run_call`` (answer each call ``ok``), ``stop_call`` (say it stopped the call,
    ``stop_delay_s`` later); with ``gpus`` it says each ``load_service`` loaded. Everything
    else it receives is only recorded; ``trace`` has what it received and sent about calls,
    in order (``(kind, action_id)``)."""

    def __init__(
        self, join: dict[str, Any], name: str = "rogue", gpus: list[dict[str, Any]] | None = None
    ) -> None:
        self.join, self.name, self.gpus = join, name, gpus or []
        self.answers: set[str] = set()
        self.stop_delay_s = 0.0
        self.received: list[dict[str, Any]] = []
        self.trace: list[tuple[str, str]] = []
        self.link: Link | None = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._task = asyncio.run_coroutine_threadsafe(self._run(), self.loop)

    def kinds(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in list(self.received) if m.get("t") == kind]

    def send(self, msg: dict[str, Any]) -> None:
        def send() -> None:
            assert self.link is not None
            self.link.send(msg)

        self.loop.call_soon_threadsafe(send)

    async def _run(self) -> None:
        host, port = split_host_port(self.join["coordinator"])
        reader, writer = await asyncio.open_connection(host, port, ssl=client_context())
        link = self.link = Link(reader, writer)
        assert (await link.recv())["t"] == "ca"
        hello = make_message(
            "hello",
            name=self.name,
            version=__version__,
            cores_by_numa=[[0]],
            mem_bytes=1 << 30,
            gpus=self.gpus,
            backend="process",
            envs=[],
            running=[],
            outbox=[],
            token=self.join["token"],
        )
        link.send(hello)
        assert (await link.recv())["t"] == "welcome"
        beat = asyncio.get_running_loop().create_task(self._beat(link))
        try:
            while True:
                msg = await link.recv()
                self.received.append(msg)
                if "action_id" in msg:
                    self.trace.append((msg["t"], msg["action_id"]))
                self._answer(link, msg)
        finally:
            beat.cancel()
            await asyncio.gather(beat, return_exceptions=True)

    async def _beat(self, link: Link) -> None:
        while True:
            link.send(make_message("hb"))
            await asyncio.sleep(0.2)

    def _answer(self, link: Link, msg: dict[str, Any]) -> None:
        kind = msg["t"]
        if kind == "create_env":
            env = msg["env_id"]
            link.send(make_message("env_created", key=f"c:{env}", env_id=env))
        elif kind == "run_exec" and "exec_started" in self.answers:
            link.send(make_message("exec_started", action_ids=[msg["action_id"]]))
        elif kind == "open_session" and "open_session" in self.answers:
            sid = msg["session_id"]
            link.send(make_message("session_opened", key=f"so:{sid}", session_id=sid))
        elif kind == "load_service" and self.gpus:
            name = msg["spec"]["name"]
            link.send(make_message("service_loaded", key=f"sl:{name}", name=name, info={}))
        elif kind == "run_call" and "run_call" in self.answers:
            link.send(call_done(msg["action_id"], {"y": 1.0}))
        elif kind == "stop_call" and "stop_call" in self.answers:
            aid = msg["action_id"]
            stopped = make_message("call_stopped", key=f"cs:{aid}", action_id=aid, was="running")

            def confirm() -> None:
                self.trace.append(("call_stopped", aid))
                link.send(stopped)

            asyncio.get_running_loop().call_later(self.stop_delay_s, confirm)

    def close(self) -> None:
        async def stop() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if self.link is not None:
                self.link.abort()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


def call_done(action_id: str, result: dict[str, Any]) -> dict[str, Any]:
    """A node's ``call_done`` for a call that answered ``result``."""
    return make_message(
        "call_done",
        key=f"cd:{action_id}",
        action_id=action_id,
        outcome="ok",
        result=result,
        exec_s=0.01,
        restore_s=0.0,
        batch=1,
    )


@contextlib.contextmanager
def _rogue_cluster(tmp_path: Path, config: str, **rogue: Any) -> Iterator[tuple[Any, RogueNode]]:
    """A real coordinator with the rogue node joined (``rogue``: RogueNode's options)."""
    coord = spawn_coordinator(tmp_path / "c", config)
    node = None
    try:
        node = RogueNode(coord.join, **rogue)
        wait_for(lambda: _state(coord) == "ready", 20, "the rogue node joined")
        yield coord, node
    finally:
        if node is not None:
            node.close()
        stop_all([coord])


@pytest.fixture
def cluster(tmp_path) -> Iterator[tuple[Any, RogueNode]]:
    with _rogue_cluster(tmp_path, CONFIG) as both:
        yield both


@pytest.fixture
def gpu_cluster(tmp_path) -> Iterator[tuple[Any, RogueNode]]:
    """The rogue node with one GPU, and service `s` registered (it answers no call
    message until a test adds it to ``answers``)."""
    with _rogue_cluster(tmp_path, GPU_CONFIG, gpus=ONE_GPU) as (coord, rogue):
        with Client(coord.socket) as c:
            c.service_register("s", mem_gb=0.1, entry="tiny_services:small", path=str(tmp_path))
        yield coord, rogue


def _state(coord: Any) -> str | None:
    with Client(coord.socket) as c:
        rows = {r["name"]: r for r in c.nodes()}
    return rows["rogue"]["state"] if "rogue" in rows else None


def _undrain(coord: Any) -> None:
    with Client(coord.socket) as c:
        c.request("node.undrain", {"name": "rogue"})


def test_an_exec_the_node_never_acknowledges_fails_infra_error_and_drains_it(cluster):
    """run_exec never acknowledged: the exec ends `infra_error` after the deadline, not
    after its own (long) timeout; the node is drained as suspect and told to kill it."""
    coord, rogue = cluster
    with Client(coord.socket) as c:
        env = c.env_open(trajectory="t")
        started = time.monotonic()
        res = c.exec("sleep 100", env=env, timeout_s=300)
        assert time.monotonic() - started < 20
    assert res.outcome == "infra_error", res
    assert f"did not acknowledge run_exec within {TIMEOUT_S:g} s" in res.detail, res
    assert node_row(coord, "rogue")["state"] == "draining"
    assert "node_suspect" in coord.log()
    aid = rogue.kinds("run_exec")[0]["action_id"]
    wait_for(lambda: any(m["action_id"] == aid for m in rogue.kinds("cancel_exec")), 10, "kill")


def test_a_started_exec_is_bounded_by_its_timeout_plus_the_grace(cluster):
    """An exec the node said it started but never ends: `infra_error` once its timeout
    plus node_request_timeout_s have passed, not before the timeout (it may run that long)."""
    coord, rogue = cluster
    rogue.answers.add("exec_started")
    with Client(coord.socket) as c:
        env = c.env_open(trajectory="t")
        started = time.monotonic()
        res = c.exec("sleep 100", env=env, timeout_s=1.5)
        took = time.monotonic() - started
    assert res.outcome == "infra_error", res
    assert "did not report the end of exec" in res.detail and "within 2.5 s" in res.detail, res
    assert 2.5 <= took < 20, took
    assert node_row(coord, "rogue")["state"] == "draining"


def test_session_open_and_close_the_node_never_answers(cluster):
    """open_session unanswered: session.open fails `infra_error` and the node is drained;
    a late session_opened is closed on the node. close_session unanswered: session.close
    is done at the deadline (the node drops the shell when it rejoins). remove_env
    unanswered: env.close likewise."""
    coord, rogue = cluster
    with Client(coord.socket) as c:
        env = c.env_open(trajectory="t")
        started = time.monotonic()
        with pytest.raises(InfraError, match=f"did not answer open_session within {TIMEOUT_S:g} s"):
            c.session_open(env)
        assert time.monotonic() - started < 20
        assert node_row(coord, "rogue")["state"] == "draining"
        late = rogue.kinds("open_session")[0]["session_id"]
        rogue.send(make_message("session_opened", key=f"so:{late}", session_id=late))
        wait_for(
            lambda: any(m["session_id"] == late for m in rogue.kinds("close_session")),
            10,
            "the coordinator closes the late session on the node",
        )
        _undrain(coord)
        rogue.answers.add("open_session")
        session = c.session_open(env)
        started = time.monotonic()
        c.session_close(session)  # answered at the deadline
        assert TIMEOUT_S * 0.9 <= time.monotonic() - started < 20
        assert "did not answer close_session" in coord.log()
        c.env_close(env)
        assert "did not answer remove_env" in coord.log()
        assert not [r for r in c.request("env.list", {})["envs"] if r["id"] == env]


def test_a_call_the_node_never_answers_fails_infra_error_and_frees_its_gpu(gpu_cluster):
    """run_call swallowed by a node with a GPU: once its timeout plus `[gpu]
    restore_timeout_s` plus node_request_timeout_s have passed, not before, the node is
    told to stop the call (`stop_call`) and, once it confirms (`call_stopped`), the call
    ends `infra_error` naming the node; the node is drained as suspect; the GPU is free
    again in the pool (the next call is placed on it, and answered); the late `call_done`
    of the first call is acknowledged and changes nothing."""
    coord, rogue = gpu_cluster
    rogue.answers.add("stop_call")
    with Client(coord.socket) as c:
        started = time.monotonic()
        res = c.call("s", {"x": 1.0}, timeout_s=1.5)
        took = time.monotonic() - started
        limit = 1.5 + RESTORE_TIMEOUT_S + TIMEOUT_S
        assert res.outcome == "infra_error", res
        assert rogue.trace[:3] == [
            ("run_call", res.action_id),
            ("stop_call", res.action_id),
            ("call_stopped", res.action_id),
        ], rogue.trace
        assert f"node rogue did not answer run_call for call {res.action_id}" in (
            res.error or ""
        ), res
        assert f"within {limit:.3g} s" in (res.error or ""), res
        assert limit <= took < 20, took
        assert node_row(coord, "rogue")["state"] == "draining"
        (first,) = rogue.kinds("run_call")
        assert first["action_id"] == res.action_id and first["gpus"] == [0]
        # the GPU went back to the pool: the next call is placed on it and answered
        rogue.answers.add("run_call")
        again = c.call("s", {"x": 2.0}, timeout_s=1.5)
        assert again.outcome == "ok" and again.result == {"y": 1.0}, again
        assert again.node == "rogue" and again.gpus == (0,), again
        # the first call's answer, late: acknowledged, and the call stays as it ended
        rogue.send(call_done(res.action_id, {"y": 2.0}))
        wait_for(
            lambda: any(m.get("key") == f"cd:{res.action_id}" for m in rogue.kinds("ack")),
            10,
            "the late call_done acknowledged",
        )
        story = json.dumps(c.story(res.action_id))
        assert "did not answer run_call" in story and '"y": 2.0' not in story, story
        assert "node_suspect" in coord.log()


def test_a_call_past_its_deadline_keeps_its_gpu_until_the_node_confirms_the_stop(gpu_cluster):
    """The rogue node confirms `stop_call` only a while later: the call past its deadline
    ends then, not before, and a call that waits for the node's one GPU meanwhile is sent
    there only after the node said the first one stopped (the GPU is never given twice)."""
    coord, rogue = gpu_cluster
    rogue.answers.add("stop_call")
    rogue.stop_delay_s = TIMEOUT_S / 2

    def call(x: float) -> Any:
        with Client(coord.socket) as c:
            return c.call("s", {"x": x}, timeout_s=1.5)

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(call, 1.0)
        wait_for(lambda: rogue.kinds("stop_call"), 30, "the node told to stop the call")
        rogue.answers.add("run_call")  # (the next call it gets: answered)
        second = pool.submit(call, 2.0)
        res, again = first.result(60), second.result(60)
    assert res.outcome == "infra_error" and "did not answer run_call" in (res.error or "")
    assert again.outcome == "ok" and again.gpus == (0,), again
    trace = rogue.trace
    assert trace.index(("call_stopped", res.action_id)) < trace.index(
        ("run_call", again.action_id)
    ), trace
    assert "node_suspect" in coord.log()


def test_a_node_that_never_confirms_a_stop_is_lost(gpu_cluster):
    """A node that neither answers a call nor confirms its `stop_call` within
    node_request_timeout_s is counted lost (though it heartbeats): that ends the call
    `infra_error` and takes its GPUs out of the pool."""
    coord, rogue = gpu_cluster
    with Client(coord.socket) as c:
        started = time.monotonic()
        res = c.call("s", {"x": 1.0}, timeout_s=1.5)
        took = time.monotonic() - started
        assert res.outcome == "infra_error", res
        assert took >= 1.5 + RESTORE_TIMEOUT_S + 2 * TIMEOUT_S, took
        assert [m["action_id"] for m in rogue.kinds("stop_call")] == [res.action_id]
        assert "did not confirm stop_call for call" in coord.log()
        assert node_row(coord, "rogue")["state"] == "lost"

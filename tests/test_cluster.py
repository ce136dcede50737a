"""Cluster mode with real daemons: a coordinator and nodes on loopback, in this process
(``InProcessCluster``: the real daemons, link, TLS and process backend on one event loop;
the command lines through click's runner). The end-to-end path with subprocesses is
tests/test_cluster_restart.py's.

Two nodes share this small host's cores (``--cpus 0`` and ``--cpus 1``); heartbeats are
fast so failures show within seconds. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from cluster_harness import (
    InProcessCluster,
    InProcessDaemon,
    check_clean,
    node_row,
    stop_all,
    wait_for,
    wait_node_state,
)

from tangram import AsyncClient, Client, EnvLost
from tangram.protocol import OPS, BadRequest, InfraError, NotFound, UnknownOp
from tangramctl.main import cli
from tangramd.main import cli as tangramd_cli

HEARTBEAT_TIMEOUT_S = 1.0
CONFIG = f"""
[cluster]
heartbeat_s = 0.25
heartbeat_timeout_s = {HEARTBEAT_TIMEOUT_S}

[[api]]
name = "search"
concurrency = 2
"""
ENV = {"TANGRAM_VALIDATE": "1"}
CORES = sorted(os.sched_getaffinity(0))
CPUS_A, CPUS_B = str(CORES[0]), str(CORES[-1])  # the same core on a one-core host


@pytest.fixture
def here(tmp_path: Path) -> Iterator[InProcessCluster]:
    """Daemons in this process (validated after every event); none outlives the test."""
    with InProcessCluster(tmp_path, env=ENV) as daemons:
        yield daemons


@pytest.fixture
def cluster(here: InProcessCluster) -> Iterator[dict[str, InProcessDaemon]]:
    """A coordinator and two joined nodes, ``a`` and ``b``; logs must stay clean."""
    coord = here.coordinator(CONFIG)
    daemons = {"coordinator": coord}
    daemons["a"] = here.node(coord, "a", cpus=CPUS_A)
    daemons["b"] = here.node(coord, "b", cpus=CPUS_B)
    yield daemons
    stop_all(list(daemons.values()))
    check_clean(*daemons.values())


def ctl(daemon: InProcessDaemon, *args: str) -> str:
    """``tangramctl --socket <daemon's> ARGS`` in this process; its output."""
    result = CliRunner().invoke(cli, ["--socket", daemon.socket, *args])
    assert result.exit_code == 0, result.output
    return result.output


def _env_on(c: Client, node: str, tries: int = 8) -> str:
    """Open environments until one lands on ``node`` (placement balances memory)."""
    for _ in range(tries):
        env = c.request("env.open", {})
        if env["node"] == node:
            return str(env["id"])
    raise AssertionError(f"no environment landed on {node} in {tries} tries")


def test_exec_through_a_node_runs_where_its_environment_is(
    cluster: dict[str, InProcessDaemon],
) -> None:
    """An exec sent to node a's socket runs on the node holding its env, within its cores."""
    cpus = {"a": {int(CPUS_A)}, "b": {int(CPUS_B)}}
    with cluster["a"].client() as c:
        for node in ("a", "b"):
            env = _env_on(c, node)
            result = c.exec(
                ["sh", "-c", "grep Cpus_allowed_list /proc/self/status; echo $TANGRAM_CORES"],
                env=env,
            )
            assert result.outcome == "ok", result
            assert result.node == node
            assert set(result.cores) <= cpus[node]
            assert result.stdout.split()[-1] == ",".join(str(x) for x in result.cores)
        throwaway = c.exec(["true"])
        assert throwaway.outcome == "ok" and throwaway.node in ("a", "b")
        rows = {row["name"]: row for row in c.nodes()}
    assert set(rows) == {"a", "b"}
    for name, row in rows.items():
        assert row["state"] == "ready"
        assert row["cores"] == 1 and row["free_cores"] == 1 and row["running"] == 0
        assert row["envs"] == 1 and row["mem_gb"] > 0
        assert 0 <= row["heartbeat_age_s"] < HEARTBEAT_TIMEOUT_S, name


def test_exec_results_through_a_node_carry_the_cores_facts(
    cluster: dict[str, InProcessDaemon],
) -> None:
    """An exec's answer through a node, run on that node or another, carries the facts the
    core adds (action id, time queued, cores, node); the coordinator has its outcome before
    the next op on the same socket. The node answers its own client's exec itself (one link
    round trip less); an exec on another node is answered through the coordinator."""
    with cluster["a"].client() as c:
        env_a, env_b = _env_on(c, "a"), _env_on(c, "b")
        local = c.exec(["sh", "-c", "echo hi; exit 3"], env=env_a)
        remote = c.exec(["sh", "-c", "echo hi; exit 3"], env=env_b)
        for result, node in ((local, "a"), (remote, "b")):
            assert result.outcome == "failed" and result.exit_code == 3, result
            assert result.stdout == "hi\n" and result.node == node
            assert result.action_id and len(result.cores) == 1
            assert result.queue_s >= 0
            assert result.act_s == pytest.approx(result.queue_s + result.exec_s)
            story = c.request("story", {"action_id": result.action_id})
            assert story["outcome"] == "failed", story
        assert {row["name"]: row["running"] for row in c.nodes()} == {"a": 0, "b": 0}
    assert "exit=3" in str(story)
    answered = {
        name: {
            line["action_id"]: line["answered"]
            for text in cluster[name].log().splitlines()
            if text.startswith("{") and (line := json.loads(text))["event"] == "action_finished"
        }
        for name in ("a", "b")
    }
    assert answered["a"][local.action_id] is True
    assert answered["b"][remote.action_id] is False


def test_execs_through_a_node_each_get_their_own_answer(
    cluster: dict[str, InProcessDaemon],
) -> None:
    """Execs a node forwards are answered without a task on either side: many at once on
    one connection each get their own answer, on both nodes; an exec with files runs in a
    task on its node and brings its files back; refusals and errors are answered too."""
    with cluster["a"].client() as c:
        envs = {node: _env_on(c, node) for node in ("a", "b")}

    async def run() -> list[Any]:
        async with AsyncClient(cluster["a"].socket) as ac:
            execs = [
                ac.exec(["sh", "-c", f"echo {k}"], env=envs["ab"[k % 2]], cpus=1) for k in range(12)
            ]
            return await asyncio.gather(*execs)

    for k, result in enumerate(asyncio.run(run())):
        assert result.outcome == "ok" and result.stdout == f"{k}\n", result
        assert result.node == "ab"[k % 2]
    with cluster["a"].client() as c:
        for node, env in envs.items():
            result = c.exec(
                ["sh", "-c", "cat in.txt > out.txt; echo more >> out.txt"],
                env=env,
                files={"in.txt": f"from {node}\n"},
                fetch=["out.txt"],
            )
            assert result.outcome == "ok" and result.node == node, result
            assert result.files == {"out.txt": f"from {node}\nmore\n".encode()}
            no_dir = c.exec(["true"], env=env, cwd="no-such-dir")  # the backend refuses
            assert no_dir.outcome == "failed" and "no such directory" in no_dir.stderr, no_dir
        with pytest.raises(NotFound):
            c.exec(["true"], env="no-such-env")
        assert {row["name"]: row["running"] for row in c.nodes()} == {"a": 0, "b": 0}


def test_every_op_answers_through_a_node_as_documented(cluster: dict[str, InProcessDaemon]) -> None:
    """Each op of the table, forwarded by a node, answers exactly its documented fields;
    cluster.join answers on the coordinator and is refused through a node (it is secret),
    as is node.lost (it could take any node down)."""
    with cluster["b"].client() as c:
        env = c.env_open()
        result = c.request("exec", {"cmd": "true", "env": env})
        lease = c.request("lease.acquire", {"api": "search"})
        profile = {
            "name": "p",
            "dop": {"1": 2.0},
            "t1_s": 2.0,
            "eff": {"1": 1.0},
            "speedup": {"1": 1.0},
            "elastic": False,
        }
        session = c.request("session.open", {"env": env})
        answers: dict[str, Any] = {
            "exec": result,
            "lease.acquire": lease,
            "profile.save": c.request("profile.save", profile),
            "session.open": session,
        }
        # files and shell sessions are carried out on the node that holds the environment
        answers["env.put"] = c.request("env.put", {"id": env, "path": "f", "data": b"x"})
        answers["env.get"] = c.request("env.get", {"id": env, "path": "f"})
        assert answers["env.get"]["data"] == b"x"
        ran = c.request("exec", {"cmd": "cd /tmp; X=1", "session": session["id"]})
        assert ran["outcome"] == "ok"
        answers["session.interrupt"] = c.request("session.interrupt", {"id": session["id"]})
        answers["session.close"] = c.request("session.close", {"id": session["id"]})
        answers["env.reset"] = c.request("env.reset", {"env": env})  # no session open now
        with pytest.raises(BadRequest, match="not supported on a cluster coordinator"):
            c.request("env.fork", {"env": env, "n": 1})
        args = {
            "story": {"action_id": result["action_id"]},
            "env.close": {"id": env},
            "lease.release": {"lease_id": lease["lease_id"]},
            "profile.get": {"name": "p"},
            "node.drain": {"name": "a"},
            "node.undrain": {"name": "a"},
            "cancel": {"id": result["action_id"]},  # ended: answered with its outcome
        }
        answers["lease.renew"] = c.request(
            "lease.renew", {"lease": lease["lease_id"], "ttl_s": 30.0}
        )  # before lease.release
        # GPU services need a node with GPUs (none here): the coordinator refuses them with
        # the documented errors, and lists no service (tests/test_cluster_services.py)
        with pytest.raises(BadRequest, match="no node with GPUs"):
            c.request("service.register", {"name": "s", "runtime": "torch", "mem_gb": 1,
                                           "entry": "m:f"})  # fmt: skip
        with pytest.raises(NotFound, match="not registered"):
            c.request("call", {"name": "s", "payload": {}})
        with pytest.raises(NotFound, match="not registered"):
            c.request("service.remove", {"name": "s"})
        with pytest.raises(NotFound, match="not registered"):
            c.request("service.set_eff", {"name": "s", "eff": "1:1,2:1.8"})
        gpu_ops = ("service.register", "call", "service.remove", "service.set_eff", "env.fork")
        local_only = ("cluster.join", "node.lost", "node.forget")
        for op in [o for o in OPS if o not in answers and o not in local_only + gpu_ops]:
            answers[op] = c.request(op, args.get(op, {}))
        assert answers["service.list"] == {"services": []}
        with pytest.raises(UnknownOp, match="coordinator's own socket"):
            c.cluster_join()
        with pytest.raises(UnknownOp, match="coordinator's own socket"):
            c.node_lost("a")
        with pytest.raises(UnknownOp, match="coordinator's own socket"):
            c.request("node.forget", {"name": "a"})
    with cluster["coordinator"].client() as c:
        answers["cluster.join"] = c.request("cluster.join", {})
        answers["node.forget"] = c.request("node.forget", {"name": "never-joined"})
    # node.lost would take node a down under the other tests: tests/test_ray.py checks it
    assert set(answers) | {"node.lost", *gpu_ops} == set(OPS)
    for op, answer in answers.items():
        assert sorted(answer) == sorted(OPS[op].result_fields), op
    assert answers["exec"]["node"] in ("a", "b")


def test_wrong_token_is_refused_on_both_sides(here: InProcessCluster) -> None:
    """A node with a wrong token exits 1 saying so; the coordinator logs the refusal."""
    coord = here.coordinator(CONFIG)
    node = here.node(coord, "x", token="not-the-token", wait_ready=False)
    assert node.wait(30) == 1
    assert "wrong join token" in node.log()
    assert "refused the join" in node.log()
    wait_for(lambda: "node_refused" in coord.log(), 10, "coordinator logs the refusal")
    assert node_row(coord, "x") is None
    coord.stop()
    check_clean(coord)


def test_wrong_ca_hash_is_refused_before_the_token_is_sent(here: InProcessCluster) -> None:
    """A node pinned to another CA names the expected and actual hash and never sends its
    token; the coordinator logs that the node rejected it."""
    coord = here.coordinator(CONFIG)
    wrong = "sha256:" + "0" * 64
    node = here.node(coord, "x", ca_sha256=wrong, wait_ready=False)
    assert node.wait(30) == 1
    log = node.log()
    assert f"expected {wrong}" in log and f"got {coord.join['ca_sha256']}" in log
    wait_for(lambda: "node_rejected_coordinator" in coord.log(), 10, "coordinator log")
    assert "node_refused" not in coord.log()  # no hello (and so no token) ever arrived
    coord.stop()
    check_clean(coord)


def test_killed_node_ends_its_actions_and_loses_its_envs(
    cluster: dict[str, InProcessDaemon],
) -> None:
    """Node b killed (its link reset, no goodbye): its running action ends infra_error
    naming b within the timeout, its env answers env_lost, b shows lost, and node a keeps
    working."""
    with cluster["a"].client() as c:
        env_b = _env_on(c, "b")
        env_a = _env_on(c, "a")
    outcome: dict[str, Any] = {}

    def run() -> None:
        with Client(cluster["a"].socket) as c:
            outcome["result"] = c.exec(["sleep", "60"], env=env_b)

    worker = threading.Thread(target=run)
    worker.start()
    wait_for(lambda: node_row(cluster["coordinator"], "b")["running"] == 1, 10, "sleep runs")
    killed_at = time.monotonic()
    cluster["b"].kill()
    worker.join(HEARTBEAT_TIMEOUT_S + 10)
    assert not worker.is_alive(), "the action on the killed node hangs"
    ended_after = time.monotonic() - killed_at
    result = outcome["result"]
    assert result.outcome == "infra_error" and result.node == "b"
    assert "node b lost" in result.detail
    assert ended_after < HEARTBEAT_TIMEOUT_S + 5
    with cluster["a"].client() as c:
        with pytest.raises(EnvLost, match="node b"):
            c.exec(["true"], env=env_b)
        assert c.exec(["true"], env=env_a).node == "a"
        assert c.exec(["true"]).node == "a"  # new work goes where there is capacity
        rows = {row["name"]: row for row in c.nodes()}
        c.env_close(env_b)  # a lost environment can still be closed
    assert rows["b"]["state"] == "lost" and rows["a"]["state"] == "ready"
    assert "node_lost" in cluster["coordinator"].log()


def test_drained_node_gets_no_new_trajectories(cluster: dict[str, InProcessDaemon]) -> None:
    """After `tangramctl node drain a` new environments land on b only; a's existing
    environment keeps working; undrain makes a eligible again."""
    with cluster["a"].client() as c:
        env_a = _env_on(c, "a")
    ctl(cluster["b"], "node", "drain", "a")
    with cluster["a"].client() as c:
        assert node_row(cluster["coordinator"], "a")["state"] == "draining"
        placed = {c.request("env.open", {})["node"] for _ in range(4)}
        assert placed == {"b"}
        assert c.exec(["true"], env=env_a).node == "a"
        assert c.exec(["true"]).node == "b"
    ctl(cluster["b"], "node", "undrain", "a")
    out = ctl(cluster["b"], "nodes", "--json")
    states = {row["name"]: row["state"] for row in json.loads(out)["nodes"]}
    assert states == {"a": "ready", "b": "ready"}
    with cluster["a"].client() as c:
        assert _env_on(c, "a")  # a takes new trajectories again (it is now the lighter)


def test_rotated_token_keeps_joined_nodes(here: InProcessCluster) -> None:
    """`cluster join --rotate` stops the old token; a joined node restarted with it still
    rejoins with its credential; a new node needs the new token."""
    coord = here.coordinator(CONFIG)
    a = here.node(coord, "a", cpus=CPUS_A)
    old = coord.join["token"]
    rotated = json.loads(ctl(coord, "cluster", "join", "--rotate", "--json"))
    assert rotated["token"] != old and rotated["ca_sha256"] == coord.join["ca_sha256"]
    line = ctl(coord, "cluster", "join")
    assert line.startswith(f"TANGRAM_JOIN_TOKEN={rotated['token']} tangramd node --coordinator")
    assert a.stop() == 0
    wait_node_state(coord, "a", "lost", 10)
    a = here.node(coord, "a", cpus=CPUS_A, token=old)
    with a.client() as c:
        assert c.exec(["true"]).node == "a"
    stale = here.node(coord, "c", token=old, wait_ready=False)
    assert stale.wait(30) == 1 and "wrong join token" in stale.log()
    coord.join = rotated
    here.node(coord, "c", cpus=CPUS_B)
    stop_all(here.daemons)
    check_clean(coord)


def test_gateway_node_forwards_without_offering_cores(here: InProcessCluster) -> None:
    """A node started with --cpus '' offers no cores: its clients' work runs elsewhere."""
    coord = here.coordinator(CONFIG)
    here.node(coord, "worker", cpus=CPUS_A)
    gateway = here.node(coord, "gw", cpus="")
    with gateway.client() as c:
        assert c.exec(["true"]).node == "worker"
        rows = {row["name"]: row for row in c.nodes()}
    assert rows["gw"]["cores"] == 0 and rows["gw"]["state"] == "ready"


def test_node_reports_its_gpus(here: InProcessCluster) -> None:
    """GPUs of the node's [gpu] inventory (here simulated, NVML off) are its capacity in
    `nodes --json`; a node without any reports none."""
    coord = here.coordinator(CONFIG)
    gpu_config = "[gpu]\nnvml = false\nsimulated = { count = 2, mem_gb = 16, h2d_gbps = 10 }\n"
    gpu_node = here.node(coord, "g", cpus=CPUS_A, config=gpu_config)
    here.node(coord, "c", cpus=CPUS_B)
    rows = {row["name"]: row for row in json.loads(ctl(gpu_node, "nodes", "--json"))["nodes"]}
    assert rows["g"]["gpus"] == 2 and rows["c"]["gpus"] == 0
    assert rows["g"]["gpu_list"] == [
        {"local": k, "name": "simulated", "mem_bytes": 16 * 10**9, "simulated": True}
        for k in (0, 1)
    ]
    assert rows["c"]["gpu_list"] == []


def test_node_without_coordinator_answers_infra_error(here: InProcessCluster) -> None:
    """A client of a node whose coordinator is gone gets a typed infra_error, not a hang."""
    coord = here.coordinator(CONFIG)
    node = here.node(coord, "a", cpus=CPUS_A)
    coord.kill()
    with node.client() as c:
        wait_for(lambda: _raises_infra(c), HEARTBEAT_TIMEOUT_S + 10, "infra_error")
    node.stop()
    check_clean(node)


def _raises_infra(c: Client) -> bool:
    try:
        c.status()
    except InfraError as exc:
        return "coordinator" in str(exc)
    return False


def test_garbage_on_the_node_port_never_crashes_the_coordinator(here: InProcessCluster) -> None:
    """Plain bytes, TLS garbage, a huge length prefix and malformed hellos are refused or
    dropped; the coordinator keeps serving and logs no traceback."""
    import socket
    import ssl

    from tangram.protocol.codec import encode
    from tangramd.cluster.link import split_host_port

    coord = here.coordinator(CONFIG)
    host, port = split_host_port(coord.join["coordinator"])
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE

    def tls_send(payload: bytes) -> bytes:
        with (
            socket.create_connection((host, port), timeout=10) as raw,
            ctx.wrap_socket(raw) as tls,
        ):
            tls.sendall(payload)
            chunks = []
            while chunk := tls.recv(65536):
                chunks.append(chunk)
            return b"".join(chunks)

    with socket.create_connection((host, port), timeout=10) as raw:
        raw.sendall(b"GET / HTTP/1.0\r\n\r\n" * 10)
        raw.settimeout(10)
        assert raw.recv(65536) is not None  # the TLS server answers or closes
    assert b"refused" in tls_send(encode({"t": "hello", "name": 7}))
    assert b"refused" in tls_send(encode({"t": "hello", "name": "x", "cores_by_numa": "0"}))
    assert b"refused" in tls_send(encode({"t": "bogus"}))
    tls_send(b"\xff\xff\xff\xff" + b"x" * 100)  # a 4 GiB frame is never buffered
    tls_send(b"\x00\x00\x00\x02\xc1\xc1")  # not msgpack
    with coord.client() as c:
        assert c.ping()["pong"] is True
        assert c.nodes() == []
    coord.stop()
    check_clean(coord)


def test_insecure_is_refused_off_loopback(tmp_path: Path) -> None:
    """--insecure (plain TCP) exits 2 with a clear message unless the address is loopback."""
    sock, state = str(tmp_path / "s.sock"), str(tmp_path / "state")
    coord_args = ["--listen", "0.0.0.0:0", "--socket", sock, "--state-dir", state, "--insecure"]
    coord = CliRunner().invoke(tangramd_cli, ["coordinator", *coord_args])
    assert coord.exit_code == 2 and "refused off loopback" in coord.stderr
    node_args = ["--coordinator", "192.0.2.1:7000", "--token", "t", "--socket", sock]
    node = CliRunner().invoke(
        tangramd_cli, ["node", *node_args, "--state-dir", state, "--insecure"]
    )
    assert node.exit_code == 2 and "refused off loopback" in node.stderr
    assert not Path(state).exists()  # refused before anything was made


def test_insecure_mode_works_on_loopback(here: InProcessCluster) -> None:
    """With --insecure on both ends (loopback only) a node joins over plain TCP and runs."""
    coord = here.coordinator(CONFIG, insecure=True)
    assert coord.join["ca_sha256"] == ""
    node = here.node(coord, "plain", cpus=CPUS_A, insecure=True)
    with node.client() as c:
        assert c.exec(["true"]).node == "plain"
    stop_all([coord, node])
    check_clean(coord, node)

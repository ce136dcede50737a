"""`tangramctl ray up|status|down` on a real Ray cluster (issue 14): real daemons, no mocks.

One ``ray.cluster_utils.Cluster`` for the module: three Ray nodes on this host, each with
its own resource label and its own ``TANGRAM_SOCKET`` in its raylet's environment (so the
node daemon and the Ray workers of one Ray node agree on a socket, as hosts do on the
standard path). Ray stays on loopback (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``). The tests
run in file order on one cluster: a refused and a failed up, the corrected up, exec,
idempotent up, a node joins, one whose daemon fails, a node dies, down.
The heartbeat timeout is 60 s, so a node lost within seconds was lost because Ray said so.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

# Ray reads this once, at import: with it, every Ray node (and the coordinator, which
# listens on its node's Ray address) is on 127.0.0.1, not the host's interface address.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import ray  # the [ray] extra: scripts/test.sh installs it; nothing here skips
from click.testing import CliRunner
from cluster_harness import spawn_coordinator, spawn_node, wait_for, wait_node_state
from harness import running_daemon
from ray._private import ray_constants
from ray.cluster_utils import Cluster

from tangram import Client
from tangram.protocol import OPS, NotFound, UnknownOp
from tangram.protocol.paths import default_socket_path
from tangramctl import ray as tray
from tangramctl.main import cli
from tangramctl.ray_actors import NAMESPACE, RESTART_AFTER_S, host_cores, node_name

ROOT = Path(__file__).resolve().parent.parent
LABELS = ("n0", "n1", "n2")  # n0 is the head: the coordinator lives there
CONFIG = """
[cluster]
heartbeat_s = 1.0
heartbeat_timeout_s = 60.0   # longer than any wait here: Ray, not silence, loses nodes

[cpu]
default_env_mem = "64MiB"
"""
LOST_WITHIN_S = 10.0


@dataclass
class RayHost:
    """The Ray cluster on this host and where its tangram daemons keep things."""

    cluster: Cluster
    work: Path
    nodes: dict[str, Any] = field(default_factory=dict)  # label -> ray._private.node.Node
    removed: list[str] = field(default_factory=list)  # tangram names of removed Ray nodes

    @property
    def state_root(self) -> Path:
        return self.work / "state"

    def socket(self, label: str) -> str:
        return str(self.work / f"{label}.sock")

    def node_args(self, label: str) -> dict[str, Any]:
        return {
            "num_cpus": 1,
            "include_dashboard": False,
            "object_store_memory": 80 << 20,
            "resources": {label: 1},
            # the daemons Ray starts here check the core's invariants after every event
            "env_vars": {"TANGRAM_SOCKET": self.socket(label), "TANGRAM_VALIDATE": "1"},
        }

    def add(self, label: str) -> Any:
        node = self.cluster.add_node(**self.node_args(label))
        self.nodes[label] = node
        return node


def ctl(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    """The real CLI in a subprocess: its own Ray driver, as an operator runs it."""
    return subprocess.run(
        [sys.executable, "-m", "tangramctl.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayHost]:
    """Three Ray nodes on loopback, and this test process connected as a driver."""
    assert not ray_constants.ENABLE_RAY_CLUSTER, "ray was imported before this module"
    work = tmp_path_factory.mktemp("ray")
    with pytest.MonkeyPatch.context() as mp:
        # Ray's workers (and so the actors) import this checkout, not an installed copy.
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.getenv("PYTHONPATH")])))
        started = time.monotonic()
        h = RayHost(Cluster(initialize_head=False), work)
        for label in LABELS:
            h.add(label)
        h.cluster.wait_for_nodes(60)
        print(f"ray cluster of {len(LABELS)} nodes up in {time.monotonic() - started:.1f} s")
        ray.init(address=h.cluster.address, namespace="tangram-tests", log_to_driver=False)
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tasks below
        try:
            yield h
        finally:
            try:
                tray.down()
            finally:
                _kill_leftovers(h.state_root)
                ray.shutdown()
                h.cluster.shutdown()


def _daemons_under(root: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or ())
        if str(root) in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


def _kill_leftovers(root: Path) -> None:
    """Safety net after a failed test: nothing of ours outlives the module."""
    for proc in _daemons_under(root):
        for sig in (signal.SIGCONT, signal.SIGKILL):
            proc.send_signal(sig)


@pytest.fixture(scope="module")
def report(host: RayHost) -> dict[str, Any]:
    """`tangramctl ray up --json` as an operator runs it; its report."""
    config = host.work / "tangram.toml"
    config.write_text(CONFIG)
    args = ["ray", "up", "--address", host.cluster.address, "--config", str(config)]
    args += ["--cpus-per-node", "0", "--state-dir", str(host.state_root), "--json"]
    done = ctl(*args)
    assert done.returncode == 0, done.stderr
    up: dict[str, Any] = json.loads(done.stdout)
    print(f"ray up: all {len(up['nodes'])} tangram nodes ready in {up['ready_s']:.1f} s")
    return up


# ------------------------------------------------------------------ Ray tasks (rollouts)


@ray.remote(num_cpus=0)
def rollout_step(cmd: list[str], env: str | None = None) -> dict[str, Any]:
    """A rollout worker's tool call: `Client()` with no argument, as in production."""
    with Client() as c:
        result = c.exec(cmd, env=env, timeout_s=120)
    return {
        "socket": default_socket_path(),
        "outcome": result.outcome,
        "node": result.node,
        "stdout": result.stdout,
        "detail": result.detail,
        "ended": time.time(),
    }


def on(label: str) -> dict[str, Any]:
    """Task options that put a task on the Ray node with this resource label."""
    return {"resources": {label: 0.01}}


def row_of(status: dict[str, Any], ray_node_id: str) -> dict[str, Any] | None:
    return next((r for r in status["nodes"] if r.get("ray_node_id") == ray_node_id), None)


# ------------------------------------------------------------------ the layer rule


def _imports_ray(path: Path, *, top_level_only: bool) -> list[int]:
    """Lines of ``path`` that import ray (at module level only, if asked)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    lines = []
    for node in nodes:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        if any(name.split(".")[0] == "ray" for name in names):
            lines.append(node.lineno)
    return lines


def test_core_and_daemon_never_import_ray() -> None:
    """`tangram` and `tangramd` never import Ray anywhere (not even in a function), and the
    CLI loads it only inside the `ray` commands: Ray stays an optional extra."""
    bad = [
        f"{path.relative_to(ROOT)}:{line}"
        for top in ("tangram", "tangramd")
        for path in sorted((ROOT / top).rglob("*.py"))
        for line in _imports_ray(path, top_level_only=False)
    ]
    bad += [
        f"{path.relative_to(ROOT)}:{line} (module level)"
        for path in sorted((ROOT / "tangramctl").rglob("*.py"))
        for line in _imports_ray(path, top_level_only=True)
    ]
    assert not bad, "imports of ray:\n" + "\n".join(bad)
    probe = "import sys, tangramctl.main, tangramd.main; print('ray' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


# ------------------------------------------------------------------ refused and failed ups


def _ours() -> list[str]:
    """The named actors of `tangramctl ray` alive now."""
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == NAMESPACE
    )


@contextlib.contextmanager
def squatting(path: str) -> Iterator[None]:
    """Something listening on ``path``: a tangramd that should serve it fails at start-up."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen()
    try:
        yield
    finally:
        sock.close()
        os.unlink(path)


def test_ray_up_without_a_ray_cluster_says_to_start_one(tmp_path: Path) -> None:
    """Before this module's cluster exists: with no Ray cluster to find, `ray up` fails at
    once (exit 2) and says to run `ray start --head`; an address with nothing listening
    fails at once too, instead of Ray's minutes of retries."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = str(tmp_path)  # no address file of an earlier `ray start` here
    done = subprocess.run(
        [sys.executable, "-m", "tangramctl.main", "ray", "up", "--cpus-per-node", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2, (done.stderr, "is another Ray cluster running on this host?")
    assert "no Ray cluster is running" in done.stderr and "ray start --head" in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr  # one line, no traceback
    with socket.socket() as free:  # a port nothing listens on once closed
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with pytest.raises(tray.RayError) as unreachable:
        tray.check_reachable(f"127.0.0.1:{port}")
    assert unreachable.value.exit_code == 2
    assert f"cannot reach a Ray cluster at 127.0.0.1:{port} (Connection refused)" in str(
        unreachable.value
    )
    assert "ray start --head" in str(unreachable.value)


def test_ray_up_refuses_cores_a_host_lacks(host: RayHost) -> None:
    """`--cpus-per-node` asking for a core a Ray node's host lacks is refused before
    anything starts, naming the option and the cores the host has; a bad list is refused
    before Ray is even reached."""
    have = host_cores()
    asked = f"0-{max(have) + 1}"
    with pytest.raises(tray.RayError) as refused:
        tray.up(config_text=CONFIG, cpus=asked, state_root=str(host.state_root))
    message = refused.value.format_message()
    assert refused.value.exit_code == 2
    assert message.startswith(f"--cpus-per-node {asked}: "), message
    assert f"lacks core(s) {max(have) + 1}" in message and f"({len(have)})" in message, message
    assert _ours() == [] and not host.state_root.exists()
    bad = CliRunner().invoke(cli, ["ray", "up", "--cpus-per-node", "3-1"])
    assert bad.exit_code == 2 and "--cpus-per-node '3-1': reversed range" in bad.output


def test_a_failed_up_leaves_nothing_and_a_rerun_takes_its_options(
    host: RayHost, request: pytest.FixtureRequest
) -> None:
    """A `ray up` whose node daemon cannot start (its socket is taken) fails naming it and
    leaves nothing behind: no actor, no coordinator or node process, no state. The rerun
    (the module's `ray up`, with other options) starts afresh and runs with its own."""
    victim = node_name(host.nodes["n1"].node_id)
    with squatting(host.socket("n1")), pytest.raises(tray.RayError) as failed:
        tray.up(config_text=CONFIG, cpus="0-1", state_root=str(host.state_root))
    message = failed.value.format_message()
    print(f"failed up: {message}")
    assert f"tangramd node {victim} exited" in message, message
    assert "another daemon is listening" in message, message
    assert "nothing is left running" in message, message
    assert _ours() == []
    assert not _daemons_under(host.state_root)
    assert not host.state_root.exists() or not list(host.state_root.iterdir())
    report = request.getfixturevalue("report")  # the corrected rerun, `--cpus-per-node 0`
    assert not report["already_running"] and "replaced" not in report
    assert report["spec"]["cpus"] == "0"
    assert [row["cores"] for row in report["nodes"]] == [1] * len(LABELS), report["nodes"]


# ------------------------------------------------------------------ up, exec


def test_ray_up_starts_the_coordinator_and_one_node_per_ray_node(
    host: RayHost, report: dict[str, Any]
) -> None:
    """`ray up` starts the coordinator on the head and a ready tangram node on every Ray
    node, each serving the socket that Ray workers on its host find by default."""
    head = host.nodes["n0"].node_id
    assert report["coordinator"]["alive"]
    assert report["coordinator"]["ray_node_id"] == head
    assert report["coordinator"]["address"].startswith("127.0.0.1:")
    assert not report["already_running"]
    by_ray_id = {row["ray_node_id"]: row for row in report["nodes"]}
    for label, node in host.nodes.items():
        row = by_ray_id[node.node_id]
        assert row["state"] == "ready", row
        assert row["name"] == node_name(node.node_id)
        assert row["socket"] == host.socket(label)
        assert Path(row["socket"]).is_socket()
    with Client(report["coordinator"]["socket"]) as c:
        names = sorted(r["name"] for r in c.nodes() if r["state"] == "ready")
        token = c.cluster_join()["token"]
    assert names == sorted(node_name(n.node_id) for n in host.nodes.values())
    for row in report["nodes"]:  # joined with the token in its environment: `ps` never shows it
        assert token not in " ".join(psutil.Process(row["pid"]).cmdline()), row
    status = CliRunner().invoke(cli, ["ray", "status", "--json"])
    assert status.exit_code == 0, status.output
    assert {r["name"] for r in json.loads(status.output)["nodes"]} == set(names)


def test_exec_from_a_ray_task_lands_and_returns(host: RayHost, report: dict[str, Any]) -> None:
    """A Ray task on each node runs a command through its host's tangram node, no socket
    argument needed; the result names the tangram node that ran it."""
    refs = {label: rollout_step.options(**on(label)).remote(["echo", label]) for label in LABELS}
    results = {label: ray.get(ref, timeout=120) for label, ref in refs.items()}
    names = {row["name"] for row in report["nodes"]}
    for label, result in results.items():
        assert result["socket"] == host.socket(label)
        assert result["outcome"] == "ok", result
        assert result["stdout"] == f"{label}\n"
        assert result["node"] in names


def test_ray_up_twice_is_idempotent(host: RayHost, report: dict[str, Any]) -> None:
    """A second `ray up` finds the running coordinator and nodes and starts nothing new;
    one with other options is refused (exit 1) and changes nothing."""
    actors = sorted(str(a) for a in ray.util.list_named_actors(all_namespaces=True))
    again = tray.up(config_text=CONFIG, cpus="0", state_root=str(host.state_root))
    assert again["already_running"] and "replaced" not in again
    assert again["coordinator"]["address"] == report["coordinator"]["address"]
    pids = {row["name"]: row["pid"] for row in report["nodes"]}
    assert {row["name"]: row["pid"] for row in again["nodes"]} == pids
    assert sorted(str(a) for a in ray.util.list_named_actors(all_namespaces=True)) == actors
    with pytest.raises(tray.RayError) as other:
        tray.up(config_text=CONFIG, cpus="0-1", state_root=str(host.state_root))
    assert "--cpus-per-node '0', now '0-1'" in other.value.format_message()
    assert "`tangramctl ray down` first" in other.value.format_message()
    assert {row["name"]: row["pid"] for row in tray.status()["nodes"]} == pids


def test_node_lost_op_is_the_coordinators_own(host: RayHost, report: dict[str, Any]) -> None:
    """`node.lost` answers its documented fields on the coordinator's socket, `not_found`
    for an unknown node, and is refused through a node's socket (it could take any node
    down)."""
    with Client(report["coordinator"]["socket"]) as c, pytest.raises(NotFound):
        c.node_lost("no-such-node")
    with Client(host.socket("n1")) as c, pytest.raises(UnknownOp):
        c.node_lost(node_name(host.nodes["n2"].node_id))
    assert OPS["node.lost"].result_fields == ("name", "already_lost")


def test_node_lost_ends_a_nodes_actions_now_and_a_live_node_rejoins(tmp_path: Path) -> None:
    """Without Ray: `node.lost` on a live, heartbeating node ends its running action
    `infra_error` with the reason at once (heartbeat timeout 60 s), answers the documented
    fields, and the node, being alive, reconnects and is ready again."""
    coord = spawn_coordinator(tmp_path, CONFIG, env={"TANGRAM_VALIDATE": "1"})
    node = spawn_node(tmp_path, coord, "a", cpus="0", env={"TANGRAM_VALIDATE": "1"})
    try:
        results: list[Any] = []
        with Client(coord.socket) as c:
            env = c.env_open()

            def exec_sleep() -> None:
                with Client(coord.socket) as worker_client:
                    results.append(worker_client.exec(["sleep", "30"], env=env))

            worker = threading.Thread(target=exec_sleep)
            worker.start()
            wait_for(lambda: c.queue()["running"], 30, "the action running on a")
            answer = c.node_lost("a", "the test says so")
            worker.join(LOST_WITHIN_S)
            assert sorted(answer) == sorted(OPS["node.lost"].result_fields)
            assert answer == {"name": "a", "already_lost": False}
            assert results and results[0].outcome == "infra_error", results
            assert results[0].detail == "node a lost: the test says so"
        wait_node_state(coord, "a", "ready", 30, node=node)
    finally:
        node.stop()
        coord.stop()
    assert "invariant_violated" not in coord.log() and "Traceback" not in coord.log()


def test_tangramd_up_has_no_nodes_to_lose(tmp_path: Path) -> None:
    """The all-in-one daemon answers `node.lost` with `unknown_op`: its node is itself."""
    with running_daemon(tmp_path) as daemon, daemon.client() as c, pytest.raises(UnknownOp):
        c.node_lost("local")


# ------------------------------------------------------------------ membership


def test_a_ray_node_that_joins_gets_a_tangram_node(host: RayHost, report: dict[str, Any]) -> None:
    """A Ray node added after `ray up` gets a ready tangram node, and work from it runs."""
    started = time.monotonic()
    node = host.add("n3")

    def ready() -> dict[str, Any] | None:
        row = row_of(tray.status(), node.node_id)
        return row if row and row["state"] == "ready" and row["socket"] else None

    row = wait_for(ready, 60, "a tangram node on the new Ray node")
    print(f"a joining Ray node got a ready tangram node in {time.monotonic() - started:.1f} s")
    assert row["socket"] == host.socket("n3")
    result = ray.get(rollout_step.options(**on("n3")).remote(["echo", "new"]), timeout=120)
    assert result["outcome"] == "ok", result


def test_status_shows_a_node_whose_daemon_failed(host: RayHost, report: dict[str, Any]) -> None:
    """A Ray node whose tangram node cannot start (its socket is taken) shows in `ray
    status` as failed, with why, not as "starting"; once Ray drops that node, it is gone."""
    with squatting(host.socket("n4")):
        node = host.add("n4")
        name = node_name(node.node_id)

        def failed() -> dict[str, Any] | None:
            row = row_of(tray.status(), node.node_id)
            return row if row and row["state"] != "starting" else None

        row = wait_for(failed, 60, "the joining node's daemon to fail", every_s=0.2)
        assert row["state"] == "failed", row
        assert row["reason"].startswith("exited (1) at start-up: tangramd: cannot serve"), row
        assert row["reason"].endswith("another daemon is listening on it"), row
        shown = CliRunner().invoke(cli, ["ray", "status"])
        assert shown.exit_code == 0, shown.output
        assert f"\n{name} failed: {row['reason']}\n" in shown.output, shown.output
        host.cluster.remove_node(node)
        del host.nodes["n4"]
        host.removed.append(name)  # its state stays, as on a dead host's disk
        wait_for(
            lambda: row_of(tray.status(), node.node_id) is None,
            30,
            "the removed Ray node to leave the status",
            every_s=0.2,
        )
    assert all(r["state"] not in ("failed", "dead") for r in tray.status()["nodes"])


def test_a_ray_node_that_dies_is_lost_at_once(host: RayHost, report: dict[str, Any]) -> None:
    """When Ray reports a node dead, its tangram node is lost and the action it was running
    ends `infra_error` at the client within seconds, even when the node daemon cannot say
    goodbye (here: frozen, as a hung host), long before the 60 s heartbeat timeout."""
    victim = host.nodes["n2"]
    name = node_name(victim.node_id)
    coordinator = report["coordinator"]["socket"]
    others = [row["name"] for row in tray.status()["nodes"] if row.get("ray_node_id")]
    others.remove(name)
    with Client(coordinator) as c:  # put an environment on the victim
        for other in others:
            c.node_drain(other)
        try:
            env = c.env_open()
        finally:
            for other in others:
                c.node_undrain(other)
    ref = rollout_step.options(**on("n0")).remote(["sleep", "60"], env)

    def running_on_victim() -> bool:
        with Client(coordinator) as c:
            return any(r["pool"] == f"cpu:{name}" for r in c.queue()["running"])

    wait_for(running_on_victim, 60, "the action running on the victim")
    daemon = psutil.Process(row_of(tray.status(), victim.node_id)["pid"])
    daemon.send_signal(signal.SIGSTOP)  # no goodbye, link held open: only Ray can tell
    try:
        removed = time.time()
        host.cluster.remove_node(victim)
        del host.nodes["n2"]
        host.removed.append(name)
        result = ray.get(ref, timeout=LOST_WITHIN_S + 30)
        took = result["ended"] - removed
        print(f"Ray node removed -> infra_error at the client in {took:.2f} s")
        assert result["outcome"] == "infra_error", result
        assert f"node {name} lost" in result["detail"] and "Ray reports" in result["detail"]
        assert took < LOST_WITHIN_S
        with Client(coordinator) as c:
            assert next(r for r in c.nodes() if r["name"] == name)["state"] == "lost"
        lost = next(r for r in tray.status()["nodes"] if r["name"] == name)
        assert "Ray reports" in lost["lost_because"]
    finally:
        daemon.send_signal(signal.SIGCONT)  # it has its SIGTERM (its actor died): it stops
    wait_for(lambda: not _alive(daemon), 30, "the frozen node daemon to stop once thawed")
    assert not Path(host.socket("n2")).exists()
    result = ray.get(rollout_step.options(**on("n1")).remote(["echo", "still"]), timeout=120)
    assert result["outcome"] == "ok" and result["node"] != name


def test_a_node_daemon_that_crashes_is_restarted_by_ray(
    host: RayHost, report: dict[str, Any]
) -> None:
    """A node daemon killed outright takes its actor down; Ray restarts the actor, and its
    new daemon rejoins under the same name and serves the same socket."""
    node_id = host.nodes["n1"].node_id
    old = psutil.Process(row_of(tray.status(), node_id)["pid"])
    # One that dies at start-up is reported as failed, not restarted. psutil's create_time
    # counts from the kernel's boot time, which /proc/stat gives in whole seconds: it can be
    # up to 1 s early (0.3 s on one CI machine, which killed the daemon at 9.7 s of its 10).
    wait_for(
        lambda: time.time() - old.create_time() >= RESTART_AFTER_S + 1.5,
        RESTART_AFTER_S + 7,
        "the daemon to have run long enough to be restarted",
    )
    old.kill()

    def restarted() -> dict[str, Any] | None:
        row = row_of(tray.status(), node_id)
        if row is None or row["pid"] in (None, old.pid):
            return None
        with Client(host.socket("n1"), connect_timeout_s=1.0) as c:
            c.ping()  # forwarded: the new daemon has joined the coordinator
        return row

    row = wait_for(restarted, 90, "the node daemon restarted by Ray")
    assert row["name"] == node_name(node_id) and row["state"] == "ready"
    result = ray.get(rollout_step.options(**on("n1")).remote(["echo", "back"]), timeout=120)
    assert result["outcome"] == "ok", result


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ------------------------------------------------------------------ down


def test_ray_down_leaves_nothing_behind(host: RayHost, report: dict[str, Any]) -> None:
    """`ray down` stops every daemon and kills every actor it started: no process, socket,
    state dir (but a dead host's) or named actor is left; `ray status` then says so."""
    logs = "".join(p.read_text() for p in host.state_root.rglob("tangramd.log"))
    assert "invariant_violated" not in logs and "Traceback" not in logs, logs[-3000:]
    assert _daemons_under(host.state_root)
    done = ctl("ray", "down", "--address", host.cluster.address, "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["stopped"] and not summary["problems"], summary
    assert all(node["exit_status"] == 0 for node in summary["nodes"]), summary
    ours = [
        a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE
    ]
    assert not ours
    assert not _daemons_under(host.state_root)
    assert not list(host.work.rglob("*.sock"))
    # Only the state of the node whose host "died" stays, as on a real dead host's disk.
    assert sorted(p.name for p in host.state_root.iterdir()) == sorted(host.removed)
    again = CliRunner().invoke(cli, ["ray", "status"])
    assert again.exit_code == 3 and "not running" in again.output
    assert ctl("ray", "down", "--address", host.cluster.address).stdout.strip() == (
        "nothing to stop"
    )

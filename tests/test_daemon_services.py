"""GPU services in a real `tangramd up`: simulated GPUs, real torch worker processes.

One daemon serves the module (starting a worker imports torch: seconds on a shared core);
its two simulated GPUs hold one of the 0.06 GB services each, so three services force
evictions and restores. Tests that kill workers, remove services or restart the daemon
come last.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from harness import assert_clean_log
from hostile_user import in_child_as

from tangram import Client
from tangram.client import CallResult
from tangram.model import TangramError
from tangram.protocol import BadRequest, NotFound
from tangram.testing import SpawnedDaemon, spawn_daemon, wait_for
from tangramctl.main import cli

SERVICES = Path(__file__).parent / "data" / "services"
sys.path.insert(0, str(SERVICES))
from tiny_services import expected  # noqa: E402  # the services' own formula, without torch

CONFIG = """
[sched]
coalesce_ms = 1.0

[gpu]
simulated = { count = 2, mem_gb = 0.1, h2d_gbps = 1 }
nvml = false
"""
MEM_GB = 0.06  # two of these never share a 0.1 GB GPU
SIZES = {"small": (1000, 0.5), "medium": (3000, 1.5), "large": (5000, 2.5)}
NAMES = {"a": "small", "b": "medium", "c": "large"}


class GpuDaemon:
    """The module's daemon; the restart test replaces it with one on the same state dir."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.current = self._spawn()

    def _spawn(self) -> SpawnedDaemon:
        env = {"TANGRAM_VALIDATE": "1"}
        return spawn_daemon(self.workdir, CONFIG, env=env, ready_timeout_s=120)

    def client(self) -> Client:
        return Client(self.current.socket, timeout_s=120)

    def restart(self) -> None:
        self.stop()
        self.current = self._spawn()

    def stop(self) -> None:
        assert self.current.stop() == 0, self.current.log()
        assert_clean_log(self.current.log())


@pytest.fixture(scope="module")
def gpu_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuDaemon]:
    """A daemon with services a, b, c (0.06 GB each) registered concurrently."""
    d = GpuDaemon(tmp_path_factory.mktemp("gpud"))
    try:
        errors: list[BaseException] = []

        def register(name: str) -> None:
            try:
                with d.client() as c:
                    c.service_register(
                        name,
                        mem_gb=MEM_GB,
                        entry=f"tiny_services:{NAMES[name]}",
                        path=str(SERVICES),
                    )
            except BaseException as exc:  # reported below, in the main thread
                errors.append(exc)

        threads = [threading.Thread(target=register, args=(n,)) for n in NAMES]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        yield d
    finally:
        d.stop()


def want(name: str, x: float) -> float:
    n, bias = SIZES[NAMES[name]]
    return expected(n, bias, x)


def listed(c: Client) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in c.service_list()}


def call_in_background(
    gpu_daemon: GpuDaemon, name: str, payload: dict[str, Any]
) -> tuple[threading.Thread, list[CallResult]]:
    """Start one call on its own connection; the box gets its result."""
    box: list[CallResult] = []

    def call_and_keep() -> None:
        with gpu_daemon.client() as c:
            box.append(c.call(name, payload))

    thread = threading.Thread(target=call_and_keep)
    thread.start()
    return thread, box


def test_gpus_are_a_pool_and_a_node_resource(gpu_daemon: GpuDaemon) -> None:
    """The simulated GPUs show as the `gpu` pool in status and as the node's gpus count."""
    with gpu_daemon.client() as c:
        assert c.status()["pools"]["gpu"]["capacity"] == 2
        assert [node["gpus"] for node in c.nodes()] == [2]


def test_call_returns_the_handlers_answer_with_placement(gpu_daemon: GpuDaemon) -> None:
    """A call answers what the module computes, with the contract's fields and its GPUs."""
    with gpu_daemon.client() as c:
        result = c.call("a", {"x": 2.0})
        assert isinstance(result, CallResult)
        assert result.outcome == "ok", result
        assert result.result is not None
        assert result.result["y"] == pytest.approx(want("a", 2.0), rel=1e-5)
        assert result.error is None and result.node == "local"
        assert len(result.gpus) == 1 and result.gpus[0] in (0, 1)
        assert result.act_s >= result.queue_s + result.restore_s + result.exec_s - 1e-6
        story = c.story(result.action_id)
        events = [(e["event"], e["detail"]) for e in story["events"]]
        placed = [d for e, d in events if e == "placed"]
        assert placed and "pool=gpu" in placed[0] and f"units={list(result.gpus)}" in placed[0]
        running = [d for e, d in events if e == "running"]
        assert running and f"node=local gpus={list(result.gpus)}" in running[0]
        assert story["outcome"] == "ok"


def test_three_services_on_two_gpus_evict_and_restore(gpu_daemon: GpuDaemon) -> None:
    """Rotating over three services that fit two at a time evicts and restores them, and
    every answer after a restore is still exactly right (every byte came back)."""
    with gpu_daemon.client() as c:
        before = listed(c)
        for round_ in range(2):
            for name in NAMES:
                x = float(round_ * 3 + 1)
                result = c.call(name, {"x": x})
                assert result.outcome == "ok", result
                assert result.result is not None
                assert result.result["y"] == pytest.approx(want(name, x), rel=1e-5)
        after = listed(c)
    restored = {n: after[n]["restores"] - before[n]["restores"] for n in NAMES}
    assert sum(restored.values()) >= 4, (before, after)
    assert all(count >= 1 for count in restored.values()), restored
    assert sum(after[n]["evictions"] for n in NAMES) >= 2, after
    states = [r["state"] for row in after.values() for r in row["replicas"]]
    assert "resident" in states and "backed_up" in states, after
    assert all(after[n]["restore_s_total"] > 0 for n in NAMES), after
    assert all(after[n]["calls"] >= 2 for n in NAMES)


def test_concurrent_calls_use_both_gpus(gpu_daemon: GpuDaemon) -> None:
    """Two slow calls of different services run at once, one on each GPU."""
    with gpu_daemon.client() as c:
        c.call("b", {"x": 1})  # resident somewhere before the pair starts
    jobs = [call_in_background(gpu_daemon, name, {"x": 1, "sleep": 2.0}) for name in "ab"]
    for thread, _ in jobs:
        thread.join(60)
    results = [box[0] for _, box in jobs]
    assert [r.outcome for r in results] == ["ok", "ok"], results
    assert sorted(r.gpus[0] for r in results) == [0, 1]


def test_handler_error_is_failed_with_its_message(gpu_daemon: GpuDaemon) -> None:
    """A payload the handler rejects ends `failed` with the handler's message."""
    with gpu_daemon.client() as c:
        result = c.call("a", {"y": 1})
        assert result.outcome == "failed"
        assert result.error is not None and "payload needs 'x'" in result.error
        assert c.call("a", {"x": 1}).outcome == "ok"


def test_an_answer_past_the_frame_limit_is_failed_naming_size_and_limit(
    gpu_daemon: GpuDaemon,
) -> None:
    """A handler's 20 MB answer cannot travel in a 16 MiB response: the call ends `failed`
    naming the answer's size and the limit (it was `internal`, "a bug in the daemon"),
    through `Client.call` and `tangramctl call --json`; the service answers on."""
    pad = 20 << 20
    with gpu_daemon.client() as c:
        result = c.call("a", {"x": 1, "pad": pad})
        assert result.outcome == "failed", result
        assert result.error is not None
        limit = f"limit of {(16 << 20) - (64 << 10)} bytes"
        assert limit in result.error and f"max_frame_bytes = {16 << 20}" in result.error
        size = int(result.error.split("answer is ")[1].split(" bytes")[0])
        assert pad < size < pad + 1024, result.error
        assert result.result is None
        assert c.call("a", {"x": 1}).outcome == "ok"
    args = ["--socket", gpu_daemon.current.socket, "call", "a", "--json", "--"]
    r = CliRunner().invoke(cli, [*args, json.dumps({"x": 1, "pad": pad})])
    assert r.exit_code == 1, r.output  # failed, as a handler's rejection
    answer = json.loads(r.output)
    assert answer["outcome"] == "failed" and "daemon.max_frame_bytes" in answer["error"], answer


def test_call_of_an_unknown_service_is_not_found(gpu_daemon: GpuDaemon) -> None:
    """Calling a service nobody registered is a not_found error naming it."""
    with gpu_daemon.client() as c, pytest.raises(NotFound, match="'nope'"):
        c.call("nope", {"x": 1})


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ({"runtime": "onnx", "entry": "tiny_services:small"}, "runtime"),
        ({"runtime": "torch"}, "'entry'"),
        ({"runtime": "torch", "entry": "tiny_services:small", "gpus": 3}, "'gpus'"),
        ({"runtime": "torch", "entry": "tiny_services:small", "mem_gb": 5}, "does not fit"),
        ({"runtime": "http", "cmd": "server --port 1"}, "'cmd'"),
    ],
    ids=["unknown runtime", "missing entry", "three gpus", "too big", "http without port"],
)
def test_bad_registration_names_the_field(
    gpu_daemon: GpuDaemon, args: dict[str, Any], needle: str
) -> None:
    """An invalid registration is a bad_request that names the field or the limit."""
    request = {"name": "bad", "mem_gb": 0.01, "path": str(SERVICES), **args}
    with gpu_daemon.client() as c:
        with pytest.raises(BadRequest, match=needle):
            c.request("service.register", request)
        assert "bad" not in listed(c)


def test_factory_failure_names_service_and_exception(gpu_daemon: GpuDaemon) -> None:
    """A factory that raises is refused with the service's name and the exception; the
    daemon keeps serving and the name stays free."""
    with gpu_daemon.client() as c:
        with pytest.raises(BadRequest) as info:
            c.service_register(
                "oops", mem_gb=0.01, entry="tiny_services:broken", path=str(SERVICES)
            )
        assert "'oops'" in info.value.message and "no weights here" in info.value.message
        assert "oops" not in listed(c)
        assert c.call("a", {"x": 1}).outcome == "ok"


def test_cli_register_list_call_json(gpu_daemon: GpuDaemon) -> None:
    """`service register/list --json` and `call --json` keep the contract; exit codes
    follow the outcome."""

    def ctl(*args: str) -> Any:
        sock = gpu_daemon.current.socket
        return CliRunner().invoke(cli, ["--socket", sock, *args], catch_exceptions=False)

    r = ctl(
        "service", "register", "cli", "--entry", "tiny_services:small", "--path",
        str(SERVICES), "--mem-gb", "0.01", "--json",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["name"] == "cli"
    r = ctl("service", "list", "--json")
    assert r.exit_code == 0, r.output
    rows = {row["name"]: row for row in json.loads(r.output)["services"]}
    keys = {"name", "runtime", "mem_gb", "gpus", "replicas", "calls", "restores"}
    assert keys | {"restore_s_total"} <= set(rows["cli"])
    assert rows["cli"]["runtime"] == "torch" and rows["cli"]["gpus"] == [1]
    r = ctl("call", "cli", "--timeout", "30", "--json", "--", '{"x": 2}')
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    fields = {"outcome", "result", "error", "queue_s", "restore_s", "exec_s", "act_s", "gpus"}
    assert fields | {"node"} <= set(out)
    assert out["result"]["y"] == pytest.approx(want("a", 2.0), rel=1e-5)
    assert ctl("call", "cli", "--", '{"y": 2}').exit_code == 1  # failed
    assert ctl("call", "nope", "--", "{}").exit_code == 2  # not_found
    assert ctl("call", "cli", "--", "[1]").exit_code == 2  # not an object


def test_http_runtime_serves_calls_through_the_daemon(gpu_daemon: GpuDaemon) -> None:
    """An http service (the worker's vLLM-style server on loopback) is started on its first
    call and answers through the daemon like a torch one."""
    cmd = (
        f"{sys.executable} -m tangramd.services.worker --name h --entry tiny_services:small "
        f"--path {SERVICES} --http-port {{port}}"
    )
    with gpu_daemon.client() as c:
        info = c.service_register("h", runtime="http", mem_gb=0.01, cmd=cmd, route="/score")
        assert info["runtime"] == "http"
        result = c.call("h", {"x": 2})
        assert result.outcome == "ok", result
        assert result.result is not None
        assert result.result["y"] == pytest.approx(want("a", 2.0), rel=1e-5)
        rejected = c.call("h", {"y": 2})
        assert rejected.outcome == "failed" and "payload needs 'x'" in (rejected.error or "")
        assert c.service_remove("h")["removed"] is True


def test_worker_kill_is_infra_error_then_next_call_works(
    gpu_daemon: GpuDaemon, tmp_path: Path
) -> None:
    """Killing the worker under a call ends that call `infra_error`; the next call
    restarts the replica and answers correctly."""
    with gpu_daemon.client() as c:
        first = c.call("a", {"x": 1})
        assert first.outcome == "ok" and first.result is not None
        victim = first.result["pid"]
        started = tmp_path / "started"
        payload = {"x": 1, "sleep": 30, "started": str(started)}
        thread, box = call_in_background(gpu_daemon, "a", payload)
        wait_for(started.exists, 60, "the call inside the handler")
        os.kill(victim, signal.SIGKILL)
        thread.join(60)
        assert box and box[0].outcome == "infra_error", box
        again = c.call("a", {"x": 3})
        assert again.outcome == "ok", again
        assert again.result is not None and again.result["pid"] != victim
        assert again.result["y"] == pytest.approx(want("a", 3.0), rel=1e-5)


def test_call_timeout_is_timeout_then_next_call_works(gpu_daemon: GpuDaemon) -> None:
    """A handler that overruns `--timeout` ends `timeout` (CLI exit 124); the stuck worker
    is replaced and the next call answers."""
    sock = gpu_daemon.current.socket
    args = ["--socket", sock, "call", "b", "--timeout", "0.5", "--", '{"x": 1, "sleep": 30}']
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 124, r.output
    with gpu_daemon.client() as c:
        late = c.call("b", {"x": 1, "sleep": 30}, timeout=0.5)  # the contract's keyword
        assert late.outcome == "timeout", late
        again = c.call("b", {"x": 2})
        assert again.outcome == "ok", again
        assert again.result is not None
        assert again.result["y"] == pytest.approx(want("b", 2.0), rel=1e-5)


def test_remove_ends_queued_calls_rejected(gpu_daemon: GpuDaemon) -> None:
    """Removing a service whose calls wait for GPUs ends each of them `rejected`; the CLI
    then finds no such service (exit 1)."""
    with gpu_daemon.client() as c:
        if "cli" not in listed(c):  # the CLI test registers it; alone, this test does
            c.service_register("cli", entry="tiny_services:small", path=str(SERVICES), mem_gb=0.01)
        calls = [call_in_background(gpu_daemon, "cli", {"x": 1, "sleep": 2}) for _ in range(4)]
        wait_for(
            lambda: len((q := c.queue())["running"]) == 2 and len(q["waiting"]) == 2,
            60,
            "two calls running and two waiting",
        )
        removed = c.service_remove("cli")
        assert removed == {"name": "cli", "removed": True, "rejected": 2}
        for thread, _ in calls:
            thread.join(60)
        outcomes = sorted(box[0].outcome for _, box in calls)
        assert outcomes.count("rejected") >= 2, outcomes
        assert "cli" not in listed(c)
        with pytest.raises(NotFound):
            c.call("cli", {"x": 1})
        assert c.status()["pools"]["gpu"]["free"] == 2
    args = ["--socket", gpu_daemon.current.socket, "service", "remove", "cli"]
    assert CliRunner().invoke(cli, args, catch_exceptions=False).exit_code == 1


def test_only_the_operator_registers_services(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Registered code runs as the daemon's user: another local user may not register or
    remove services (`forbidden`), though its calls are served as usual."""
    from hostile_user import local_user

    with local_user() as user, tempfile.TemporaryDirectory(prefix="tgs-", dir="/tmp") as tmp:
        os.chmod(tmp, 0o755)
        d = spawn_daemon(tmp, "[gpu]\nnvml = false\n")
        try:
            os.chown(d.socket, 0, user.gid)
            register = {"name": "s", "runtime": "torch", "mem_gb": 1, "entry": "m:f"}
            errors = as_user(user.uid, user.gid, d.socket, [
                ("service.register", register), ("service.remove", {"name": "s"}),
                ("call", {"name": "s", "payload": {}}),
            ])  # fmt: skip
            assert errors[0].startswith("forbidden: service.register: operators only")
            assert errors[1].startswith("forbidden: service.remove: operators only")
            assert errors[2].startswith("not_found")  # calls pass the check
            with Client(d.socket) as c, pytest.raises(BadRequest, match="no GPUs"):
                c.request("service.register", register)  # the operator gets past it
        finally:
            assert d.stop() == 0


def as_user(uid: int, gid: int, path: str, requests: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Send each request from a child running as uid/gid; ``code: message`` of each error."""

    def ask() -> bytes:
        lines = []
        with Client(path) as c:
            for op, args in requests:
                try:
                    c.request(op, args)
                    lines.append("ok")
                except TangramError as exc:
                    lines.append(f"{exc.code}: {exc.message}")
        return json.dumps(lines).encode()

    return json.loads(in_child_as(uid, gid, ask))


def test_registrations_persist_across_a_restart(gpu_daemon: GpuDaemon) -> None:
    """A restarted daemon on the same state dir has the same services and serves them."""
    with gpu_daemon.client() as c:
        names = set(listed(c))
    assert names == set(NAMES)
    gpu_daemon.restart()
    with gpu_daemon.client() as c:
        rows = listed(c)
        assert set(rows) == names
        assert all(row["error"] is None for row in rows.values()), rows
        result = c.call("c", {"x": 2})
        assert result.outcome == "ok", result
        assert result.result is not None
        assert result.result["y"] == pytest.approx(want("c", 2.0), rel=1e-5)

"""Elastic GPU calls on a real `tangramd up` with two simulated GPUs (issue 33 item 2).

The scheduler picks each call's GPU count from the service's speed-up table: two GPUs when
idle, one when the other GPU is held; the answers (and `tangramctl call --json`) report the
GPUs. A k-GPU torch replica is k worker processes and answers as a 1-GPU one;
`tangramctl service profile` measures the speed-up per count on real k-worker replicas and
saves it as the service's eff; an http engine gets `--tensor-parallel-size k` and
`CUDA_VISIBLE_DEVICES` (a stub engine, a real process, says what it got).
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from harness import assert_clean_log

from tangram import Client
from tangram.client import CallResult
from tangram.protocol import BadRequest
from tangram.testing import SpawnedDaemon, spawn_daemon, wait_for
from tangramctl.main import cli

SERVICES = Path(__file__).parent / "data" / "services"
CONFIG = """
[sched]
coalesce_ms = 1.0

[gpu]
simulated = { count = 2, mem_gb = 0.1, h2d_gbps = 1 }
nvml = false
"""
X = {"x": [3, -1, 4, 1, -5, 9]}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SpawnedDaemon]:
    """A daemon on two simulated GPUs with the layered service `mlp` (GPU counts 1, 2;
    speed-up 1.3 at 2) and the one-GPU service `hold`, registered through the CLI."""
    d = spawn_daemon(
        tmp_path_factory.mktemp("elasticd"),
        CONFIG,
        env={"TANGRAM_VALIDATE": "1"},
        ready_timeout_s=120,
    )
    try:
        for name, extra in (
            ("mlp", ["--entry", "mlp_services:small", "--gpus", "1,2", "--eff", "1:1,2:1.3"]),
            ("hold", ["--entry", "tiny_services:small"]),
        ):
            args = ["service", "register", name, "--mem-gb", "0.01", "--path", str(SERVICES)]
            r = ctl(d, *args, *extra, "--json")
            assert r.exit_code == 0, r.output
        yield d
    finally:
        assert d.stop() == 0, d.log()
        assert_clean_log(d.log())


def ctl(d: SpawnedDaemon, *args: str) -> Any:
    return CliRunner().invoke(cli, ["--socket", d.socket, *args])


def call_json(d: SpawnedDaemon, name: str, payload: dict[str, Any], *extra: str) -> dict[str, Any]:
    r = ctl(d, "call", name, *extra, "--json", "--", json.dumps(payload))
    assert r.exit_code == 0, r.output
    answer: dict[str, Any] = json.loads(r.output)
    return answer


def test_an_elastic_call_gets_two_gpus_when_idle_and_one_when_crowded(
    daemon: SpawnedDaemon, tmp_path: Path
) -> None:
    """Idle, a call to `mlp` runs on both GPUs (its `--json` says gpus [0, 1]); while a
    long call of another service holds one GPU, the next `mlp` call runs at once on the
    other one rather than wait for both."""
    idle = call_json(daemon, "mlp", X)
    assert idle["outcome"] == "ok" and idle["gpus"] == [0, 1], idle
    with Client(daemon.socket, timeout_s=120) as c:
        assert c.call("hold", {"x": 1, "sleep": 2.0}).ok  # its history: calls take 2 s
    started = tmp_path / "started"
    box: list[CallResult] = []

    def blocker() -> None:
        with Client(daemon.socket, timeout_s=120) as c:
            box.append(c.call("hold", {"x": 1, "sleep": 3.0, "started": str(started)}))

    thread = threading.Thread(target=blocker)
    thread.start()
    try:
        wait_for(started.exists, 60, "the blocking call started")
        crowded = call_json(daemon, "mlp", X)
    finally:
        thread.join(60)
    (held,) = box
    assert held.ok and len(held.gpus) == 1, held
    assert crowded["outcome"] == "ok" and len(crowded["gpus"]) == 1, crowded
    assert crowded["gpus"] != list(held.gpus), (crowded, held)
    assert crowded["queue_s"] < 1.0, crowded  # it did not wait for the 3 s call
    assert crowded["result"]["y"] == idle["result"]["y"]


def test_a_two_gpu_replica_is_two_workers_and_answers_as_one(daemon: SpawnedDaemon) -> None:
    """The same input at one GPU and at two (`call --gpus`): the same answer; the two-GPU
    replica is two live worker processes, each holding a shard of the module."""
    one = call_json(daemon, "mlp", X, "--gpus", "1")
    two = call_json(daemon, "mlp", X, "--gpus", "2")
    assert len(one["gpus"]) == 1 and two["gpus"] == [0, 1], (one, two)
    assert two["result"]["y"] == one["result"]["y"]
    assert two["result"]["held_bytes"] < one["result"]["held_bytes"]  # worker 0's shard
    with Client(daemon.socket, timeout_s=60) as c:
        (row,) = [r for r in c.service_list() if r["name"] == "mlp"]
    (pair,) = [r for r in row["replicas"] if r["gpus"] == [0, 1] and r["state"] == "resident"]
    workers = pair["workers"]
    assert len({w["pid"] for w in workers}) == 2 and workers[0]["pid"] == two["result"]["pid"]
    assert all(w["shard_bytes"] > 0 for w in workers), workers
    bad = ctl(daemon, "call", "mlp", "--gpus", "4", "--", json.dumps(X))
    assert bad.exit_code == 2 and "gpus=4" in bad.output, bad.output


def test_service_profile_measures_each_count_and_saves_the_eff(daemon: SpawnedDaemon) -> None:
    """`service profile --json` calls the service at each of its GPU counts on real
    k-worker replicas, reports the median seconds and the speed-up per count, and saves
    the speed-ups as the service's eff (`service list` shows it); `--no-save` keeps it."""
    with Client(daemon.socket, timeout_s=60) as c:
        c.service_register(
            "prof",
            mem_gb=0.01,
            entry="mlp_services:small",
            path=str(SERVICES),
            gpus=[1, 2],
        )
    r = ctl(daemon, "service", "profile", "prof", "--repeat", "2", "--json", "--", json.dumps(X))
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["service"] == "prof" and report["saved"] is True, report
    assert sorted(report["gpus"]) == ["1", "2"] and sorted(report["speedup"]) == ["1", "2"]
    assert report["speedup"]["1"] == 1.0 and report["speedup"]["2"] > 0
    assert all(len(v) == 2 and min(v) > 0 for v in report["runs"].values()), report
    assert report["eff"] == f"1:1,2:{report['speedup']['2']:.4g}", report
    with Client(daemon.socket, timeout_s=60) as c:
        (row,) = [row for row in c.service_list() if row["name"] == "prof"]
        assert row["eff"] == report["eff"], row
        with pytest.raises(BadRequest, match="eff"):
            c.service_set_eff("prof", "4:2")  # 4 is not one of its counts
    again = ctl(
        daemon, "service", "profile", "prof", "--gpus", "1", "--no-save", "--json", "--", "{}"
    )
    assert again.exit_code == 1, again.output  # the handler rejects {}: nothing saved
    with Client(daemon.socket, timeout_s=60) as c:
        assert [r["eff"] for r in c.service_list() if r["name"] == "prof"] == [report["eff"]]
        c.service_remove("prof")


@pytest.mark.parametrize(
    ("cmd_tail", "flag"),
    [("", ["--tensor-parallel-size", "2"]), (" --tp-size {tp}", ["--tp-size", "2"])],
    ids=["appended", "placeholder"],
)
def test_an_http_engine_gets_its_gpu_count_and_visible_devices(
    daemon: SpawnedDaemon, cmd_tail: str, flag: list[str]
) -> None:
    """An http service on 2 GPUs starts its engine with the count (`--tensor-parallel-size
    2` appended, or written where `{tp}` is) and `CUDA_VISIBLE_DEVICES` set (empty on
    simulated GPUs); on 1 GPU the command runs as written."""
    cmd = f"{sys.executable} {SERVICES / 'stub_engine.py'} --port {{port}}{cmd_tail}"
    with Client(daemon.socket, timeout_s=120) as c:
        c.service_register("engine", runtime="http", mem_gb=0.01, cmd=cmd, gpus=[1, 2], route="/x")
        try:
            two = c.call("engine", {"n": 2}, gpus=2)
            one = c.call("engine", {"n": 1}, gpus=1)
        finally:
            c.service_remove("engine")
    assert two.ok and two.gpus == (0, 1) and two.result is not None, two
    argv = two.result["argv"]
    assert argv[argv.index(flag[0]) : argv.index(flag[0]) + 2] == flag, argv
    assert argv.count(flag[0]) == 1, argv
    assert two.result["cuda_visible_devices"] == "", two.result
    assert one.ok and len(one.gpus) == 1 and one.result is not None, one
    assert "--tensor-parallel-size" not in one.result["argv"], one.result
    assert one.result["cuda_visible_devices"] == "", one.result
    assert one.result["pid"] != two.result["pid"]  # one engine per chunk


def test_an_http_command_that_fixes_the_parallel_size_is_refused(daemon: SpawnedDaemon) -> None:
    """A command with its own `--tensor-parallel-size` for a service on 1 or 2 GPUs is a
    bad request naming the flag and `{tp}`."""
    cmd = f"{sys.executable} {SERVICES / 'stub_engine.py'} --port {{port}} --tensor-parallel-size 2"
    with Client(daemon.socket, timeout_s=60) as c, pytest.raises(BadRequest, match=r"\{tp\}"):
        c.service_register("fixed", runtime="http", mem_gb=0.01, cmd=cmd, gpus=[1, 2])

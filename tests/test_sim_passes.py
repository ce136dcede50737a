"""``Engine(passes="touched")``: while trajectories wait for a node, a pass runs only the
queues of the CPU nodes whose state changed (and of those the node choice could give a
trajectory). Where memory never binds it decides exactly as ``passes="all"``; where it
binds it leaves queues out, every action still runs once and the pools stay consistent,
and the results stay close to the default's; a mode it does not know is refused, naming the
known ones. The JSON of ``tangramctl simulate`` says which mode ran."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import pytest
from click.testing import CliRunner
from sim_starts import logged

from tangram.sim import generate, parse_policy
from tangram.sim.cli import simulate as simulate_cmd
from tangram.sim.cluster import ClusterSpec, CpuNodeSpec, load_cluster
from tangram.sim.engine import PASSES, Engine
from tangram.sim.metrics import ActionRecord, SimResult

ROOT = Path(__file__).resolve().parents[1]


def _cluster(nodes: int, mem_gb: float) -> ClusterSpec:
    base = load_cluster(ROOT / "config" / "cluster-mixed.toml")
    node = CpuNodeSpec(count=nodes, cores=64, numa=2, mem_gb=mem_gb)
    return replace(base, cpu_nodes=(node,))


class _Ran(NamedTuple):
    engine: Engine
    starts: list[tuple[str, str, float, int]]
    result: SimResult

    @property
    def touched_skips(self) -> int:
        return self.engine.touched_skips

    @property
    def records(self) -> list[ActionRecord]:
        return self.engine.records


def _run(cluster: ClusterSpec, batch: int, policy: str, passes: str) -> _Ran:
    trace = generate("ai-coding", cluster, batch, seed=0)
    engine, starts = logged(cluster, trace, parse_policy(policy), passes=passes, check=True)
    return _Ran(engine, starts, engine.run())


@pytest.mark.parametrize("policy", ["tangram", "tangram-eft"])
def test_touched_decides_as_all_where_memory_never_binds(policy: str) -> None:
    # 96 trajectories on 2 nodes of 512 GB (128 environments each): every trajectory has
    # its node at its first pass, so no node's queue is ever left out
    cluster = _cluster(2, 512.0)
    every = _run(cluster, 96, policy, "all")
    touched = _run(cluster, 96, policy, "touched")
    assert touched.touched_skips == 0 and every.touched_skips == 0
    assert len(every.starts) > 1000
    assert touched.starts == every.starts
    assert touched.records == every.records
    assert touched.result.summary == every.result.summary


@pytest.mark.parametrize("policy", ["tangram", "tangram-eft"])
def test_touched_leaves_queues_out_and_stays_close(policy: str) -> None:
    # 512 trajectories on 2 nodes of 64 GB (16 environments each): most of them wait
    # node-less most of the run, the case the mode exists for
    cluster = _cluster(2, 64.0)
    every = _run(cluster, 512, policy, "all")
    touched = _run(cluster, 512, policy, "touched")
    assert touched.touched_skips > 1000  # queues were left out, or this compares nothing
    assert every.touched_skips == 0
    # every action ran exactly once, none failed (check=True validated the pools after
    # every event)
    ids = [s[0] for s in touched.starts]
    assert len(ids) == len(set(ids)) == len(every.starts)
    assert not any(r.failed for r in touched.records)
    a = every.result.summary
    t = touched.result.summary
    assert t["actions"] == a["actions"]
    # close to the default, not the same: a node's held-back elastic action is looked at
    # again at that node's next event rather than at the next event anywhere
    assert t["avg_act_s"] == pytest.approx(a["avg_act_s"], rel=0.02)
    assert t["makespan_s"] == pytest.approx(a["makespan_s"], rel=0.05)
    assert touched.starts != every.starts


def test_unknown_mode_is_refused_naming_the_known_ones() -> None:
    cluster = _cluster(1, 512.0)
    trace = generate("ai-coding", cluster, 8, seed=0)
    with pytest.raises(ValueError, match="passes: 'some' is not one of all, touched"):
        Engine(cluster, trace, parse_policy("tangram"), passes="some")
    assert PASSES == ("all", "touched")


def test_cli_runs_touched_and_says_so(tmp_path: Path) -> None:
    runner = CliRunner()
    args = [
        "--cluster",
        str(ROOT / "config" / "cluster-mixed.toml"),
        "--workload",
        "ai-coding",
        "--batch",
        "32",
        "--policy",
        "tangram",
        "--quiet",
        "--json",
    ]
    out = runner.invoke(simulate_cmd, [*args, "--passes", "touched"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert doc["passes"] == "touched"
    assert doc["policies"]["tangram"]["actions"] > 0
    default = json.loads(runner.invoke(simulate_cmd, args).output)
    assert default["passes"] == "all"
    bad = runner.invoke(simulate_cmd, [*args, "--passes", "some"])
    assert bad.exit_code == 2 and "'some' is not one of 'all', 'touched'" in bad.output

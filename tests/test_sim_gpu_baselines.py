"""The simulator's static GPU baseline batching as SGLang does, and MOPD's popularity skew
(issue 33 item 5): hand-computed ACTs from the service time model, and bench/paper/fig8_gpu.py's
table (c) in a small mode."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from script_loader import load_script

from tangram.sim import generate, load_cluster, parse_cluster, parse_lines, parse_policy, simulate
from tangram.sim.cluster import ClusterError
from tangram.sim.workloads import WorkloadError

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "paper" / "fig8_gpu.py"


def cluster(max_batch: int, gain: float = 1.0, replicas: int = 1) -> Any:
    """One 8-GPU node; service ``judge`` deployed as ``replicas`` static 4-GPU replicas."""
    return parse_cluster(
        {
            "gpu_node": [{"count": 1, "gpus": 8, "gpu_mem_gb": 80, "h2d_gbps": 10}],
            "service": [
                {"name": "judge", "mem_gb": 10, "static_gpus": 4, "static_replicas": replicas}
            ],
            "baselines": {"static_max_batch": max_batch, "static_batch_gain": gain},
        },
        "<test>",
    )


def calls(*t1: float, eff4: float = 1.0) -> Any:
    """One trajectory per call, all submitted at 0; a call alone on 4 GPUs takes
    ``t1 / (4 * eff4)`` seconds."""
    lines = []
    for i, t in enumerate(t1):
        action = {
            "kind": "service",
            "service": "judge",
            "gpus": [1, 2, 4],
            "t1_s": t,
            "eff": {"1": 1, "2": 1, "4": eff4},
        }
        trajectory = {"id": f"t{i}", "task": "t", "arrival_s": 0.0, "mem_gb": 1}
        lines.append(json.dumps({**trajectory, "steps": [{"action": action}]}))
    return parse_lines(lines)


def acts(max_batch: int, gain: float, t1: tuple[float, ...], replicas: int = 1) -> list[float]:
    result = simulate(
        cluster(max_batch, gain, replicas), calls(*t1), parse_policy("static-services"), check=True
    )
    return sorted(round(a, 6) for a in result.acts)


# name: (max_batch, gain, replicas, each call's t1 on one GPU, ACTs worked out by hand)
CASES = {
    # one call at a time: the second waits for the first (1 s each on 4 GPUs)
    "serial": (1, 1.0, 1, (4.0, 4.0), [1.0, 2.0]),
    # gain 1: a batch of n runs each call n times slower (rho = E(4) / 1 = 1): the same work
    "batched, no gain: processor sharing": (2, 1.0, 1, (4.0, 4.0), [2.0, 2.0]),
    # gain 2: rho = 0.5, two calls each run 1.5 times slower than alone
    "batched, gain 2": (2, 2.0, 1, (4.0, 4.0), [1.5, 1.5]),
    # a (1 s alone) and b (2 s alone) at 1.5x: a ends at 1.5, b has 1 s left alone: 2.5
    "unequal calls leave one by one": (2, 2.0, 1, (4.0, 8.0), [1.5, 2.5]),
    # at most 2 in a batch: the third call waits for a place (1.5), then runs alone (1 s)
    "a full batch queues": (2, 2.0, 1, (4.0, 4.0, 4.0), [1.5, 1.5, 2.5]),
    # two replicas: each call joins the least loaded one and runs alone
    "least loaded replica": (4, 2.0, 2, (4.0, 4.0), [1.0, 1.0]),
    # a lone call runs as fast as the service time model says, batched or not
    "alone is unchanged": (64, 2.0, 1, (8.0,), [2.0]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_static_batching_acts(name: str) -> None:
    """The static baseline's ACTs follow the batching model's formula, case by case."""
    max_batch, gain, replicas, t1, want = CASES[name]
    assert acts(max_batch, gain, t1, replicas) == pytest.approx(want)


def test_batching_removes_the_multi_gpu_loss_only_as_the_batch_grows() -> None:
    """With E(4) = 0.5 and gain 1, two calls batch at rho = 0.5: 1.5x one call alone (2 s),
    where one at a time the second would end at 4 s."""
    result = simulate(
        cluster(2, 1.0), calls(4.0, 4.0, eff4=0.5), parse_policy("static-services"), check=True
    )
    assert sorted(round(a, 6) for a in result.acts) == pytest.approx([3.0, 3.0])
    serial = simulate(
        cluster(1), calls(4.0, 4.0, eff4=0.5), parse_policy("static-services"), check=True
    )
    assert sorted(round(a, 6) for a in serial.acts) == pytest.approx([2.0, 4.0])


def test_batching_baseline_keys_are_checked() -> None:
    """static_max_batch below 1 or a non-positive gain is a cluster error naming the table."""
    for bad in ({"static_max_batch": 0}, {"static_batch_gain": 0.0}):
        with pytest.raises(ClusterError, match="baselines"):
            parse_cluster({"baselines": bad}, "c.toml")


def test_teacher_skew_sets_the_call_volume_spread() -> None:
    """MOPD's teacher calls follow the skew: 1 spreads them evenly, 1000 (the default) puts
    about three orders of magnitude between the most and least called teacher."""
    paper = load_cluster(ROOT / "config" / "cluster-paper.toml")

    def volume(**kw: float) -> Counter[str]:
        trace = generate("mopd", paper, 4000, seed=1, **kw)
        return Counter(a.template.service for t in trace for a in t.actions())

    default, skewed, flat = volume(), volume(teacher_skew=1000.0), volume(teacher_skew=1.0)
    assert default == skewed
    teachers = [s.name for s in paper.services if s.name != "judge"]
    assert max(flat[t] for t in teachers) < 1.5 * min(flat[t] for t in teachers)
    assert skewed[teachers[0]] > 100 * max(skewed[teachers[-1]], 1)
    with pytest.raises(WorkloadError, match="skew"):
        generate("mopd", paper, 1, teacher_skew=0.5)


def _fig8():
    return load_script(SCRIPT, "fig8_gpu_under_test")


def test_fig8_baselines_table_small() -> None:
    """Table (c) in a small mode: a row per shape with serial and batching columns, and the
    GPUs it reports are the fewest of the sweep whose tangram ACT is within the static one."""
    mod = _fig8()
    doc = mod.baselines_table([1000.0], ["4x1", "1x4"], [4, 8], 32, 64, [2.0])
    assert doc["modes"] == ["serial", "batching-gain2"]
    total = doc["static_gpus"]["1000"]
    assert 4 <= total <= 40 and total % 4 == 0  # 4 GPUs per service the trace calls
    acts = {int(g): a for g, a in doc["tangram_act"]["1000"].items()}
    assert sorted(acts) == [4, 8]
    assert [row["shape"] for row in doc["rows"]] == ["4x1", "1x4"]
    for row in doc["rows"]:
        for mode in doc["modes"]:
            cell = row[mode]
            fits = [g for g, a in acts.items() if a <= cell["static_act_s"] + 1e-3]
            assert cell["tangram_gpus"] == (min(fits) if fits else None)
            if cell["tangram_gpus"] is not None:
                assert cell["saving"] == pytest.approx(1 - cell["tangram_gpus"] / total, abs=1e-3)
            # tangram batching (max_batch calls a pass) against the column of its gain
            batched = cell["tangram_batching"]
            assert batched["gain"] == (1.0 if mode == "serial" else 2.0)
            bacts = doc["tangram_batching_act"]["1000"][f"gain{batched['gain']:g}"]
            fits = [int(g) for g, a in bacts.items() if a <= cell["static_act_s"] + 1e-3]
            assert batched["tangram_gpus"] == (min(fits) if fits else None)
    # batching changes tangram's run (calls ride along) at both gains
    for gain in ("gain1", "gain2"):
        assert doc["tangram_batching_act"]["1000"][gain] != doc["tangram_act"]["1000"]


def test_fig8_sweep_bisection_finds_the_full_sweeps_answer(monkeypatch: Any) -> None:
    """Table (c) runs tangram on the GPU counts a bisection asks for: with ACT falling as
    GPUs are added, it names the same fewest count as running every count, in fewer runs."""
    mod = _fig8()
    ran: list[int] = []

    def fake(_base: Any, _trace: Any, g: int) -> float:
        ran.append(g)
        return 1000.0 / g

    monkeypatch.setattr(mod, "_tangram_act", fake)
    counts = list(range(4, 41, 4))
    full = {g: 1000.0 / g for g in counts}
    for target in (10.0, 24.9, 25.0, 40.0, 100.0, 250.0, 300.0, 20.0):
        ran.clear()
        sweep = mod.Sweep(None, [], counts, full=False)
        assert sweep.fewest(target) == mod.fewest_gpus(full, target)
        assert len(ran) <= 4 < len(counts)
        assert mod.Sweep(None, [], counts, full=True).fewest(target) == mod.fewest_gpus(
            full, target
        )

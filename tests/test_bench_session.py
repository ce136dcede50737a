"""bench/session.py at its smallest: it runs end to end (a daemon, the gateway and
``swerex-remote``) and prints the JSON the results table is made of."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

SESSION = Path(__file__).parents[1] / "bench" / "session.py"


def test_bench_session_prints_its_json():
    out = subprocess.run(
        [sys.executable, str(SESSION), "--n", "3", "--warmup", "1", "--concurrent", "2",
         "--sleep", "0.05", "--repeat", "1"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    report = json.loads(out.stdout)
    figures = {
        "client": ("session_p50_ms", "plain_p50_ms"),
        "swerex": ("gateway_p50_ms", "swerex_remote_p50_ms", "ratio"),
        "concurrent": ("gateway_wall_s", "swerex_remote_wall_s", "ratio"),
    }
    for section, keys in figures.items():
        for key in keys:
            value = report[section][key]
            assert math.isfinite(value) and value > 0, (section, key, value)
        assert report["repetitions"][0][section] == report[section]
    # a difference of two latencies: finite, of either sign
    assert math.isfinite(report["client"]["overhead_p50_ms"])
    assert report["concurrent_commands"] == 2 and report["repeat"] == 1 and report["cores"] >= 1

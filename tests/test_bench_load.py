"""bench/load.py on a small instance: every request answered once, nothing left over."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

LOAD = Path(__file__).parents[1] / "bench" / "load.py"


@pytest.mark.slow
def test_small_load_leaves_nothing_behind():
    """400 execs from 32 clients plus 10 env cycles: one answer each, no leftovers."""
    out = subprocess.run(
        [sys.executable, str(LOAD), "--n", "400", "--clients", "32", "--env-cycles", "10",
         "--json"],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    report = json.loads(out.stdout)
    load = report["tangram"]
    assert load["answered"] == 400 and load["outcomes"] == {"ok": 400}, load
    assert load["env_cycles_ok"] == 10
    assert report["leftovers"] == {"processes": 0, "busy_cgroups": 0, "env_dirs": 0}
    # one socket to the fork server and one to each of its lodgers (one per core set),
    # beside the descriptors kept on purpose (the journal, a tasks file per core set)
    before, after = report["daemon_before"], report["daemon_after"]
    lodgers = after["lodgers"]
    assert after["fds"] - after["kept_fds"] <= before["fds"] - before["kept_fds"] + 2 + lodgers

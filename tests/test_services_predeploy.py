"""`[[service]]` pre-deployment and `min_resident` on a real `tangramd up` (issue 33, item 4).

One simulated GPU of 0.1 GB holds one 0.06 GB service at a time, so a warm replica and a
cold one take turns: the config registers both at start and restores the warm one; a call
to the cold one evicts it; removing the cold one frees the memory and the warm one comes
back without a call.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from click.testing import CliRunner
from harness import assert_clean_log

from tangram import Client
from tangram.testing import spawn_daemon, wait_for
from tangramctl.main import cli

SERVICES = Path(__file__).parent / "data" / "services"
sys.path.insert(0, str(SERVICES))
from tiny_services import expected  # noqa: E402  # the services' own formula, without torch

CONFIG = f"""
[sched]
coalesce_ms = 1.0

[gpu]
simulated = {{ count = 1, mem_gb = 0.1, h2d_gbps = 1 }}
nvml = false

[[service]]
name = "warm"
entry = "tiny_services:small"
path = "{SERVICES}"
mem_gb = 0.06
min_resident = 1

[[service]]
name = "cold"
entry = "tiny_services:medium"
path = "{SERVICES}"
mem_gb = 0.06
"""


def rows(c: Client) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in c.service_list()}


def warm_count(c: Client, name: str) -> int:
    return int(rows(c)[name]["warm"])


def test_config_services_are_registered_and_min_resident_is_kept(tmp_path: Path) -> None:
    """`[[service]]` entries are registered at start; a `min_resident = 1` service is
    restored before any call (its first call restores nothing), comes back after an
    eviction once memory is free, and `service register --min-resident` does the same."""
    daemon = spawn_daemon(tmp_path, CONFIG, env={"TANGRAM_VALIDATE": "1"}, ready_timeout_s=120)
    try:
        with Client(daemon.socket, timeout_s=120) as c:
            assert set(rows(c)) == {"warm", "cold"}
            wait_for(lambda: warm_count(c, "warm") == 1, 60, "the warm replica")
            warm = rows(c)["warm"]
            assert warm["min_resident"] == 1 and warm["restores"] == 1, warm
            (replica,) = [r for r in warm["replicas"] if r["state"] == "resident"]
            assert replica["node"] == "local" and replica["gpus"] == [0], replica
            assert rows(c)["cold"]["warm"] == 0
            first = c.call("warm", {"x": 2.0})
            assert first.outcome == "ok" and first.restore_s == 0.0, first
            assert first.result is not None and first.result["y"] == expected(1000, 0.5, 2.0)
            # the cold service's first call restores it, evicting the warm one (no room)
            cold = c.call("cold", {"x": 1.0})
            assert cold.outcome == "ok" and cold.restore_s > 0.0, cold
            assert rows(c)["warm"]["evictions"] == 1
            assert warm_count(c, "warm") == 0
            # room returns when the cold one goes: the warm one is restored with no call
            c.service_remove("cold")
            wait_for(lambda: warm_count(c, "warm") == 1, 60, "the warm replica back")
            assert rows(c)["warm"]["restores"] == 2
            assert c.call("warm", {"x": 3.0}).restore_s == 0.0
            # the CLI's --min-resident: registered, then warmed once there is room
            c.service_remove("warm")
        base = ["--socket", daemon.socket]
        register = ["service", "register", "cli", "--entry", "tiny_services:large", "--json"]
        options = ["--path", str(SERVICES), "--mem-gb", "0.06", "--min-resident", "1"]
        r = CliRunner().invoke(cli, [*base, *register, *options])
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["min_resident"] == 1

        def cli_warm() -> bool:
            listed = CliRunner().invoke(cli, [*base, "service", "list", "--json"])
            (row,) = json.loads(listed.output)["services"]
            return bool(row["warm"] == 1)

        wait_for(cli_warm, 60, "the CLI-registered replica warm")
        with Client(daemon.socket, timeout_s=120) as c:
            assert c.call("cli", {"x": 1.0}).restore_s == 0.0
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert_clean_log(daemon.log())


def test_a_bad_service_key_stops_the_daemon_with_one_line(tmp_path: Path) -> None:
    """A misspelt `[[service]]` key is one error line naming the key and the allowed keys,
    exit 2, before anything starts; so is a service that fits none of its GPU counts."""
    head = CONFIG.split("[[service]]")[0] + '[[service]]\nname = "w"\nentry = "m:f"\n'
    cases = {
        "mem_gb = 0.06\nbatchsize = 8\n": (
            "service[0].batchsize: unknown key",
            "max_batch, batch_window_ms",
        ),
        "mem_gb = 0.06\nmin_resident = -1\n": ("service[0].min_resident: got -1", ">= 0"),
        "mem_gb = 1\n": ("service[0].mem_gb: 1 GB does not fit", "up to 0.1 GB"),
    }
    for extra, needles in cases.items():
        cfg = tmp_path / "bad.toml"
        cfg.write_text(head + extra)
        argv = [sys.executable, "-m", "tangramd.main", "up", "--config", str(cfg)]
        argv += ["--socket", str(tmp_path / "s.sock"), "--state-dir", str(tmp_path / "state")]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (extra, proc.stdout, proc.stderr)
        # (a stale compiled core makes `import tangram` warn first: not the daemon's line)
        lines = [line for line in proc.stderr.strip().splitlines() if "Warning" not in line]
        lines = [line for line in lines if not line.startswith("  ")]
        assert len(lines) == 1, proc.stderr
        assert lines[0].startswith(f"tangramd: {cfg}: "), lines[0]
        for needle in needles:
            assert needle in lines[0], lines[0]


def test_the_readme_service_example_is_a_valid_config(tmp_path: Path) -> None:
    """The README's `[[service]]` example loads, with the keys it shows."""
    from tangramd.config import load_config

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    (block,) = [b.split("```")[0] for b in readme.split("```toml\n")[1:] if "[[service]]" in b]
    cfg = tmp_path / "example.toml"
    cfg.write_text(block)
    (service,) = load_config(cfg, {}).services
    spec = service.spec()
    assert (spec.name, spec.min_resident, spec.max_batch, spec.batch_window_ms) == (
        "reward",
        1,
        16,
        2.0,
    )


def test_a_coordinator_validates_service_tables_and_registers_them(
    tmp_path: Path,
) -> None:
    """`tangramd coordinator` checks `[[service]]` as `tangramd up` does (a bad key stops it
    with one line naming it) and registers valid ones at start, before any node with GPUs
    has joined (tests/test_cluster_services.py deploys them on nodes)."""
    from tangram.testing import spawn_coordinator

    services = CONFIG.split("[gpu]")[0] + "[[service]]" + CONFIG.split("[[service]]", 1)[1]
    coordinator = spawn_coordinator(tmp_path / "ok", services)
    try:
        with Client(coordinator.socket) as c:
            assert {row["name"]: row["replicas"] for row in c.service_list()} == {
                "warm": [],
                "cold": [],
            }
        assert "config_services_not_registered" not in coordinator.log()
    finally:
        coordinator.stop()
    bad = tmp_path / "bad.toml"
    bad.write_text('[[service]]\nname = "w"\nentry = "m:f"\nmem_gb = 1\nbatchsize = 8\n')
    argv = [sys.executable, "-m", "tangramd.main", "coordinator", "--config", str(bad)]
    argv += ["--socket", str(tmp_path / "c.sock"), "--state-dir", str(tmp_path / "cstate")]
    argv += ["--listen", "127.0.0.1:0"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.strip().splitlines() if "Warning" not in line]
    lines = [line for line in lines if not line.startswith("  ")]
    assert len(lines) == 1 and "service[0].batchsize: unknown key" in lines[0], proc.stderr
    assert "max_batch" in lines[0], lines[0]

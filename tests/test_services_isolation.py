"""Service workers run isolated from the daemon's working directory (issue 31, item 12).

A root ``tangramd up`` started from a directory holding a planted ``torch.py`` once ran that
file as root in every torch worker (``python -m`` puts the current directory first on
``sys.path``). The daemon here is the installed ``tangramd`` script, as systemd and operators
start it, from a directory of planted modules that each leave a marker file when imported.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from harness import assert_clean_log

from tangram import Client
from tangram.testing import DaemonExited, SpawnedDaemon, wait_for

SERVICES = Path(__file__).parent / "data" / "services"
sys.path.insert(0, str(SERVICES))
from tiny_services import expected  # noqa: E402  # the service's own formula, without torch

CONFIG = """
[gpu]
simulated = { count = 1, mem_gb = 0.1, h2d_gbps = 1 }
nvml = false
"""
# what a worker imports (torch, numpy) or runs first (runpy, argparse), and the service's
# own module name: a planted copy of any of them must never be imported
PLANTED = ("torch", "numpy", "runpy", "argparse", "tiny_services")


def _plant(cwd: Path, markers: Path) -> None:
    for name in PLANTED:
        marker = markers / name
        (cwd / f"{name}.py").write_text(
            f"open({str(marker)!r}, 'w').write('imported')\n"
            f"raise ImportError('planted {name} imported')\n"
        )


def _spawn_in(cwd: Path, work: Path) -> SpawnedDaemon:
    """``tangramd up`` (the installed script, not ``python -m``) with ``cwd`` as its working
    directory."""
    tangramd = shutil.which("tangramd", path=str(Path(sys.executable).parent))
    assert tangramd is not None, f"no tangramd script next to {sys.executable}"
    sock, state = str(work / "tangramd.sock"), str(work / "state")
    config = work / "tangram.toml"
    config.write_text(CONFIG)
    log_path = work / "tangramd.log"
    args = [tangramd, "up", "--config", str(config), "--socket", sock, "--state-dir", state]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    daemon = SpawnedDaemon(proc, sock, state, log_path)

    def answers() -> bool:
        if proc.poll() is not None:
            raise DaemonExited(f"tangramd exited ({proc.returncode}):\n{daemon.log()}")
        with Client(sock, connect_timeout_s=1.0) as c:
            c.ping()
        return True

    try:
        wait_for(answers, 60, "tangramd", every_s=0.05, ignore=(Exception,), fatal=(DaemonExited,))
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return daemon


def test_workers_never_import_modules_planted_in_the_daemons_cwd(tmp_path: Path) -> None:
    """A service call starts workers that import nothing from the daemon's working directory,
    while the service's --path still provides its module."""
    cwd, markers, work = tmp_path / "cwd", tmp_path / "markers", tmp_path / "work"
    for d in (cwd, markers, work):
        d.mkdir()
    _plant(cwd, markers)
    daemon = _spawn_in(cwd, work)
    try:
        with Client(daemon.socket, timeout_s=120) as c:
            c.service_register("s", mem_gb=0.06, entry="tiny_services:small", path=str(SERVICES))
            result = c.call("s", {"x": 2.0})
        assert result.result["y"] == pytest.approx(expected(1000, 0.5, 2.0), rel=1e-5)
        # the workers (fork server and replica) are running: any import has happened
        assert sorted(p.name for p in markers.iterdir()) == []
    finally:
        code = daemon.stop(signal.SIGTERM)
    assert code == 0, daemon.log()
    assert_clean_log(daemon.log())
    assert "planted" not in (work / "state" / "services" / "s.log").read_text()

"""The systemd units install for the tangramd this machine has, and systemd accepts them."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "install-systemd.sh"
UNITS = ("tangramd.service", "tangramd-coordinator.service", "tangramd-node.service")


def install(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120, check=False
    )


def fake_tangramd(where: Path) -> Path:
    """An executable named tangramd under ``where`` (a venv's bin, as the units would run)."""
    where.mkdir(parents=True, exist_ok=True)
    tangramd = where / "tangramd"
    tangramd.write_text("#!/bin/sh\nexit 0\n")
    tangramd.chmod(0o755)
    return tangramd


def test_units_point_at_the_installed_tangramd_and_verify(tmp_path: Path) -> None:
    """ExecStart names the given tangramd (no /usr/local/bin assumption), configs and the
    docs Documentation= names are installed, configs are kept on a rerun, and where
    systemd-analyze exists the units pass ``systemd-analyze verify``."""
    root = tmp_path / "root"
    tangramd = fake_tangramd(tmp_path / "opt" / "arl-tangram" / "bin")
    done = install("--root", str(root), "--bin", str(tangramd))
    assert done.returncode == 0, done.stderr
    for unit in UNITS:
        text = (root / "etc/systemd/system" / unit).read_text()
        settings = [line for line in text.splitlines() if not line.startswith("#")]
        assert not [line for line in settings if "/usr/local/bin" in line]
        assert f"{tangramd} " in text.split("ExecStart=", 1)[1].splitlines()[0]
        doc = text.split("Documentation=file://", 1)[1].splitlines()[0]
        assert (root / doc.lstrip("/")).is_file(), doc
    for config in ("tangram", "node", "coordinator"):
        assert (root / f"etc/tangram/{config}.toml").read_text() == (
            REPO / f"config/{config}.toml"
        ).read_text()
    if shutil.which("systemd-analyze"):
        assert "the units are valid" in done.stdout
    (root / "etc/tangram/node.toml").write_text("# site edits\n")
    again = install("--root", str(root), "--bin", str(tangramd))
    assert again.returncode == 0, again.stderr
    assert (root / "etc/tangram/node.toml").read_text() == "# site edits\n"
    assert "kept" in again.stdout


def test_a_tangramd_under_a_home_directory_is_not_hidden_by_protecthome(tmp_path: Path) -> None:
    """The coordinator's ProtectHome=yes would hide a venv under /root or /home: such an
    install gets read-only instead; elsewhere it stays yes."""
    home = Path(os.path.expanduser("~"))
    venv = Path(os.environ.get("HOME", "/root")) / f".tangram-unit-test-{os.getpid()}"
    try:
        tangramd = fake_tangramd(venv / "bin")
        if not str(tangramd).startswith(("/root/", "/home/")):  # HOME elsewhere: use /root
            shutil.rmtree(venv)
            venv = Path("/root") / f".tangram-unit-test-{os.getpid()}"
            tangramd = fake_tangramd(venv / "bin")
        done = install("--root", str(tmp_path / "r"), "--bin", str(tangramd))
        assert done.returncode == 0, done.stderr
        unit = (tmp_path / "r/etc/systemd/system/tangramd-coordinator.service").read_text()
        assert "ProtectHome=read-only" in unit and "ProtectHome=yes" not in unit
    finally:
        shutil.rmtree(venv, ignore_errors=True)
    assert home.exists()
    elsewhere = fake_tangramd(tmp_path / "opt" / "bin")
    done = install("--root", str(tmp_path / "s"), "--bin", str(elsewhere))
    unit = (tmp_path / "s/etc/systemd/system/tangramd-coordinator.service").read_text()
    assert "ProtectHome=yes" in unit


def test_bad_arguments_name_the_option(tmp_path: Path) -> None:
    """An unknown option or a --bin that is not executable exits 2 saying which."""
    unknown = install("--prefix", "/x")
    assert unknown.returncode == 2 and "unknown option --prefix" in unknown.stderr
    missing = install("--root", str(tmp_path), "--bin", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "--bin" in missing.stderr
    assert not (tmp_path / "etc").exists()

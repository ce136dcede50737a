"""Issue 9 items 11, 13, 14: `tangramctl` against a real daemon says what happened, honestly."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tangram.testing import SpawnedDaemon
from tangramctl.main import cli

SUITE = Path(__file__).parent / "data" / "cpu_suite"


@pytest.fixture(scope="module")
def sock(daemon: SpawnedDaemon) -> str:
    """The socket of the module's daemon, which `tangramctl --socket` takes."""
    return daemon.socket


def ctl(sock: str, *args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(cli, ["--socket", sock, *args], env=env, catch_exceptions=False)


def test_status_of_a_fresh_daemon_has_no_empty_sections(sock):
    """Before any action, `status` says so instead of printing a bare 'recent:'."""
    r = ctl(sock, "status")
    assert r.exit_code == 0
    assert not any(
        line.rstrip().endswith(":") and "recent" in line for line in r.output.splitlines()
    )


def test_status_counts_are_integers(sock):
    """Counts read as integers ('count: 2'), never '2.000'."""
    assert ctl(sock, "exec", "--", "true").exit_code == 0
    assert ctl(sock, "exec", "--", "true").exit_code == 0
    r = ctl(sock, "status")
    counts = re.findall(r"count:\s+(\S+)", r.output)
    assert counts and all(c.isdigit() for c in counts), r.output


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--timeout", "-1"], "--timeout"),
        (["--profile", "nope"], "--profile"),
        (["--cpus", "3"], "--cpus"),
        (["--mem", "100TiB"], "--mem"),
        (["--env", "no-such-env"], "--env"),
    ],
    ids=["timeout", "profile", "cpus", "mem", "env"],
)
def test_request_errors_exit_2_naming_the_option(sock, args, option):
    """Usage and request errors exit 2 with a line naming the option, never 125."""
    r = ctl(sock, "exec", *args, "--", "true")
    assert r.exit_code == 2, r.output
    assert option in r.output
    assert "Traceback" not in r.output


def test_memory_shortfall_is_in_binary_units(sock):
    """A memory shortfall reads '100.0TiB', not a 15-digit byte count."""
    r = ctl(sock, "exec", "--mem", "100TiB", "--", "true")
    assert "100.0TiB" in r.output and not re.search(r"\d{10,}", r.output), r.output


def test_timeout_is_124_and_infra_is_not_claimed(sock):
    """A command past its timeout exits 124."""
    assert ctl(sock, "exec", "--timeout", "0.3", "--", "sleep", "5").exit_code == 124


def test_profile_of_failing_runs_is_not_saved(sock):
    """A profile whose runs fail (relative path in the env's empty dir) exits 1, unsaved."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/data/cpu_suite"]
    r = ctl(sock, "profile", "--dop", "1,2", "--repeat", "1", "--save", "broken", "--", *cmd)
    assert r.exit_code == 1, r.output
    assert "DoP 1 run 1: exit 4" in r.output and "not saved" in r.output
    assert "broken" not in ctl(sock, "profiles", "list").output


def test_profile_with_an_absolute_path_is_saved(sock):
    """The documented form (an absolute path) profiles and saves."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(SUITE)]
    r = ctl(
        sock, "profile", "--dop", "1,2", "--repeat", "1", "--save", "good", "--", *cmd,
        env={"CPU_SUITE_SCALE": "0.2"},
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "good" in ctl(sock, "profiles", "list").output


def test_a_missing_cwd_says_it_does_not_exist(sock):
    """``--cwd missing`` says there is no such directory; a file there is 'not a directory'."""
    env = ctl(sock, "env", "open").output.strip()
    r = ctl(sock, "exec", "--env", env, "--cwd", "missing", "--", "true")
    assert r.exit_code == 1 and "cwd missing: no such directory" in r.stderr, r.output
    assert ctl(sock, "exec", "--env", env, "--", "touch", "afile").exit_code == 0
    r = ctl(sock, "exec", "--env", env, "--cwd", "afile", "--", "true")
    assert r.exit_code == 1 and "cwd afile: not a directory" in r.stderr, r.output
    ctl(sock, "env", "close", env)


def test_nodes_shows_memory_once_and_the_busy_cores(sock):
    """``nodes`` prints memory in one unit and the cores an exec holds (by id) while it runs;
    'none' once every core is free again."""
    import threading

    from tangram import Client
    from tangram.testing import wait_for

    header = ctl(sock, "nodes").output.splitlines()[0].split()
    assert "MEM" in header and not {"MEM_BYTES", "MEM_GB"} & set(header), header
    busy = header.index("BUSY_CORES")
    with Client(sock) as c:
        env = c.env_open()

        def hold_both_cores() -> None:
            with Client(sock) as other:
                other.exec(["sleep", "3"], env=env, cpus=2)

        t = threading.Thread(target=hold_both_cores)
        t.start()
        try:
            wait_for(lambda: c.queue()["running"], 10, "the exec running")
            row = ctl(sock, "nodes").output.splitlines()[1].split()
            assert row[busy] == "0,1", row
        finally:
            t.join(10)
        assert ctl(sock, "nodes").output.splitlines()[1].split()[busy] == "none"
        c.env_close(env)

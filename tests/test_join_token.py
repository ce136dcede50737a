"""The join token never sits on a node's command line (issue 31, item 2).

``ps`` shows every process's argv to every local user, and the README, the systemd units
and the Ray actors all used to pass ``--token TOKEN``. A real ``tangramd node`` here joins a
real coordinator (TLS) with the token from ``--token-file``, ``$TANGRAM_JOIN_TOKEN`` and the
systemd credential ``join-token``; ``--token`` still joins, with a warning.
"""

from __future__ import annotations

import json
import os
import shlex
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from cluster_harness import check_clean, spawn_coordinator, spawn_node, stop_all

from tangram.testing import ClusterDaemon
from tangramctl.main import cli as ctl_cli
from tangramd.main import cli as tangramd_cli

CONFIG = """
[cluster]
heartbeat_s = 0.25
heartbeat_timeout_s = 5
"""
CORE = str(min(os.sched_getaffinity(0)))
WARNING = "--token puts the join token on this process's command line"


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterDaemon]:
    """One real coordinator (TLS, its own CA) for the module's nodes."""
    coord = spawn_coordinator(tmp_path_factory.mktemp("coord"), CONFIG)
    try:
        yield coord
    finally:
        coord.stop()
    check_clean(coord)


def _cmdline(node: ClusterDaemon) -> bytes:
    return Path(f"/proc/{node.proc.pid}/cmdline").read_bytes()


def _private_file(path: Path, text: str) -> Path:
    path.touch(mode=0o600)
    path.write_text(text)
    return path


def _joined(coordinator: ClusterDaemon, node: ClusterDaemon) -> None:
    """The node is ready, runs an exec, and nothing in its argv or its commands' environment
    holds the token."""
    token = coordinator.join["token"].encode()
    assert token not in _cmdline(node)
    with node.client() as c:
        ran = c.exec(["env"])
    assert ran.node == node.name and ran.outcome == "ok", ran
    assert "TANGRAM_JOIN_TOKEN" not in ran.stdout and token.decode() not in ran.stdout


def test_token_file_joins_and_argv_has_no_token(coordinator: ClusterDaemon, tmp_path: Path) -> None:
    """A node started with --token-file joins; its /proc/PID/cmdline has no token, and no
    warning is printed."""
    token_file = _private_file(tmp_path / "join-token", coordinator.join["token"] + "\n")
    extra = ("--token-file", str(token_file))
    node = spawn_node(tmp_path, coordinator, "by-file", cpus=CORE, token="", extra=extra)
    try:
        assert b"--token-file" in _cmdline(node)
        _joined(coordinator, node)
    finally:
        stop_all([node])
    assert WARNING not in node.log()
    check_clean(node)


def test_environment_variable_joins(coordinator: ClusterDaemon, tmp_path: Path) -> None:
    """A node given $TANGRAM_JOIN_TOKEN joins, and its commands do not inherit the
    variable."""
    env = {"TANGRAM_JOIN_TOKEN": coordinator.join["token"]}
    node = spawn_node(tmp_path, coordinator, "by-env", cpus=CORE, token="", env=env)
    try:
        _joined(coordinator, node)
    finally:
        stop_all([node])
    assert WARNING not in node.log()
    check_clean(node)


def test_systemd_credential_joins(coordinator: ClusterDaemon, tmp_path: Path) -> None:
    """A node under systemd reads the token from $CREDENTIALS_DIRECTORY/join-token (what the
    unit's LoadCredential= provides)."""
    credentials = tmp_path / "credentials"
    credentials.mkdir(mode=0o700)
    _private_file(credentials / "join-token", coordinator.join["token"])
    env = {"CREDENTIALS_DIRECTORY": str(credentials)}
    node = spawn_node(tmp_path, coordinator, "by-credential", cpus=CORE, token="", env=env)
    try:
        _joined(coordinator, node)
    finally:
        stop_all([node])
    check_clean(node)


def test_token_on_the_command_line_still_joins_with_a_warning(
    coordinator: ClusterDaemon, tmp_path: Path
) -> None:
    """--token TOKEN still joins, and the node warns that `ps` shows it."""
    extra = ("--token", coordinator.join["token"])
    node = spawn_node(tmp_path, coordinator, "by-argv", cpus=CORE, token="", extra=extra)
    try:
        with node.client() as c:
            assert c.exec(["true"]).node == "by-argv"
    finally:
        stop_all([node])
    assert WARNING in node.log() and "ps" in node.log()
    check_clean(node)


def test_a_wrong_token_file_is_refused(coordinator: ClusterDaemon, tmp_path: Path) -> None:
    """The token from a file is the one sent: a wrong one is refused like a wrong --token."""
    token_file = _private_file(tmp_path / "join-token", "not-the-token\n")
    extra = ("--token-file", str(token_file))
    node = spawn_node(tmp_path, coordinator, "wrong", token="", extra=extra, wait_ready=False)
    assert node.wait(30) == 1 and "wrong join token" in node.log(), node.log()


def test_unusable_token_options_exit_2(tmp_path: Path) -> None:
    """--token with --token-file, an empty or a missing token file: exit 2 naming it,
    before anything is made."""
    state = tmp_path / "state"
    empty = _private_file(tmp_path / "empty", "\n")
    base = ["node", "--coordinator", "127.0.0.1:1", "--insecure", "--state-dir", str(state)]
    cases = {
        "not both": ["--token", "t", "--token-file", str(empty)],
        "is empty": ["--token-file", str(empty)],
        "No such file": ["--token-file", str(tmp_path / "absent")],
    }
    for said, options in cases.items():
        result = CliRunner().invoke(tangramd_cli, [*base, *options])
        assert result.exit_code == 2 and said in result.stderr, (options, result.output)
    assert not state.exists()


def test_cluster_join_prints_no_token_argument(coordinator: ClusterDaemon, tmp_path: Path) -> None:
    """`tangramctl cluster join` prints the token as $TANGRAM_JOIN_TOKEN, never as --token;
    with --token-file it writes the token there (0600) and the line names the file."""
    token = coordinator.join["token"]
    sock = ["--socket", coordinator.socket]
    plain = CliRunner().invoke(ctl_cli, [*sock, "cluster", "join"])
    assert plain.exit_code == 0, plain.output
    assert plain.output.startswith(f"TANGRAM_JOIN_TOKEN={token} tangramd node --coordinator ")
    assert "--token" not in plain.output
    path = tmp_path / "tok"
    path.write_text("old")
    path.chmod(0o644)  # an existing file is made private
    to_file = CliRunner().invoke(ctl_cli, [*sock, "cluster", "join", "--token-file", str(path)])
    assert to_file.exit_code == 0, to_file.output
    argv = shlex.split(to_file.output)
    assert argv[:2] == ["tangramd", "node"] and token not in to_file.output
    assert argv[argv.index("--token-file") + 1] == str(path)
    assert path.read_text().strip() == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    raw = CliRunner().invoke(ctl_cli, [*sock, "cluster", "join", "--json"])
    assert json.loads(raw.output)["token"] == token  # programs still get it

"""The ``[cluster]`` config section and the shipped coordinator/node examples."""

from __future__ import annotations

from pathlib import Path

import pytest

from tangramd.cluster import config as cluster_config
from tangramd.cluster.link import is_loopback, split_host_port
from tangramd.config import ConfigError

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["coordinator.toml", "node.toml"])
def test_shipped_examples_are_valid(name: str) -> None:
    """config/coordinator.toml and config/node.toml load, with the documented defaults."""
    config, cluster = cluster_config.load(REPO / "config" / name, {})
    assert (cluster.heartbeat_s, cluster.heartbeat_timeout_s) == (1.0, 10.0)
    assert config.cpu.backend == "process"
    defaults, _ = cluster_config.load(None, {})
    assert config.sched == defaults.sched  # "every key is shown with its default"


def test_defaults_without_a_file() -> None:
    """No file: heartbeat every second, lost after ten."""
    _, cluster = cluster_config.load(None, {})
    assert (cluster.heartbeat_s, cluster.heartbeat_timeout_s) == (1.0, 10.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[cluster]\nheartbeat_ms = 5\n", r"cluster\.heartbeat_ms: unknown key"),
        ("[cluster]\nheartbeat_s = 0\n", r"cluster\.heartbeat_s"),
        (
            "[cluster]\nheartbeat_s = 2\nheartbeat_timeout_s = 1\n",
            r"cluster\.heartbeat_timeout_s: 1\.0 s is not longer than heartbeat_s",
        ),
        ("[clutser]\n", r"clutser: unknown section"),
    ],
)
def test_bad_cluster_keys_name_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    """A bad [cluster] key is a ConfigError naming the file and the dotted key."""
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        cluster_config.load(path, {})
    assert str(info.value).startswith(str(path))


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1:7000", ("127.0.0.1", 7000)), ("[::1]:0", ("::1", 0)), ("h:1", ("h", 1))],
)
def test_split_host_port(text: str, expected: tuple[str, int]) -> None:
    """HOST:PORT and [IPv6]:PORT parse; the port stays an int."""
    assert split_host_port(text) == expected


@pytest.mark.parametrize("text", ["7000", "host:", ":7000", "host:99999", "host:x"])
def test_split_host_port_rejects(text: str) -> None:
    """Anything but HOST:PORT is a ValueError naming the text."""
    with pytest.raises(ValueError, match=r"HOST:PORT|port out of range"):
        split_host_port(text)


def test_insecure_is_only_for_loopback() -> None:
    """--insecure is allowed for loopback names and addresses only."""
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.1") and not is_loopback("192.0.2.7")

"""The ``[cluster]`` section of the coordinator's and node's config files.

The daemon's own sections are read by :mod:`tangramd.config`, which builds ``[cluster]``
from the same file through its public ``load_config_with`` (the same steps and error
messages: file, dotted key, allowed values); the cross-key check is here. Every key is documented in
``config/coordinator.toml`` and ``config/node.toml``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tangramd.config import (
    COMMAND_LINE,
    Config,
    ConfigError,
    integer,
    load_config_with,
    number,
    setting,
    size,
)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """``[cluster]``: heartbeats between nodes and the coordinator (seconds), and the most
    capacity one node may claim when it joins."""

    heartbeat_s: float = setting(number(0.0, exclusive=True), 1.0)
    heartbeat_timeout_s: float = setting(number(0.0, exclusive=True), 10.0)
    max_node_cores: int = setting(integer(1), 4096)
    max_node_mem: int = setting(size(1), 64 << 40)
    node_request_timeout_s: float = setting(number(0.0, exclusive=True), 60.0)


def load(
    path: str | os.PathLike[str] | None, overrides: Mapping[str, Any]
) -> tuple[Config, ClusterConfig]:
    """The daemon config and its ``[cluster]`` section; raise ConfigError."""
    config, sections = load_config_with(path, overrides, {"cluster": ClusterConfig})
    cluster: ClusterConfig = sections["cluster"]
    if cluster.heartbeat_timeout_s <= cluster.heartbeat_s:
        raise ConfigError(
            os.fspath(path) if path is not None else COMMAND_LINE,
            "cluster.heartbeat_timeout_s",
            f"{cluster.heartbeat_timeout_s} s is not longer than heartbeat_s "
            f"({cluster.heartbeat_s} s)",
            "a timeout of several heartbeats",
        )
    return config, cluster

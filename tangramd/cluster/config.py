"""The ``[cluster]`` section of the coordinator's and node's config files.

The daemon's own sections are read by :mod:`tangramd.config`; this module takes
``[cluster]`` out of the same file first and builds it with the same three steps and the
same error messages (file, dotted key, allowed values). Every key is documented in
``config/coordinator.toml`` and ``config/node.toml``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tangramd import config as base
from tangramd.config import COMMAND_LINE, Config, ConfigError


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """``[cluster]``: heartbeats between nodes and the coordinator (seconds)."""

    heartbeat_s: float = base._key(base._number(0.0, exclusive=True), 1.0)
    heartbeat_timeout_s: float = base._key(base._number(0.0, exclusive=True), 10.0)


def load(
    path: str | os.PathLike[str] | None, overrides: Mapping[str, Any]
) -> tuple[Config, ClusterConfig]:
    """The daemon config and its ``[cluster]`` section; raise ConfigError."""
    source = os.fspath(path) if path is not None else None
    label = source if source is not None else COMMAND_LINE
    raw = dict(base._read_toml(source))
    cluster = base._build_table(ClusterConfig, raw.pop("cluster", {}), "cluster", label, {})
    if cluster.heartbeat_timeout_s <= cluster.heartbeat_s:
        raise ConfigError(
            label,
            "cluster.heartbeat_timeout_s",
            f"{cluster.heartbeat_timeout_s} s is not longer than heartbeat_s "
            f"({cluster.heartbeat_s} s)",
            "a timeout of several heartbeats",
        )
    flat = base._flatten(overrides)
    config = base._build(raw, label, flat)

    def origin(dotted: str) -> str:
        return COMMAND_LINE if dotted in flat else label

    return base._validate(config, label, origin), cluster

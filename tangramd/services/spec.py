"""Service registrations: ``ServiceSpec`` (validated) and the JSON registry in the state dir.

A spec is what ``tangramctl service register`` sends; the registry persists the specs so a
daemon restart loads the same services. No torch here: the daemon imports this module
whether or not torch is installed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from tangram.pools.gpu import ALLOWED_GPU_COUNTS
from tangram.pools.gpu import ServiceSpec as PoolServiceSpec

GB: Final = 1_000_000_000  # decimal gigabytes, as the simulator's cluster files use
RUNTIMES: Final = ("torch", "http")
HTTP_APIS: Final = ("vllm", "sglang")  # which sleep/wake endpoints an http server offers
REGISTRY_FILE: Final = "services.json"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_ENTRY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class SpecError(ValueError):
    """A registration is invalid; the message names the field and what is allowed."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"service field {field_name!r}: {message}")
        self.field = field_name


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """One GPU model service as registered by an operator.

    ``mem_gb`` is the state of one instance (decimal GB) that the pool accounts on the GPUs
    (sharded evenly over a multi-GPU instance). ``gpus`` lists the allowed GPUs per
    instance (each a DoP variant of the service to the cache). ``entry``/``path`` name the
    torch factory; ``cmd`` is the http server command line with ``{port}`` where the node
    puts the loopback port it chose; ``route`` is the path calls are POSTed to and
    ``api`` the server's sleep/wake flavour.
    """

    name: str
    runtime: str
    mem_gb: float
    gpus: tuple[int, ...] = (1,)
    entry: str | None = None
    path: str | None = None
    cmd: str | None = None
    route: str = "/v1/completions"
    api: str = "vllm"
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise SpecError("name", f"{self.name!r} must be 1-64 of letters, digits, '_.-'")
        if self.runtime not in RUNTIMES:
            raise SpecError("runtime", f"{self.runtime!r} is not one of {', '.join(RUNTIMES)}")
        if (
            isinstance(self.mem_gb, bool)
            or not isinstance(self.mem_gb, (int, float))
            or not self.mem_gb > 0
        ):
            raise SpecError("mem_gb", f"{self.mem_gb!r} must be a positive number of GB")
        object.__setattr__(self, "gpus", _gpu_counts(self.gpus))
        object.__setattr__(self, "env", dict(self.env))
        if self.runtime == "torch":
            if not self.entry or not _ENTRY.match(self.entry):
                raise SpecError("entry", f"{self.entry!r} must be MODULE:FACTORY for torch")
            if self.cmd is not None:
                raise SpecError("cmd", "is only for runtime 'http'")
        else:
            if not self.cmd or "{port}" not in self.cmd:
                raise SpecError("cmd", "runtime 'http' needs a command line containing {port}")
            try:
                shlex.split(self.cmd)
            except ValueError as exc:
                raise SpecError("cmd", f"cannot be split into arguments: {exc}") from None
            if self.api not in HTTP_APIS:
                raise SpecError("api", f"{self.api!r} is not one of {', '.join(HTTP_APIS)}")
            if not self.route.startswith("/"):
                raise SpecError("route", f"{self.route!r} must start with '/'")
        if self.path is not None and not os.path.isabs(self.path):
            raise SpecError("path", f"{self.path!r} must be an absolute directory")

    @property
    def mem_bytes(self) -> int:
        return int(self.mem_gb * GB)

    def pool_spec(self) -> PoolServiceSpec:
        """The pure pool's view of this service (what ``GpuNodePool.register_service`` takes)."""
        return PoolServiceSpec(self.name, self.mem_bytes)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "runtime": self.runtime,
            "mem_gb": self.mem_gb,
            "gpus": list(self.gpus),
        }
        for key in ("entry", "path", "cmd"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.runtime == "http":
            out["route"] = self.route
            out["api"] = self.api
        if self.env:
            out["env"] = dict(self.env)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ServiceSpec:
        """Build from a wire/registry map; unknown keys and missing fields are ``SpecError``."""
        known = {"name", "runtime", "mem_gb", "gpus", "entry", "path", "cmd", "route", "api"}
        known.add("env")
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(unknown[0], f"unknown field (allowed: {', '.join(sorted(known))})")
        for required in ("name", "runtime", "mem_gb"):
            if required not in data:
                raise SpecError(required, "is required")
        return cls(**dict(data))


def _gpu_counts(value: object) -> tuple[int, ...]:
    allowed = ", ".join(map(str, ALLOWED_GPU_COUNTS))
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise SpecError("gpus", f"{value!r} must be a GPU count or a list of them ({allowed})")
    counts: set[int] = set()
    for item in items:
        if isinstance(item, bool) or item not in ALLOWED_GPU_COUNTS:
            raise SpecError("gpus", f"{item!r} is not an allowed GPU count ({allowed})")
        counts.add(int(item))
    return tuple(sorted(counts))


class ServiceRegistry:
    """Registered specs, persisted as one JSON file in the state dir (atomic replace)."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.path = Path(state_dir) / REGISTRY_FILE
        self._specs: dict[str, ServiceSpec] = {}

    def load(self) -> list[ServiceSpec]:
        """Read the file (absent = no services); a corrupt file raises naming the file."""
        if not self.path.exists():
            return []
        try:
            raw = json.loads(self.path.read_text())
            specs = [ServiceSpec.from_json(item) for item in raw["services"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{self.path}: cannot load service registrations: {exc}") from exc
        self._specs = {spec.name: spec for spec in specs}
        return specs

    def add(self, spec: ServiceSpec) -> None:
        self._specs[spec.name] = spec
        self._save()

    def remove(self, name: str) -> ServiceSpec | None:
        spec = self._specs.pop(name, None)
        if spec is not None:
            self._save()
        return spec

    def get(self, name: str) -> ServiceSpec | None:
        return self._specs.get(name)

    def __iter__(self) -> Iterator[ServiceSpec]:
        return iter(list(self._specs.values()))

    def __len__(self) -> int:
        return len(self._specs)

    def _save(self) -> None:
        from tangramd.records import write_json  # (structlog: not at import, see state/)

        write_json(self.path, {"services": [s.to_json() for s in self._specs.values()]}, indent=1)

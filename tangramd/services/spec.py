"""Service registrations: ``ServiceSpec`` (validated) and the JSON registry in the state dir.

A spec is what ``tangramctl service register`` sends; the registry persists the specs so a
daemon restart loads the same services. No torch here: the daemon imports this module
whether or not torch is installed.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from tangram.pools.gpu import ALLOWED_GPU_COUNTS
from tangram.pools.gpu import ServiceSpec as PoolServiceSpec

GB: Final = 1_000_000_000  # decimal gigabytes, as the simulator's cluster files use
RUNTIMES: Final = ("torch", "http")
HTTP_APIS: Final = ("vllm", "sglang")  # which sleep/wake endpoints an http server offers
# an engine's tensor-parallel flags (vLLM, SGLang): the node sets them per replica
TP_FLAGS: Final = ("--tensor-parallel-size", "-tp", "--tp-size", "--tp")
REGISTRY_FILE: Final = "services.json"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_ENTRY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
MAX_BATCH: Final = 4096  # calls merged into one forward pass, at most
MAX_WINDOW_MS: Final = 60_000.0  # how long a batch may wait to fill, at most
MAX_RESIDENT: Final = 64  # warm replicas kept per service, at most


class SpecError(ValueError):
    """A registration is invalid; the message names the field and what is allowed."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"service field {field_name!r}: {message}")
        self.field = field_name
        self.problem = message


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """One GPU model service as registered by an operator.

    ``mem_gb`` is the state of one instance (decimal GB) that the pool accounts on the GPUs
    (sharded evenly over a multi-GPU instance). ``gpus`` lists the allowed GPUs per
    instance (each a DoP variant of the service to the cache). ``entry``/``path`` name the
    torch factory; ``cmd`` is the http server command line with ``{port}`` where the node
    puts the loopback port it chose (and optionally ``{tp}``: the replica's GPU count,
    else ``--tensor-parallel-size K`` is appended on K > 1 GPUs); ``route`` is the path
    calls are POSTed to and ``api`` the server's sleep/wake flavour.
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
    eff: Mapping[int, float] = field(default_factory=dict)
    max_batch: int = 1
    batch_window_ms: float = 0.0
    min_resident: int = 0

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
        object.__setattr__(self, "eff", _speedups(self.eff, self.gpus))
        _check_int("max_batch", self.max_batch, 1, MAX_BATCH)
        _check_int("min_resident", self.min_resident, 0, MAX_RESIDENT)
        window = self.batch_window_ms
        if (
            isinstance(window, bool)
            or not isinstance(window, (int, float))
            or not 0 <= window <= MAX_WINDOW_MS
        ):
            raise SpecError(
                "batch_window_ms", f"{window!r} must be a number of ms from 0 to {MAX_WINDOW_MS:g}"
            )
        object.__setattr__(self, "batch_window_ms", float(window))
        if self.runtime == "torch":
            if self.entry is None:
                raise SpecError("entry", "missing: runtime 'torch' needs MODULE:FACTORY")
            if not self.entry or not _ENTRY.match(self.entry):
                raise SpecError("entry", f"{self.entry!r} must be MODULE:FACTORY for torch")
            if self.cmd is not None:
                raise SpecError("cmd", "is only for runtime 'http'")
        else:
            if not self.cmd or "{port}" not in self.cmd:
                raise SpecError("cmd", "runtime 'http' needs a command line containing {port}")
            try:
                words = shlex.split(self.cmd)
            except ValueError as exc:
                raise SpecError("cmd", f"cannot be split into arguments: {exc}") from None
            fixed = [w for w in words if w.split("=")[0] in TP_FLAGS]
            if fixed and "{tp}" not in self.cmd and max(self.gpus) > 1:
                raise SpecError(
                    "cmd",
                    f"fixes {fixed[0].split('=')[0]}, but the service runs on "
                    f"{'/'.join(map(str, self.gpus))} GPUs: write {{tp}} where the node puts "
                    "each replica's GPU count (or leave the flag out: it is appended)",
                )
            if self.api not in HTTP_APIS:
                raise SpecError("api", f"{self.api!r} is not one of {', '.join(HTTP_APIS)}")
            if not self.route.startswith("/"):
                raise SpecError("route", f"{self.route!r} must start with '/'")
        if self.path is not None and not os.path.isabs(self.path):
            raise SpecError("path", f"{self.path!r} must be an absolute directory")

    @property
    def mem_bytes(self) -> int:
        return int(self.mem_gb * GB)

    def speedup(self, k: int) -> float:
        """The speed-up at ``k`` GPUs by ``eff`` (1.0 without a table): the table's value,
        linear between its counts, in proportion to ``k`` below its smallest count and the
        largest count's above it. A call of ``T`` s at ``k`` GPUs is ``T * speedup(k)``
        seconds of work at speed-up 1 (the unit the duration history keeps)."""
        if not self.eff:
            return 1.0
        points = sorted(self.eff.items())
        lo, s_lo = points[0]
        if k <= lo:
            return s_lo * k / lo
        for (a, s_a), (b, s_b) in itertools.pairwise(points):
            if k <= b:
                return s_a + (s_b - s_a) * (k - a) / (b - a)
        return points[-1][1]

    def elastic(self, counts: Sequence[int], work_s: float) -> tuple[float, dict[int, float]]:
        """``(t1_s, eff)`` for ``tangram.model.make_action`` so that a call of ``work_s``
        seconds of work at speed-up 1 lasts ``work_s / speedup(k)`` at each of ``counts``
        that the table covers (between its smallest and largest count): the model's
        efficiency ``E(k) = speedup(k) / k``, scaled with ``t1_s`` to stay within ``(0, 1]``
        (a super-linear table is kept as it is). Empty ``eff`` when the table covers fewer
        than two of ``counts`` (the call is then not elastic)."""
        if not self.eff:
            return work_s, {}
        lo, hi = min(self.eff), max(self.eff)
        covered = {k: self.speedup(k) / k for k in counts if lo <= k <= hi}
        if len(covered) < 2:
            return work_s, {}
        scale = max(1.0, *covered.values())
        return work_s / scale, {k: e / scale for k, e in covered.items()}

    def pool_spec(self) -> PoolServiceSpec:
        """The pure pool's view of this service (what ``GpuNodePool.register_service`` takes)."""
        return PoolServiceSpec(self.name, self.mem_bytes)

    def list_fields(self) -> dict[str, Any]:
        """The spec's part of a ``service list`` row (``ServiceHost.list`` on a host, the
        coordinator's merged rows): the rest of a row is what its replicas did."""
        return {
            "name": self.name,
            "runtime": self.runtime,
            "mem_gb": self.mem_gb,
            "gpus": list(self.gpus),
            "eff": format_eff(self.eff) if self.eff else None,
            "min_resident": self.min_resident,
            "max_batch": self.max_batch,
        }

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
        if self.eff:
            out["eff"] = format_eff(self.eff)
        for key in ("max_batch", "batch_window_ms", "min_resident"):
            if getattr(self, key) != getattr(DEFAULTS, key):
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ServiceSpec:
        """Build from a wire/registry map; unknown keys and missing fields are ``SpecError``."""
        known = set(FIELDS)
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(unknown[0], f"unknown field (allowed: {', '.join(sorted(known))})")
        for required in ("name", "runtime", "mem_gb"):
            if required not in data:
                raise SpecError(required, "is required")
        return cls(**dict(data))


# the keys of a registration (the wire's, the registry's and ``[[service]]``'s)
FIELDS: Final = (
    "name",
    "runtime",
    "entry",
    "path",
    "mem_gb",
    "gpus",
    "eff",
    "max_batch",
    "batch_window_ms",
    "min_resident",
    "cmd",
    "route",
    "api",
    "env",
)


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise SpecError(name, f"{value!r} must be an integer from {lo} to {hi}")


def parse_eff(text: str) -> dict[int, float]:
    """``"1:1,2:1.8,4:3.2"`` → ``{1: 1.0, 2: 1.8, 4: 3.2}``; ``SpecError`` naming ``eff``."""
    table: dict[int, float] = {}
    for part in text.split(","):
        count, sep, speedup = part.partition(":")
        try:
            if not sep:
                raise ValueError(part)
            table[int(count)] = float(speedup)
        except ValueError:
            raise SpecError(
                "eff", f"{text!r}: want GPUS:SPEEDUP pairs such as '1:1,2:1.8,4:3.2'"
            ) from None
    return table


def format_eff(eff: Mapping[int, float]) -> str:
    """The inverse of :func:`parse_eff`."""
    return ",".join(f"{k}:{v:g}" for k, v in sorted(eff.items()))


def _speedups(value: object, gpus: tuple[int, ...]) -> dict[int, float]:
    """The speed-up table: a ``"1:1,2:1.8"`` string or a map of GPU count to speed-up, each
    count one of ``gpus`` and each speed-up a positive number."""
    if isinstance(value, str):
        value = parse_eff(value)
    if not isinstance(value, Mapping):
        raise SpecError("eff", f"{value!r} must be a map or a string like '1:1,2:1.8'")
    table: dict[int, float] = {}
    for key, speedup in value.items():
        try:
            count = int(key)
        except (TypeError, ValueError):
            count = -1
        if isinstance(key, bool) or count not in gpus:
            raise SpecError(
                "eff", f"GPU count {key!r} is not one of gpus ({', '.join(map(str, gpus))})"
            )
        if (
            isinstance(speedup, bool)
            or not isinstance(speedup, (int, float))
            or not 0 < speedup < float("inf")
        ):
            raise SpecError("eff", f"speed-up {speedup!r} at {count} GPUs must be a number > 0")
        table[count] = float(speedup)
    return table


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


DEFAULTS: Final = ServiceSpec("defaults", "torch", 1.0, entry="m:f")


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

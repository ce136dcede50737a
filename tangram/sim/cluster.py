"""Cluster files for the simulator (docs/design.md §8): TOML → frozen dataclasses → validation.

Every key of docs/design.md §8 is accepted and nothing else; errors name the file and the key.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from tangram.model import TangramError

GB = 1_000_000_000  # the cluster file's sizes are decimal gigabytes


class ClusterError(TangramError):
    """An invalid cluster file; the message names the file and the key."""

    code = "bad_request"


@dataclass(frozen=True, slots=True)
class CpuNodeSpec:
    count: int = 1
    cores: int = 64
    numa: int = 1
    mem_gb: float = 256.0


@dataclass(frozen=True, slots=True)
class GpuNodeSpec:
    count: int = 1
    gpus: int = 8
    gpu_mem_gb: float = 80.0
    h2d_gbps: float = 25.0


@dataclass(frozen=True, slots=True)
class SimService:
    name: str
    mem_gb: float
    static_gpus: int = 1
    static_replicas: int = 1
    # tangram: calls one forward pass takes (the placed call and up to max_batch - 1
    # queued calls to the service riding along, tangram.sim.gpubatch); 1: no batching
    max_batch: int = 1


@dataclass(frozen=True, slots=True)
class ApiSpec:
    name: str
    concurrency: int = 0
    quota: int = 0
    period_s: float = 60.0


@dataclass(frozen=True, slots=True)
class Baselines:
    k8s_pod_cores: int = 4
    k8s_pod_start_s: float = 2.0
    k8s_sched_pods_per_s: float = 0.0  # kube-scheduler binding rate; 0 = unlimited
    k8s_exec_overhead_s: float = 0.0  # per-exec round trip (kubectl exec) before it runs
    api_retry_backoff_s: float = 1.0
    # static-services replicas: calls one replica runs at once (1: one at a time; > 1:
    # continuous batching, as SGLang does) and, at a full batch, the replica's throughput
    # per GPU relative to one call alone on one GPU (see tangram.sim.baselines)
    static_max_batch: int = 1
    static_batch_gain: float = 1.0


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    step_train_s: float = 60.0
    cpu_nodes: tuple[CpuNodeSpec, ...] = ()
    gpu_nodes: tuple[GpuNodeSpec, ...] = ()
    services: tuple[SimService, ...] = ()
    apis: tuple[ApiSpec, ...] = ()
    baselines: Baselines = field(default_factory=Baselines)
    source: str = "<cluster>"

    def service(self, name: str) -> SimService | None:
        return next((s for s in self.services if s.name == name), None)

    def api(self, name: str) -> ApiSpec | None:
        return next((a for a in self.apis if a.name == name), None)

    @property
    def total_cores(self) -> int:
        return sum(n.count * n.cores for n in self.cpu_nodes)

    @property
    def total_gpus(self) -> int:
        return sum(n.count * n.gpus for n in self.gpu_nodes)

    def with_gpus(self, total: int) -> ClusterSpec:
        """The same cluster with ``total`` GPUs: full nodes like the first, then a remainder."""
        if not self.gpu_nodes:
            raise ClusterError(f"{self.source}: no [[gpu_node]] to resize")
        proto = self.gpu_nodes[0]
        full, rest = divmod(total, proto.gpus)
        nodes = [replace(proto, count=full)] if full else []
        if rest:
            nodes.append(replace(proto, count=1, gpus=rest))
        return replace(self, gpu_nodes=tuple(nodes))


_SECTIONS: dict[str, tuple[type, set[str]]] = {
    "cpu_node": (CpuNodeSpec, {"count", "cores", "numa", "mem_gb"}),
    "gpu_node": (GpuNodeSpec, {"count", "gpus", "gpu_mem_gb", "h2d_gbps"}),
    "service": (SimService, {"name", "mem_gb", "static_gpus", "static_replicas", "max_batch"}),
    "api": (ApiSpec, {"name", "concurrency", "quota", "period_s"}),
}
_INT_KEYS = {
    "count",
    "cores",
    "numa",
    "gpus",
    "static_gpus",
    "static_replicas",
    "concurrency",
    "static_max_batch",
    "max_batch",
}
_INT_KEYS |= {"quota", "k8s_pod_cores"}
_POSITIVE = {"count", "cores", "numa", "gpus", "static_gpus", "static_replicas", "period_s"}
_POSITIVE |= {"k8s_pod_cores", "gpu_mem_gb", "h2d_gbps", "max_batch"}


def _value(where: str, key: str, value: object) -> Any:
    if key == "name":
        if not isinstance(value, str) or not value:
            raise ClusterError(f"{where}.{key}: expected a non-empty string")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ClusterError(f"{where}.{key}: expected a number, got {value!r}")
    if key in _INT_KEYS and value != int(value):
        raise ClusterError(f"{where}.{key}: expected a whole number, got {value!r}")
    if value < 0 or (key in _POSITIVE and value == 0):
        raise ClusterError(f"{where}.{key}: must be {'> 0' if key in _POSITIVE else '>= 0'}")
    return int(value) if key in _INT_KEYS else float(value)


def _build(kind: type, where: str, raw: object, keys: set[str]) -> Any:
    if not isinstance(raw, Mapping):
        raise ClusterError(f"{where}: expected a table")
    unknown = set(raw) - keys
    if unknown:
        raise ClusterError(f"{where}: unknown key(s) {sorted(unknown)}; allowed {sorted(keys)}")
    return kind(**{k: _value(where, k, v) for k, v in raw.items()})


def parse_cluster(doc: Mapping[str, Any], source: str = "<cluster>") -> ClusterSpec:
    allowed = {"step_train_s", "baselines"} | set(_SECTIONS)
    unknown = set(doc) - allowed
    if unknown:
        raise ClusterError(f"{source}: unknown key(s) {sorted(unknown)}; allowed {sorted(allowed)}")
    parts: dict[str, list[Any]] = {}
    for name, (kind, keys) in _SECTIONS.items():
        raw = doc.get(name, [])
        if not isinstance(raw, list):
            raise ClusterError(f"{source}: [[{name}]] must be an array of tables")
        parts[name] = [_build(kind, f"{source}: {name}[{i}]", r, keys) for i, r in enumerate(raw)]
        if kind in (SimService, ApiSpec):
            names = [p.name for p in parts[name]]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ClusterError(f"{source}: duplicate {name} name(s) {dup}")
    for i, n in enumerate(parts["cpu_node"]):
        if n.cores % n.numa:
            raise ClusterError(f"{source}: cpu_node[{i}].numa: {n.numa} does not divide cores")
    for i, g in enumerate(parts["gpu_node"]):
        if g.gpus > 8:
            raise ClusterError(f"{source}: gpu_node[{i}].gpus: at most 8 GPUs per node")
    for i, s in enumerate(parts["service"]):
        if s.static_gpus not in (1, 2, 4, 8):
            raise ClusterError(f"{source}: service[{i}].static_gpus: must be 1, 2, 4 or 8")
    base = doc.get("baselines", {})
    baselines = _build(
        Baselines,
        f"{source}: baselines",
        base,
        {
            "k8s_pod_cores",
            "k8s_pod_start_s",
            "k8s_sched_pods_per_s",
            "k8s_exec_overhead_s",
            "api_retry_backoff_s",
            "static_max_batch",
            "static_batch_gain",
        },
    )
    if baselines.static_max_batch < 1 or baselines.static_batch_gain <= 0:
        raise ClusterError(
            f"{source}: baselines: static_max_batch must be >= 1 and static_batch_gain > 0"
        )
    step_train = _value(source, "step_train_s", doc.get("step_train_s", 60.0))
    return ClusterSpec(
        step_train_s=step_train,
        cpu_nodes=tuple(parts["cpu_node"]),
        gpu_nodes=tuple(parts["gpu_node"]),
        services=tuple(parts["service"]),
        apis=tuple(parts["api"]),
        baselines=baselines,
        source=source,
    )


def load_cluster(path: str | Path) -> ClusterSpec:
    try:
        with open(path, "rb") as fp:
            doc = tomllib.load(fp)
    except tomllib.TOMLDecodeError as exc:
        raise ClusterError(f"{path}: invalid TOML: {exc}") from None
    return parse_cluster(doc, str(path))

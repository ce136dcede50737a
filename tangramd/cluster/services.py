"""The coordinator's GPU services: the registrations it keeps and what its nodes report.

A coordinator has no GPUs of its own. Its core's gpu pool holds its nodes' GPUs (each node
reports them in its hello) and decides as ``tangramd up``'s does; the registrations are
replicated: each one is loaded on every connected node with GPUs (``load_service``) and
answered once all of them have it, and a node that joins later gets them all with its
``welcome``. So any node can run any replica the pool places there, and a registration's
spec crosses the link once per node, not with each call.

:class:`ClusterServices` keeps the registrations (``services.json`` in the coordinator's
state dir, with the config's ``[[service]]`` entries: they survive a restart, as
``tangramd up``'s do) and each node's rows as it last reported them (``services_state``),
and answers ``service list`` by merging the rows per service: one row per service, its
replicas on every node (each names its ``node``), its counters summed. The counters of a
lost node's rows are kept (``calls``, ``restores``... never go back), its replicas go.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tangramd.services.spec import ServiceRegistry, ServiceSpec

# the counters of a ``service list`` row: summed over nodes
COUNTERS = (
    "calls",
    "batches",
    "batched_calls",
    "restores",
    "restore_s_total",
    "restore_bytes",
    "evictions",
)


class ClusterServices:
    """The registrations and the nodes' reports (see the module doc)."""

    def __init__(self, state_dir: str | Path, declared: Sequence[ServiceSpec] = ()) -> None:
        self.registry = ServiceRegistry(state_dir)
        self.declared = tuple(declared)  # the config's [[service]] entries
        self._specs: dict[str, ServiceSpec] = {}
        self._rows: dict[str, dict[str, Mapping[str, Any]]] = {}  # node -> name -> row
        self._retired: dict[str, dict[str, float]] = {}  # name -> counters of lost nodes

    # ------------------------------------------------------------------ registrations
    def recover(self) -> tuple[ServiceSpec, ...]:
        """The registrations of an earlier run and the config's (which replace one of
        the same name, and are kept in turn); a corrupt file raises naming it."""
        by_name = {spec.name: spec for spec in self.registry.load()}
        by_name.update((spec.name, spec) for spec in self.declared)
        for spec in self.declared:
            self.registry.add(spec)
        self._specs = by_name
        return tuple(by_name.values())

    def added(self, spec: ServiceSpec) -> None:
        """A registration every node with GPUs loaded: kept."""
        self._specs[spec.name] = spec
        self.registry.add(spec)

    def removed(self, name: str) -> None:
        self._specs.pop(name, None)
        self._retired.pop(name, None)
        self.registry.remove(name)

    def specs(self) -> list[ServiceSpec]:
        return list(self._specs.values())

    # ------------------------------------------------------------------ the nodes' rows
    def reported(self, node: str, rows: Iterable[Any]) -> None:
        """A node's ``services_state``: its rows replace the ones it sent before."""
        self._rows[node] = {
            row["name"]: row
            for row in rows
            if isinstance(row, Mapping) and isinstance(row.get("name"), str)
        }

    def node_gone(self, node: str) -> None:
        """A node is lost: its replicas go, its counters stay."""
        for name, row in self._rows.pop(node, {}).items():
            kept = self._retired.setdefault(name, {})
            for key in COUNTERS:
                kept[key] = kept.get(key, 0) + _number(row.get(key))

    # ------------------------------------------------------------------ service list
    def list(self) -> list[dict[str, Any]]:
        """``service list``: one row per registration (see the module doc)."""
        return [self.row(spec) for spec in self._specs.values()]

    def row(
        self, spec: ServiceSpec, rows: Mapping[str, Mapping[str, Any]] | None = None
    ) -> dict[str, Any]:
        """``spec``'s row, merged from ``rows`` by node (default: the nodes' latest
        reports)."""
        if rows is None:
            rows = {node: mine[spec.name] for node, mine in self._rows.items() if spec.name in mine}
        return merge_rows(spec, rows, self._retired.get(spec.name, {}))


def merge_rows(
    spec: ServiceSpec, by_node: Mapping[str, Mapping[str, Any]], retired: Mapping[str, float]
) -> dict[str, Any]:
    """One ``service list`` row of ``spec`` from the rows of the nodes that hold it (each
    as ``ServiceHost.list`` gives it, by node): the replicas of all of them, the counters
    summed (with ``retired``: those of lost nodes), the first load error, naming its node."""
    replicas: list[Any] = []
    error = None
    module_bytes = None
    for node, row in sorted(by_node.items()):
        found = row.get("replicas")
        replicas += [r for r in found if isinstance(r, Mapping)] if isinstance(found, list) else []
        if error is None and isinstance(row.get("error"), str):
            error = f"node {node}: {row['error']}"
        if module_bytes is None and isinstance(row.get("module_bytes"), int):
            module_bytes = row["module_bytes"]
    rows = list(by_node.values())
    counters = {
        key: sum((_number(row.get(key)) for row in rows), retired.get(key, 0)) for key in COUNTERS
    }
    for key in COUNTERS:
        if key != "restore_s_total":
            counters[key] = int(counters[key])
    return {
        **spec.list_fields(),
        "warm": sum(int(_number(row.get("warm"))) for row in rows),
        "replicas": replicas,
        "calls": counters["calls"],
        "batches": counters["batches"],
        "batched_calls": counters["batched_calls"],
        "restores": counters["restores"],
        "restore_s_total": counters["restore_s_total"],
        "restore_bytes": counters["restore_bytes"],
        "evictions": counters["evictions"],
        "module_bytes": module_bytes,
        "error": error,
    }


def _number(value: Any) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok and value == value else 0.0

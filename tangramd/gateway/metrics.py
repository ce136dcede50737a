"""Prometheus metrics of the gateway and, read at scrape time, of the daemon behind it.

Daemon-wide gauges come from the daemon's ``status`` and ``queue`` views on every scrape:
queue length (per action kind), free and total units per pool, running actions, open
environments, connected clients (the daemon's socket connections). Counters and
histograms are the gateway's own actions: every exec it submitted, by kind (``run_code``
language, ``swerex`` endpoint) and outcome, with the daemon-reported queue, exec and ACT
seconds of each.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from tangram.client import ExecResult

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class Metrics:
    """One registry per gateway (tests start several in one process)."""

    def __init__(self) -> None:
        # the *_created series only add noise to dashboards
        disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in the package
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_length = Gauge(
            "tangram_queue_length", "Actions waiting in the daemon, by kind", ["kind"], registry=r
        )
        self.pool_free = Gauge(
            "tangram_pool_free_units", "Free units per pool", ["pool"], registry=r
        )
        self.pool_capacity = Gauge(
            "tangram_pool_capacity_units", "Capacity per pool", ["pool"], registry=r
        )
        self.running = Gauge("tangram_running_actions", "Actions running now", registry=r)
        self.environments = Gauge("tangram_environments", "Open environments", registry=r)
        self.clients = Gauge(
            "tangram_connected_clients", "Clients connected to the daemon's socket", registry=r
        )
        self.daemon_up = Gauge("tangram_daemon_up", "1 if the daemon answered", registry=r)
        self.actions = Counter(
            "tangram_gateway_actions", "Actions the gateway ran", ["kind", "outcome"], registry=r
        )
        self.requests = Counter(
            "tangram_gateway_requests", "HTTP requests by route and status", ["route", "code"],
            registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(
            "tangram_gateway_requests_in_flight", "HTTP requests being served", registry=r
        )
        self.act = Histogram(
            "tangram_action_act_seconds", "Action completion time (queue + exec)", ["kind"],
            buckets=BUCKETS, registry=r,
        )  # fmt: skip
        self.queue = Histogram(
            "tangram_action_queue_seconds", "Time from submission to placement", ["kind"],
            buckets=BUCKETS, registry=r,
        )  # fmt: skip
        self.exec = Histogram(
            "tangram_action_exec_seconds", "Command run time", ["kind"],
            buckets=BUCKETS, registry=r,
        )  # fmt: skip

        # labelled children, looked up once per label set (``labels`` validates and locks)
        self._kinds: dict[str, tuple[Histogram, Histogram, Histogram]] = {}
        self._counts: dict[tuple[Counter, tuple[str, ...]], Counter] = {}

    def observe(self, kind: str, result: ExecResult) -> None:
        """Count one exec action the gateway ran and record its times."""
        self._count(self.actions, kind, result.outcome).inc()
        times = self._kinds.get(kind)
        if times is None:
            times = (self.act.labels(kind), self.queue.labels(kind), self.exec.labels(kind))
            self._kinds[kind] = times
        act, queue, exec_ = times
        act.observe(result.act_s)
        queue.observe(result.queue_s)
        exec_.observe(result.exec_s)

    def request_done(self, route: str, status: int) -> None:
        """Count one HTTP request by route and status code."""
        self._count(self.requests, route, str(status)).inc()

    def _count(self, counter: Counter, *labels: str) -> Counter:
        key = (counter, labels)
        child = self._counts.get(key)
        if child is None:
            child = self._counts[key] = counter.labels(*labels)
        return child

    def daemon(self, status: dict[str, Any] | None, queue: dict[str, Any] | None) -> None:
        """Set the daemon-wide gauges from its ``status`` and ``queue`` (None: unreachable)."""
        if status is None or queue is None:
            self.daemon_up.set(0)
            return
        self.daemon_up.set(1)
        for pool, row in (status.get("pools") or {}).items():
            self.pool_free.labels(pool).set(row.get("free", 0))
            self.pool_capacity.labels(pool).set(row.get("capacity", 0))
        self.running.set(status.get("running", 0))
        self.environments.set(status.get("environments", 0))
        self.clients.set(status.get("clients", 0))
        waiting: dict[str, int] = {}
        for row in queue.get("waiting", []):
            kind = str(row.get("kind", "?"))
            waiting[kind] = waiting.get(kind, 0) + 1
        self.queue_length.clear()
        for kind in ("exec", "api", *waiting):
            self.queue_length.labels(kind).set(waiting.get(kind, 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)

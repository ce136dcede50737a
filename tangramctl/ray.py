"""``tangramctl ray up|status|down``: run the cluster on a Ray cluster (design §6.1).

Ray places one process per host, restarts it, says when a host dies and names things; we
keep our own scheduler, environments and protocol. ``ray up`` starts, as detached named
actors in the Ray namespace ``tangram`` (see :mod:`tangramctl.ray_actors`):

- ``tangram-coordinator`` on the head node: ``tangramd coordinator`` listening on the head
  node's Ray address, and the supervisor that gives every Ray node a node daemon (nodes
  that join later too) and reports Ray nodes that die to the coordinator (``node.lost``),
  so their actions end ``infra_error`` at once instead of after the heartbeat timeout;
- ``tangram-node-<ray node id>`` on each node, pinned there (hard node affinity) and
  restarted by Ray: ``tangramd node`` joined with the token and CA pin of ``cluster.join``,
  serving the host's standard socket, so ``Client()`` in a Ray worker needs no argument.

``ray up`` is idempotent (a running coordinator actor is reused) and waits until every
live Ray node has a ready tangram node. ``ray down`` stops every daemon (nodes first, so
they say goodbye), removes their state dirs and sockets and kills every actor it started.

Ray is an optional extra (``pip install 'arl-tangram[ray]'``): this module imports it only
inside the commands, and nothing in ``tangram`` or ``tangramd`` imports it at all.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from tangramctl.ray_actors import COORDINATOR, NAMESPACE, NODE_PREFIX, Coordinator
from tangramctl.render import table, to_json

UP_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 60.0  # for one call on the coordinator actor
POLL_S = 0.2  # between two looks at the nodes while `ray up` waits for them


class RayError(click.ClickException):
    """One line on stderr, as every tangramctl error; exit 1 unless told otherwise."""

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code

    def show(self, file: Any = None) -> None:
        click.echo(f"tangramctl: {self.format_message()}", err=True)


class NotRunning(RayError):
    """``ray status`` found no coordinator actor (exit 3)."""

    exit_code = 3


def _ray() -> Any:
    try:
        import ray
    except ModuleNotFoundError:
        raise RayError(
            "Ray is not installed; install the extra: pip install 'arl-tangram[ray]'"
        ) from None
    return ray


@contextlib.contextmanager
def connected(address: str | None) -> Iterator[Any]:
    """Ray, connected to the cluster at ``address`` (else ``$RAY_ADDRESS``, else the local
    one); a connection that already exists in this process is used and left open."""
    ray = _ray()
    if ray.is_initialized():
        yield ray
        return
    where = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(
            address=where, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING
        )
    except ConnectionError as exc:  # no cluster there: one line, exit 2 like a dead daemon
        raise RayError(f"cannot reach a Ray cluster at {where}: {exc}", exit_code=2) from None
    try:
        yield ray
    finally:
        ray.shutdown()


def _call(ref: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
    """The answer of a call on an actor; RayError (one line) if the actor died or hangs."""
    ray = _ray()
    try:
        return ray.get(ref, timeout=timeout_s)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
        raise RayError(f"the coordinator actor did not answer: {exc}") from None


def coordinator_actor() -> Any | None:
    """The running coordinator actor, or None."""
    ray = _ray()
    try:
        return ray.get_actor(COORDINATOR, namespace=NAMESPACE)
    except ValueError:
        return None


def _head_node_id() -> str:
    ray = _ray()
    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return str(node["NodeID"])
    return str(ray.get_runtime_context().get_node_id())  # no head marker: the driver's node


def up(
    *,
    config_text: str = "",
    cpus: str | None = None,
    state_root: str | None = None,
    poll_s: float = 0.5,
    timeout_s: float = UP_TIMEOUT_S,
) -> dict[str, Any]:
    """Start (or find) the coordinator actor and wait until every live Ray node has a
    ready tangram node; the status, with ``ready_s`` and ``already_running``."""
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    started = time.monotonic()
    spec: dict[str, Any] = {
        "config_text": config_text,
        "cpus": cpus,
        "state_root": state_root,
        "poll_s": poll_s,
    }
    if os.environ.get("PYTHONPATH"):  # a source checkout: the actors import what we do
        spec["runtime_env"] = {"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}}
    already = coordinator_actor() is not None
    actor = (
        ray.remote(Coordinator)
        .options(
            name=COORDINATOR,
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=-1,
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(_head_node_id(), soft=False),
            runtime_env=spec.get("runtime_env"),
        )
        .remote(spec)
    )
    report = wait_ready(actor, started + timeout_s)
    report["ready_s"] = round(time.monotonic() - started, 3)
    report["already_running"] = already
    running = {k: v for k, v in spec.items() if k != "runtime_env"}
    if already and report["spec"] != running:
        report["note"] = "already running with other options; `ray down` first to change them"
    return report


def _live_ray_nodes() -> set[str]:
    return {str(n["NodeID"]) for n in _ray().nodes() if n.get("Alive")}


def wait_ready(actor: Any, deadline: float) -> dict[str, Any]:
    """Poll the coordinator actor until every live Ray node's tangram node is ready and
    its socket known; raise RayError with what is missing at ``deadline``. The first
    answer waits for the actor to start its coordinator, so it may take the whole time."""
    while True:
        patience = max(CALL_TIMEOUT_S, deadline - time.monotonic())
        report: dict[str, Any] = _call(actor.status.remote(), patience)
        failed = [row["failed"] for row in report["nodes"] if row.get("failed")]
        if report["coordinator"].get("failed"):
            failed.append(report["coordinator"]["failed"])
        if failed:
            raise RayError("a daemon failed to start:\n" + "\n".join(failed))
        ready = {
            row["ray_node_id"]
            for row in report["nodes"]
            if row.get("state") == "ready" and row.get("socket") and row.get("ray_node_id")
        }
        missing = _live_ray_nodes() - ready
        if not missing:
            return report
        if time.monotonic() > deadline:
            rows = [r for r in report["nodes"] if r.get("ray_node_id") in missing]
            raise RayError(
                f"{len(missing)} Ray node(s) have no ready tangram node yet:\n"
                + table(rows, preferred=NODE_COLUMNS)
            )
        time.sleep(POLL_S)  # the next look; nothing pushes node states to us


def status() -> dict[str, Any]:
    """The coordinator actor's status; NotRunning when there is none."""
    actor = coordinator_actor()
    if actor is None:
        raise NotRunning("tangram is not running on this Ray cluster (`tangramctl ray up`)")
    report: dict[str, Any] = _call(actor.status.remote())
    return report


def down() -> dict[str, Any]:
    """Stop everything ``up`` started; ``{"stopped": bool, ...}``. Idempotent."""
    ray = _ray()
    actor = coordinator_actor()
    summary: dict[str, Any] = {"stopped": actor is not None, "nodes": [], "problems": []}
    if actor is not None:
        try:
            summary.update(ray.get(actor.stop.remote(), timeout=CALL_TIMEOUT_S * 2))
        except Exception as exc:  # a coordinator actor that cannot stop is killed below
            summary["problems"].append(f"coordinator: {type(exc).__name__}: {exc}")
        ray.kill(actor, no_restart=True)
    # Node actors the coordinator did not stop (it restarted and lost track, or failed):
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != NAMESPACE or not entry["name"].startswith(NODE_PREFIX):
            continue
        with contextlib.suppress(ValueError):
            node = ray.get_actor(entry["name"], namespace=NAMESPACE)
            try:
                summary["nodes"].append(ray.get(node.stop.remote(), timeout=CALL_TIMEOUT_S))
            except Exception as exc:
                summary["problems"].append(f"{entry['name']}: {type(exc).__name__}")
            ray.kill(node, no_restart=True)
    return summary


# --------------------------------------------------------------------------- commands

NODE_COLUMNS = ("name", "host", "state", "socket", "cores", "running", "ray_node_id")
HUMAN_COLUMNS = ("name", "host", "state", "socket", "cores", "running", "pid")
ADDRESS = click.option(
    "--address",
    metavar="ADDR",
    default=None,
    help="Ray cluster address [default: $RAY_ADDRESS, else the local cluster].",
)
JSON = click.option("--json", "as_json", is_flag=True, help="Print JSON for programs.")


def _human(report: dict[str, Any]) -> str:
    coord = report["coordinator"]
    state = "running" if coord["alive"] else "not running"
    lines = [
        f"coordinator  {coord['address']} on Ray node {str(coord['ray_node_id'])[:12]}, {state}",
        f"             its socket there: {coord['socket']}",
    ]
    if "ready_s" in report:
        again = " (was already running)" if report.get("already_running") else ""
        lines.append(f"ready in     {report['ready_s']:.1f} s{again}")
    rows = report["nodes"]
    columns = [*HUMAN_COLUMNS]
    columns += [c for c in ("failed", "lost_because") if any(row.get(c) for row in rows)]
    lines += ["", table(rows, columns, empty="(no nodes)")]
    sockets = sorted({row["socket"] for row in rows if row.get("socket")})
    if sockets:
        lines += ["", "rollout workers: Client() on each host (socket " + ", ".join(sockets) + ")"]
    if report.get("note"):
        lines += ["", f"note: {report['note']}"]
    lines += [f"supervisor error: {error}" for error in report.get("errors") or ()]
    return "\n".join(lines)


@click.group("ray")
def ray_group() -> None:
    """Run the cluster on Ray: a coordinator and one node daemon per Ray node."""


@ray_group.command("up")
@ADDRESS
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False),
    help="TOML for the coordinator and every node (read here, sent to each host).",
)
@click.option(
    "--cpus-per-node",
    "cpus",
    metavar="SPEC",
    default=None,
    help="Cores each node offers, e.g. 0-7 ('' for a pure gateway) [default: all].",
)
@click.option(
    "--state-dir",
    "state_root",
    metavar="DIR",
    default=None,
    help="State and logs on each host [default: $TMPDIR/tangram-ray-$UID].",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=UP_TIMEOUT_S,
    show_default=True,
    metavar="SECONDS",
    help="How long to wait for the coordinator and every node to be ready.",
)
@JSON
def up_command(
    address: str | None,
    config_path: str | None,
    cpus: str | None,
    state_root: str | None,
    timeout_s: float,
    as_json: bool,
) -> None:
    """Start the coordinator and a node on every Ray node; wait until all are ready."""
    config_text = Path(config_path).read_text() if config_path else ""
    root = os.path.abspath(state_root) if state_root else None
    with connected(address):
        report = up(config_text=config_text, cpus=cpus, state_root=root, timeout_s=timeout_s)
    click.echo(to_json(report) if as_json else _human(report))


@ray_group.command("status")
@ADDRESS
@JSON
def status_command(address: str | None, as_json: bool) -> None:
    """The coordinator, and each Ray node's tangram node: socket and state."""
    with connected(address):
        report = status()
    click.echo(to_json(report) if as_json else _human(report))


@ray_group.command("down")
@ADDRESS
@JSON
def down_command(address: str | None, as_json: bool) -> None:
    """Stop every daemon and actor `ray up` started; remove their sockets and state."""
    with connected(address):
        summary = down()
    if as_json:
        click.echo(to_json(summary))
    elif not summary["stopped"] and not summary["nodes"]:
        click.echo("nothing to stop")
    else:
        click.echo(f"stopped the coordinator and {len(summary['nodes'])} node(s)")
        for problem in summary["problems"]:
            click.echo(f"  {problem}")

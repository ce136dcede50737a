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

``ray up`` needs a running Ray cluster (``ray start --head``; it does not start one: a
cluster started by the command would end with it, and its detached actors too), and fails
at once, saying so, when none is reachable. It checks ``--cpus-per-node`` against the
cores of every Ray node's host before it starts anything. It waits until every live Ray
node has a ready tangram node; if that fails (a daemon exits at start-up, the timeout, ^C),
it stops and kills everything it started, so a corrected rerun starts afresh with its own
options. Run again, it replaces what runs if that has failed (its coordinator, or a node
failed or dead), reuses it if healthy and the options are the same (idempotent), and
refuses other options for a healthy one (``ray down`` first: that ends running actions).
``ray down`` stops every daemon (nodes first, so they say goodbye), removes their state
dirs and sockets and kills every actor it started.

Ray is an optional extra (``pip install 'arl-tangram[ray]'``): this module imports it only
inside the commands, and nothing in ``tangram`` or ``tangramd`` imports it at all.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from tangramctl.ray_actors import COORDINATOR, NAMESPACE, NODE_PREFIX, Coordinator, gist, host_cores
from tangramctl.render import table, to_json

UP_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 60.0  # for one call on the coordinator actor
POLL_S = 0.2  # between two looks at the nodes while `ray up` waits for them
REACH_TIMEOUT_S = 3.0  # for a TCP connect to an explicit --address before ray.init
START_RAY = "start one with `ray start --head` (other hosts: `ray start --address HEAD:6379`)"


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
    check_reachable(where)
    try:
        ray.init(
            address=where, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING
        )
    except ConnectionError as exc:  # no cluster there: one line, exit 2 like a dead daemon
        if where == "auto":
            raise RayError(
                "no Ray cluster is running on this host and $RAY_ADDRESS is unset: "
                f"{START_RAY}, or pass --address HOST:PORT",
                exit_code=2,
            ) from None
        raise RayError(f"cannot reach a Ray cluster at {where}: {exc}", exit_code=2) from None
    try:
        yield ray
    finally:
        ray.shutdown()


def check_reachable(where: str) -> None:
    """Fail at once, in one line, when an explicit address has nothing listening: Ray
    itself retries such an address for minutes. ``local`` is refused: that cluster would
    end with this command, and the detached actors with it."""
    if where == "local":
        raise RayError(
            f"--address local would start a Ray cluster that ends with this command: {START_RAY}",
            exit_code=2,
        )
    if where == "auto":
        return  # Ray finds the local cluster's address file, or says at once there is none
    hostport = where.removeprefix("ray://").rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise RayError(f"--address {where}: expected HOST:PORT, e.g. 10.0.0.1:6379", exit_code=2)
    try:
        socket.create_connection((host.strip("[]"), int(port)), REACH_TIMEOUT_S).close()
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise RayError(
            f"cannot reach a Ray cluster at {where} ({why}): is Ray running there? "
            f"If not, {START_RAY}",
            exit_code=2,
        ) from None


def _call(ref: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
    """The answer of a call on an actor; RayError (one line) if the actor died or hangs."""
    ray = _ray()
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.ActorDiedError as exc:  # e.g. its constructor raised
        raise RayError(f"the coordinator actor died: {gist(str(exc))}") from None
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


def wanted_cores(cpus: str | None) -> tuple[int, ...]:
    """The cores ``--cpus-per-node`` asks for (() for all, or none); RayError (exit 2)
    naming the option when it is not a core list. Needs no Ray: checked first."""
    if cpus is None or cpus.strip() == "":
        return ()
    from tangramd.config import parse_cores

    try:
        return parse_cores(cpus)
    except ValueError as exc:
        raise RayError(
            f"--cpus-per-node {cpus!r}: {exc}; want a core list such as 0-3,6, "
            "'' for none (a pure gateway), or leave it out for all of each host's cores",
            exit_code=2,
        ) from None


def check_cores(cpus: str | None, runtime_env: dict[str, Any] | None) -> None:
    """Refuse ``--cpus-per-node`` before anything starts when a Ray node's host lacks one
    of its cores: a 0-CPU task on each live Ray node reads its host's cores."""
    wanted = wanted_cores(cpus)
    if not wanted:
        return
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from tangramd.config import format_cores

    nodes = {str(n["NodeID"]): n for n in ray.nodes() if n.get("Alive")}
    probe = ray.remote(host_cores)
    refs = {
        probe.options(
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            runtime_env=runtime_env,
        ).remote(): node_id
        for node_id in nodes
    }
    done, late = ray.wait(list(refs), num_returns=len(refs), timeout=CALL_TIMEOUT_S)
    problems = []
    for ref in done:
        node = nodes[refs[ref]]
        where = f"Ray node {refs[ref][:12]} ({node.get('NodeManagerAddress')})"
        try:
            have = ray.get(ref)
        except Exception as exc:  # e.g. this package is not installed there
            problems.append(f"{where}: cannot run tangramctl there: {type(exc).__name__}")
            continue
        if missing := sorted(set(wanted) - set(have)):
            problems.append(
                f"{where} lacks core(s) {format_cores(missing)}; "
                f"its cores are {format_cores(have)} ({len(have)})"
            )
    problems += [f"Ray node {refs[ref][:12]}: no answer in {CALL_TIMEOUT_S:.0f} s" for ref in late]
    if problems:
        raise RayError(
            f"--cpus-per-node {cpus}: "
            + "; ".join(problems)
            + ". Ask for cores every host has, or leave the option out to offer all of them",
            exit_code=2,
        )


def _unhealthy(report: dict[str, Any]) -> str | None:
    """Why a running coordinator actor's report is a failed one (None: healthy)."""
    coord = report["coordinator"]
    if coord.get("failed") or not coord.get("alive"):
        return f"its coordinator failed: {coord.get('reason') or 'not alive'}"
    bad = [f"{r['name']} {r['state']}" for r in report["nodes"] if r["state"] in ("failed", "dead")]
    return f"node(s) {', '.join(bad)}" if bad else None


def _leftover_node_actors() -> bool:
    return any(name.startswith(NODE_PREFIX) for name in _named_actors())


def up(
    *,
    config_text: str = "",
    cpus: str | None = None,
    state_root: str | None = None,
    poll_s: float = 0.5,
    timeout_s: float = UP_TIMEOUT_S,
) -> dict[str, Any]:
    """Start (or find) the coordinator actor and wait until every live Ray node has a
    ready tangram node; the status, with ``ready_s``, ``already_running`` and, when it
    took the place of a failed one, ``replaced``.

    What this call starts it also takes down when it fails (RayError, timeout, ^C), so a
    corrected rerun starts afresh. One found running that has failed (its coordinator, or
    a node failed or dead) is taken down and started afresh with this call's options; a
    healthy one is reused with the same options, and with others RayError (``ray down``
    first: it ends the running actions)."""
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    wanted_cores(cpus)
    started = time.monotonic()
    spec: dict[str, Any] = {
        "config_text": config_text,
        "cpus": cpus,
        "state_root": state_root,
        "poll_s": poll_s,
    }
    running = {k: v for k, v in spec.items() if k != "runtime_env"}
    if os.environ.get("PYTHONPATH"):  # a source checkout: the actors import what we do
        spec["runtime_env"] = {"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}}
    replaced = None
    existing = coordinator_actor()
    if existing is not None:
        try:
            current: dict[str, Any] | None = _call(existing.status.remote())
        except RayError:
            current = None  # dead or hung: a failed one
        why = _unhealthy(current) if current else "its coordinator actor does not answer"
        if why is not None:  # failed: start afresh with the options asked for now
            down()
            replaced, existing = why, None
        elif current is not None and current["spec"] != running:
            raise RayError(
                "tangram already runs on this Ray cluster with other options "
                f"({_differences(current['spec'], running)}); `tangramctl ray down` "
                "first (it ends the running actions), then `ray up` with the new ones"
            )
    already = existing is not None
    if not already:
        if _leftover_node_actors():  # of a coordinator that died: they hold old options
            down()
        check_cores(cpus, spec.get("runtime_env"))
    try:
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
    except BaseException as exc:
        if already:  # not ours to take down: it ran before this call
            if isinstance(exc, RayError):
                hint = "it ran before this `ray up` and is left running; `tangramctl ray down`"
                raise RayError(f"{exc.format_message()}\n({hint} takes it down)") from None
            raise
        left = _take_down()
        if isinstance(exc, RayError):
            raise RayError(f"{exc.format_message()}\n{left}", exc.exit_code) from None
        raise
    report["ready_s"] = round(time.monotonic() - started, 3)
    report["already_running"] = already
    if replaced:
        report["replaced"] = replaced
    return report


def _differences(old: dict[str, Any], new: dict[str, Any]) -> str:
    names = {"cpus": "--cpus-per-node", "config_text": "--config", "state_root": "--state-dir"}
    changed = [k for k in new if old.get(k) != new.get(k)]
    parts = []
    for key in changed:
        if key == "config_text":
            parts.append("--config differs")
        else:
            parts.append(f"{names.get(key, key)} {old.get(key)!r}, now {new.get(key)!r}")
    return "; ".join(parts)


def _take_down() -> str:
    """After a failed ``up``: stop and kill all it started; one line saying so."""
    try:
        summary = down()
    except Exception as exc:  # say so: the operator must then run `ray down`
        return f"taking it down failed too ({type(exc).__name__}: {exc}); run `tangramctl ray down`"
    if summary["problems"]:
        return "took it down, with problems: " + "; ".join(summary["problems"])
    return (
        f"nothing is left running: stopped the coordinator and {len(summary['nodes'])} "
        "node daemon(s), and killed their actors"
    )


def _live_ray_nodes() -> set[str]:
    return {str(n["NodeID"]) for n in _ray().nodes() if n.get("Alive")}


def wait_ready(actor: Any, deadline: float) -> dict[str, Any]:
    """Poll the coordinator actor until every live Ray node's tangram node is ready and
    its socket known; raise RayError with what is missing at ``deadline``. The first
    answer waits for the actor to start its coordinator, so it may take the whole time."""
    while True:
        patience = max(CALL_TIMEOUT_S, deadline - time.monotonic())
        report: dict[str, Any] = _call(actor.status.remote(), patience)
        failed = [
            row.get("failed") or f"{row['name']}: {row['reason']}"
            for row in report["nodes"]
            if row.get("state") in ("failed", "dead")
        ]
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
    # ray.kill returns before the names are free: an `up` right after (a replace) would
    # otherwise get the dying coordinator back through get_if_exists.
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while _named_actors() and time.monotonic() < deadline:
        time.sleep(POLL_S)  # nothing tells us when the GCS has dropped them
    if left := _named_actors():
        summary["problems"].append(f"actors still named after {CALL_TIMEOUT_S:.0f} s: {left}")
    return summary


def _named_actors() -> list[str]:
    """The names of this module's actors alive on the cluster now."""
    return sorted(
        entry["name"]
        for entry in _ray().util.list_named_actors(all_namespaces=True)
        if entry["namespace"] == NAMESPACE
    )


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
    if coord.get("reason"):
        state += f" ({coord['reason']})"
    lines = [
        f"coordinator  {coord['address']} on Ray node {str(coord['ray_node_id'])[:12]}, {state}",
        f"             its socket there: {coord['socket']}",
    ]
    if "ready_s" in report:
        again = " (was already running)" if report.get("already_running") else ""
        lines.append(f"ready in     {report['ready_s']:.1f} s{again}")
    rows = report["nodes"]
    lines += ["", table(rows, HUMAN_COLUMNS, empty="(no nodes)")]
    # in full, below: a table cell would cut them
    lines += [f"{row['name']} {row['state']}: {row['reason']}" for row in rows if row.get("reason")]
    sockets = sorted({row["socket"] for row in rows if row.get("socket")})
    if sockets:
        lines += ["", "rollout workers: Client() on each host (socket " + ", ".join(sockets) + ")"]
    if report.get("replaced"):
        lines += ["", f"replaced the one that ran with other options: {report['replaced']}"]
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
    wanted_cores(cpus)  # a bad list fails here, before Ray is reached
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

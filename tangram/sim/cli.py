"""The simulator's command line: compare policies on one trace, locally (no daemon).

``tangramctl simulate`` attaches this click command (``tangramctl/simulate.py`` re-exports it)
and ``python -m tangram.sim`` runs it alone; the library never imports ``tangramctl``.
"""

from __future__ import annotations

import sys
import time

import click

from tangram.jobs import JobError, load_jobs
from tangram.sched import SchedConfig
from tangram.sim.cluster import ClusterError, load_cluster
from tangram.sim.engine import PASSES, SimError
from tangram.sim.engine import simulate as run_policy
from tangram.sim.policy import POLICY_HELP, PolicyError, parse_policy
from tangram.sim.report import plot, table, to_json
from tangram.sim.trace import TraceError, dump_trace, load_trace
from tangram.sim.workloads import WORKLOADS, WorkloadError, generate


class _Progress:
    """Prints simulated time and finished trajectories to stderr at most once a second."""

    def __init__(self, policy: str, enabled: bool) -> None:
        self.policy = policy
        self.enabled = enabled
        self.last = time.monotonic()

    def __call__(self, now: float, done: int, total: int) -> None:
        t = time.monotonic()
        if self.enabled and t - self.last >= 1.0:
            self.last = t
            click.echo(f"  {self.policy}: t={now:,.0f}s  {done}/{total} trajectories", err=True)


@click.command("simulate")
@click.option(
    "--cluster",
    "cluster_file",
    required=True,
    type=click.Path(dir_okay=False),
    help="Cluster TOML (docs/design.md §8), e.g. config/cluster-paper.toml.",
)
@click.option(
    "--trace",
    "trace_file",
    type=click.Path(dir_okay=False),
    help="Trace file (JSON lines, docs/trace-format.md).",
)
@click.option(
    "--jobs",
    "jobs_file",
    type=click.Path(dir_okay=False),
    help="Jobs TOML: [[job]] name, weight, priority, max_cores, max_gpus (fair share across "
    "the trace's jobs; docs/trace-format.md). Without it every job has weight 1.",
)
@click.option("--workload", type=click.Choice(WORKLOADS), help="Named generator.")
@click.option("--batch", type=int, metavar="N", help="Trajectories per RL step (with --workload).")
@click.option(
    "--steps",
    type=int,
    default=1,
    metavar="N",
    show_default=True,
    help="RL steps to generate (with --workload).",
)
@click.option(
    "--policy", "policies", multiple=True, required=True, metavar="NAME", help=POLICY_HELP
)
@click.option(
    "--seed", type=int, default=0, show_default=True, metavar="N", help="Workload generator seed."
)
@click.option(
    "--depth", type=int, default=2, show_default=True, metavar="N", help="Scheduler replay depth."
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
@click.option(
    "--plot",
    "plot_file",
    type=click.Path(dir_okay=False),
    help="Draw ACT CDFs and step times to this PNG (needs matplotlib).",
)
@click.option(
    "--save-trace",
    type=click.Path(dir_okay=False),
    help="Write the generated trace here (JSON lines).",
)
@click.option(
    "--passes",
    type=click.Choice(PASSES),
    default="all",
    show_default=True,
    help="Which CPU nodes' queues a pass runs while trajectories wait for a node: all of "
    "them, or only those whose state changed (touched: several times faster on large "
    "clusters, decisions differ slightly; docs/results.md).",
)
@click.option("--quiet", is_flag=True, help="No progress on stderr.")
def simulate(
    cluster_file: str,
    trace_file: str | None,
    jobs_file: str | None,
    workload: str | None,
    batch: int | None,
    steps: int,
    policies: tuple[str, ...],
    seed: int,
    depth: int,
    as_json: bool,
    plot_file: str | None,
    save_trace: str | None,
    passes: str,
    quiet: bool,
) -> None:
    """Replay a trace (or a generated workload) under each --policy and compare them."""
    if (trace_file is None) == (workload is None):
        raise click.UsageError("give exactly one of --trace FILE or --workload NAME")
    if workload is not None and batch is None:
        raise click.UsageError("--workload needs --batch N")
    try:
        cluster = load_cluster(cluster_file)
        jobs = load_jobs(jobs_file) if jobs_file else None
        parsed = [parse_policy(p) for p in policies]
        if trace_file is not None:
            trajs = load_trace(trace_file)
        else:
            assert workload is not None and batch is not None
            trajs = generate(workload, cluster, batch, seed=seed, steps=steps)
        if save_trace:
            with open(save_trace, "w", encoding="utf-8") as fp:
                dump_trace(trajs, fp)
        results = []
        for pol in parsed:
            progress = _Progress(pol.name, not quiet)
            t0 = time.monotonic()
            results.append(
                run_policy(
                    cluster,
                    trajs,
                    pol,
                    SchedConfig(depth=depth, order=pol.order, rule=pol.rule),
                    progress=progress,
                    jobs=jobs,
                    passes=passes,
                )
            )
            if not quiet:
                click.echo(f"  {pol.name}: done in {time.monotonic() - t0:.1f}s wall", err=True)
    except (
        ClusterError,
        TraceError,
        PolicyError,
        WorkloadError,
        SimError,
        JobError,
        OSError,
    ) as exc:
        raise click.ClickException(str(exc)) from None
    n_actions = sum(1 for t in trajs for _ in t.actions())
    source = trace_file or f"{workload} batch={batch} steps={steps} seed={seed}"
    if as_json:
        click.echo(
            to_json(
                results,
                {
                    "trace": {"source": source, "trajectories": len(trajs), "actions": n_actions},
                    "passes": passes,
                },
            )
        )
    else:
        click.echo(f"{source}: {len(trajs)} trajectories, {n_actions} actions")
        click.echo(table(results))
        for r in results:
            for name, st in r.summary.get("by_job", {}).items():
                click.echo(
                    f"  {r.policy} job {name}: {st['actions']} actions, avg ACT "
                    f"{st['avg_act_s']:.3f}s, p99 ACT {st['p99_act_s']:.3f}s, "
                    f"avg queue {st['avg_queue_s']:.3f}s"
                )
    if plot_file:
        try:
            plot(results, plot_file, title=source)
        except ImportError:
            click.echo("--plot needs matplotlib (pip install matplotlib)", err=True)
            sys.exit(1)

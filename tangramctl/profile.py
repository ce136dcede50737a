"""``tangramctl profile``: measure a command's elasticity (docs/design.md §7).

For each degree of parallelism K the command runs through the daemon on exactly K pinned
cores (``cpus=K``), ``--repeat`` times, in one environment opened for the whole profile:
pytest is rewritten by the daemon to ``pytest -n K``, every command sees
``TANGRAM_CPUS=K``. The result is the median execution time per K, ``T1``, the speedup
``S(K) = T1 / T(K)`` and the efficiency ``E(K) = S(K) / K`` (capped at 1: superlinear
readings are noise to a scheduler that assumes ``0 < E <= 1``).

A profile is only worth scheduling by if the command does the same work at every K: when
its outcome (exit code; for pytest the passed/failed/error counts of its summary line)
under K differs from K = 1, the profile says ``outcomes_differ`` and ``elastic: false``.
It is elastic only when more cores pay: some K > 1 must run faster than K = 1 (speed-up
above ``PAYS``), else it says ``elastic: false`` and ``why`` gives the best speed-up.
"""

from __future__ import annotations

import re
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import click

from tangram.client import Client, ExecResult
from tangramctl.render import table, to_json

EXIT_INFRA = 125  # as `tangramctl exec`: the infrastructure, not the command, failed
EXIT_RUNS_FAILED = 1  # the command itself failed in some run: nothing to measure
MIN_SECONDS = 1e-6  # a run too fast to time still gets a positive duration (t1_s > 0)
_PYTEST_SUMMARY = re.compile(r"\b(?:\d+ \w+|no tests ran)\b.* in [0-9.]+s\b")
_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)")
_PYTEST_ARGV0 = ("pytest", "py.test")
# A DoP K > 1 pays when it runs faster than K = 1. The scheduler's rule (``priced``) picks
# the K of least t(K) * max(1, (1 + K * N/C) / 2): on an idle node the factor is 1 for every
# K up to the node's cores, so it takes K > 1 only where t(K) < t(1), i.e. speed-up > 1.
PAYS = 1.0


class InfraFailure(click.ClickException):
    """The daemon could not run a measurement: exit 125, like ``tangramctl exec``."""

    exit_code = EXIT_INFRA

    def show(self, file: Any = None) -> None:
        click.echo(f"tangramctl: {self.message}", err=True)


# --------------------------------------------------------------------------- pure helpers


def parse_dops(text: str) -> list[int]:
    """``"1,2,4,8"`` → ``[1, 2, 4, 8]`` (sorted, unique, always including 1)."""
    try:
        values = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        raise click.BadParameter(f"{text!r}: want a list such as 1,2,4,8") from None
    if not values or min(values) < 1:
        raise click.BadParameter(f"{text!r}: want positive core counts")
    return sorted(values | {1})  # T1 is the reference every other DoP is measured against


def is_pytest(cmd: Sequence[str]) -> bool:
    """Whether the daemon will treat ``cmd`` as a pytest run (docs/design.md §5.2)."""
    if not cmd:
        return False
    head = cmd[0].rsplit("/", 1)[-1]
    if head in _PYTEST_ARGV0:
        return True
    return bool(re.fullmatch(r"python[0-9.]*", head)) and list(cmd[1:3]) == ["-m", "pytest"]


def pytest_counts(output: str) -> dict[str, int] | None:
    """Counts from pytest's last summary line (``=== 3 passed, 1 failed in 2.1s ===``, or
    the same without the rulers under ``-q``); None if there is none."""
    for line in reversed(output.splitlines()):
        if _PYTEST_SUMMARY.search(line) is None:
            continue
        counts = {"passed": 0, "failed": 0, "errors": 0}
        for number, kind in _PYTEST_COUNT.findall(line):
            key = "errors" if kind.startswith("error") else kind
            if key in counts:
                counts[key] += int(number)
        return counts
    return None


def outcome_signature(result: ExecResult, pytest: bool) -> tuple[Any, ...]:
    """What must not change with K: the outcome and exit code, or pytest's counts."""
    if pytest:
        counts = pytest_counts(result.stdout + "\n" + result.stderr)
        if counts is not None:
            return ("pytest", counts["passed"], counts["failed"], counts["errors"])
    return (result.outcome, result.exit_code)


def describe_signature(signature: tuple[Any, ...]) -> str:
    if signature[0] == "pytest":
        return f"{signature[1]} passed, {signature[2]} failed, {signature[3]} errors"
    return f"{signature[0]} (exit {signature[1]})"


@dataclass
class Profile:
    """Measurements of one profile run, and what follows from them."""

    runs: dict[int, list[float]] = field(default_factory=dict)
    signatures: dict[int, list[tuple[Any, ...]]] = field(default_factory=dict)
    skipped: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # "DoP K run R: why", one per bad run

    def medians(self) -> dict[int, float]:
        return {k: max(statistics.median(v), MIN_SECONDS) for k, v in sorted(self.runs.items())}

    def differing(self) -> list[int]:
        """DoPs at which some run's outcome differs from the first run at K = 1."""
        reference = self.signatures[1][0]
        return [
            k
            for k, sigs in sorted(self.signatures.items())
            if any(sig != reference for sig in sigs)
        ]

    def report(self) -> dict[str, Any]:
        """The ``--json`` object (docs/design.md §7; keys beyond the contract are additive)."""
        dop = self.medians()
        t1 = dop[1]
        speedup = {k: t1 / t for k, t in dop.items()}
        eff = {k: min(1.0, s / k) for k, s in speedup.items()}
        differ = bool(self.differing())
        elastic, why = verdict(speedup, differ)
        return {
            "dop": {str(k): round(v, 6) for k, v in dop.items()},
            "t1_s": round(t1, 6),
            "eff": {str(k): round(v, 4) for k, v in eff.items()},
            "speedup": {str(k): round(v, 4) for k, v in speedup.items()},
            "elastic": elastic,
            "why": why,
            "outcomes_differ": differ,
            "runs": {str(k): [round(x, 6) for x in v] for k, v in sorted(self.runs.items())},
            "skipped_dops": self.skipped,
            "failed_runs": self.failures,
        }


def verdict(speedup: Mapping[int, float], outcomes_differ: bool) -> tuple[bool, str]:
    """Whether a profile is elastic, and why: the same outcome at every DoP, and a speed-up
    above ``PAYS`` at some DoP > 1 (the scheduler gives a command more cores only then)."""
    if outcomes_differ:
        return False, "outcomes differ across DoPs"
    above = {k: s for k, s in speedup.items() if k > 1}
    if not above:
        return False, "only DoP 1 measured"
    best = max(above, key=lambda k: above[k])
    if above[best] <= PAYS:
        sign = "<" if round(above[best], 2) < PAYS else "<="
        return False, f"speed-up {above[best]:.2f} {sign} 1 at DoP {best}: more cores do not pay"
    return True, f"speed-up {above[best]:.2f} at DoP {best}"


def max_node_cores(nodes: Sequence[Mapping[str, Any]]) -> int | None:
    """The most cores any node offers, or None if the daemon's answer does not say."""
    best: int | None = None
    for node in nodes:
        count = _core_count(node)
        if count is not None:
            best = count if best is None else max(best, count)
    return best


def _core_count(node: Mapping[str, Any]) -> int | None:
    for holder in (node, node.get("capacity"), node.get("cpu")):
        if not isinstance(holder, Mapping):
            continue
        for key in ("cores", "cpu", "cpus", "count"):
            value = holder.get(key)
            if isinstance(value, list):
                return len(value)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


# --------------------------------------------------------------------------- the command


def _run_once(
    client: Client, cmd: list[str], env_id: str, k: int, timeout_s: float | None
) -> ExecResult:
    return client.exec(
        cmd,
        env=env_id,
        cpus=k,
        elastic=True,  # lets the daemon rewrite pytest to -n K
        timeout_s=timeout_s,
        env_vars={"TANGRAM_CPUS": str(k)},
    )


def measure(
    client: Client,
    cmd: list[str],
    dops: list[int],
    repeat: int,
    image: str | None,
    timeout_s: float | None,
) -> Profile:
    """Run ``cmd`` ``repeat`` times per DoP in one environment; progress on stderr."""
    profile = Profile()
    limit = max_node_cores(client.nodes())
    usable = [k for k in dops if limit is None or k <= limit]
    profile.skipped = [k for k in dops if k not in usable]
    if profile.skipped:
        click.echo(
            f"tangramctl: skipping DoP {','.join(map(str, profile.skipped))}: "
            f"no node has more than {limit} cores",
            err=True,
        )
    pytest = is_pytest(cmd)
    total = len(usable) * repeat
    env_id = client.env_open(image=image)
    try:
        done = 0
        for k in usable:
            for rep in range(1, repeat + 1):
                result = _run_once(client, cmd, env_id, k, timeout_s)
                done += 1
                _progress(done, total, k, rep, repeat, result)
                if result.outcome in ("infra_error", "rejected"):
                    detail = result.stderr.strip().splitlines()[-1:] or [""]
                    raise InfraFailure(f"DoP {k} run {rep}: {result.outcome} {detail[0]}")
                if len(result.cores) not in (0, k):
                    click.echo(
                        f"tangramctl: warning: asked for {k} cores, ran on {len(result.cores)}",
                        err=True,
                    )
                if result.outcome != "ok":
                    profile.failures.append(f"DoP {k} run {rep}: {failure_reason(result)}")
                profile.runs.setdefault(k, []).append(result.exec_s)
                profile.signatures.setdefault(k, []).append(outcome_signature(result, pytest))
    finally:
        client.env_close(env_id)
    return profile


def failure_reason(result: ExecResult) -> str:
    """``exit 4: ERROR: file or directory not found: tests/x`` (the last line it printed)."""
    what = "timed out" if result.outcome == "timeout" else f"exit {result.exit_code}"
    lines = (result.stderr.strip() or result.stdout.strip()).splitlines()
    return f"{what}: {lines[-1][:200]}" if lines else what


def _progress(done: int, total: int, k: int, rep: int, repeat: int, r: ExecResult) -> None:
    status = r.outcome if r.exit_code is None else f"{r.outcome}, exit {r.exit_code}"
    click.echo(
        f"[{done}/{total}] dop {k} run {rep}/{repeat}: {r.exec_s:.3f} s ({status})", err=True
    )


def render(report: Mapping[str, Any]) -> str:
    rows = [
        {
            "dop": int(k),
            "median_s": report["dop"][k],
            "speedup": report["speedup"][k],
            "efficiency": report["eff"][k],
        }
        for k in report["dop"]
    ]
    why = report.get("why") or ""
    said = f"elastic ({why})" if report["elastic"] else f"not elastic ({why})"
    headers = {"dop": "DOP", "median_s": "MEDIAN S", "speedup": "SPEEDUP", "efficiency": "EFF"}
    return table(rows, headers=headers) + f"\n\nT1 = {report['t1_s']:.3f} s; {said}"


@click.command(
    "profile",
    short_help="Measure a command's speedup per core count.",
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
)
@click.option("--image", metavar="IMG", help="Run in a container of this image (docker).")
@click.option(
    "--dop",
    "dop_text",
    default="1,2,4,8",
    show_default=True,
    metavar="K,K,…",
    help="Core counts (DoPs) to measure; 1 is always measured.",
)
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    metavar="N",
    help="Runs per DoP (the median is kept).",
)
@click.option("--save", metavar="NAME", help="Store the profile in the registry under NAME.")
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="Wall-clock limit of each run (> 0).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for programs.")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_obj
def profile(
    ctl: Any,  # tangramctl.main.Ctl (not imported: main imports this module)
    image: str | None,
    dop_text: str,
    repeat: int,
    save: str | None,
    timeout_s: float | None,
    as_json: bool,
    cmd: tuple[str, ...],
) -> None:
    """Measure how CMD speeds up with cores: tangramctl profile [OPTIONS] -- CMD [ARG…].

    CMD runs in a fresh environment whose working directory starts empty (the process
    backend's per-environment directory; /work in a container): give paths outside it as
    absolute paths. Every run must succeed: if one fails, nothing is saved, the failed
    runs are listed and the exit status is 1.
    """
    dops = parse_dops(dop_text)
    client = ctl.client
    result = measure(client, list(cmd), dops, repeat, image, timeout_s)
    if result.failures:
        if as_json:
            click.echo(to_json({**result.report(), "saved": None}))
        for line in result.failures:
            click.echo(f"tangramctl: {line}", err=True)
        click.echo(
            f"tangramctl: {len(result.failures)} run(s) failed: a profile of a failing command "
            "measures nothing; not saved (the command runs in the environment's empty "
            "working directory: use absolute paths)",
            err=True,
        )
        sys.exit(EXIT_RUNS_FAILED)
    differing = result.differing()
    if differing:
        expected = describe_signature(result.signatures[1][0])
        click.echo(
            f"tangramctl: outcome at DoP {','.join(map(str, differing))} differs from DoP 1 "
            f"({expected}): marking the profile non-elastic",
            err=True,
        )
    report = result.report()
    if save is not None:
        client.profile_save(
            save,
            dop=report["dop"],
            t1_s=report["t1_s"],
            eff=report["eff"],
            speedup=report["speedup"],
            elastic=report["elastic"],
        )
        report["saved"] = save
        how = "" if report["elastic"] else " (not elastic: its execs get one core)"
        click.echo(f"tangramctl: saved profile {save!r}{how}", err=True)
    click.echo(to_json(report) if as_json else render(report))


__all__ = ["Profile", "is_pytest", "measure", "parse_dops", "profile", "pytest_counts"]

"""``tangramctl service profile NAME``: measure a GPU service's speed-up per GPU count.

The GPU twin of ``tangramctl profile``. For each of the service's GPU counts K (or those of
``--gpus``) the payload is called through the daemon at exactly K GPUs (``call`` with
``gpus=K``: a real K-GPU replica, on a simulated inventory K CPU workers holding a shard
each), once to warm the replica up (its restore is not measured) and then ``--repeat``
times. ``exec_s`` (the handler's own time) is what is measured; the median per K gives
the speed-up ``S(K) = T(K0) / T(K)`` against the smallest count K0 measured (``S(K0) =
1``), which is the service's ``eff`` as ``service register --eff`` takes it. It is saved
as the service's ``eff`` (``service.set_eff``) unless ``--no-save``: calls submitted from
then on run at the count the scheduler picks by it.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import click

from tangram.client import CallResult, Client
from tangramctl.render import table, to_json

EXIT_INFRA = 125  # as `tangramctl exec` and `profile`: the infrastructure failed
EXIT_RUNS_FAILED = 1  # the handler failed in some run: nothing to measure
MIN_SECONDS = 1e-6  # a call too fast to time still gets a positive duration


def parse_counts(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise click.BadParameter(f"{text!r}: want GPU counts such as 1,2,4") from None
    if not counts or counts[0] < 1:
        raise click.BadParameter(f"{text!r}: want positive GPU counts")
    return counts


def speedups(medians: Mapping[int, float]) -> dict[int, float]:
    """``S(K) = T(K0) / T(K)`` for the smallest count ``K0`` measured."""
    base = medians[min(medians)]
    return {k: base / t for k, t in sorted(medians.items())}


def format_table(table_: Mapping[int, float]) -> str:
    """``{1: 1.0, 2: 1.31}`` -> ``"1:1,2:1.31"`` (``--eff``'s form, 4 significant digits)."""
    return ",".join(f"{k}:{v:.4g}" for k, v in sorted(table_.items()))


def measure(
    client: Client,
    name: str,
    payload: dict[str, Any],
    counts: Sequence[int],
    repeat: int,
    timeout_s: float | None,
) -> tuple[dict[int, list[float]], list[str]]:
    """``repeat`` timed calls per count after one warm-up; progress on stderr. Returns the
    seconds per count and a line per failed run."""
    runs: dict[int, list[float]] = {}
    failures: list[str] = []
    total, done = len(counts) * repeat, 0
    for k in counts:
        warm = _call(client, name, payload, k, timeout_s)
        if not warm.ok:
            failures.append(f"{k} GPU(s) warm-up: {warm.outcome}: {warm.error}")
            continue
        for rep in range(1, repeat + 1):
            result = _call(client, name, payload, k, timeout_s)
            done += 1
            click.echo(
                f"[{done}/{total}] {k} GPU(s) run {rep}/{repeat}: {result.exec_s:.4f} s "
                f"({result.outcome}, gpus {list(result.gpus)})",
                err=True,
            )
            if not result.ok:
                failures.append(f"{k} GPU(s) run {rep}: {result.outcome}: {result.error}")
                continue
            runs.setdefault(k, []).append(max(result.exec_s, MIN_SECONDS))
    return runs, failures


def _call(
    client: Client, name: str, payload: dict[str, Any], k: int, timeout_s: float | None
) -> CallResult:
    result = client.call(name, payload, timeout_s=timeout_s, gpus=k)
    if result.outcome in ("infra_error", "rejected"):
        raise _Infra(f"{k} GPU(s): {result.outcome}: {result.error}")
    if result.ok and len(result.gpus) != k:
        raise _Infra(f"asked for {k} GPU(s), the call ran on {list(result.gpus)}")
    return result


class _Infra(click.ClickException):
    exit_code = EXIT_INFRA

    def show(self, file: Any = None) -> None:
        click.echo(f"tangramctl: {self.message}", err=True)


def report(name: str, runs: Mapping[int, list[float]]) -> dict[str, Any]:
    medians = {k: statistics.median(v) for k, v in sorted(runs.items())}
    speed = speedups(medians)
    return {
        "service": name,
        "gpus": {str(k): round(v, 6) for k, v in medians.items()},
        "speedup": {str(k): round(v, 4) for k, v in speed.items()},
        "eff": format_table(speed),
        "runs": {str(k): [round(x, 6) for x in v] for k, v in sorted(runs.items())},
    }


def render(data: Mapping[str, Any]) -> str:
    rows = [
        {"gpus": int(k), "median_s": data["gpus"][k], "speedup": data["speedup"][k]}
        for k in data["gpus"]
    ]
    said = f"saved as eff {data['eff']}" if data.get("saved") else f"eff {data['eff']} (not saved)"
    headers = {"gpus": "GPUS", "median_s": "MEDIAN S", "speedup": "SPEEDUP"}
    return table(rows, headers=headers) + f"\n\n{data['service']}: {said}"


@click.command(
    "profile",
    short_help="Measure a service's speed-up per GPU count and save it as its eff.",
)
@click.argument("name")
@click.option(
    "--gpus",
    "gpus_text",
    metavar="K,K,…",
    help="GPU counts to measure [default: all of the service's counts that a node holds].",
)
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    metavar="N",
    help="Timed calls per count (the median is kept), after one warm-up call.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="Limit of each call's handler (> 0).",
)
@click.option("--no-save", is_flag=True, help="Only measure: leave the service's eff as it is.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for programs.")
@click.argument("payload", metavar="-- PAYLOAD_JSON")
@click.pass_obj
def service_profile(
    ctl: Any,  # tangramctl.main.Ctl (not imported: main imports this module)
    name: str,
    gpus_text: str | None,
    repeat: int,
    timeout_s: float | None,
    no_save: bool,
    as_json: bool,
    payload: str,
) -> None:
    """Measure how service NAME speeds up with GPUs: tangramctl service profile NAME --
    '{"x": 1}'.

    Each count runs on a real replica of that many GPUs. With --json: service, gpus
    (median seconds per count), speedup, eff (as --eff takes it), runs, saved. Exit 0, 1
    when a call failed (nothing saved), 125 on an infrastructure error, 2 on a usage
    error.
    """
    try:
        body = json.loads(payload)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="PAYLOAD_JSON") from None
    if not isinstance(body, dict):
        raise click.BadParameter("must be a JSON object", param_hint="PAYLOAD_JSON")
    client: Client = ctl.client
    rows = {row["name"]: row for row in client.service_list()}
    if name not in rows:
        raise click.BadParameter(f"service {name!r} is not registered", param_hint="NAME")
    listed = [int(k) for k in rows[name].get("gpus", [])]
    wanted = parse_counts(gpus_text)
    counts = listed if wanted is None else wanted
    unknown = [k for k in counts if k not in listed]
    if unknown:
        raise click.BadParameter(
            f"{name!r} runs on {','.join(map(str, listed))} GPUs, not {unknown[0]}",
            param_hint="--gpus",
        )
    largest = max((_gpus_of(node) for node in client.nodes()), default=0)
    if largest and wanted is None:
        skipped = [k for k in counts if k > largest]
        if skipped:
            click.echo(f"tangramctl: skipping {skipped}: no node has more than {largest}", err=True)
        counts = [k for k in counts if k <= largest]
    runs, failures = measure(client, name, body, counts, repeat, timeout_s)
    if failures or not runs:
        for line in failures:
            click.echo(f"tangramctl: {line}", err=True)
        click.echo("tangramctl: some calls failed: nothing measured is saved", err=True)
        if as_json:
            click.echo(to_json({**(report(name, runs) if runs else {}), "saved": False}))
        sys.exit(EXIT_RUNS_FAILED)
    data = report(name, runs)
    data["saved"] = False
    if not no_save and len(runs) > 1:
        client.service_set_eff(name, data["eff"])
        data["saved"] = True
        click.echo(f"tangramctl: saved eff {data['eff']} for {name!r}", err=True)
    click.echo(to_json(data) if as_json else render(data))


def _gpus_of(node: Mapping[str, Any]) -> int:
    """How many GPUs a ``nodes`` row says the node has (0 when it does not say)."""
    count = node.get("gpus")
    return count if isinstance(count, int) and not isinstance(count, bool) else 0


__all__ = ["parse_counts", "service_profile", "speedups"]

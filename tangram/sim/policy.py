"""Policies compared by the simulator (docs/design.md §8): one choice per resource kind."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from tangram.model import TangramError

CpuPolicy = Literal["tangram", "k8s"]
GpuPolicy = Literal["tangram", "static"]
ApiPolicy = Literal["tangram", "retry"]

# The policies by name: the one list the --help, the unknown-policy error and the README show.
POLICIES = (
    "tangram",
    "tangram-eft",
    "tangram-wait",
    "tangram-paper",
    "tangram-backfill",
    "baseline",
    "k8s",
    "static-services",
    "api-retry",
    "fixed-dop:K",
)
POLICY_HELP = (
    ", ".join(POLICIES) + " (suffixes +backfill and one of +eft, +wait, +paper combine with "
    "any of them)"
)
Rule = Literal["paper", "wait", "wait-eft", "priced"]
_RULE_OF = {"paper": "paper", "wait": "wait", "eft": "wait-eft"}


class PolicyError(TangramError):
    code = "bad_request"


@dataclass(frozen=True, slots=True)
class Policy:
    """How each resource kind is managed in one simulated run.

    ``order`` is the scheduler's queue rule: ``fcfs`` is the paper's, ``backfill`` ours.
    ``fixed_dop`` forces every elastic action to exactly that many units (scheduler ablation).
    """

    name: str
    cpu: CpuPolicy = "tangram"
    gpu: GpuPolicy = "tangram"
    api: ApiPolicy = "tangram"
    order: Literal["fcfs", "backfill"] = "fcfs"
    fixed_dop: int | None = None
    # the scheduler's rule (SchedConfig.rule): ours by default
    rule: Rule = "priced"


def parse_policy(name: str) -> Policy:
    """``tangram``, ``baseline``, ``k8s``, ``static-services``, ``api-retry``, ``fixed-dop:K``.

    The scheduler runs our default ``priced`` rule; ``tangram-eft`` (or ``+eft``) runs the
    ``wait-eft`` rule, ``tangram-wait`` (``+wait``) the ``wait`` rule and ``tangram-paper``
    (``+paper``) the paper's, so gains are attributable; ``tangram-backfill`` (or
    ``+backfill``) uses our backfill queue order.
    """
    base, order, rules = name, "fcfs", set[str]()
    while True:
        for suffix in ("+backfill", "+paper", "+wait", "+eft"):
            if base.endswith(suffix):
                base = base[: -len(suffix)]
                if suffix == "+backfill":
                    order = "backfill"
                else:
                    rules.add(suffix[1:])
                break
        else:
            break
    alias = {
        "tangram-backfill": "backfill",
        "tangram-paper": "paper",
        "tangram-wait": "wait",
        "tangram-eft": "eft",
    }
    if base in alias:
        if alias[base] == "backfill":
            order = "backfill"
        else:
            rules.add(alias[base])
        base = "tangram"
    if len(rules) > 1:
        raise PolicyError(f"policy {name!r}: the rules {sorted(rules)} exclude each other")
    rule: Rule = "priced"
    if rules:
        rule = _RULE_OF[rules.pop()]  # type: ignore[assignment]  # a Rule by construction
    policy = _by_name(name, base, order)  # type: ignore[arg-type]  # "fcfs" or "backfill"
    return replace(policy, rule=rule)


def _by_name(name: str, base: str, order: Literal["fcfs", "backfill"]) -> Policy:
    if base == "tangram":
        return Policy(name, order=order)
    if base == "baseline":
        return Policy(name, cpu="k8s", gpu="static", api="retry", order=order)
    if base == "k8s":
        return Policy(name, cpu="k8s", order=order)
    if base == "static-services":
        return Policy(name, gpu="static", order=order)
    if base == "api-retry":
        return Policy(name, api="retry", order=order)
    if base.startswith("fixed-dop:"):
        try:
            k = int(base.split(":", 1)[1])
        except ValueError:
            raise PolicyError(f"policy {name!r}: K in fixed-dop:K must be an integer") from None
        if k < 1:
            raise PolicyError(f"policy {name!r}: K must be >= 1")
        return Policy(name, order=order, fixed_dop=k)
    raise PolicyError(f"unknown policy {name!r} (known: {POLICY_HELP})")

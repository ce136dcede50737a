"""Policies compared by the simulator (design §8): one choice per resource kind."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tangram.model import TangramError

CpuPolicy = Literal["tangram", "k8s"]
GpuPolicy = Literal["tangram", "static"]
ApiPolicy = Literal["tangram", "retry"]

POLICY_HELP = (
    "tangram, tangram-paper, tangram-backfill, baseline, k8s, static-services, api-retry, "
    "fixed-dop:K (suffixes +backfill and +paper combine with any of them)"
)


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
    rule: Literal["paper", "wait"] = "wait"  # the scheduler's replay rule (SchedConfig.rule)

    @property
    def uses_scheduler(self) -> bool:
        return "tangram" in (self.cpu, self.gpu, self.api)


def parse_policy(name: str) -> Policy:
    """``tangram``, ``baseline``, ``k8s``, ``static-services``, ``api-retry``, ``fixed-dop:K``;
    ``tangram-backfill`` (or a ``+backfill`` suffix) uses our backfill order;
    ``tangram-paper`` (or a ``+paper`` suffix) the paper's replay rule instead of ours."""
    policy = _parse_base(name)
    return policy


def _parse_base(name: str) -> Policy:
    base, backfill, paper = name, False, False
    while base.endswith(("+backfill", "+paper")):
        if base.endswith("+backfill"):
            base, backfill = base[: -len("+backfill")], True
        else:
            base, paper = base[: -len("+paper")], True
    if base == "tangram-backfill":
        base, backfill = "tangram", True
    if base == "tangram-paper":
        base, paper = "tangram", True
    order: Literal["fcfs", "backfill"] = "backfill" if backfill else "fcfs"
    rule: Literal["paper", "wait"] = "paper" if paper else "wait"
    policy = _by_name(name, base, order)
    return Policy(policy.name, policy.cpu, policy.gpu, policy.api, order, policy.fixed_dop, rule)


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

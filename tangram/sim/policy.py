"""Policies compared by the simulator (design §8): one choice per resource kind."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tangram.model import TangramError

CpuPolicy = Literal["tangram", "k8s"]
GpuPolicy = Literal["tangram", "static"]
ApiPolicy = Literal["tangram", "retry"]

POLICY_HELP = (
    "tangram, tangram-backfill, baseline, k8s, static-services, api-retry, fixed-dop:K "
    "(fixed-dop:K+backfill and tangram+backfill also work)"
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

    @property
    def uses_scheduler(self) -> bool:
        return "tangram" in (self.cpu, self.gpu, self.api)


def parse_policy(name: str) -> Policy:
    """``tangram``, ``baseline``, ``k8s``, ``static-services``, ``api-retry``, ``fixed-dop:K``;
    ``tangram-backfill`` (or any name with a ``+backfill`` suffix) uses our backfill order."""
    base, backfill = name, False
    if base.endswith("+backfill"):
        base, backfill = base[: -len("+backfill")], True
    if base == "tangram-backfill":
        base, backfill = "tangram", True
    order: Literal["fcfs", "backfill"] = "backfill" if backfill else "fcfs"
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

"""Action model (docs/design.md §3, paper §4.1): demands, elasticity, durations, typed errors.

Pure: no I/O, no clock. Everything here is a small frozen value or a deterministic
estimator that the scheduler, the pools, the daemon and the simulator share.

- A *demand* maps resource types (``cpu``, ``mem``, ``gpu``, ``gpu_mem``, ``api:<name>``)
  to allowed amounts: a ``Range(min, max)`` or a discrete ``Choices`` set. ``net`` is
  refused (no pool holds network bandwidth, so a demand on it could not be kept).
- *Joint admission* (issue 34): an ``api:<name>`` entry beside another key (an exec's
  cores + one API slot) is the action's ``extra`` demand; the scheduler starts it only
  when its key units and every extra unit fit together, and places them together.
- At most one resource type is the *key elastic resource*; all others are fixed at their
  minimum.
- ``Elasticity(t1_s, eff)`` gives ``dur(m) = T1 / (E(m) * m)`` with ``E`` interpolated
  linearly between profiled points; amounts outside the profiled range are not allowed.
- ``HistoryEstimator`` is the running mean used for actions without a profile.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal, NewType

ActionId = NewType("ActionId", str)
TrajectoryId = NewType("TrajectoryId", str)
EnvId = NewType("EnvId", str)
NodeId = NewType("NodeId", str)
LeaseId = NewType("LeaseId", str)

BASE_RESOURCES: tuple[str, ...] = ("cpu", "mem", "gpu", "gpu_mem")
# named in demands by some clients but held by no pool: refused with a clear error
UNSCHEDULED_RESOURCES: tuple[str, ...] = ("net",)
ACTION_KINDS: tuple[str, ...] = ("exec", "service", "api")
ActionKind = Literal["exec", "service", "api"]

# Largest amount of one resource any single action may ask for: bigger numbers are typos
# (or attacks) and are rejected before they reach a pool.
MAX_UNITS: dict[str, int] = {
    "cpu": 4096,
    "gpu": 64,
    "mem": 1 << 44,  # 16 TiB in bytes
    "gpu_mem": 1 << 40,
}
MAX_API_UNITS = 1 << 20


# --------------------------------------------------------------------------- errors


class TangramError(Exception):
    """Base of every typed error; ``code`` is the wire error code (docs/design.md §6)."""

    code: ClassVar[str] = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidDemand(TangramError):
    """A demand that can never be valid: names the field and what is allowed."""

    code: ClassVar[str] = "bad_request"

    def __init__(self, field_name: str, problem: str, allowed: str = "") -> None:
        text = f"{field_name}: {problem}"
        if allowed:
            text += f" (allowed: {allowed})"
        super().__init__(text)
        self.field = field_name
        self.allowed = allowed


class Unschedulable(TangramError):
    """A valid demand that this cluster can never satisfy."""

    code: ClassVar[str] = "unschedulable"


# --------------------------------------------------------------------------- amounts


def is_resource_type(name: str) -> bool:
    """True for the base types and ``api:<name>`` with a non-empty name."""
    if name in BASE_RESOURCES:
        return True
    return name.startswith("api:") and len(name) > 4 and name[4:].strip() == name[4:]


def _check_int(field_name: str, value: object, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidDemand(field_name, f"expected an integer, got {type(value).__name__}")
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value) or value != int(value):
            raise InvalidDemand(field_name, f"expected a whole number, got {value!r}")
        value = int(value)
    if value < 0:
        raise InvalidDemand(field_name, f"negative amount {value}", "0 or more")
    if value > limit:
        raise InvalidDemand(field_name, f"amount {value} is absurd", f"at most {limit}")
    return value


@dataclass(frozen=True, slots=True)
class Range:
    """Any whole amount in ``[min, max]``."""

    min: int
    max: int

    def allowed(self) -> tuple[int, ...]:
        return tuple(range(self.min, self.max + 1))

    def __contains__(self, amount: object) -> bool:
        return isinstance(amount, int) and self.min <= amount <= self.max


@dataclass(frozen=True, slots=True)
class Choices:
    """One of a discrete set of amounts, e.g. GPUs ``{1, 2, 4, 8}`` (kept sorted)."""

    values: tuple[int, ...]

    @property
    def min(self) -> int:
        return self.values[0]

    @property
    def max(self) -> int:
        return self.values[-1]

    def allowed(self) -> tuple[int, ...]:
        return self.values

    def __contains__(self, amount: object) -> bool:
        return amount in self.values


Amounts = Range | Choices


def parse_amounts(field_name: str, raw: object) -> Amounts:
    """Read one resource's allowed amounts from wire/trace form.

    ``n`` → exactly n; ``[lo, hi]`` → range; ``{"set": [..]}`` or a list of more than two
    values → discrete set; ``{"min": lo, "max": hi}`` → range.
    """
    limit = _limit_for(field_name)
    if isinstance(raw, Range | Choices):
        return raw
    if isinstance(raw, bool):
        raise InvalidDemand(field_name, "expected an amount, got a boolean")
    if isinstance(raw, int | float):
        n = _check_int(field_name, raw, limit)
        return Range(n, n)
    if isinstance(raw, Mapping):
        if "set" in raw:
            return _choices(field_name, raw["set"], limit)
        if "min" in raw or "max" in raw:
            lo = _check_int(f"{field_name}.min", raw.get("min", raw.get("max")), limit)
            hi = _check_int(f"{field_name}.max", raw.get("max", raw.get("min")), limit)
            return _range(field_name, lo, hi)
        raise InvalidDemand(field_name, "unknown form", "n, [min, max], {'set': [...]}")
    if isinstance(raw, list | tuple):
        if len(raw) == 2:
            lo = _check_int(f"{field_name}[0]", raw[0], limit)
            hi = _check_int(f"{field_name}[1]", raw[1], limit)
            return _range(field_name, lo, hi)
        return _choices(field_name, raw, limit)
    raise InvalidDemand(
        field_name, f"unsupported type {type(raw).__name__}", "n, [min, max], {'set': [...]}"
    )


def _limit_for(field_name: str) -> int:
    base = field_name.split(".")[-1]
    if base.startswith("api:"):
        return MAX_API_UNITS
    return MAX_UNITS.get(base, MAX_API_UNITS)


def _range(field_name: str, lo: int, hi: int) -> Range:
    if lo > hi:
        raise InvalidDemand(field_name, f"min {lo} > max {hi}", "min <= max")
    return Range(lo, hi)


def _choices(field_name: str, raw: object, limit: int) -> Choices:
    if not isinstance(raw, list | tuple | set | frozenset):
        raise InvalidDemand(field_name, "set must be a list of amounts")
    values = sorted({_check_int(field_name, v, limit) for v in raw})
    if not values:
        raise InvalidDemand(field_name, "empty set of allowed amounts", "at least one amount")
    return Choices(tuple(values))


# --------------------------------------------------------------------------- elasticity


@dataclass(frozen=True, slots=True)
class Elasticity:
    """``dur(m) = t1_s / (E(m) * m)``; ``eff`` holds E at profiled amounts (E(1) may be absent)."""

    t1_s: float
    eff: tuple[tuple[int, float], ...]  # sorted by amount

    @staticmethod
    def of(t1_s: float, eff: Mapping[int, float] | Mapping[str, float]) -> Elasticity:
        if not isinstance(t1_s, int | float) or isinstance(t1_s, bool):
            raise InvalidDemand("t1_s", "expected seconds as a number")
        if not (math.isfinite(t1_s) and t1_s > 0):
            raise InvalidDemand("t1_s", f"must be a positive finite duration, got {t1_s!r}")
        table: dict[int, float] = {}
        for k, v in eff.items():
            try:
                m = int(k)
            except (TypeError, ValueError):
                raise InvalidDemand("eff", f"amount {k!r} is not an integer") from None
            if m <= 0:
                raise InvalidDemand("eff", f"amount {m} must be positive")
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise InvalidDemand(f"eff.{m}", "expected a number")
            if not (0 < v <= 1.0 + 1e-9):
                raise InvalidDemand(f"eff.{m}", f"efficiency {v!r} out of range", "0 < E <= 1")
            table[m] = min(float(v), 1.0)
        if not table:
            raise InvalidDemand("eff", "empty elasticity table", "at least one amount")
        return Elasticity(float(t1_s), tuple(sorted(table.items())))

    @property
    def lo(self) -> int:
        return self.eff[0][0]

    @property
    def hi(self) -> int:
        return self.eff[-1][0]

    def efficiency(self, m: int) -> float:
        """E(m) by linear interpolation; amounts outside the profiled range are an error."""
        if m < self.lo or m > self.hi:
            raise InvalidDemand(
                "amount", f"{m} outside the profiled range", f"{self.lo}..{self.hi}"
            )
        prev_m, prev_e = self.eff[0]
        for pm, pe in self.eff:
            if pm == m:
                return pe
            if pm > m:
                frac = (m - prev_m) / (pm - prev_m)
                return prev_e + frac * (pe - prev_e)
            prev_m, prev_e = pm, pe
        return prev_e

    def dur(self, m: int) -> float:
        return self.t1_s / (self.efficiency(m) * m)

    def speedup(self, m: int) -> float:
        return self.efficiency(m) * m


# --------------------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class Action:
    """One atomic external call: the unit of scheduling.

    ``demand`` has one entry per resource type used; ``key`` names the resource whose
    amount the scheduler chooses (the elastic one, or the main one of a fixed action).
    ``seq`` is the FCFS position (smaller = earlier) assigned at submission.
    """

    id: ActionId
    kind: ActionKind
    trajectory: TrajectoryId
    demand: Mapping[str, Amounts]
    key: str
    task: str = "default"
    seq: int = 0
    elasticity: Elasticity | None = None
    dur_s: float | None = None  # known duration of a non-elastic action (e.g. from a trace)
    service: str | None = None
    api: str | None = None
    klass: str = ""  # history class: task + command class / service
    submitted_at: float = 0.0
    payload: Mapping[str, object] = field(default_factory=dict)
    job: str = "default"  # the job it belongs to (fair share across jobs, tangram.sched.share)
    # derived once at construction (the scheduler reads them in its inner loops)
    allowed: tuple[int, ...] = field(init=False, repr=False, compare=False)
    min_units: int = field(init=False, repr=False, compare=False)
    elastic: bool = field(init=False, repr=False, compare=False)
    # a dict (not a Mapping): compiled, its get is then a direct call in the inner loops
    profiled: dict[int, float] = field(init=False, repr=False, compare=False)
    # own_duration(min_units): computed once, the scheduler asks for it on every pass
    base_min: float | None = field(init=False, repr=False, compare=False)
    # the scheduler's memo keys: strings (their hash is cached) that are equal exactly when
    # (kind, service, min_units, demand["mem"]) resp. (min_units, demand["mem"]) are
    fit_key: str = field(init=False, repr=False, compare=False)
    node_key: str = field(init=False, repr=False, compare=False)
    # the key a pool's extra cost at ``min_units`` is memoised on (``Durations._extra_at``)
    min_cost_key: tuple[str, str | None, int] = field(init=False, repr=False, compare=False)
    # units it also needs on other pools while it runs, (pool id, amount at its minimum):
    # the ``api:<name>`` entries besides the key (joint admission; empty for most actions)
    extra: tuple[tuple[str, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        allowed = self.demand[self.key].allowed()
        if self.elasticity is None:
            allowed = allowed[:1]
        else:
            lo, hi = self.elasticity.lo, self.elasticity.hi
            allowed = tuple(a for a in allowed if lo <= a <= hi) or allowed[:1]
        object.__setattr__(self, "allowed", allowed)
        object.__setattr__(self, "min_units", allowed[0])
        object.__setattr__(self, "elastic", len(allowed) > 1)
        e = self.elasticity
        table = {m: e.dur(m) for m in allowed} if e is not None and e.lo <= allowed[0] else {}
        object.__setattr__(self, "profiled", table)
        low = allowed[0]
        object.__setattr__(self, "base_min", self.own_duration(low))
        object.__setattr__(self, "min_cost_key", (self.kind, self.service, low))
        mem = self.demand.get("mem")
        object.__setattr__(self, "node_key", f"{low}|{mem!r}")
        object.__setattr__(self, "fit_key", f"{self.kind}|{self.service!r}|{low}|{mem!r}")
        extra = tuple(
            sorted(
                (name, amounts.min)
                for name, amounts in self.demand.items()
                if name != self.key and name.startswith("api:") and amounts.min > 0
            )
        )
        object.__setattr__(self, "extra", extra)

    @property
    def key_amounts(self) -> Amounts:
        return self.demand[self.key]

    def is_elastic(self) -> bool:
        """Elastic = more than one allowed amount on the key resource and a known profile."""
        return self.elastic

    def allowed_units(self) -> tuple[int, ...]:
        """Allowed key amounts, intersected with the profiled range when there is a profile.

        Without a profile only the minimum is allowed (unknown elasticity = non-elastic).
        """
        return self.allowed

    def duration(self, units: int, fallback: float) -> float:
        """Expected execution time at ``units`` key units (``fallback`` = history estimate)."""
        own = self.own_duration(units)
        return fallback if own is None else own

    def own_duration(self, units: int) -> float | None:
        """``duration`` from the action's own fields (profile, elasticity, known duration,
        in that order); None where only the history estimate would give one."""
        known = self.profiled.get(units)
        if known is not None:
            return known
        if self.elasticity is not None:
            e = self.elasticity
            if e.lo <= units <= e.hi:
                return e.dur(units)
            return e.t1_s / units if units > 0 else e.t1_s
        return self.dur_s


def make_action(
    action_id: str,
    kind: str,
    trajectory: str,
    demand: Mapping[str, object],
    *,
    key: str | None = None,
    task: str = "default",
    seq: int = 0,
    t1_s: float | None = None,
    eff: Mapping[int, float] | Mapping[str, float] | None = None,
    dur_s: float | None = None,
    service: str | None = None,
    api: str | None = None,
    klass: str = "",
    submitted_at: float = 0.0,
    payload: Mapping[str, object] | None = None,
    capacity: Mapping[str, int] | None = None,
    job: str = "default",
) -> Action:
    """Validate raw fields and build an ``Action``; raises ``InvalidDemand``/``Unschedulable``.

    ``capacity`` (largest amount of each resource any single node or endpoint can ever hold)
    lets submission reject demands larger than the whole cluster.
    """
    if kind not in ACTION_KINDS:
        raise InvalidDemand("kind", f"unknown kind {kind!r}", ", ".join(ACTION_KINDS))
    if not isinstance(demand, Mapping) or not demand:
        raise InvalidDemand("demand", "must be a non-empty map of resource -> amounts")
    parsed: dict[str, Amounts] = {}
    for name, raw in demand.items():
        if name in UNSCHEDULED_RESOURCES:
            raise InvalidDemand(
                f"demand.{name}",
                "not scheduled: no pool holds it, so the demand could not be kept",
                ", ".join((*BASE_RESOURCES, "api:<name>")),
            )
        if not isinstance(name, str) or not is_resource_type(name):
            raise InvalidDemand(
                "demand",
                f"unknown resource type {name!r}",
                ", ".join((*BASE_RESOURCES, "api:<name>")),
            )
        parsed[name] = parse_amounts(f"demand.{name}", raw)
    if key is None:
        key = _default_key(kind, parsed)
    if key not in parsed:
        raise InvalidDemand("key", f"{key!r} is not in the demand", ", ".join(sorted(parsed)))
    if kind == "exec" and key != "cpu":
        raise InvalidDemand("key", f"exec actions are keyed on cpu, not {key!r}", "cpu")
    if kind == "service" and key != "gpu":
        raise InvalidDemand("key", f"service actions are keyed on gpu, not {key!r}", "gpu")
    if kind == "api" and not key.startswith("api:"):
        raise InvalidDemand("key", f"api actions are keyed on an api resource, not {key!r}")
    if parsed[key].max == 0:
        raise InvalidDemand(f"demand.{key}", "key resource amount must be positive", ">= 1")
    if parsed[key].min == 0:
        raise InvalidDemand(f"demand.{key}.min", "minimum of the key resource is 0", ">= 1")
    if kind == "service" and not service:
        raise InvalidDemand("service", "service actions must name a service")
    if kind == "api" and not api:
        api = key[4:]
    elasticity = Elasticity.of(t1_s, eff) if (t1_s is not None and eff is not None) else None
    if t1_s is not None and eff is None:
        elasticity = Elasticity.of(t1_s, {parsed[key].min: 1.0})
    if dur_s is not None and (
        isinstance(dur_s, bool)
        or not isinstance(dur_s, int | float)
        or not math.isfinite(dur_s)
        or dur_s < 0
    ):
        raise InvalidDemand("dur_s", f"must be a non-negative finite duration, got {dur_s!r}")
    if capacity is not None:
        for name, amounts in parsed.items():
            cap = capacity.get(name)
            if cap is not None and amounts.min > cap:
                raise Unschedulable(
                    f"demand.{name}: needs at least {amounts.min}, "
                    f"the largest node/endpoint has {cap}"
                )
    return Action(
        id=ActionId(action_id),
        kind=kind,  # type: ignore[arg-type]  # checked against ACTION_KINDS above
        trajectory=TrajectoryId(trajectory),
        demand=parsed,
        key=key,
        task=task,
        seq=seq,
        elasticity=elasticity,
        dur_s=None if dur_s is None else float(dur_s),
        service=service,
        api=api,
        klass=klass or f"{task}/{kind}/{service or api or ''}",
        submitted_at=submitted_at,
        payload=dict(payload or {}),
        job=job,
    )


def _default_key(kind: str, parsed: Mapping[str, Amounts]) -> str:
    if kind == "exec":
        return "cpu"
    if kind == "service":
        return "gpu"
    apis = [n for n in parsed if n.startswith("api:")]
    if len(apis) != 1:
        raise InvalidDemand("key", "api actions need exactly one api:<name> resource")
    return apis[0]


# --------------------------------------------------------------------------- history


class HistoryEstimator:
    """Running mean of observed execution time per action class (docs/design.md §3 'Duration').

    Used for actions without a profile. Per unit of the key resource is ignored on purpose:
    such actions are non-elastic and always run at their minimum.
    """

    __slots__ = ("_count", "_default", "_mean")

    def __init__(self, default_s: float = 1.0) -> None:
        self._mean: dict[str, float] = {}
        self._count: dict[str, int] = {}
        self._default = default_s

    def observe(self, klass: str, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            return
        n = self._count.get(klass, 0) + 1
        mean = self._mean.get(klass, 0.0)
        self._mean[klass] = mean + (seconds - mean) / n
        self._count[klass] = n

    def estimate(self, klass: str) -> float:
        return self._mean.get(klass, self._default)

    def count(self, klass: str) -> int:
        return self._count.get(klass, 0)

    def snapshot(self) -> dict[str, tuple[float, int]]:
        return {k: (self._mean[k], self._count[k]) for k in self._mean}


@dataclass(frozen=True, slots=True)
class Shortfall:
    """Why an action cannot run (now or ever): misfits are data, never a bare None."""

    resource: str
    requested: int
    free: int
    capacity: int
    reason: str = ""

    def describe(self) -> str:
        text = (
            f"{self.resource}: needs {self.requested}, free {self.free}, capacity {self.capacity}"
        )
        return f"{text} ({self.reason})" if self.reason else text

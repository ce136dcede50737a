"""Workload traces (docs/design.md §8): JSON lines, one trajectory per line.

A trajectory is a sequence of steps, each either LLM generation time (``{"gen_s": s}``,
no external resource held) or one action (``{"action": {...}}``); an ``exec`` action with
``"api"`` holds its cores and one slot of that API together (joint admission, as the
daemon's exec arg ``api``: ``Action.extra``). Parsing is strict: an
unknown key, a wrong type or an invalid demand is a ``TraceError`` naming the line. The
full format is documented in ``docs/trace-format.md``.

Pure: no clock, no randomness; reading a file is the only I/O (``load_trace``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tangram.model import Action, TangramError, make_action

ACTION_KEYS = {
    "exec": {"kind", "cpu", "api", "dur_s", "t1_s", "eff", "tag", "job"},
    "service": {"kind", "service", "gpus", "dur_s", "t1_s", "eff", "tag", "job"},
    "api": {"kind", "api", "dur_s", "tag", "job"},
}
TRAJECTORY_KEYS = {"id", "task", "job", "arrival_s", "mem_gb", "step", "steps"}


class TraceError(TangramError):
    """A malformed trace line; the message starts with ``<source>:<line>:``."""

    code = "bad_request"


@dataclass(frozen=True, slots=True)
class TraceAction:
    """One action of a trace; ``template`` is the validated scheduler ``Action``.

    ``dur_s`` (non-elastic) or ``t1_s``/``eff`` (profiled, elastic) give the true duration.
    The scheduler sees the profile of an elastic action but not the ``dur_s`` of a
    non-elastic one: like the daemon, it estimates those from the history of their class.
    """

    kind: str
    tag: str
    template: Action
    dur_s: float | None
    raw: Mapping[str, Any]

    def true_duration(self, units: int) -> float:
        if self.dur_s is not None:
            return self.dur_s
        return self.template.duration(units, 0.0)


Step = float | TraceAction  # a float is generation time in seconds


@dataclass(frozen=True, slots=True)
class Trajectory:
    id: str
    task: str
    arrival_s: float
    mem_gb: float
    step: int
    steps: tuple[Step, ...]
    job: str = "default"  # the job its actions belong to (an action's own "job" wins)

    def actions(self) -> Iterator[TraceAction]:
        return (s for s in self.steps if isinstance(s, TraceAction))


def _num(where: str, value: object, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: expected a number, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        kind = "positive" if positive else "non-negative"
        raise ValueError(f"{where}: expected a {kind} finite number, got {value!r}")
    return v


def _job(where: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: expected a non-empty job name, got {value!r}")
    return value


def _api_name(where: str, value: object) -> str:
    if not isinstance(value, str) or not value or value.strip() != value:
        raise ValueError(
            f"{where}: expected the name of an [[api]] of the cluster file (a non-empty "
            f"string without outer spaces), got {value!r}"
        )
    return value


def parse_action(raw: object, task: str, traj_id: str, job: str = "default") -> TraceAction:
    """Validate one trace action and build its scheduler template (raises ``ValueError``)."""
    if not isinstance(raw, dict):
        raise ValueError("action: expected an object")
    kind = raw.get("kind")
    if kind not in ACTION_KEYS:
        raise ValueError(f"action.kind: {kind!r} is not one of exec, service, api")
    unknown = set(raw) - ACTION_KEYS[kind]
    if unknown:
        raise ValueError(f"action: unknown key(s) {sorted(unknown)} for kind {kind!r}")
    job = _job("action.job", raw.get("job", job))
    tag = raw.get("tag", kind)
    if not isinstance(tag, str) or not tag:
        raise ValueError("action.tag: expected a non-empty string")
    dur_s = raw.get("dur_s")
    t1_s = raw.get("t1_s")
    eff = raw.get("eff")
    if (dur_s is None) == (t1_s is None):
        raise ValueError("action: give exactly one of dur_s (fixed) or t1_s (+ eff, elastic)")
    if dur_s is not None:
        dur_s = _num("action.dur_s", dur_s)
        if eff is not None:
            raise ValueError("action.eff: only with t1_s")
    if t1_s is not None:
        t1_s = _num("action.t1_s", t1_s, positive=True)
        if eff is not None and not isinstance(eff, dict):
            raise ValueError("action.eff: expected an object {amount: efficiency}")
    service = api = None
    if kind == "exec":
        demand: dict[str, object] = {"cpu": raw.get("cpu", 1)}
        if "api" in raw:  # cores and one API slot together (the exec arg ``api``)
            demand[f"api:{_api_name('action.api', raw['api'])}"] = 1
    elif kind == "service":
        service = raw.get("service")
        if not isinstance(service, str) or not service:
            raise ValueError("action.service: expected a service name")
        gpus = raw.get("gpus", 1)
        demand = {"gpu": {"set": gpus} if isinstance(gpus, list) else gpus}
    else:
        api = _api_name("action.api", raw.get("api"))
        demand = {f"api:{api}": 1}
    # The scheduler gets the profile of elastic actions only; durations of fixed actions
    # are learnt from history (klass), as in the daemon.
    template = make_action(
        "template",
        kind,
        traj_id,
        demand,
        task=task,
        t1_s=t1_s,
        eff=eff,
        service=service,
        api=api,
        klass=f"{task}/{kind}/{service or api or tag}",
        job=job,
    )
    if t1_s is not None and template.elasticity is not None:
        allowed = template.key_amounts.allowed()
        e = template.elasticity
        if allowed[0] < e.lo or allowed[0] > e.hi:
            raise ValueError(
                f"action.eff: minimum amount {allowed[0]} is outside the profiled range "
                f"{e.lo}..{e.hi}"
            )
    return TraceAction(kind, tag, template, dur_s, raw)


def parse_trajectory(obj: object) -> Trajectory:
    """Validate one decoded trace line (raises ``ValueError`` with the field)."""
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object (one trajectory per line)")
    unknown = set(obj) - TRAJECTORY_KEYS
    if unknown:
        raise ValueError(f"unknown key(s) {sorted(unknown)}")
    tid = obj.get("id")
    if not isinstance(tid, str) or not tid:
        raise ValueError("id: expected a non-empty string")
    task = obj.get("task", "default")
    if not isinstance(task, str) or not task:
        raise ValueError("task: expected a non-empty string")
    job = _job("job", obj.get("job", "default"))
    arrival = _num("arrival_s", obj.get("arrival_s", 0.0))
    mem_gb = _num("mem_gb", obj.get("mem_gb", 0.0))
    step = obj.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step: expected a non-negative integer, got {step!r}")
    raw_steps = obj.get("steps")
    if not isinstance(raw_steps, list) or not raw_steps:
        raise ValueError("steps: expected a non-empty list")
    steps: list[Step] = []
    for i, s in enumerate(raw_steps):
        if not isinstance(s, dict) or len(s) != 1 or not ({"gen_s", "action"} & set(s)):
            raise ValueError(f"steps[{i}]: expected {{'gen_s': s}} or {{'action': {{...}}}}")
        try:
            if "gen_s" in s:
                steps.append(_num("gen_s", s["gen_s"]))
            else:
                steps.append(parse_action(s["action"], task, tid, job))
        except (ValueError, TangramError) as exc:
            raise ValueError(f"steps[{i}].{_message(exc)}") from None
    return Trajectory(tid, task, arrival, mem_gb, step, tuple(steps), job)


def _message(exc: Exception) -> str:
    return exc.message if isinstance(exc, TangramError) else str(exc)


def parse_lines(lines: Iterable[str], source: str = "<trace>") -> list[Trajectory]:
    """Parse JSON lines; blank lines and ``#`` comments are skipped."""
    out: list[Trajectory] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{source}:{lineno}: invalid JSON: {exc.msg}") from None
        try:
            traj = parse_trajectory(obj)
        except (ValueError, TangramError) as exc:
            raise TraceError(f"{source}:{lineno}: {_message(exc)}") from None
        if traj.id in seen:
            raise TraceError(
                f"{source}:{lineno}: duplicate trajectory id {traj.id!r} (first on line "
                f"{seen[traj.id]})"
            )
        seen[traj.id] = lineno
        out.append(traj)
    if not out:
        raise TraceError(f"{source}: empty trace")
    return out


def load_trace(path: str | Path) -> list[Trajectory]:
    with open(path, encoding="utf-8") as fp:
        return parse_lines(fp, str(path))


def trajectory_to_json(traj: Trajectory) -> dict[str, Any]:
    steps: list[dict[str, Any]] = []
    for s in traj.steps:
        if isinstance(s, TraceAction):
            steps.append({"action": dict(s.raw)})
        else:
            steps.append({"gen_s": s})
    out: dict[str, Any] = {
        "id": traj.id,
        "task": traj.task,
        **({"job": traj.job} if traj.job != "default" else {}),
        "arrival_s": traj.arrival_s,
        "mem_gb": traj.mem_gb,
    }
    if traj.step:
        out["step"] = traj.step
    out["steps"] = steps
    return out


def dump_trace(trajs: Sequence[Trajectory], fp: IO[str]) -> None:
    for t in trajs:
        fp.write(json.dumps(trajectory_to_json(t), separators=(",", ":")) + "\n")

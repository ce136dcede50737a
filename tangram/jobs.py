"""``[[job]]`` tables (issue 34): the jobs' terms, parsed for the simulator and the daemon.

``parse_jobs(raw)`` takes the decoded array of tables (``[[job]] name, weight, priority,
max_cores, max_gpus``) and returns ``{name: Job}``; every problem is a ``JobError`` naming
``job[i].KEY``, the problem and the allowed values. ``load_jobs(path)`` reads a TOML file
holding such tables (``tangramctl simulate --jobs JOBS.toml``).
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from tangram.model import TangramError
from tangram.sched.share import DEFAULT_JOB, Job

JOB_KEYS = ("name", "weight", "priority", "max_cores", "max_gpus")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$")
NAME_ALLOWED = "1-64 characters: letters, digits, . _ : - (not first)"


class JobError(TangramError):
    """A bad ``[[job]]`` entry: ``key`` is the dotted key (``job[1].weight``)."""

    code = "bad_request"

    def __init__(self, key: str, problem: str, allowed: str = "") -> None:
        self.key = key
        self.problem = problem
        self.allowed = allowed
        text = f"{key}: {problem}" + (f" (allowed: {allowed})" if allowed else "")
        super().__init__(text)


def check_job_name(value: object, key: str = "job") -> str:
    """A job name as given on the wire or in a file, or a ``JobError`` naming ``key``."""
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise JobError(key, f"invalid job name {value!r}", NAME_ALLOWED)
    return value


def _number(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise JobError(key, f"expected a number, got {value!r}", "a positive number")
    return float(value)


def _count(value: object, key: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise JobError(key, f"expected a non-negative integer, got {value!r}", ">= 0")
    return value


def parse_jobs(raw: object, section: str = "job") -> dict[str, Job]:
    """``{name: Job}`` from a decoded ``[[job]]`` array (None or empty: no jobs)."""
    if raw is None:
        return {}
    if not isinstance(raw, list):
        raise JobError(section, "expected an array of tables", f"[[{section}]]")
    jobs: dict[str, Job] = {}
    for i, entry in enumerate(raw):
        where = f"{section}[{i}]"
        if not isinstance(entry, dict):
            raise JobError(where, f"expected a table, got {entry!r}")
        for k in entry:
            if k not in JOB_KEYS:
                raise JobError(f"{where}.{k}", "unknown key", ", ".join(JOB_KEYS))
        if "name" not in entry:
            raise JobError(f"{where}.name", "missing required key")
        name = check_job_name(entry["name"], f"{where}.name")
        if name in jobs:
            raise JobError(f"{where}.name", f"duplicate job name {name!r}")
        weight = _number(entry.get("weight", 1.0), f"{where}.weight")
        if not (weight > 0 and math.isfinite(weight)):
            raise JobError(f"{where}.weight", f"must be positive and finite, got {weight}", "> 0")
        priority: Any = entry.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise JobError(f"{where}.priority", f"expected an integer, got {priority!r}", "integer")
        if not -1000 <= priority <= 1000:
            raise JobError(f"{where}.priority", f"out of range: {priority}", "-1000..1000")
        jobs[name] = Job(
            name,
            weight,
            priority,
            _count(entry.get("max_cores"), f"{where}.max_cores"),
            _count(entry.get("max_gpus"), f"{where}.max_gpus"),
        )
    return jobs


def load_jobs(path: str | Path) -> dict[str, Job]:
    """The ``[[job]]`` tables of a TOML file (a ``JobError`` names the file and key)."""
    try:
        with open(path, "rb") as fp:
            doc = tomllib.load(fp)
    except OSError as exc:
        raise JobError(str(path), f"cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise JobError(str(path), f"invalid TOML: {exc}") from None
    extra = sorted(set(doc) - {"job"})
    if extra:
        raise JobError(f"{path}: {extra[0]}", "unknown section", "[[job]]")
    try:
        return parse_jobs(doc.get("job"))
    except JobError as exc:
        raise JobError(f"{path}: {exc.key}", exc.problem, exc.allowed) from None


__all__ = [
    "DEFAULT_JOB",
    "JOB_KEYS",
    "Job",
    "JobError",
    "check_job_name",
    "load_jobs",
    "parse_jobs",
]

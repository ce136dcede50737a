"""Each job's ACT statistics (the ``jobs`` op's ``done``, ``act_p50``, ``act_p99``), kept
across restarts (issue 34).

What is kept, and why it is bounded: per job, the ACT (submission to end) of each of its
last ``JOB_ACTS`` (1000) actions that started, a sliding window (the view's percentiles are
of the job's recent work, not of its whole life), and ``done``, how many such actions
ended since the stats began (this window's count is ``min(done, JOB_ACTS)``). At most
``MAX_JOBS`` (256) jobs are kept beyond the configured ones; past that, the job whose last
action ended longest ago is dropped. A window is kept whole, not as a histogram, so that
the percentiles a restarted daemon gives are exactly those it gave before (a float
written by ``json`` reads back the same): the file is at most ~20 bytes per ACT, under
20 KiB a job.

Saved: ``state_dir/job_stats.json``, written whole (atomically, ``records.write_json``) by
the executor when the core returns ``PersistJobStats``: at most every ``SAVE_EVERY_S`` after
an action ended, and at shutdown (and at once for the actions that end while the daemon
stops). A daemon killed hard loses at most the last ``SAVE_EVERY_S`` of its stats; a full
disk loses that write (logged), never the daemon. Loaded once at start (``JobStatsLoaded``);
a file that is not what :func:`parse_job_stats` expects is logged and the stats start
fresh.

The file: ``{"version": 1, "jobs": [{"name", "done", "acts": [float, ...]}, ...]}``, the
jobs from the least to the most recently active.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Container, Iterator, Mapping
from typing import Any

from tangram.jobs import NAME_RE

JOB_ACTS = 1000  # ACTs kept per job for the ``jobs`` op's percentiles
MAX_JOBS = 256  # jobs kept beyond the configured ones (least recently active dropped)
SAVE_EVERY_S = 5.0  # how long after a change the stats are written at the latest
VERSION = 1


class JobStats:
    """The ACT windows and counts of every job (see the module doc); pure."""

    __slots__ = ("acts", "dirty", "done", "due")

    def __init__(self) -> None:
        # job -> its recent ACTs; dict order: least recently active first
        self.acts: dict[str, deque[float]] = {}
        self.done: dict[str, int] = {}
        self.dirty = False  # changed since the last PersistJobStats
        self.due: float | None = None  # when the change is to be written at the latest

    def __contains__(self, job: object) -> bool:
        return job in self.acts

    def __iter__(self) -> Iterator[str]:
        return iter(self.acts)

    def get(self, job: str) -> tuple[float, ...]:
        return tuple(self.acts.get(job, ()))

    def count(self, job: str) -> int:
        return self.done.get(job, 0)

    def record(self, job: str, act: float, now: float, keep: Container[str] = ()) -> None:
        """An action of ``job`` ended ``act`` seconds after its submission."""
        acts = self.acts.pop(job, None)  # re-inserted last: the most recently active
        if acts is None:
            acts = deque(maxlen=JOB_ACTS)
        acts.append(act)
        self.acts[job] = acts
        self.done[job] = self.done.get(job, 0) + 1
        self._trim(keep)
        self.dirty = True
        if self.due is None:
            self.due = now + SAVE_EVERY_S

    def take(self) -> dict[str, Any]:
        """The file's content now; the stats count as saved from here on."""
        self.dirty = False
        self.due = None
        return self.snapshot()

    def snapshot(self) -> dict[str, Any]:
        """The file's content now (nothing changes)."""
        return {
            "version": VERSION,
            "jobs": [
                {"name": job, "done": self.done.get(job, len(acts)), "acts": list(acts)}
                for job, acts in self.acts.items()
            ],
        }

    def load(self, data: Mapping[str, Any], keep: Container[str] = ()) -> None:
        """Start from what an earlier run saved (``data`` as :func:`parse_job_stats`
        accepted it); what this run recorded already stays on top."""
        ours, counts = self.acts, self.done
        self.acts, self.done = {}, {}
        for row in data.get("jobs", ()):
            acts = deque((float(a) for a in row["acts"]), maxlen=JOB_ACTS)
            self.acts[row["name"]] = acts
            self.done[row["name"]] = max(int(row["done"]), len(acts))
        for job, mine in ours.items():
            old = self.acts.pop(job, None)
            merged: deque[float] = deque(old or (), maxlen=JOB_ACTS)
            merged.extend(mine)
            self.acts[job] = merged
            self.done[job] = self.done.get(job, 0) + counts.get(job, 0)
        self._trim(keep)

    def _trim(self, keep: Container[str]) -> None:
        extra = len(self.acts) - MAX_JOBS
        if extra <= 0:
            return
        for job in [j for j in self.acts if j not in keep][:extra]:
            del self.acts[job]
            self.done.pop(job, None)


def parse_job_stats(data: Any) -> bool:
    """Whether ``data`` (a decoded ``job_stats.json``) has the file's shape: version 1, and
    each job a valid name (at most once), a non-negative integer ``done`` and a list of at
    most ``JOB_ACTS`` finite, non-negative ACTs."""
    if not isinstance(data, dict) or data.get("version") != VERSION:
        return False
    jobs = data.get("jobs")
    if not isinstance(jobs, list):
        return False
    names: set[str] = set()
    for row in jobs:
        if not isinstance(row, dict):
            return False
        name, done, acts = row.get("name"), row.get("done"), row.get("acts")
        if not isinstance(name, str) or not NAME_RE.match(name) or name in names:
            return False
        names.add(name)
        if isinstance(done, bool) or not isinstance(done, int) or done < 0:
            return False
        if not isinstance(acts, list) or len(acts) > JOB_ACTS:
            return False
        for a in acts:
            if isinstance(a, bool) or not isinstance(a, int | float):
                return False
            if not math.isfinite(a) or a < 0:
                return False
    return True

"""Jobs (issue 34): their ACT statistics, loaded at start and written back
(:mod:`tangramd.state.jobstats`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tangramd import events as ev
from tangramd.state.dispatch import handles
from tangramd.state.jobstats import parse_job_stats

if TYPE_CHECKING:
    from tangramd.state.context import Core


@handles(ev.JobStatsLoaded)
def job_stats_loaded(core: Core, e: ev.JobStatsLoaded, now: float, out: list[ev.Command]) -> None:
    """What an earlier run saved (the executor checked its shape; an empty map: none)."""
    if e.stats and parse_job_stats(e.stats):
        core.job_stats.load(e.stats, core.cfg.jobs)


def save_job_stats(core: Core, now: float, out: list[ev.Command], *, force: bool = False) -> None:
    """Write the stats when they changed and their save is due (``force``: now)."""
    stats = core.job_stats
    if stats.dirty and (force or (stats.due is not None and stats.due <= now)):
        out.append(ev.PersistJobStats(stats=stats.take(), cause=core.stimulus))

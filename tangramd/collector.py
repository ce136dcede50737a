"""The daemon's policy for Python's cyclic garbage collector, in one place.

A scheduling pass over a long queue allocates hundreds of thousands of short-lived objects
(candidate lists, replay entries, price bands, placements). With the collector running,
they trigger collections in the middle of the pass, and the pass's survivors push it into
a *full* collection every few passes, which walks every tracked object of the daemon: the
whole queue. That was the tail of a pass at 10x (bench/sched.py ``--scale``: at 65,536
queued, p99 twice p50; docs/results.md, "At 10x").

The policy:

- :func:`freeze_startup`: once the daemon is ready, its start-up objects (modules, config,
  pools) move to the permanent generation: they never die, and no collection walks them.
- :func:`schedule_paused`: the pass runs with the collector paused (and on again after, if
  it was on). A pass's temporaries die by reference counting when it returns (the core
  builds no cycles), so the collector never has to look at them: no work is deferred,
  none is skipped that would free memory. Collections still run between passes, as
  Python paces them (a full one once the objects that survived since the last grow by a
  quarter of those it walks), so a cycle elsewhere in the daemon is still freed.

``bench/sched.py`` times a pass through :func:`schedule_paused` (``--gc daemon``, its
default), so its numbers are the daemon's.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

from tangram.sched import Decision, SchedConfig, Snapshot, schedule


def freeze_startup() -> None:
    """Collect once, then keep everything alive now out of every later collection."""
    gc.collect()
    gc.freeze()


@contextmanager
def paused() -> Iterator[None]:
    """The cyclic collector off inside the block, back to its previous state after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def schedule_paused(snapshot: Snapshot, now: float, config: SchedConfig | None) -> Decision:
    """One scheduling pass as the daemon runs it: ``schedule`` with the collector paused."""
    with paused():
        return schedule(snapshot, now, config)

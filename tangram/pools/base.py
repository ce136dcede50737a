"""The scheduler's pool protocol, re-exported: it is defined (and owned) by ``tangram.sched``."""

from tangram.sched.pool import SchedPool

__all__ = ["SchedPool"]

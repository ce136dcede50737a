"""A full disk under the state dir: a typed answer, a back-off, one log line per interval.

What a daemon must write before it acknowledges a change (an environment's record, the
coordinator's SQLite rows, profiles) fails with ``ENOSPC``/``EDQUOT`` (SQLite: "database or
disk is full") when the filesystem holding its state dir is full. :class:`DiskWatch` turns
such a failure into :class:`~tangram.protocol.errors.DiskFull` naming the filesystem
(its mount point and device) and the path, and from then on refuses the requests that
would write, at once and without touching the disk, until a probe (``statvfs``, at most
every ``probe_s``, the interval doubling while the disk stays full, up to
``PROBE_MAX_S``) finds space again. It logs ``disk_full`` once per ``LOG_EVERY_S`` with the
count of what it refused meanwhile (not a line per attempt), and ``disk_space_back`` once
when space returns.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from tangram.protocol.errors import DiskFull

log = structlog.get_logger("tangramd")

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
MIN_FREE_BYTES = 1 << 20  # space back: at least this much free for the daemon's user
PROBE_MIN_S = 0.5
PROBE_MAX_S = 30.0
LOG_EVERY_S = 60.0


def is_disk_full(exc: BaseException) -> bool:
    """True for a write that failed because the filesystem (or the user's quota) is full."""
    if isinstance(exc, DiskFull):
        return True
    if isinstance(exc, OSError):
        return exc.errno in FULL_ERRNOS
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        return code == sqlite3.SQLITE_FULL or "database or disk is full" in str(exc)
    return False


def filesystem_of(path: str | os.PathLike[str]) -> tuple[str, str]:
    """(mount point, device) of the filesystem holding ``path`` (best effort)."""
    here = Path(os.path.abspath(path))
    while not here.exists() and here != here.parent:
        here = here.parent
    mount = here
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    device = "?"
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) >= 3 and fields[1] == str(mount):
                    device = f"device {fields[0]}, {fields[2]}"  # the last mount there wins
    except OSError:
        pass
    return str(mount), device


class DiskWatch:
    """The state of the disk under one state dir (see the module doc)."""

    def __init__(self, path: str | os.PathLike[str], clock: Callable[[], float] = time.monotonic):
        self.path = str(path)
        self.clock = clock
        self.full = False
        self.refused = 0  # requests refused since the last log line
        self._error: DiskFull | None = None
        self._since = 0.0
        self._probe_at = 0.0
        self._probe_s = PROBE_MIN_S
        self._logged_at: float | None = None
        self._recovered_at: float | None = None
        self._where = ""  # the disk and path of the last failure, and what it was
        self._what = ""

    def failed(self, what: str, exc: BaseException, path: str | None = None) -> DiskFull:
        """A write of ``what`` (at ``path``, default the state dir) failed for want of
        space: the error to answer with; the disk counts as full until a probe finds
        space (a failure right after a probe said so doubles the probe interval)."""
        now = self.clock()
        again = self._recovered_at is not None and now - self._recovered_at < PROBE_MAX_S
        if self.full or again:  # (space seemed back, and was not: probe less often)
            self._probe_s = min(self._probe_s * 2, PROBE_MAX_S)
        else:
            self._probe_s = PROBE_MIN_S
        if not self.full:
            self._since = now
        self.full = True
        self._probe_at = now + self._probe_s
        self._error = self._describe(what, path or self.path, exc)
        self._log(now, str(exc))
        return self._error

    def refusal(self) -> DiskFull | None:
        """The error for a request that would write while the disk is full (None: go
        ahead; the write itself may still fail, see :meth:`failed`)."""
        if not self.full:
            return None
        now = self.clock()
        if now >= self._probe_at:
            if self._free() >= MIN_FREE_BYTES:
                self.full = False
                log.info(
                    "disk_space_back",
                    path=self.path,
                    full_s=round(now - self._since, 3),
                    refused=self.refused,
                    free_bytes=self._free(),
                )
                self.refused, self._logged_at, self._recovered_at = 0, None, now
                return None
            self._probe_s = min(self._probe_s * 2, PROBE_MAX_S)
            self._probe_at = now + self._probe_s
        self.refused += 1
        self._log(now, None)
        assert self._error is not None
        return DiskFull(
            f"{self._where}: nothing is written there until space is freed (next try in"
            f" {max(0.0, self._probe_at - now):.1f} s; the last write that failed: {self._what})"
        )

    def _free(self) -> int:
        try:
            st = os.statvfs(self.path)
        except OSError:
            return 0
        return st.f_bavail * st.f_frsize

    def _describe(self, what: str, path: str, exc: BaseException) -> DiskFull:
        mount, device = filesystem_of(path)
        self._where = (
            f"no space left on the disk holding {path} (filesystem {mount}, {device};"
            f" {self._free()} bytes free)"
        )
        self._what = f"{what} ({exc})"
        return DiskFull(f"{self._where}: {self._what} could not be written; free space there")

    def _log(self, now: float, error: str | None) -> None:
        if self._logged_at is not None and now - self._logged_at < LOG_EVERY_S:
            return
        self._logged_at = now
        assert self._error is not None
        log.warning(
            "disk_full",
            path=self.path,
            detail=self._error.message,
            refused=self.refused,
            retry_in_s=round(max(0.0, self._probe_at - now), 3),
            error=error,
        )
        self.refused = 0

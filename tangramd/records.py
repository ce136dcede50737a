"""Records that must outlive the daemon process, kept as a snapshot plus a journal.

``<name>.json`` holds a JSON list of records (dicts with a string ``"id"``);
``<name>.journal`` holds the changes since, one JSON line each: ``{"id": …, "record": {…}}``,
or ``"record": null`` when the record is gone. A change appends one line, so it costs the
same however many records there are (rewriting the whole list on every change is
quadratic in them). The
snapshot is rewritten and the journal emptied once the journal holds more than twice as
many lines as there are records (and at least ``min_lines``), or when the caller replaces
every record. Replay is idempotent (the last line for an id wins), so a crash between
the two steps of a compaction loses nothing; a line torn by a crash mid-append, or one
that is not a valid record, is skipped and counted in a warning.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

JOURNAL_MIN_LINES = 1024


def read_json(path: Path, problem: str, valid: Callable[[Any], bool], expected: str) -> Any | None:
    """What the state dir's JSON file holds, or None when it is missing; an unreadable or
    ill-shaped file is logged as ``problem`` and treated as missing (never a crash)."""
    try:
        loaded = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning(problem, path=str(path), error=str(exc))
        return None
    if not valid(loaded):
        log.warning(problem, path=str(path), error=expected)
        return None
    return loaded


def write_json(path: Path, data: Any, indent: int | None = None) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves either the old file or the new
    one, never half: a private (0600) temporary file beside it, synced, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(data, indent=indent, sort_keys=True))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class RecordJournal:
    """The records of one kind in a state dir (see the module doc); not thread-safe."""

    def __init__(
        self,
        snapshot: Path,
        *,
        valid: Callable[[Any], bool],
        problem: str,
        min_lines: int = JOURNAL_MIN_LINES,
    ) -> None:
        self.snapshot = snapshot
        self.journal = snapshot.with_suffix(".journal")
        self.valid = valid  # a record's shape (beyond a string "id")
        self.problem = problem  # the warning's event name
        self.min_lines = min_lines
        self.records: dict[str, dict[str, Any]] = {}
        self._fd: int | None = None
        self._lines = 0
        # a change failed to reach the disk (full): the records held are ahead of it, and
        # the next change rewrites the snapshot from them instead of appending
        self.behind = False

    @property
    def where(self) -> str:
        """The file changes are appended to (named when its disk is full)."""
        return str(self.journal)

    def _ok(self, record: Any) -> bool:
        return isinstance(record, dict) and isinstance(record.get("id"), str) and self.valid(record)

    def load(self) -> dict[str, dict[str, Any]]:
        """Read the snapshot and replay the journal over it; unreadable parts are logged as
        ``problem`` and skipped (never a crash)."""
        rows = read_json(
            self.snapshot,
            self.problem,
            lambda data: isinstance(data, list) and all(self._ok(r) for r in data),
            "not a list of records",
        )
        records: dict[str, dict[str, Any]] = {row["id"]: row for row in rows or []}
        bad = lines = 0
        with contextlib.suppress(FileNotFoundError), open(self.journal, "rb") as f:
            for line in f:
                lines += 1
                try:
                    change = json.loads(line)
                    key, record = change["id"], change["record"]
                except (ValueError, TypeError, KeyError):
                    bad += 1
                    continue
                if record is None and isinstance(key, str):
                    records.pop(key, None)
                elif self._ok(record) and record["id"] == key:
                    records[key] = record
                else:
                    bad += 1
        if bad:
            log.warning(self.problem, path=str(self.journal), error=f"{bad} line(s) skipped")
        self.records, self._lines = records, lines
        return dict(records)

    def put(self, key: str, record: Mapping[str, Any] | None) -> None:
        """Record one change (None: the record is gone); compact when the journal has grown.
        Raises OSError when the state dir cannot be written (a full disk: ENOSPC); the
        journal is then as it was (a line written in part is cut off again), the change is
        held, and the next change that reaches the disk rewrites the snapshot with it."""
        copy = None if record is None else dict(record)
        if copy is None:
            self.records.pop(key, None)
        else:
            self.records[key] = copy
        if self.behind:
            self.compact()
            return
        line = json.dumps({"id": key, "record": copy}, sort_keys=True).encode() + b"\n"
        self._append(line)
        self._lines += 1
        if self._lines > max(self.min_lines, 2 * len(self.records)):
            self.compact()

    def _append(self, line: bytes) -> None:
        if self._fd is None:
            self.journal.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        size = os.fstat(self._fd).st_size
        try:
            written = os.write(self._fd, line)
            if written != len(line):  # a short write: the disk filled up under it
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            self.behind = True
            with contextlib.suppress(OSError):  # no torn line for the next one to join
                os.ftruncate(self._fd, size)
            raise

    def replace(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Every record at once (the snapshot rewritten, the journal emptied)."""
        self.records = {str(r["id"]): dict(r) for r in records}
        self.compact()

    def compact(self) -> None:
        """Rewrite the snapshot atomically from the records held, then empty the journal
        (OSError, a full disk: nothing changed on disk, and the records stay ahead)."""
        try:
            write_json(self.snapshot, list(self.records.values()))
        except OSError:
            self.behind = True
            raise
        self.behind = False
        self.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.journal)
        self._lines = 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

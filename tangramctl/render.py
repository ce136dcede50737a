"""Rendering for people: aligned tables and key/value blocks (``--json`` bypasses this).

The daemon's result maps may grow fields; these helpers show whatever they get, with the
preferred columns first, so the CLI does not break when the daemon adds something.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

MAX_CELL = 60  # characters; longer cells are cut with an ellipsis


def fmt(value: Any, key: str = "", limit: int | None = MAX_CELL) -> str:
    """One cell: numbers rounded for reading, byte counts (keys naming ``mem``/``bytes``) as
    binary sizes, lists joined (core lists as ranges), maps compact, None as '-'; text cut
    at ``limit`` characters (None: never)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) and _is_size_key(key):
        return size(value)
    if isinstance(value, float) and value.is_integer() and _is_count_key(key):
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e-3 or abs(value) >= 1e6 else f"{value:.3f}"
    if isinstance(value, list | tuple):
        if not value:
            return "-"
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return _int_ranges(list(value))
        sep = " | " if any(isinstance(v, list | tuple) for v in value) else ","
        return sep.join(fmt(v) for v in value)
    if isinstance(value, Mapping):
        return " ".join(f"{k}={fmt(v)}" for k, v in value.items())
    text = str(value).replace("\n", "⏎")
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"


def _is_size_key(key: str) -> bool:
    key = key.lower()
    return "mem" in key or key.endswith("bytes")


def _is_count_key(key: str) -> bool:
    key = key.lower()
    return key in ("n", "count", "actions", "runs") or key.endswith(("count", "_n"))


_MEM_CLAUSE = re.compile(r"\bmem\b[^;()]*")
_BIG_INT = re.compile(r"\b\d{4,}\b")


def humanize_sizes(message: str) -> str:
    """Byte counts in a ``mem: needs N, free N`` clause as GiB/MiB for people."""
    return _MEM_CLAUSE.sub(
        lambda m: _BIG_INT.sub(lambda n: size(int(n.group())), m.group()), message
    )


def size(n: int) -> str:
    """Bytes in binary units for reading: ``1536`` → ``1.5KiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{n}B" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{n}B"  # unreachable


def _int_ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` → ``0-2,5`` (core lists read better this way); unsorted kept as is."""
    if values != sorted(values) or len(set(values)) != len(values) or len(values) < 3:
        return ",".join(str(v) for v in values)
    parts: list[str] = []
    start = prev = values[0]
    for v in [*values[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(parts)


def columns_of(rows: Sequence[Mapping[str, Any]], preferred: Sequence[str] = ()) -> list[str]:
    """``preferred`` columns that occur, then every other key in first-seen order."""
    seen: dict[str, None] = {}
    for row in rows:
        for key in row:
            seen.setdefault(key, None)
    return [c for c in preferred if c in seen] + [c for c in seen if c not in preferred]


def table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str] | None = None,
    *,
    preferred: Sequence[str] = (),
    headers: Mapping[str, str] | None = None,
    empty: str = "(none)",
    uncut: Sequence[str] = (),
) -> str:
    """An aligned text table; numeric columns right-aligned. ``empty`` if there are no rows.
    Cells are cut at ``MAX_CELL`` characters, except in the ``uncut`` columns."""
    if not rows:
        return empty
    cols = list(columns) if columns is not None else columns_of(rows, preferred)
    titles = [(headers or {}).get(c, c.upper()) for c in cols]
    limits = [None if c in uncut else MAX_CELL for c in cols]
    cells = [[fmt(row.get(c), c, n) for c, n in zip(cols, limits, strict=True)] for row in rows]
    numeric = [
        all(_is_number(row.get(c)) or row.get(c) is None for row in rows)
        and any(_is_number(row.get(c)) for row in rows)
        for c in cols
    ]
    widths = [max(len(t), *(len(r[i]) for r in cells)) for i, t in enumerate(titles)]

    def line(values: Iterable[str]) -> str:
        parts = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(titles), *(line(r) for r in cells)])


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def kv(mapping: Mapping[str, Any], *, indent: int = 0) -> str:
    """``key: value`` lines, keys aligned; nested maps indented below their key."""
    if not mapping:
        return " " * indent + "(empty)"
    width = max(len(str(k)) for k in mapping)
    lines: list[str] = []
    pad = " " * indent
    for key, value in mapping.items():
        if isinstance(value, Mapping) and value:
            lines.append(f"{pad}{key}:")
            lines.append(kv(value, indent=indent + 2))
        elif isinstance(value, Mapping):  # nothing to show: say so, never a bare "key:"
            lines.append(f"{pad}{str(key) + ':':<{width + 1}} (none yet)")
        else:
            lines.append(f"{pad}{str(key) + ':':<{width + 1}} {fmt(value, str(key))}")
    return "\n".join(lines)


NODE_COLUMNS = (
    "name",
    "state",
    "cores",
    "free_cores",
    "busy_cores",
    "mem",
    "mem_reserved",
    "gpus",
    "envs",
    "running",
    "heartbeat_age_s",
)


def node_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``nodes`` rows for people: memory once, in binary units (``mem``, not ``mem_bytes``
    and ``mem_gb`` both); the busy cores by id, ``none`` when every core is free (a bare
    ``-`` read as "unknown"); ``id`` only where it differs from the name."""
    out: list[dict[str, Any]] = []
    for row in rows:
        shown = {k: v for k, v in row.items() if k not in ("mem_bytes", "mem_gb", "id")}
        if row.get("id") not in (None, row.get("name")):
            shown["id"] = row["id"]
        if "mem_bytes" in row:
            shown["mem"] = row["mem_bytes"]
        elif isinstance(row.get("mem_gb"), int | float):
            shown["mem"] = int(row["mem_gb"] * (1 << 30))
        busy = row.get("busy_cores")
        if isinstance(busy, list):
            shown["busy_cores"] = _int_ranges(sorted(busy)) if busy else "none"
        out.append(shown)
    return out


def to_json(obj: Any) -> str:
    """The ``--json`` form: one JSON document, indented, non-JSON values as strings."""
    return json.dumps(obj, indent=2, default=_jsonable)


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)


__all__ = [
    "NODE_COLUMNS",
    "columns_of",
    "fmt",
    "humanize_sizes",
    "kv",
    "node_rows",
    "size",
    "table",
    "to_json",
]

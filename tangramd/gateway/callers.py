"""Who an HTTP request comes from: its API key, and the daemon client it is served through.

The gateway's :class:`~tangramd.gateway.app.Gate` finds the request's key and sets
:data:`CALLER` for the rest of the request; the routes send their ops through
``CALLER``'s client (one per user: under ``tangramd up --http`` each key of ``[http] keys``
may be its own user, so its commands run as that uid) and record the environments a caller
opens under its label, so that another key's requests for them are answered ``not_found``
(issue 30, item 4). The label names the key (``key``, ``key1``, ...), never holds it.

``[http] keys`` is a file of lines ``KEY [USER]`` (``#`` starts a comment): each key the
gateway accepts, and the user (name or uid) whose commands its requests run as (default:
the gateway's callers' user, as with ``--api-key-file``). Pure Python: ``tangramd.main``
reads the file without the http extra.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Caller:
    """One key's identity: ``label`` for ownership records, ``client`` for its ops."""

    label: str
    client: Any  # an AsyncClient (InProcessClient under tangramd up --http)


PEER_STATE = "tangram_peer"  # scope["state"] key: (uid, gid) of a Unix socket's peer
CALLER: ContextVar[Caller | None] = ContextVar("tangram_gateway_caller", default=None)


def caller_label() -> str:
    """The label of the request's key ("" without keys: every caller is the same one)."""
    caller = CALLER.get()
    return "" if caller is None else caller.label


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """A line of ``[http] keys``: the key and the user its requests run as (None: the
    gateway's default)."""

    key: str
    user: str | None


def read_keys(path: str) -> list[KeyEntry]:
    """The entries of a ``[http] keys`` file; ValueError naming the line if one is bad
    (OSError if it cannot be read)."""
    entries: list[KeyEntry] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8") as fh:
        for number, raw in enumerate(fh, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            if len(fields) > 2:
                raise ValueError(f"{path}:{number}: want KEY [USER], got {len(fields)} fields")
            if fields[0] in seen:
                raise ValueError(f"{path}:{number}: a key given twice")
            seen.add(fields[0])
            entries.append(KeyEntry(fields[0], fields[1] if len(fields) == 2 else None))
    if not entries:
        raise ValueError(f"{path}: no keys")
    return entries

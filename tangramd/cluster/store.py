"""The coordinator's registry on disk: SQLite in ``<state_dir>/coordinator.db`` (0600).

What a restarted coordinator needs to carry on: the join token, each node's credential
digest and last known capacity, and every persistent environment with the node that holds
it. Each change is committed before the coordinator acknowledges it (the client's
``env.open`` answer, the node's welcome with a new credential). Profiles stay in
``profiles.json``, written the same way by the executor; API endpoints come from the
config file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sqlite3
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
    name TEXT PRIMARY KEY,
    credential_sha256 TEXT,
    cores_by_numa TEXT NOT NULL DEFAULT '[]',
    mem_bytes INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS envs (
    id TEXT PRIMARY KEY,
    trajectory TEXT NOT NULL,
    node TEXT NOT NULL,
    image TEXT,
    mem INTEGER NOT NULL,
    lost_node TEXT NOT NULL DEFAULT ''
);
"""


@dataclass(frozen=True, slots=True)
class StoredNode:
    name: str
    credential_sha256: str | None
    cores_by_numa: tuple[tuple[int, ...], ...]
    mem_bytes: int


@dataclass(frozen=True, slots=True)
class StoredEnv:
    id: str
    trajectory: str
    node: str
    image: str | None
    mem: int
    lost_node: str = ""


class Store:
    """Synchronous SQLite access; every method commits before it returns."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.path = Path(state_dir) / "coordinator.db"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.close(fd)
        self.db = sqlite3.connect(self.path, isolation_level=None)  # explicit transactions
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """The statements inside commit together or not at all (a full disk, "database or
        disk is full", rolls them back and raises)."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self.db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                self.db.execute("ROLLBACK")
            raise

    # ------------------------------------------------------------------ meta
    def get_meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    # ------------------------------------------------------------------ nodes
    def nodes(self) -> list[StoredNode]:
        rows = self.db.execute(
            "SELECT name, credential_sha256, cores_by_numa, mem_bytes FROM nodes ORDER BY name"
        ).fetchall()
        return [
            StoredNode(name, cred, tuple(tuple(int(c) for c in g) for g in json.loads(numa)), mem)
            for name, cred, numa, mem in rows
        ]

    def set_credential(self, name: str, digest: str | None) -> None:
        self.db.execute(
            "INSERT INTO nodes (name, credential_sha256) VALUES (?, ?) "
            "ON CONFLICT(name) DO UPDATE SET credential_sha256 = excluded.credential_sha256",
            (name, digest),
        )

    def set_capacity(self, name: str, cores: tuple[tuple[int, ...], ...], mem: int) -> None:
        self.db.execute(
            "INSERT INTO nodes (name, cores_by_numa, mem_bytes) VALUES (?, ?, ?) "
            "ON CONFLICT(name) DO UPDATE SET cores_by_numa = excluded.cores_by_numa, "
            "mem_bytes = excluded.mem_bytes",
            (name, json.dumps([list(g) for g in cores]), mem),
        )

    # ------------------------------------------------------------------ environments
    def envs(self) -> list[StoredEnv]:
        rows = self.db.execute(
            "SELECT id, trajectory, node, image, mem, lost_node FROM envs ORDER BY id"
        ).fetchall()
        return [StoredEnv(*row) for row in rows]

    def put_env(self, env: StoredEnv) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO envs (id, trajectory, node, image, mem, lost_node) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (env.id, env.trajectory, env.node, env.image, env.mem, env.lost_node),
        )

    def drop_envs(self, ids: Iterable[str]) -> None:
        self.db.executemany("DELETE FROM envs WHERE id = ?", [(i,) for i in ids])


class StoreEnvRecords:
    """The coordinator's end of the core's ``RecordEnv`` / ``PersistEnvs`` commands: the
    environments' rows of its SQLite store (what ``tangramd.executor.EnvRecords`` asks)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        # changes a full disk refused, newest per id: written with the next change
        self._behind: dict[str, Mapping[str, Any] | None] = {}

    @property
    def where(self) -> str:
        return str(self.store.path)

    def load(self) -> dict[str, dict[str, Any]]:
        return {e.id: dataclasses.asdict(e) for e in self.store.envs()}

    def put(self, key: str, record: Mapping[str, Any] | None) -> None:
        """One change, in one transaction with those a full disk refused before; when it
        fails (SQLite's "database or disk is full") none is written and all are kept."""
        self._behind.pop(key, None)
        self._behind[key] = record
        with self.store.transaction():
            for k, r in self._behind.items():
                self._write(k, r)
        self._behind.clear()

    def _write(self, key: str, record: Mapping[str, Any] | None) -> None:
        if record is None:
            self.store.drop_envs([key])
            return
        self.store.put_env(
            StoredEnv(
                id=str(record["id"]),
                trajectory=str(record["trajectory"]),
                node=str(record["node"]),
                image=record.get("image"),
                mem=int(record["mem"]),
                lost_node=str(record.get("lost_node") or ""),
            )
        )

    def replace(self, records: Iterable[Mapping[str, Any]]) -> None:
        rows = list(records)
        with self.store.transaction():
            self.store.drop_envs([e.id for e in self.store.envs()])
            for record in rows:
                self._write(str(record["id"]), record)
        self._behind.clear()

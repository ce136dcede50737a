"""A full disk under the state dir (issue 31, item 11), on a real small tmpfs the test
mounts, fills and frees: `tangramd up`'s env.open is answered `disk_full` naming the
filesystem and the path (it was never answered), refused at once while the disk stays
full, logged once per interval, and works again when space returns; a coordinator whose
SQLite store hits "database or disk is full" answers its node's clients the same way and
keeps the link up (the node reconnected every ~80 ms), and its database passes
`PRAGMA integrity_check` after."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_harness import node_row, spawn_coordinator, spawn_node, stop_all, wait_node_state

from tangram.client import Client
from tangram.protocol.errors import DiskFull
from tangram.testing import spawn_daemon, wait_for
from tangramd.records import RecordJournal

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: needs root")


@contextlib.contextmanager
def small_disk(path: Path, size: str = "4m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (0700, as a state dir must be)."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size},mode=0700"
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(disk: Path) -> Path:
    """Write a file on ``disk`` until it is full; the file (delete it to free the space)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (64 << 10, 512):  # then the last blocks, a little at a time
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * size) == size:
                    pass
    finally:
        os.close(fd)
    assert os.statvfs(disk).f_bavail == 0
    return filler


def log_lines(text: str, event: str) -> int:
    return text.count(f'"event": "{event}"')


def _opens_once_space_is_back(c: Client) -> str:
    """env.open answers disk_full until the daemon's probe sees space again; then the
    environment it opens (its id returned) runs a command."""

    def opened() -> str | None:
        try:
            return c.env_open(trajectory="t")
        except DiskFull:
            return None

    env = wait_for(opened, 40, "env.open once space is back")
    assert c.exec("echo ok", env=env).stdout == "ok\n"
    return str(env)


def test_up_answers_disk_full_backs_off_and_recovers(tmp_path):
    """env.open on a full state dir: `disk_full` naming the tmpfs and the journal, at once
    each time (nothing half-made stays), one `disk_full` log line for them all; once the
    filler is deleted env.open works, and a restart re-adopts exactly that environment."""
    work = tmp_path / "up"
    with small_disk(work / "state") as disk:
        daemon = spawn_daemon(work, "")
        try:
            filler = fill(disk)
            with Client(daemon.socket, timeout_s=20) as c:
                with pytest.raises(DiskFull, match=f"holding {disk}/envs.journal") as first:
                    c.env_open(trajectory="t")
                assert f"filesystem {disk}, device tmpfs" in str(first.value)
                started = time.monotonic()
                for _ in range(20):
                    with pytest.raises(DiskFull, match="nothing is written there until"):
                        c.env_open(trajectory="t")
                assert time.monotonic() - started < 5  # refused at once, not tried
                closed = lambda: c.request("env.list", {})["envs"] == []  # noqa: E731
                wait_for(closed, 20, "the first closed again")
                os.unlink(filler)
                env = _opens_once_space_is_back(c)
            log = daemon.log()
            assert log_lines(log, "disk_full") == 1, log
            assert log_lines(log, "disk_space_back") == 1, log
            assert daemon.stop() == 0, daemon.log()
            journal = RecordJournal(disk / "envs.json", valid=lambda r: True, problem="bad")
            assert list(journal.load()) == [env]  # the failed one is not there, nor torn
            again = spawn_daemon(work, "")
            try:
                with Client(again.socket) as c:
                    assert [r["id"] for r in c.request("env.list", {})["envs"]] == [env]
            finally:
                again.stop()
        finally:
            if daemon.proc.poll() is None:
                daemon.stop()


def test_coordinator_store_full_answers_the_nodes_clients_and_keeps_the_link(tmp_path):
    """The coordinator's SQLite store on a full tmpfs: env.open through the node's socket is
    answered `disk_full` naming coordinator.db (the link stays up: no reconnect, the node
    stays ready); a node that restarts meanwhile rejoins, a new node's token join is
    refused for now and backs off, all with one `disk_full` line; after the filler is
    deleted the new node joins, env.open and exec work, and the database is intact."""
    state = tmp_path / "c" / "coordinator-state"
    with small_disk(state) as disk:
        coord = spawn_coordinator(tmp_path / "c", "[cluster]\nheartbeat_s = 0.2\n")
        daemons = [coord]
        try:
            node = spawn_node(tmp_path, coord, "n1", cpus="0")
            daemons.append(node)
            filler = fill(disk)
            with Client(node.socket, timeout_s=20) as c:
                with pytest.raises(DiskFull, match=f"holding {disk}/coordinator.db"):
                    c.env_open(trajectory="t")
                for _ in range(10):
                    with pytest.raises(DiskFull, match="nothing is written there until"):
                        c.env_open(trajectory="t")
                closed = lambda: c.request("env.list", {})["envs"] == []  # noqa: E731
                wait_for(closed, 20, "the first closed again on its node")
            assert node_row(coord, "n1")["state"] == "ready"
            assert "coordinator_link_down" not in node.log(), node.log()
            node.stop()  # a credential rejoin needs no write: it comes back
            wait_node_state(coord, "n1", "lost", 20)
            node = spawn_node(tmp_path, coord, "n1", cpus="0")
            daemons.append(node)
            newcomer = spawn_node(tmp_path, coord, "n2", cpus="1", wait_ready=False)
            daemons.append(newcomer)
            wait_for(lambda: "no space left" in newcomer.log(), 20, "n2 refused for now")
            assert "node_refused" not in coord.log()
            os.unlink(filler)
            wait_node_state(coord, "n2", "ready", 40)
            with Client(node.socket, timeout_s=20) as c:
                env = _opens_once_space_is_back(c)
            log = coord.log()
            assert log_lines(log, "disk_full") == 1, log
            assert log_lines(log, "disk_space_back") >= 1, log
            assert log.count('"event": "node_joined"') == 3, log  # n1, n1 again, n2
        finally:
            stop_all([d for d in reversed(daemons) if d.proc.poll() is None])
        db = sqlite3.connect(disk / "coordinator.db")
        try:
            assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
            assert [row[0] for row in db.execute("SELECT id FROM envs")] == [env]
        finally:
            db.close()


def _profile(t1_s: float) -> dict[str, Any]:
    return {
        "dop": {1: t1_s, 2: t1_s / 1.8},
        "t1_s": t1_s,
        "eff": {1: 1.0, 2: 0.9},
        "speedup": {1: 1.0, 2: 1.8},
        "elastic": True,
    }


def test_a_profile_the_disk_could_not_keep_is_not_kept_in_memory(tmp_path):
    """profile.save on a full state dir answers `disk_full`, and the daemon goes on with
    the profiles as the file has them (as a restart would): a changed profile keeps its
    old numbers, a new one is not there."""
    work = tmp_path / "up"
    with small_disk(work / "state") as disk:
        daemon = spawn_daemon(work, "")
        try:
            with Client(daemon.socket, timeout_s=20) as c:
                c.profile_save("old", **_profile(10.0))
                filler = fill(disk)
                with pytest.raises(DiskFull, match="profiles"):
                    c.profile_save("old", **_profile(99.0))
                with pytest.raises(DiskFull):
                    c.profile_save("new", **_profile(5.0))
                assert [p["name"] for p in c.profile_list()] == ["old"]
                assert c.profile_get("old")["t1_s"] == 10.0
                os.unlink(filler)
            assert daemon.stop() == 0, daemon.log()
            again = spawn_daemon(work, "")
            try:
                with Client(again.socket) as c:
                    assert c.profile_get("old")["t1_s"] == 10.0
            finally:
                again.stop()
        finally:
            if daemon.proc.poll() is None:
                daemon.stop()

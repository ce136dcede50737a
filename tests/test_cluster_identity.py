"""Who a client of a node's socket is, across the link (issue 31, item 1): the node carries
the uid/gid its socket saw to the coordinator, which runs the client's commands as that
user (``cpu.exec_user = "peer"``) exactly as ``tangramd up`` does, and the node's
``daemon.allowed_uids`` is enforced at its socket."""

from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
import time

import pytest
from cluster_harness import (
    node_row,
    spawn_coordinator,
    spawn_node,
    stop_all,
    wait_for,
    wait_node_state,
)
from hostile_user import in_child_as, local_user

from tangram.client import Client
from tangram.model import TangramError
from tangram.protocol.codec import FrameDecoder
from tangram.protocol.errors import EnvLost, InfraError


def _whoami_as(path: str, uid: int, gid: int) -> dict:
    """Open an environment through the node's socket as uid/gid and run ``id -u`` and a read
    of /etc/shadow there; what each printed and its exit code."""

    def work() -> bytes:
        try:
            return attempt()
        except Exception as exc:  # reported to the test, which shows it
            return json.dumps({"error": repr(exc)}).encode()

    def attempt() -> bytes:
        with Client(path) as c:
            env = c.env_open(trajectory="identity")
            try:
                me = c.exec("id -u; id -g", env=env)
                shadow = c.exec("cat /etc/shadow", env=env)
            finally:
                c.env_close(env)
        return json.dumps(
            {
                "ids": me.stdout.split(),
                "shadow_exit": shadow.exit_code,
                "shadow_out": shadow.stdout,
            }
        ).encode()

    return json.loads(in_child_as(uid, gid, work))


def test_a_node_client_runs_as_itself_not_as_the_node_daemon():
    """A non-root client of a node's socket gets its own uid from `id -u` and cannot read
    /etc/shadow (before, the coordinator saw no uid and the command ran as root)."""
    with local_user() as user, tempfile.TemporaryDirectory(prefix="tgi-", dir="/tmp") as tmp:
        os.chmod(tmp, 0o755)
        coord = spawn_coordinator(f"{tmp}/c")
        node = None
        try:
            # no user namespace: `id -u` is the host uid (an isolated environment's commands
            # are root inside one mapped to the owner's uid, whom the coordinator now knows)
            config = f'[daemon]\nallowed_uids = [{user.uid}]\n[cpu]\nisolation = "none"\n'
            node = spawn_node(tmp, coord, "n1", config=config)
            os.chmod(f"{tmp}/n1", 0o755)
            os.chown(node.socket, 0, user.gid)  # the operator's chgrp: the socket opens
            seen = _whoami_as(node.socket, user.uid, user.gid)
            assert seen.get("ids") == [str(user.uid), str(user.gid)], seen
            assert seen["shadow_exit"] != 0 and not seen["shadow_out"], seen
        finally:
            stop_all([d for d in (node, coord) if d is not None])


def test_a_node_refuses_a_client_outside_its_allowlist():
    """The node applies `daemon.allowed_uids` at its socket, as `tangramd up` does."""
    with local_user() as user, tempfile.TemporaryDirectory(prefix="tgi-", dir="/tmp") as tmp:
        os.chmod(tmp, 0o755)
        coord = spawn_coordinator(f"{tmp}/c")
        node = None
        try:
            config = f"[daemon]\nallowed_uids = [{user.uid + 1}]\n"
            node = spawn_node(tmp, coord, "n1", config=config)
            os.chmod(f"{tmp}/n1", 0o755)
            os.chown(node.socket, 0, user.gid)

            def refusal() -> bytes:
                """What the node's socket says to this peer before any request."""
                dec = FrameDecoder()
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(10.0)
                    s.connect(node.socket)
                    while (msg := dec.next_message()) is None and (data := s.recv(65536)):
                        dec.feed(data)
                return repr(msg).encode()

            answer = in_child_as(user.uid, user.gid, refusal).decode()
            assert f"uid {user.uid} is not allowed" in answer, answer
        finally:
            stop_all([d for d in (node, coord) if d is not None])


def _errors_as(path: str, uid: int, gid: int, requests: list[tuple[str, dict]]) -> list[str]:
    """Send each request as uid/gid; ``code`` of each error, "ok" for an answer."""

    def ask() -> bytes:
        codes = []
        with Client(path) as c:
            for op, args in requests:
                try:
                    c.request(op, args)
                    codes.append("ok")
                except TangramError as exc:
                    codes.append(exc.code)
        return json.dumps(codes).encode()

    return json.loads(in_child_as(uid, gid, ask))


OPERATOR_OPS = [
    ("node.drain", {"name": "n1"}),
    ("node.undrain", {"name": "n1"}),
    ("profile.save", {"name": "p", "dop": {"1": 1.0}, "t1_s": 1.0, "eff": {"1": 1.0},
                      "speedup": {"1": 1.0}, "elastic": False}),
]  # fmt: skip


def test_operator_ops_are_refused_to_other_users_through_a_node():
    """Drain, undrain and profile.save from an allowed non-operator through a node's socket
    get `forbidden` and change nothing; a uid in daemon.operator_uids may run them."""
    with (
        local_user() as user,
        local_user() as operator,
        tempfile.TemporaryDirectory(prefix="tgi-", dir="/tmp") as tmp,
    ):
        os.chmod(tmp, 0o755)
        coord = spawn_coordinator(f"{tmp}/c", f"[daemon]\noperator_uids = [{operator.uid}]\n")
        node = None
        try:
            uids = [user.uid, operator.uid]
            node = spawn_node(tmp, coord, "n1", config=f"[daemon]\nallowed_uids = {uids}\n")
            os.chmod(f"{tmp}/n1", 0o755)
            os.chmod(node.socket, 0o666)  # the allowlist is the guard
            refused = _errors_as(node.socket, user.uid, user.gid, OPERATOR_OPS)
            assert refused == ["forbidden"] * len(OPERATOR_OPS), refused
            with Client(coord.socket) as c:
                assert c.request("profile.list", {})["profiles"] == []
                assert [r["state"] for r in c.nodes() if r["name"] == "n1"] == ["ready"]
            served = _errors_as(node.socket, operator.uid, operator.gid, OPERATOR_OPS)
            assert served == ["ok"] * len(OPERATOR_OPS), served
            with Client(coord.socket) as c:
                assert [p["name"] for p in c.request("profile.list", {})["profiles"]] == ["p"]
        finally:
            stop_all([d for d in (node, coord) if d is not None])


def test_non_operators_see_their_own_actions_and_counts_of_the_rest():
    """Through a node's socket, queue, story and env.list show a non-operator its own
    environments and actions, and only counts of another user's (whose story is not found);
    an operator on the coordinator sees both."""
    with (
        local_user() as alice,
        local_user() as bob,
        tempfile.TemporaryDirectory(prefix="tgi-", dir="/tmp") as tmp,
    ):
        os.chmod(tmp, 0o755)
        coord = spawn_coordinator(f"{tmp}/c")
        node = None
        try:
            uids = [alice.uid, bob.uid]
            config = f'[daemon]\nallowed_uids = {uids}\n[cpu]\nisolation = "none"\n'
            node = spawn_node(tmp, coord, "n1", config=config)
            os.chmod(f"{tmp}/n1", 0o755)
            os.chmod(node.socket, 0o666)  # the allowlist is the guard

            def open_one() -> bytes:
                with Client(node.socket) as c:
                    env = c.env_open(trajectory="secret-trajectory")
                    return env.encode()

            env_a = in_child_as(alice.uid, alice.gid, open_one).decode()
            env_b = in_child_as(bob.uid, bob.gid, open_one).decode()

            def views() -> bytes:
                with Client(node.socket) as c:
                    listed = c.request("env.list", {})
                    try:
                        c.request("story", {"action_id": env_a})
                        story_a = "shown"
                    except TangramError as exc:
                        story_a = exc.code
                    own = c.request("story", {"action_id": env_b})["kind"]
                    queue = c.request("queue", {})
                return json.dumps(
                    {
                        "ids": [r["id"] for r in listed["envs"]],
                        "others": listed["others"],
                        "story_a": story_a,
                        "own_story": own,
                        "queue_others": queue["others"],
                    }
                ).encode()

            seen = json.loads(in_child_as(bob.uid, bob.gid, views))
            assert seen["ids"] == [env_b] and seen["others"] == 1, seen
            assert seen["story_a"] == "not_found" and seen["own_story"] == "environment", seen
            assert set(seen["queue_others"]) == {"waiting", "running", "envs"}, seen
            with Client(coord.socket) as c:  # root: an operator
                listed = c.request("env.list", {})
                assert sorted(r["id"] for r in listed["envs"]) == sorted([env_a, env_b])
                assert listed["others"] == 0
                assert c.request("story", {"action_id": env_a})["kind"] == "environment"
        finally:
            stop_all([d for d in (node, coord) if d is not None])


def test_a_joined_name_belongs_to_its_credential(tmp_path):
    """After node n1 stops, a token holder cannot join as n1 (the real n1 would be refused
    on return); `tangramctl node forget n1` by an operator frees the name."""
    coord = spawn_coordinator(tmp_path / "c")
    daemons = [coord]
    try:
        real = spawn_node(tmp_path / "real", coord, "n1")
        daemons.append(real)
        real.stop()
        wait_node_state(coord, "n1", "lost", 30)
        impostor = spawn_node(tmp_path / "impostor", coord, "n1", wait_ready=False)
        daemons.append(impostor)
        impostor.proc.wait(30)  # refused for good: it gives up
        assert "belongs to its credential" in impostor.log(), impostor.log()
        assert node_row(coord, "n1")["state"] == "lost"
        with Client(coord.socket) as c:
            assert c.request("node.forget", {"name": "n1"}) == {"name": "n1", "forgotten": True}
        again = spawn_node(tmp_path / "again", coord, "n1")
        daemons.append(again)
        assert node_row(coord, "n1")["state"] == "ready"
    finally:
        stop_all([d for d in reversed(daemons) if d.proc.poll() is None])


def test_a_node_claiming_more_than_the_bounds_is_refused(tmp_path):
    """A hello past `[cluster] max_node_cores` or `max_node_mem` is refused (the node gives
    up), and a node within them joins."""
    coord = spawn_coordinator(tmp_path / "c", "[cluster]\nmax_node_cores = 1\n")
    daemons = [coord]
    try:
        greedy = spawn_node(tmp_path, coord, "greedy", cpus="0-1", wait_ready=False)
        daemons.append(greedy)
        greedy.proc.wait(30)
        assert "max_node_cores (1)" in greedy.log(), greedy.log()
        daemons.append(spawn_node(tmp_path, coord, "modest", cpus="0"))
        assert node_row(coord, "modest")["state"] == "ready"
        assert [r["name"] for r in _nodes(coord)] == ["modest"]
    finally:
        stop_all([d for d in reversed(daemons) if d.proc.poll() is None])
    coord = spawn_coordinator(tmp_path / "c2", '[cluster]\nmax_node_mem = "1MiB"\n')
    try:
        node = spawn_node(tmp_path / "m", coord, "big", cpus="0", wait_ready=False)
        node.proc.wait(30)
        assert "max_node_mem (1048576)" in node.log(), node.log()
    finally:
        stop_all([coord])


def _nodes(coord) -> list[dict]:
    with Client(coord.socket) as c:
        return c.nodes()


def test_a_node_that_never_answers_create_env_fails_it_and_is_drained(tmp_path):
    """A node that does not answer create_env or a transfer (stopped) fails env.open and
    env.put with infra_error at `[cluster] node_request_timeout_s`, instead of hanging, and is
    drained as suspect."""
    config = "[cluster]\nnode_request_timeout_s = 1.0\nheartbeat_timeout_s = 60.0\n"
    coord = spawn_coordinator(tmp_path / "c", config)
    node = None
    try:
        node = spawn_node(tmp_path, coord, "n1", cpus="0")
        with Client(coord.socket) as c:
            env = c.env_open(trajectory="before")
        os.kill(node.proc.pid, signal.SIGSTOP)
        try:
            with Client(coord.socket) as c:
                started = time.monotonic()
                with pytest.raises(InfraError, match="did not answer create_env within 1 s"):
                    c.env_open(trajectory="t")
                assert time.monotonic() - started < 30
            assert node_row(coord, "n1")["state"] == "draining"
            assert "node_suspect" in coord.log()
            late = pytest.raises(InfraError, match="did not answer a transfer within 1 s")
            with Client(coord.socket) as c, late:
                c.request("env.put", {"id": env, "path": "f", "data": b"x"})
        finally:
            os.kill(node.proc.pid, signal.SIGCONT)
    finally:
        stop_all([d for d in (node, coord) if d is not None])


def test_an_environment_lost_with_a_stopped_node_stays_env_lost_after_it_returns(tmp_path):
    """A node stopped (SIGSTOP) past the heartbeat timeout loses its environments; once it
    is resumed and rejoins (dropping them), their next use is still `env_lost`, as
    docs/design.md promises, not `not_found`."""
    config = "[cluster]\nheartbeat_s = 0.3\nheartbeat_timeout_s = 1.5\n"
    coord = spawn_coordinator(tmp_path / "c", config)
    node = None
    try:
        node = spawn_node(tmp_path, coord, "n1", cpus="0")
        with Client(coord.socket) as c:
            env = c.env_open(trajectory="t")
        os.kill(node.proc.pid, signal.SIGSTOP)
        try:
            wait_node_state(coord, "n1", "lost", 20)
        finally:
            os.kill(node.proc.pid, signal.SIGCONT)
        wait_node_state(coord, "n1", "ready", 20)

        def dropped() -> bool:
            with Client(coord.socket) as c:
                return c.request("story", {"action_id": env})["state"] == "closed"

        wait_for(dropped, 10, "the node dropped it and the coordinator forgot it")
        for sock in (coord.socket, node.socket):
            with Client(sock) as c, pytest.raises(EnvLost, match="lost with node n1"):
                c.exec("true", env=env)
    finally:
        stop_all([d for d in (node, coord) if d is not None])

"""Waits for memory are visible, bounded by the request's timeout, and withdrawn with the
client (issue 35, items 4 and 5).

A daemon with 2 GiB for environments of 1 GiB each: two open environments take it all,
so any third one (an exec's throwaway environment, an ``env.open``) waits for memory.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from harness import frame, running_daemon

from tangram.client import Client
from tangram.protocol.errors import Timeout
from tangram.testing import (
    SpawnedDaemon,
    spawn_coordinator,
    spawn_gateway,
    spawn_node,
    wait_for,
)

SMALL = '[cpu]\nmem = "2GiB"\ndefault_env_mem = "1GiB"\n'
NO_MEM = "memory: needs 1 GiB, 0 GiB free"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SpawnedDaemon]:
    with running_daemon(tmp_path_factory.mktemp("waits"), config=SMALL) as d:
        yield d


@pytest.fixture
def full(daemon: SpawnedDaemon) -> Iterator[tuple[Client, list[str]]]:
    """The daemon's memory taken by two open environments (closed after the test)."""
    with daemon.client() as c:
        envs = [c.env_open(), c.env_open()]
        yield c, envs
        for env in envs:
            if any(row["id"] == env for row in c.env_list()):
                c.env_close(env)
        wait_for(lambda: _quiet(c), 10, "the daemon idle again")


def _quiet(c: Client) -> bool:
    s = c.status()
    return not (s["queued"] or s["waiting_env"] or s["waiting_mem"] or s["running"])


def test_a_wait_for_memory_shows_in_status_queue_and_story(daemon, full):
    """status counts the wait and says what it needs; queue lists the action and its
    environment with what they wait for; story says it too; freeing memory runs it."""
    c, envs = full
    results = []
    waiter = threading.Thread(target=lambda: results.append(daemon.client().exec("true")))
    waiter.start()
    wait_for(lambda: c.status()["waiting_mem"] == 1, 10, "the exec waiting for memory")
    status = c.status()
    assert status["queued"] == 0 and status["waiting_env"] == 1
    assert status["mem_wait"] == NO_MEM
    queue = c.queue()
    [row] = queue["waiting"]
    assert row["state"] == "waiting_env" and row["waiting_for"] == NO_MEM
    [env_row] = queue["envs"]
    assert env_row["state"] == "waiting_mem" and env_row["throwaway"]
    assert env_row["waiting_for"] == NO_MEM and env_row["mem"] == 1 << 30
    story = c.story(row["action_id"])
    assert story["state"] == "waiting_env" and story["waiting_for"] == NO_MEM
    assert any(NO_MEM in e["detail"] for e in story["events"]), story
    env_story = c.story(env_row["env_id"])
    assert env_story["state"] == "waiting_mem" and env_story["waiting_for"] == NO_MEM
    assert NO_MEM in _ctl(daemon, "story", row["action_id"])
    # the CLI shows it
    shown = _ctl(daemon, "status")
    assert "waiting_mem" in shown and NO_MEM in shown, shown
    shown = _ctl(daemon, "queue")
    assert "waiting_env" in shown and "waiting_mem" in shown and NO_MEM in shown, shown
    c.env_close(envs[0])
    waiter.join(30)
    assert results and results[0].outcome == "ok", results
    assert c.status()["waiting_mem"] == 0 and c.status()["mem_wait"] is None


def test_an_exec_timeout_bounds_its_wait_for_memory(daemon, full, tmp_path):
    """timeout_s 1 with no memory to be had: outcome timeout after about 1 s, naming the
    memory; the command never runs, even once memory is free."""
    c, envs = full
    marker = tmp_path / "ran"
    started = time.monotonic()
    result = c.exec(["touch", str(marker)], timeout_s=1.0)
    took = time.monotonic() - started
    assert result.outcome == "timeout", result
    assert result.detail.startswith("waited 1.0 s for ") and NO_MEM in result.detail, result
    assert result.exec_s == 0.0 and 1.0 <= took < 3.0, (took, result)
    assert c.story(result.action_id)["outcome"] == "timeout"
    c.env_close(envs[0])
    assert c.exec(["true"]).outcome == "ok"  # memory is free: an exec runs now
    assert not marker.exists()


def test_queue_timeout_bounds_the_wait_alone(daemon, full):
    """queue_timeout_s has its own bound: the long timeout_s does not stretch the wait."""
    c, _ = full
    started = time.monotonic()
    result = c.exec("true", timeout_s=60.0, queue_timeout_s=0.5)
    assert result.outcome == "timeout" and NO_MEM in result.detail, result
    assert time.monotonic() - started < 2.5


def test_exec_cli_timeout_names_the_memory(daemon, full):
    """tangramctl exec --timeout 1 exits 124 within about its timeout, saying why."""
    started = time.monotonic()
    done = _ctl_run(daemon, "exec", "--timeout", "1", "--", "true")
    assert done.returncode == 124, done
    assert "timed out before it ran" in done.stderr and NO_MEM in done.stderr, done.stderr
    assert time.monotonic() - started < 6.0
    done = _ctl_run(daemon, "exec", "--timeout", "30", "--queue-timeout", "0.5", "--", "true")
    assert done.returncode == 124 and NO_MEM in done.stderr, done


def test_the_timeout_bounds_waiting_plus_running(daemon):
    """A command that waited for its cores gets what its timeout left: the whole action
    ends at about timeout_s, not timeout_s after it started running."""
    with daemon.client() as c:
        env = c.env_open()
        cores = c.status()["pools"]["cpu:local"]["capacity"]
        try:
            hog = daemon.client()
            busy = threading.Thread(target=lambda: hog.exec("sleep 1.5", env=env, cpus=cores))
            busy.start()
            wait_for(lambda: c.status()["running"] == 1, 10, "every core taken")
            with daemon.client() as other:
                started = time.monotonic()
                result = other.exec("sleep 10", env=env, cpus=cores, timeout_s=3.0)
                took = time.monotonic() - started
            busy.join(30)
            hog.close()
            assert result.outcome == "timeout" and result.queue_s > 0.5, result
            assert took < 5.0, (took, result)  # not 1.5 s queued + 3 s run
        finally:
            c.env_close(env)


def test_a_client_that_gives_up_withdraws_its_waiting_exec(daemon, full, tmp_path):
    """The client's own answer timeout passes and it drops the connection: the exec that
    waits for memory is withdrawn (rejected, "client gone") and never runs."""
    c, envs = full
    marker = tmp_path / "ran"
    with daemon.client(timeout_s=0.5) as impatient, pytest.raises(Timeout):
        impatient.exec(["touch", str(marker)])
    wait_for(lambda: _quiet(c), 10, "the exec withdrawn")
    c.env_close(envs[0])
    assert c.exec(["true"]).outcome == "ok"
    assert not marker.exists()


def test_a_half_closed_client_still_gets_its_answer(daemon):
    """A client that only shut its write side (still reading) is not gone: it gets its
    answer (the withdrawal above is for a client that closed both ways)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(daemon.socket)
        sock.sendall(frame({"id": 1, "op": "exec", "args": {"cmd": "sleep 0.2; echo hi"}}))
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert b"hi" in data and b"ok" in data, data


def test_env_open_timeout_names_the_memory(daemon, full):
    """env.open with timeout_s fails with a typed timeout naming the memory; one whose
    client leaves is withdrawn (no environment left waiting)."""
    c, _ = full
    started = time.monotonic()
    with pytest.raises(Timeout, match="for memory: needs 1 GiB, 0 GiB free"):
        c.env_open(timeout_s=0.5)
    assert time.monotonic() - started < 2.5
    assert c.status()["waiting_mem"] == 0
    with pytest.raises(Timeout, match=NO_MEM), c.env(timeout_s=0.3):
        pass
    with daemon.client(timeout_s=0.5) as impatient, pytest.raises(Timeout):
        impatient.env_open()
    wait_for(lambda: c.status()["waiting_mem"] == 0, 10, "the open withdrawn")
    assert len(c.env_list()) == 2


def test_cli_env_open_timeout_exits_124_naming_the_memory(daemon, full):
    """`tangramctl env open --timeout S` waits at most S for memory, then exits 124 with
    one line naming what it needed; --timeout must be > 0."""
    ctl = [sys.executable, "-m", "tangramctl.main", "--socket", daemon.socket, "env", "open"]
    r = subprocess.run([*ctl, "--timeout", "0.3"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 124, (r.stdout, r.stderr)
    assert "for memory: needs 1 GiB, 0 GiB free" in r.stderr and r.stdout == ""
    wait_for(lambda: full[0].status()["waiting_mem"] == 0, 10, "the open withdrawn")
    r = subprocess.run([*ctl, "--timeout", "0"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--timeout" in r.stderr


def test_gateway_requests_are_bounded_by_their_timeouts(daemon, full, tmp_path):
    """POST /envs waits at most its timeout (then 504; any other refusal 502); run_code's
    run_timeout bounds its wait for memory and the abandoned request never runs later."""
    c, envs = full
    marker = tmp_path / "ran"
    with spawn_gateway(daemon.socket, tmp_path) as gw:
        started = time.monotonic()
        got = httpx.post(f"{gw.url}/envs", json={"timeout": 0.5}, timeout=30)
        # a wait that ran out is the gateway's 504 (Gateway Timeout), not a failure's 502
        assert got.status_code == 504 and NO_MEM in got.text, got.text
        assert got.json()["detail"].startswith("timeout: "), got.text
        # a refusal that is no timeout stays 502: more memory than the daemon has
        big = httpx.post(f"{gw.url}/envs", json={"mem": 8 << 30, "timeout": 5}, timeout=30)
        assert big.status_code == 502 and "unschedulable" in big.text, big.text
        code = f"open({str(marker)!r}, 'w').write('x')"
        body = {"code": code, "language": "python", "run_timeout": 1}
        got = httpx.post(f"{gw.url}/run_code", json=body, timeout=30)
        assert time.monotonic() - started < 6.0
        answer = got.json()
        assert answer["run_result"]["status"] == "TimeLimitExceeded", answer
        assert NO_MEM in answer["run_result"]["stderr"], answer
        wait_for(lambda: _quiet(c), 10, "nothing left waiting")
        c.env_close(envs[0])
        assert c.exec(["true"]).outcome == "ok"
    assert not marker.exists()


def _ctl_run(daemon: SpawnedDaemon, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tangramctl.main", "--socket", daemon.socket, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def _ctl(daemon: SpawnedDaemon, *args: str) -> str:
    done = _ctl_run(daemon, *args)
    assert done.returncode == 0, done
    json.loads(_ctl_run(daemon, *args, "--json").stdout)  # --json too
    return done.stdout


def test_cluster_waits_are_bounded_and_withdrawn(tmp_path):
    """The coordinator runs the same core: an exec's timeout bounds its wait for a node's
    memory, and one whose client gave up never runs there."""
    coordinator = spawn_coordinator(tmp_path, '[cpu]\ndefault_env_mem = "1GiB"\n')
    try:
        node = spawn_node(tmp_path, coordinator, "n1", config=SMALL)
        try:
            with Client(coordinator.socket) as c:
                envs = [c.env_open(), c.env_open()]
                marker = tmp_path / "ran"
                result = c.exec(["touch", str(marker)], timeout_s=1.0)
                assert result.outcome == "timeout" and NO_MEM in result.detail, result
                impatient = Client(coordinator.socket, timeout_s=0.5)
                with impatient, pytest.raises(Timeout):
                    impatient.exec(["touch", str(marker)])
                wait_for(lambda: _quiet(c), 10, "the exec withdrawn")
                c.env_close(envs[0])
                assert c.exec(["true"]).outcome == "ok"
                assert not marker.exists()
                c.env_close(envs[1])
        finally:
            node.stop()
    finally:
        coordinator.stop()

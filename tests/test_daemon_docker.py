"""`tangramd up --cpu-backend docker` end to end against the real dockerd (CI starts one)."""

from __future__ import annotations

import gzip
import io
import json
import tarfile

import docker
import pytest
from harness import running_daemon

from tangram.protocol.errors import BadRequest

pytestmark = pytest.mark.docker

IMAGE = "tangram-test:bookworm"


@pytest.fixture(scope="module")
def daemon_args() -> tuple[str, ...]:
    """The module's daemon runs its environments in containers."""
    return ("--cpu-backend", "docker")


def ours(env_id: str) -> list:
    client = docker.from_env()
    return client.containers.list(all=True, filters={"label": f"org.arl-tangram.env={env_id}"})


def test_exec_in_container_is_pinned_and_keeps_state(daemon):
    """Each exec sees exactly its cores from inside the container; files persist."""
    with daemon.client() as c:
        env = c.env_open(image=IMAGE)
        assert len(ours(env)) == 1
        for cpus in (1, 2, 1):
            r = c.exec(
                ["sh", "-c", "grep Cpus_allowed_list /proc/self/status; nproc"], env=env, cpus=cpus
            )
            assert r.outcome == "ok", r
            allowed = r.stdout.split()[1]
            expect = str(r.cores[0]) if cpus == 1 else f"{min(r.cores)}-{max(r.cores)}"
            assert allowed == expect
        assert c.exec("echo hi > /tmp/x", env=env).outcome == "ok"
        assert c.exec("cat /tmp/x", env=env).stdout == "hi\n"
        c.env_close(env)
        assert ours(env) == []


def test_pytest_rewritten_to_allocated_cores(daemon):
    """An elastic pytest run on 2 cores runs with 2 xdist workers inside the container."""
    with daemon.client() as c:
        env = c.env_open(image=IMAGE)
        c.exec("mkdir -p /w && printf 'def test_a():\\n    pass\\n' > /w/test_a.py", env=env)
        r = c.exec("cd /w && python3 -m pytest -p no:cacheprovider", env=env, cpus=2)
        assert r.outcome == "ok", r
        assert "gw0 [1] / gw1 [1]" in r.stdout, r.stdout  # two xdist workers
        c.env_close(env)


def test_container_removed_behind_our_back_is_infra_error_then_fresh(daemon):
    """A vanished container gives infra_error (not failed); the next action gets a new one."""
    with daemon.client() as c:
        env = c.env_open(image=IMAGE)
        assert c.exec("touch /tmp/mark", env=env).outcome == "ok"
        for ctr in ours(env):
            ctr.remove(force=True)
        r = c.exec("true", env=env)
        assert r.outcome == "infra_error"
        r = c.exec("test -e /tmp/mark", env=env)
        assert r.outcome == "failed" and r.exit_code == 1  # fresh container, state gone
        assert len(ours(env)) == 1
        c.env_close(env)
        st = c.status()
        assert st["pools"]["cpu:local"]["free"] == 2


def test_shutdown_keeps_persistent_containers_for_the_next_daemon(tmp_path):
    """SIGTERM keeps a persistent environment's container (it belongs to its trajectory);
    the next daemon re-adopts it, and env.close removes it."""
    with running_daemon(tmp_path, "--cpu-backend", "docker") as d:
        with d.client() as c:
            env = c.env_open(image=IMAGE)
            assert c.exec("echo kept > f", env=env).outcome == "ok"
        assert len(ours(env)) == 1
        assert d.stop() == 0
    assert len(ours(env)) == 1
    with running_daemon(tmp_path, "--cpu-backend", "docker") as d2, d2.client() as c:
        assert c.exec("cat f", env=env).stdout == "kept\n"
        c.env_close(env)
        assert ours(env) == []


def test_containers_of_a_killed_daemon_are_readopted_or_reconciled(tmp_path):
    """After SIGKILL the next daemon on the same state dir re-adopts the containers of the
    environments it has records of, with their files, and removes truly orphaned ones."""
    import signal

    with running_daemon(tmp_path, "--cpu-backend", "docker") as d:
        with d.client() as c:
            env = c.env_open(image=IMAGE)
            orphan = c.env_open(image=IMAGE)
            assert c.exec("echo state > f", env=env).outcome == "ok"
        d.stop(signal.SIGKILL)
        assert len(ours(env)) == 1 and len(ours(orphan)) == 1  # left behind by the dead daemon
    # The orphan's record is lost: nobody owns it now. (Opens since the last compaction
    # are lines of the journal, replayed over envs.json by the next daemon.)
    journal = tmp_path / "state" / "envs.journal"
    lines = journal.read_text().splitlines()
    kept = [ln for ln in lines if json.loads(ln)["id"] != orphan]
    assert len(kept) == len(lines) - 1
    journal.write_text("".join(ln + "\n" for ln in kept))
    with running_daemon(tmp_path, "--cpu-backend", "docker") as d2:
        with d2.client() as c:
            assert [e["id"] for e in c.env_list()] == [env]
            assert c.exec("cat f", env=env).stdout == "state\n"
        assert ours(orphan) == []
        assert len(ours(env)) == 1


def _tar(members: int, declared: int) -> bytes:
    """A gzipped tar stream of ``members`` empty files, the first declaring ``declared``
    bytes (its data left out: only the headers are read before it is refused)."""
    raw = io.BytesIO()
    for n in range(members):
        info = tarfile.TarInfo(f"m{n}")
        info.size = declared if n == 0 else 0
        raw.write(info.tobuf(format=tarfile.GNU_FORMAT))
    raw.write(b"\0" * 1024)
    return gzip.compress(raw.getvalue(), compresslevel=1)


def test_a_tar_put_over_the_extraction_caps_is_refused_before_extracting(daemon):
    """env.put of a tar stream into a container is checked as on the process backend: one
    whose headers declare over 1 GiB, or over 100,000 members, is bad_request naming the
    cap, and nothing of it lands in the container; one within the caps is extracted."""
    with daemon.client() as c:
        env = c.env_open(image=IMAGE)
        with pytest.raises(BadRequest, match="unpacks to more than"):
            c.put(env, "/w/bomb", _tar(1, 3 << 30), tar=True)
        with pytest.raises(BadRequest, match="more than 100000 tar members"):
            c.put(env, "/w/many", _tar(100_001, 0), tar=True)
        r = c.exec("ls -A /w/bomb /w/many 2>/dev/null | wc -l", env=env)
        assert (r.outcome, r.stdout) == ("ok", "0\n"), r
        c.put(env, "/w/few", _tar(3, 0), tar=True)
        assert c.exec("ls /w/few", env=env).stdout.split() == ["m0", "m1", "m2"]
        c.env_close(env)

"""The Docker backend against a real dockerd (CI runs .ci/docker-setup.sh first).

Containers have no network; the agent is reached over a bind-mounted Unix socket. Every
container made here carries a label unique to this test run, removed at the end whatever
happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path

import docker
import pytest

from tangram.testing import wait_for
from tangramd.backends.base import EnvError
from tangramd.backends.docker import AGENT_SOCK, DockerBackend

# A helper module with asserts, not a test module: have pytest rewrite them too.
pytest.register_assert_rewrite("backend_conformance")
from backend_conformance import (  # noqa: E402
    BOTH_CORES,
    BackendConformance,
    ex,
    new_env,
    req,
    until_started,
)

pytestmark = pytest.mark.docker

IMAGE = os.environ.get("TANGRAM_TEST_IMAGE", "tangram-test:bookworm")
NOPYTHON_IMAGE = f"tangram-test:nopython-{uuid.uuid4().hex[:6]}"
LABEL = f"org.arl-tangram.test-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def client():
    c = docker.from_env(timeout=30)
    assert c.ping(), "dockerd must be running: run .ci/docker-setup.sh"
    c.images.get(IMAGE)  # built by .ci/docker-setup.sh
    yield c
    for info in c.api.containers(all=True, filters={"label": LABEL}):
        c.api.remove_container(info["Id"], force=True)
    if c.images.list(name=NOPYTHON_IMAGE):
        c.images.remove(NOPYTHON_IMAGE, force=True)
    c.close()


@pytest.fixture
def state_dir():
    path = tempfile.mkdtemp(prefix="tgd-", dir="/tmp")  # short: socket paths < 108 bytes
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


def make_backend(client, state_dir, **kw):
    kw.setdefault("owner_id", f"t{uuid.uuid4().hex[:8]}")
    return DockerBackend(client=client, default_image=IMAGE, label=LABEL, state_dir=state_dir, **kw)


@pytest.fixture
def agent_backend(client, state_dir):
    b = make_backend(client, state_dir)
    yield b
    asyncio.run(b.shutdown())


@pytest.fixture
def exec_backend(client, state_dir):
    b = make_backend(client, state_dir, use_agent=False)
    yield b
    asyncio.run(b.shutdown())


class TestAgentConformance(BackendConformance):
    """The shared backend contract, through the in-container agent."""

    @pytest.fixture
    def backend(self, agent_backend):
        return agent_backend


class TestDockerExecConformance(BackendConformance):
    """The shared backend contract, through plain `docker exec`."""

    @pytest.fixture
    def backend(self, exec_backend):
        return exec_backend


@pytest.fixture(params=["agent", "docker_exec"])
def backend(request, agent_backend, exec_backend):
    return agent_backend if request.param == "agent" else exec_backend


def owned(client, backend):
    return client.api.containers(all=True, filters={"label": f"{LABEL}={backend.owner_id}"})


def test_paths_are_what_they_say(agent_backend, exec_backend):
    """The agent backend really uses the agent, the other one really uses docker exec."""
    a, b = new_env(agent_backend), new_env(exec_backend)
    assert agent_backend.uses_agent(a) and not exec_backend.uses_agent(b)


def test_timeout_leaves_no_stray_processes(backend):
    """After a timeout nothing the command started is left running in the container."""
    env = new_env(backend)
    cmd = "sleep 300 & setsid sleep 301 & (sleep 302 &); echo started; sleep 303"
    result = ex(backend, env, cmd, timeout_s=1.0)
    assert (result.outcome, result.stdout) == ("timeout", "started\n")

    def strays() -> list[str]:
        ps = ex(backend, env, ["ps", "-eo", "stat,args"]).stdout.splitlines()
        return [ln for ln in ps if "sleep 30" in ln and "Z" not in ln[:2]]

    wait_for(lambda: not strays(), 5, "no stray sleep left", every_s=0.2)


def test_container_removed_behind_our_back(client, backend):
    """A container removed behind our back gives infra_error, and a new env then works."""
    env = new_env(backend)
    (info,) = [c for c in owned(client, backend) if c["Labels"]["org.arl-tangram.env"] == env]
    client.api.remove_container(info["Id"], force=True)
    result = ex(backend, env, ["true"])
    assert result.outcome == "infra_error", result
    assert not backend.env_exists(env)
    asyncio.run(backend.create_env(env, None, None))
    assert ex(backend, env, ["echo", "back"]).stdout == "back\n"


def test_container_died_during_exec(client, backend):
    """A container killed while an exec runs ends that exec with infra_error."""
    env = new_env(backend)
    (info,) = owned(client, backend)

    async def scenario():
        cmd = ["sh", "-c", "touch started; exec sleep 30"]
        running = asyncio.ensure_future(backend.exec(req(env, cmd)))
        await until_started(backend, env)
        await asyncio.to_thread(client.api.kill, info["Id"])
        return await asyncio.wait_for(running, 20)

    result = asyncio.run(scenario())
    assert result.outcome == "infra_error", result
    assert not backend.env_exists(env)


def test_sequential_execs_reuse_one_agent_connection(agent_backend):
    """Sequential execs in an environment share one connection to its agent (no connect
    and no agent thread per exec); closing the environment lets it go."""
    env = new_env(agent_backend)
    live = agent_backend._envs[env]
    assert live.keepalive

    async def three_then_close():
        kept = []
        for i in range(3):
            result = await agent_backend.exec(req(env, ["sh", "-c", f"echo {i}"]))
            assert (result.outcome, result.stdout) == ("ok", f"{i}\n"), result
            ((_, writer),) = live.idle
            kept.append(writer)
        await agent_backend.close_env(env)
        return kept

    kept = asyncio.run(three_then_close())
    assert kept[0] is kept[1] is kept[2]
    assert live.idle == [] and kept[0].is_closing()


def test_agent_socket_gone_falls_back_to_docker_exec(agent_backend):
    """If the agent cannot be reached the exec still runs, through docker exec."""
    env = new_env(agent_backend)
    (agent_backend._agent_dir(env) / AGENT_SOCK).unlink()
    result = ex(agent_backend, env, "grep Cpus_allowed_list /proc/self/status", (1,))
    assert result.outcome == "ok" and "\t1\n" in result.stdout
    assert not agent_backend.uses_agent(env)


def test_image_without_python_uses_docker_exec(client, state_dir):
    """An image without python3 gets no agent and is driven through docker exec."""
    base = client.containers.run(IMAGE, ["sleep", "60"], detach=True, network_mode="none")
    try:
        base.exec_run(["sh", "-c", "rm -f /usr/bin/python3*"])
        repo, tag = NOPYTHON_IMAGE.split(":")
        base.commit(repository=repo, tag=tag)
    finally:
        base.remove(force=True)
    b = make_backend(client, state_dir)
    try:
        asyncio.run(b.create_env("nopy", NOPYTHON_IMAGE, None))
        assert not b.uses_agent("nopy")
        result = ex(b, "nopy", "grep Cpus_allowed_list /proc/self/status", BOTH_CORES)
        assert result.outcome == "ok" and result.stdout.strip().endswith(("0-1", "0"))
    finally:
        asyncio.run(b.shutdown())


def test_memory_limit_is_applied(client, agent_backend):
    """The environment's memory reservation becomes the container's memory limit."""
    new_env(agent_backend, mem_bytes=300 << 20)
    (info,) = owned(client, agent_backend)
    host = client.api.inspect_container(info["Id"])["HostConfig"]
    assert host["Memory"] == 300 << 20 and host["NetworkMode"] == "none"


def test_reconcile_removes_other_owners_and_adopts_our_own(client, state_dir):
    """Leftovers of another owner are removed; our own running ones that the daemon kept
    records of are adopted and work, our own without a record are removed."""
    crashed = make_backend(client, state_dir, owner_id="crashed")
    asyncio.run(crashed.create_env("left", None, None))
    asyncio.run(crashed.create_env("unrecorded", None, None))
    restarted_same = make_backend(client, state_dir, owner_id="crashed")
    done = asyncio.run(restarted_same.reconcile({"left": None}))
    assert any("removed unrecorded" in line for line in done)
    assert not restarted_same.env_exists("unrecorded")
    assert any("adopted left" in line for line in done)
    assert restarted_same.env_exists("left")
    assert ex(restarted_same, "left", ["echo", "adopted"]).stdout == "adopted\n"
    other = make_backend(client, state_dir, owner_id="other")
    done = asyncio.run(other.reconcile())
    assert any("removed left" in line for line in done)
    assert client.api.containers(all=True, filters={"label": LABEL}) == []


def test_shutdown_removes_all_our_containers(client, state_dir):
    """shutdown() leaves no container of ours behind."""
    b = make_backend(client, state_dir)
    for _ in range(2):
        new_env(b)
    assert len(owned(client, b)) == 2
    asyncio.run(b.shutdown())
    assert owned(client, b) == []


class SocketProxy:
    """A Unix-socket relay to dockerd that the test can cut and restore."""

    def __init__(self, path: str, upstream: str = "/var/run/docker.sock") -> None:
        self.path, self.upstream = path, upstream
        self.conns: list[socket.socket] = []
        self.listener: socket.socket | None = None

    def start(self) -> None:
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(self.path)
        self.listener.listen(16)
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def stop(self) -> None:
        assert self.listener is not None
        self.listener.close()
        os.unlink(self.path)
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        self.conns.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                down, _ = listener.accept()
            except OSError:
                return
            up = socket.socket(socket.AF_UNIX)
            up.connect(self.upstream)
            self.conns += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def test_unreachable_engine_fails_fast_and_recovers(client, state_dir):
    """With dockerd unreachable, docker-exec execs fail fast as infra_error, then recover."""
    proxy = SocketProxy(str(state_dir / "docker.sock"))
    proxy.start()
    via_proxy = docker.DockerClient(base_url=f"unix://{proxy.path}", timeout=5)
    b = make_backend(via_proxy, state_dir, use_agent=False)
    try:
        env = new_env(b)
        assert ex(b, env, ["true"]).outcome == "ok"
        proxy.stop()
        started = time.monotonic()
        result = ex(b, env, ["true"])
        assert result.outcome == "infra_error", result
        assert time.monotonic() - started < 3
        assert b.env_exists(env)  # the engine is away, the container is not known dead
        proxy.start()
        assert ex(b, env, ["echo", "ok"]).stdout == "ok\n"
    finally:
        asyncio.run(b.shutdown())
        via_proxy.close()


def test_agent_path_needs_no_engine_while_creation_fails_fast(client, state_dir):
    """Agent execs keep running pinned while the engine API is away; new envs fail fast."""
    proxy = SocketProxy(str(state_dir / "docker.sock"))
    proxy.start()
    via_proxy = docker.DockerClient(base_url=f"unix://{proxy.path}", timeout=5)
    b = make_backend(via_proxy, state_dir, use_agent=True)
    try:
        env = new_env(b)
        assert ex(b, env, ["true"], (0,)).outcome == "ok"
        proxy.stop()
        # re-pinning to another core goes through the container's cgroup files directly
        r = ex(b, env, ["grep", "Cpus_allowed_list", "/proc/self/status"], (1,))
        assert r.outcome == "ok" and r.stdout.split()[-1] == "1", r
        started = time.monotonic()
        with pytest.raises(EnvError):
            asyncio.run(b.create_env("e-new", None, None))
        assert time.monotonic() - started < 12
        proxy.start()
        assert ex(b, env, ["echo", "ok"]).stdout == "ok\n"
    finally:
        asyncio.run(b.shutdown())
        via_proxy.close()


def test_containers_run_without_new_privileges_and_with_few_capabilities(backend):
    """A root command cannot gain privileges, make devices or use raw sockets; OOM picks it."""
    env = new_env(backend)
    result = ex(
        backend,
        env,
        "grep -E '^(NoNewPrivs|CapEff)' /proc/self/status; cat /proc/self/oom_score_adj; "
        "mknod /tmp/dev c 1 3 2>/dev/null && echo mknod-ok || echo mknod-refused",
    )
    fields = dict(line.split(":\t") for line in result.stdout.splitlines() if ":\t" in line)
    assert fields["NoNewPrivs"] == "1", result
    cap_net_raw, cap_mknod, cap_sys_admin = 1 << 13, 1 << 27, 1 << 21
    caps = int(fields["CapEff"], 16)
    assert caps and not caps & (cap_net_raw | cap_mknod | cap_sys_admin), hex(caps)
    assert result.stdout.split()[-2:] == ["1000", "mknod-refused"]

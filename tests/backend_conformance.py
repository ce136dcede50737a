"""Behaviour every execution backend shares (docs/design.md §5.2), run against each real backend.

`BackendConformance` holds the tests; each backend's test module subclasses it and provides
a `backend` fixture (a fresh backend) — the process backend in test_backend_process.py, the
Docker backend, with the agent and with plain `docker exec`, in test_backend_docker.py
(marked `docker` there). Tests are synchronous and drive the async API with `asyncio.run`.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import docker
import pytest

from tangram.testing import wait_for_async
from tangramd.backends.base import TRUNCATION_MARKER, ExecRequest, ExecResult

SUITE_DIR = Path(__file__).parent / "data" / "cpu_suite"
BOTH_CORES = tuple(sorted(os.sched_getaffinity(0)))[:2]


# test_cluster_cancel.py (being rewritten by the cluster harness work) still imports this
# name; everything else calls asyncio.run itself.
run = asyncio.run


def backend_fixtures(name: str) -> tuple[Any, Any]:
    """A module's ``docker_client`` and ``backend`` fixtures: ``backend`` is a fresh process
    backend, Docker with the agent and Docker with plain ``docker exec`` (the last two marked
    ``docker``); containers carry a label of their own and are removed after the module.
    Use as ``docker_client, backend = backend_fixtures("io")``."""
    from tangramd.backends.docker import DockerBackend
    from tangramd.backends.process import ProcessBackend

    label = f"org.arl-tangram.test-{name}-{uuid.uuid4().hex[:8]}"

    @pytest.fixture(scope="module")
    def docker_client() -> Any:
        client = docker.from_env(timeout=30)
        yield client
        for info in client.api.containers(all=True, filters={"label": label}):
            client.api.remove_container(info["Id"], force=True)
        client.close()

    @pytest.fixture(
        params=[
            "process",
            pytest.param("agent", marks=pytest.mark.docker),
            pytest.param("docker_exec", marks=pytest.mark.docker),
        ]
    )
    def backend(request: Any, tmp_path: Path) -> Any:
        if request.param == "process":
            b = ProcessBackend(tmp_path / "root")
            yield b
            asyncio.run(b.shutdown())
            return
        client = request.getfixturevalue("docker_client")
        state = Path(tempfile.mkdtemp(prefix=f"tg{name}-", dir="/tmp"))  # short socket paths
        b = DockerBackend(
            client=client, default_image="tangram-test:bookworm", label=label,
            state_dir=state, owner_id=f"t{uuid.uuid4().hex[:8]}",
            use_agent=request.param == "agent",
        )  # fmt: skip
        yield b
        asyncio.run(b.shutdown())
        shutil.rmtree(state, ignore_errors=True)

    return docker_client, backend


def req(env_id: str, cmd: list[str] | str, cores: tuple[int, ...] = (0,), **kw: Any) -> ExecRequest:
    kw.setdefault("timeout_s", 30.0)
    kw.setdefault("action_id", f"t-{uuid.uuid4().hex[:6]}")
    return ExecRequest(env_id=env_id, cmd=cmd, cores=cores, **kw)


def new_env(backend: Any, mem_bytes: int | None = 256 << 20) -> str:
    env_id = f"env-{uuid.uuid4().hex[:8]}"
    asyncio.run(backend.create_env(env_id, None, mem_bytes))
    return env_id


def ex(backend: Any, env_id: str, cmd: list[str] | str, cores=(0,), **kw: Any) -> ExecResult:
    return asyncio.run(backend.exec(req(env_id, cmd, cores, **kw)))


def allowed_list(result: ExecResult) -> str:
    m = re.search(r"Cpus_allowed_list:\s*(\S+)", result.stdout)
    assert m, result
    return m.group(1)


def cpulist(cores: tuple[int, ...]) -> str:
    if len(cores) > 1 and cores == tuple(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def install_suite(backend: Any, env_id: str, subdir: str = "suite") -> None:
    """Copy the bundled CPU suite into the environment through the exec path itself."""
    parts = [f"mkdir -p {subdir}"]
    for name in ("cpu_burn.py", "pytest.ini"):
        text = (SUITE_DIR / name).read_text()
        parts.append(f"cat > {subdir}/{name} <<'TANGRAM_EOF'\n{text}TANGRAM_EOF")
    result = ex(backend, env_id, "\n".join(parts))
    assert result.outcome == "ok", result


class BackendConformance:
    """The shared contract; subclasses provide the `backend` fixture."""

    @pytest.mark.parametrize("cores", [(0,), (1,), BOTH_CORES], ids=["core0", "core1", "both"])
    def test_exec_is_pinned_to_allocated_cores_seen_from_inside(self, backend, cores):
        """The exec'd process itself reports exactly the allocated cores as allowed."""
        env = new_env(backend)
        result = ex(backend, env, ["grep", "Cpus_allowed_list", "/proc/self/status"], cores)
        assert result.outcome == "ok", result
        assert allowed_list(result) == cpulist(cores)

    def test_repinning_between_execs_of_one_env(self, backend):
        """Consecutive execs of one environment each see only their own allocation."""
        env = new_env(backend)
        seen = [
            allowed_list(ex(backend, env, "grep Cpus_allowed_list /proc/self/status", c))
            for c in [(1,), BOTH_CORES, (0,)]
        ]
        assert seen == ["1", cpulist(BOTH_CORES), "0"]

    def test_core_count_and_list_are_exported(self, backend):
        """Every exec receives TANGRAM_CPUS and TANGRAM_CORES for its allocation."""
        env = new_env(backend)
        result = ex(backend, env, 'echo "$TANGRAM_CPUS $TANGRAM_CORES"', BOTH_CORES)
        expected = f"{len(BOTH_CORES)} {','.join(map(str, BOTH_CORES))}"
        assert result.stdout.strip() == expected

    def test_exit_codes_map_to_outcomes(self, backend):
        """Exit 0 is ok, non-zero is failed with its code, a missing program is 127."""
        env = new_env(backend)
        assert ex(backend, env, ["true"]).outcome == "ok"
        failed = ex(backend, env, "echo out; echo err >&2; exit 3")
        assert (failed.outcome, failed.exit_code) == ("failed", 3)
        assert (failed.stdout, failed.stderr) == ("out\n", "err\n")
        missing = ex(backend, env, ["/no/such/program"])
        assert (missing.outcome, missing.exit_code) == ("failed", 127)

    def test_env_vars_reach_the_command(self, backend):
        """Per-exec environment variables are visible to the command."""
        env = new_env(backend)
        result = ex(backend, env, ["sh", "-c", 'echo "$GREETING"'], env_vars={"GREETING": "hi"})
        assert result.stdout == "hi\n"

    def test_state_persists_within_env_and_envs_are_isolated(self, backend):
        """Files written by one exec are seen by the next in the same env, not by others."""
        a, b = new_env(backend), new_env(backend)
        assert ex(backend, a, "echo kept > state.txt").outcome == "ok"
        assert ex(backend, a, "cat state.txt").stdout == "kept\n"
        other = ex(backend, b, "cat state.txt")
        assert other.outcome == "failed"

    def test_timeout_returns_partial_output_and_env_stays_usable(self, backend):
        """A timed-out exec is killed promptly, keeps its partial output, env still works."""
        env = new_env(backend)
        started = time.monotonic()
        result = ex(backend, env, "echo before; sleep 30; echo after", timeout_s=1.0)
        assert time.monotonic() - started < 6
        assert result.outcome == "timeout"
        assert result.stdout == "before\n"
        assert ex(backend, env, ["echo", "again"]).stdout == "again\n"

    def test_output_is_capped_with_marker(self, backend):
        """Each stream keeps its first max_output bytes and says how many were dropped."""
        env = new_env(backend)
        result = ex(backend, env, "head -c 5000 /dev/zero | tr '\\0' a", max_output=1000)
        assert result.truncated
        assert result.stdout == "a" * 1000 + TRUNCATION_MARKER.format(dropped=4000)

    def test_pytest_is_rewritten_to_use_all_cores(self, backend):
        """A pytest exec on two cores really runs two xdist workers."""
        if len(BOTH_CORES) < 2:
            pytest.fail("this test needs a machine with at least two cores")
        env = new_env(backend, mem_bytes=1 << 30)
        install_suite(backend, env)
        result = ex(
            backend,
            env,
            "cd suite && python3 -m pytest -v",
            BOTH_CORES,
            env_vars={"CPU_SUITE_SCALE": "0.02"},
            timeout_s=120,
        )
        assert result.outcome == "ok", result
        assert set(re.findall(r"\[(gw\d+)\]", result.stdout)) == {"gw0", "gw1"}
        single = ex(
            backend,
            env,
            "cd suite && python3 -m pytest -v",
            (0,),
            env_vars={"CPU_SUITE_SCALE": "0.02"},
            timeout_s=120,
        )
        assert single.outcome == "ok" and "[gw0]" not in single.stdout

    def test_opted_out_pytest_is_left_alone(self, backend):
        """An action that opts out of elasticity runs pytest exactly as written."""
        env = new_env(backend)
        install_suite(backend, env)
        result = ex(
            backend,
            env,
            "cd suite && python3 -m pytest -v",
            BOTH_CORES,
            elastic=False,
            env_vars={"CPU_SUITE_SCALE": "0.01"},
            timeout_s=120,
        )
        assert result.outcome == "ok" and "[gw0]" not in result.stdout

    def test_unknown_and_closed_envs_are_infra_errors(self, backend):
        """Execs in an unknown or closed environment are infra errors, never failures."""
        assert ex(backend, "env-never-made", ["true"]).outcome == "infra_error"
        env = new_env(backend)
        assert backend.env_exists(env)
        asyncio.run(backend.close_env(env))
        assert not backend.env_exists(env)
        assert ex(backend, env, ["true"]).outcome == "infra_error"

    def test_shutdown_ends_inflight_exec_with_infra_error(self, backend):
        """Shutting down ends a running exec with infra_error 'daemon shutting down'."""
        env = new_env(backend)

        async def scenario() -> ExecResult:
            cmd = ["sh", "-c", "touch started; exec sleep 30"]
            running = asyncio.ensure_future(backend.exec(req(env, cmd)))
            await until_started(backend, env)
            await backend.shutdown()
            return await asyncio.wait_for(running, 15)

        result = asyncio.run(scenario())
        assert (result.outcome, result.detail) == ("infra_error", "daemon shutting down")
        assert not backend.env_exists(env)
        assert ex(backend, env, ["true"]).outcome == "infra_error"


async def until_started(backend: Any, env: str, marker: str = "started") -> None:
    """Until the command running in ``env`` has written ``marker`` in its directory (the
    command's own signal that it runs: ``touch started; exec sleep 30``)."""
    await wait_for_async(
        lambda: backend.get(env, marker, max_bytes=1), 10, f"{marker} written", ignore=(Exception,)
    )


async def lodger_of(b: Any, cores: tuple[int, ...]) -> int:
    """The pid of the process backend's lodger for ``cores``' cgroup once it has joined and
    takes spawns (waits up to 5 s)."""
    key = str(b.cgroups.for_cores(cores))

    def ready_pid() -> int | None:
        chan = b._spawner._lodgers.get(key)
        return int(chan.pid) if chan is not None and chan.ready else None

    return await wait_for_async(ready_pid, 5, f"a lodger joined {key}")

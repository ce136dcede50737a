"""Per-action overhead (ACT) of the execution backends on `true`, next to bare baselines.

    python bench/exec_backends.py [--n 200] [--warmup 20] [--image tangram-test:bookworm] [--json]

Measured, each as p50/p99 wall milliseconds per action after a warm-up:
- docker_exec:  DockerBackend.exec via `docker update` + `docker exec` (no agent);
- docker_agent: DockerBackend.exec via `docker update` + the in-container agent;
- docker_update_only: the `update_container` call alone (the pinning share of both);
- sdk_exec_run: a bare docker SDK `container.exec_run(["true"])`, no pinning;
- process:      ProcessBackend.exec (affinity + per-exec cpuset cgroup when root);
- subprocess:   a bare `subprocess.run(["true"])`.
Needs a running dockerd (.ci/docker-setup.sh) for the docker rows; without one they are
reported as errors and the process rows still run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tangramd.backends.base import ExecRequest
from tangramd.backends.docker import DockerBackend
from tangramd.backends.process import ProcessBackend


def summarize(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples_s)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return {
        "n": len(ms),
        "p50_ms": round(statistics.median(ms), 3),
        "p99_ms": round(p99, 3),
        "mean_ms": round(statistics.fmean(ms), 3),
    }


async def measure(fn: Callable[[], Awaitable[object]], n: int, warmup: int) -> dict[str, float]:
    for _ in range(warmup):
        await fn()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - t0)
    return summarize(samples)


def checked(
    backend: object, env_id: str, cores: tuple[int, ...]
) -> Callable[[], Awaitable[object]]:
    request = ExecRequest(env_id=env_id, cmd=["true"], cores=cores, timeout_s=30, action_id="b")

    async def once() -> object:
        result = await backend.exec(request)  # type: ignore[attr-defined]
        if result.outcome != "ok":
            raise RuntimeError(f"exec failed: {result}")
        return result

    return once


async def bench_docker(image: str, n: int, warmup: int, cores: tuple[int, ...]) -> dict:
    out: dict[str, object] = {}
    state = tempfile.mkdtemp(prefix="tgb-", dir="/tmp")
    label = f"org.arl-tangram.bench-{uuid.uuid4().hex[:6]}"
    agent = DockerBackend(default_image=image, label=label, owner_id="bench-a", state_dir=state)
    plain = DockerBackend(
        default_image=image, label=label, owner_id="bench-e", state_dir=state, use_agent=False
    )
    try:
        await agent.create_env("a", None, 256 << 20)
        await plain.create_env("e", None, 256 << 20)
        out["docker_exec"] = await measure(checked(plain, "e", cores), n, warmup)
        out["docker_agent"] = await measure(checked(agent, "a", cores), n, warmup)
        api = agent.client.api
        cid = agent._envs["a"].container_id
        cpus = ",".join(map(str, cores))

        async def update() -> object:
            return await asyncio.to_thread(
                api.update_container,
                cid,
                cpuset_cpus=cpus,
                cpu_period=100000,
                cpu_quota=100000 * len(cores),
            )

        out["docker_update_only"] = await measure(update, n, warmup)
        container = agent.client.containers.get(cid)

        async def bare() -> object:
            return await asyncio.to_thread(container.exec_run, ["true"])

        out["sdk_exec_run"] = await measure(bare, n, warmup)
    finally:
        await agent.shutdown()
        await plain.shutdown()
        shutil.rmtree(state, ignore_errors=True)
    return out


async def bench_process(n: int, warmup: int, cores: tuple[int, ...]) -> dict:
    with tempfile.TemporaryDirectory() as root:
        backend = ProcessBackend(root)
        await backend.create_env("p", None, None)
        out: dict[str, object] = {
            "process": await measure(checked(backend, "p", cores), n, warmup),
            "process_cgroups": backend.cgroups is not None,
        }
        await backend.shutdown()

    async def bare() -> object:
        return subprocess.run(["true"], check=True)

    out["subprocess"] = await measure(bare, n, warmup)
    return out


async def main_async(args: argparse.Namespace) -> dict:
    cores = (min(os.sched_getaffinity(0)),)
    report: dict[str, object] = {"n": args.n, "warmup": args.warmup, "cores": list(cores)}
    try:
        report.update(await bench_docker(args.image, args.n, args.warmup, cores))
    except Exception as e:  # report it and still measure the process backend
        report["docker_error"] = f"{type(e).__name__}: {e}"
    report.update(await bench_process(args.n, args.warmup, cores))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--image", default="tangram-test:bookworm")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for key, value in report.items():
        if isinstance(value, dict):
            print(f"{key:20s} p50 {value['p50_ms']:8.2f} ms   p99 {value['p99_ms']:8.2f} ms")
        else:
            print(f"{key:20s} {value}")


if __name__ == "__main__":
    main()

"""ACT of `true` through tangramd, next to a bare baseline, measured side by side.

    python bench/exec.py [--backend process|docker] [--n 300] [--json]

process: the client-observed ACT of `exec true` (1 core, persistent environment) through a
real `tangramd up` vs a bare `subprocess.run(["true"])`; reports p50/p99 of both and of the
difference (the overhead tangram adds: socket round trip, scheduling pass, pinning).

docker: ACT of `exec true` through `tangramd up --cpu-backend docker` with (a) the exec agent
disabled (docker update + docker exec) and (b) the in-container agent, next to a bare docker
SDK `exec_run(["true"])` on a container of the same image. Needs dockerd and the test image
(.ci/docker-setup.sh). Samples are interleaved round-robin so load drifts hit all alike:
call by call on the process backend; on docker in blocks of ``DOCKER_BLOCK`` calls, because
a bare ``docker exec`` leaves dockerd, containerd and runc busy for milliseconds after it
returns, which call-by-call alternation charged to the agent path (docs/results.md,
``bench/exec.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tangram.testing import spawn_daemon

IMAGE = "tangram-test:bookworm"
DOCKER_BLOCK = 10  # docker: calls of one kind in a row (see the module docstring)


def stats(ms: list[float]) -> dict[str, float]:
    s = sorted(ms)
    return {
        "p50_ms": round(statistics.median(s), 3),
        "p99_ms": round(s[min(len(s) - 1, int(0.99 * len(s)))], 3),
    }


def _loop_config(event_loop: str) -> str:
    """The default config but for the event loop (the default, auto: no key at all, so the
    daemon of an older tree runs too)."""
    return "" if event_loop == "auto" else f'[daemon]\nevent_loop = "{event_loop}"\n'


def interleaved(
    fns: dict[str, Callable[[], None]], n: int, warmup: int, block: int = 1
) -> dict[str, list[float]]:
    """``n`` timed calls of each function after ``warmup``, round-robin in blocks of
    ``block`` calls of one function."""
    out: dict[str, list[float]] = {k: [] for k in fns}
    done = 0
    while done < warmup + n:
        count = min(block, warmup + n - done)
        for name, fn in fns.items():
            for i in range(done, done + count):
                t0 = time.perf_counter()
                fn()
                dt = (time.perf_counter() - t0) * 1e3
                if i >= warmup:
                    out[name].append(dt)
        done += count
    return out


def bench_process(n: int, warmup: int, event_loop: str = "auto") -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="tangram-bench-") as tmp:
        # the default config (adaptive 1 ms coalescing) but for the event loop
        d = spawn_daemon(tmp, _loop_config(event_loop))
        try:
            with d.client() as c:
                env = c.env_open()

                def via_tangram() -> None:
                    r = c.exec(["true"], env=env, cpus=1)
                    assert r.outcome == "ok", r

                def bare() -> None:
                    subprocess.run(["true"], check=True)

                samples = interleaved({"tangram": via_tangram, "bare": bare}, n, warmup)
                c.env_close(env)
        finally:
            d.stop()
    diff = [a - b for a, b in zip(samples["tangram"], samples["bare"], strict=True)]
    return {
        "backend": "process",
        "n": n,
        "tangram": stats(samples["tangram"]),
        "bare_subprocess": stats(samples["bare"]),
        "overhead": stats(diff),
    }


def bench_docker(n: int, warmup: int, event_loop: str = "auto") -> dict[str, object]:
    import docker

    client = docker.from_env()
    bare_ctr = client.containers.run(
        IMAGE,
        ["sleep", "infinity"],
        detach=True,
        network_mode="none",
        remove=True,
        labels={"org.arl-tangram.bench": "1"},
    )

    def sdk() -> None:
        code, _ = bare_ctr.exec_run(["true"])
        assert code == 0

    # One daemon at a time (a tangramd reconciles away containers it does not own), each
    # interleaved with the bare SDK baseline.
    cfgs = {
        "update_plus_docker_exec": "[cpu]\nexec_agent = false\n",
        "agent": "[cpu]\nexec_agent = true\n",
    }
    cfgs = {name: _loop_config(event_loop) + cfg for name, cfg in cfgs.items()}
    out: dict[str, object] = {"backend": "docker", "n": n}
    base: list[float] = []
    try:
        for name, cfg in cfgs.items():
            with tempfile.TemporaryDirectory(prefix=f"tangram-bench-{name}-") as tmp:
                d = spawn_daemon(tmp, cfg, "--cpu-backend", "docker")
                try:
                    with d.client() as c:
                        env = c.env_open(image=IMAGE)
                        cores = iter(range(10**9))

                        def run(c=c, env=env, cores=cores) -> None:
                            # alternate 1 and 2 cores so every exec re-pins the container
                            r = c.exec(["true"], env=env, cpus=1 + next(cores) % 2)
                            assert r.outcome == "ok", r

                        samples = interleaved(
                            {name: run, "sdk": sdk}, n, warmup, block=DOCKER_BLOCK
                        )
                        c.env_close(env)
                finally:
                    d.stop()
            out[name] = stats(samples[name])
            out[f"{name}_overhead"] = stats(
                [a - b for a, b in zip(samples[name], samples["sdk"], strict=True)]
            )
            base += samples["sdk"]
    finally:
        bare_ctr.kill()
    out["bare_sdk_exec_run"] = stats(base)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["process", "docker"], default="process")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument(
        "--event-loop",
        choices=["auto", "uvloop", "asyncio"],
        default="auto",
        help="the daemon's [daemon] event_loop (default: auto, uvloop where installed)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.backend == "process":
        result = bench_process(args.n, args.warmup, args.event_loop)
    else:
        result = bench_docker(max(50, args.n // 3), args.warmup, args.event_loop)
    result["event_loop"] = args.event_loop
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

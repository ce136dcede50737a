"""What isolation costs on the process backend (issue 30), side by side in one run.

    python bench/sandbox.py [--n 200] [--envs 30] [--json]

Measured (p50/p99 wall milliseconds), as root on a kernel that allows namespaces:
- env_open:      ProcessBackend.create_env with isolation on (the keeper's namespaces, the
                 overlay root, the env's cgroups), and off (a directory) for reference;
- exec:          a lone ProcessBackend.exec of ``/bin/true``, isolation on and off;
- bare_spawn:    ``os.posix_spawn("/bin/true")`` and its wait, in this process;
- overhead:      exec p50 minus bare_spawn p50, isolation on (goal <= 1.2 ms) and off;
- bwrap:         ``bwrap --unshare-all --ro-bind / / --proc /proc --dev /dev true``
                 (Debian's ``bubblewrap``), a fresh sandbox per command: the anchor; null
                 when bwrap is not installed.
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
from pathlib import Path

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tangramd.backends.base import ExecRequest
from tangramd.backends.process import ProcessBackend

CORE = (min(os.sched_getaffinity(0)),)


def summarize(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples_s)
    return {
        "p50_ms": round(statistics.median(ms), 3),
        "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 3),
        "n": len(ms),
    }


async def backend_rows(isolation: str, n: int, envs: int) -> dict[str, object]:
    root = tempfile.mkdtemp(prefix="tg-sandbox-bench-")
    backend = ProcessBackend(root, isolation=isolation)
    try:
        opens = []
        for i in range(envs):
            start = time.perf_counter()
            await backend.create_env(f"b{i}", None, 512 << 20)
            opens.append(time.perf_counter() - start)
        req = ExecRequest("b0", ["/bin/true"], CORE)
        for _ in range(20):  # warm-up: the fork server and the core's lodger
            await backend.exec(req)
        execs = []
        for _ in range(n):
            start = time.perf_counter()
            result = await backend.exec(req)
            execs.append(time.perf_counter() - start)
            assert result.outcome == "ok", result
            await asyncio.sleep(0.002)  # lone: nothing else in flight
        return {
            "isolated": backend.isolated,
            "env_open": summarize(opens),
            "exec": summarize(execs),
        }
    finally:
        await backend.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def bare_spawn(n: int) -> dict[str, float]:
    samples = []
    os.sched_setaffinity(0, CORE)
    try:
        for _ in range(n + 20):
            start = time.perf_counter()
            pid = os.posix_spawn("/bin/true", ["/bin/true"], {})
            os.waitpid(pid, 0)
            samples.append(time.perf_counter() - start)
            time.sleep(0.002)
    finally:
        os.sched_setaffinity(0, os.sched_getaffinity(os.getppid()))
    return summarize(samples[20:])


def bwrap(n: int) -> dict[str, float] | None:
    exe = shutil.which("bwrap")
    if exe is None:
        return None
    argv = [exe, "--unshare-all", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
    argv.append("true")
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        subprocess.run(argv, check=True)
        samples.append(time.perf_counter() - start)
    return summarize(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="execs per row")
    parser.add_argument("--envs", type=int, default=30, help="environments opened per row")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    # the backends' start-up lines go to stderr: stdout is the result
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    on = asyncio.run(backend_rows("namespaces", args.n, args.envs))
    off = asyncio.run(backend_rows("none", args.n, args.envs))
    bare = bare_spawn(args.n)
    anchor = bwrap(max(20, args.n // 4))
    out = {
        "isolation_on": on,
        "isolation_off": off,
        "bare_spawn": bare,
        "overhead_p50_ms": {
            "isolation_on": round(on["exec"]["p50_ms"] - bare["p50_ms"], 3),  # type: ignore[index]
            "isolation_off": round(off["exec"]["p50_ms"] - bare["p50_ms"], 3),  # type: ignore[index]
        },
        "bwrap_unshare_all_true": anchor,
        "goals": {"env_open_p50_ms": 30, "overhead_p50_ms": 1.2},
        "cpus": len(os.sched_getaffinity(0)),
        "loadavg": os.getloadavg(),
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for name in ("isolation_on", "isolation_off"):
        row = out[name]
        print(f"{name:14} env_open {row['env_open']}  exec {row['exec']}")  # type: ignore[index]
    print(f"bare_spawn     {bare}")
    print(f"overhead p50   {out['overhead_p50_ms']}")
    print(f"bwrap          {anchor}")


if __name__ == "__main__":
    main()

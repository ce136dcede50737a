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
- fork:          ``ProcessBackend.fork_env`` of an environment into G children (``--fork-g``,
                 16), isolated: an empty environment, and one holding ``--fork-size-mb``
                 (1024) MiB in ``--fork-files`` (20,000) files written by a command inside
                 it (goal: <= 150 ms in all and <= 2x the empty one). Each repetition
                 first writes a small file in the source, so that every fork freezes a new
                 layer; ``first_ms`` is the fork that froze the big tree itself.
- docker_fork:   the anchors: ``docker run --rm`` of ``true`` (no network; p50 of
                 ``DOCKER_RUNS``), ``docker commit`` of a container holding the same tree,
                 and ``DockerBackend.fork_env`` into G children (a commit and G container
                 starts); null without a reachable dockerd and its test image
                 (``.ci/docker-setup.sh``), or with ``--no-docker``.
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


def fill_script(size_mb: int, files: int) -> str:
    """A command that writes ``size_mb`` MiB in ``files`` files under ``repo/``."""
    return (
        "import os\n"
        f"n, size = {files}, ({size_mb} << 20) // {max(files, 1)}\n"
        "chunk = b'x' * size\n"
        "for i in range(n):\n"
        "    d = f'repo/d{i // 500}'\n"
        "    os.makedirs(d, exist_ok=True)\n"
        "    with open(f'{d}/f{i}', 'wb') as f:\n"
        "        f.write(chunk)\n"
    )


async def fork_rows(g: int, reps: int, size_mb: int, files: int) -> dict[str, object]:
    root = tempfile.mkdtemp(prefix="tg-fork-bench-")
    backend = ProcessBackend(root, isolation="namespaces")
    rows: dict[str, object] = {"g": g, "size_mb": size_mb, "files": files}
    try:
        for name, fill in (("empty", False), ("big", True)):
            src = f"src-{name}"
            await backend.create_env(src, None, 512 << 20)
            if fill:
                start = time.perf_counter()
                script = fill_script(size_mb, files)
                res = await backend.exec(
                    ExecRequest(src, [sys.executable, "-c", script], CORE, timeout_s=3600)
                )
                assert res.outcome == "ok", res
                rows["fill_s"] = round(time.perf_counter() - start, 3)
            samples = []
            for rep in range(reps):
                await backend.put(src, f"rep{rep}.txt", b"x")  # a change: a new layer
                kids = [f"{name}-{rep}-{i}" for i in range(g)]
                start = time.perf_counter()
                await backend.fork_env(src, kids)
                samples.append(time.perf_counter() - start)
                got = await backend.exec(ExecRequest(kids[-1], ["ls", "-A"], CORE))
                assert f"rep{rep}.txt" in got.stdout, got
                for kid in kids:
                    await backend.close_env(kid)
            rows[name] = {**summarize(samples), "first_ms": round(samples[0] * 1000, 3)}
            await backend.close_env(src)
        big, empty = rows["big"], rows["empty"]
        rows["big_over_empty_p50"] = round(big["p50_ms"] / empty["p50_ms"], 2)  # type: ignore[index]
        return rows
    finally:
        await backend.shutdown()
        shutil.rmtree(root, ignore_errors=True)


DOCKER_RUNS = 5  # docker run --rm true, per run of the bench


async def docker_fork(g: int, size_mb: int, files: int) -> dict[str, object] | None:
    try:
        import docker

        from tangramd.backends.docker import DockerBackend

        client = docker.from_env(timeout=600)
        client.ping()
        image = os.environ.get("TANGRAM_TEST_IMAGE", "tangram-test:bookworm")
        client.images.get(image)
    except Exception as exc:  # no engine, no image: no anchor
        print(f"docker anchor skipped: {exc}", file=sys.stderr)
        return None
    state = tempfile.mkdtemp(prefix="tgdf-", dir="/tmp")
    backend = DockerBackend(
        client=client, default_image=image, label="org.arl-tangram.bench", state_dir=state,
        api_timeout_s=600,
    )  # fmt: skip
    try:
        runs = []
        for _ in range(DOCKER_RUNS):
            start = time.perf_counter()
            await asyncio.to_thread(
                client.containers.run, image, "true", remove=True, network_mode="none"
            )
            runs.append(time.perf_counter() - start)
        await backend.create_env("src", None, 2 << 30)
        script = fill_script(size_mb, files)
        res = await backend.exec(
            ExecRequest("src", ["python3", "-c", script], CORE, timeout_s=3600)
        )
        assert res.outcome == "ok", res
        cid = backend._envs["src"].container_id
        start = time.perf_counter()
        made = await asyncio.to_thread(client.api.commit, cid, repository="tangram-bench")
        commit_s = time.perf_counter() - start
        client.api.remove_image(made["Id"], force=True)
        kids = [f"k{i}" for i in range(g)]
        start = time.perf_counter()
        await backend.fork_env("src", kids)
        fork_s = time.perf_counter() - start
        return {
            "run_rm_p50_ms": summarize(runs)["p50_ms"],
            "commit_ms": round(commit_s * 1000, 1),
            "fork_g_ms": round(fork_s * 1000, 1),
        }
    finally:
        await backend.shutdown()
        shutil.rmtree(state, ignore_errors=True)


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
    parser.add_argument("--fork-g", type=int, default=16, help="children of each fork")
    parser.add_argument("--fork-reps", type=int, default=5, help="forks per row (<= 15)")
    parser.add_argument("--fork-size-mb", type=int, default=1024, help="the big environment")
    parser.add_argument("--fork-files", type=int, default=20000, help="files in the big one")
    parser.add_argument("--no-docker", action="store_true", help="skip the docker anchor")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    # the backends' start-up lines go to stderr: stdout is the result
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    on = asyncio.run(backend_rows("namespaces", args.n, args.envs))
    off = asyncio.run(backend_rows("none", args.n, args.envs))
    bare = bare_spawn(args.n)
    anchor = bwrap(max(20, args.n // 4))
    fork = asyncio.run(fork_rows(args.fork_g, args.fork_reps, args.fork_size_mb, args.fork_files))
    dock = (
        None
        if args.no_docker
        else asyncio.run(docker_fork(args.fork_g, args.fork_size_mb, args.fork_files))
    )
    out = {
        "isolation_on": on,
        "isolation_off": off,
        "bare_spawn": bare,
        "overhead_p50_ms": {
            "isolation_on": round(on["exec"]["p50_ms"] - bare["p50_ms"], 3),  # type: ignore[index]
            "isolation_off": round(off["exec"]["p50_ms"] - bare["p50_ms"], 3),  # type: ignore[index]
        },
        "bwrap_unshare_all_true": anchor,
        "fork": fork,
        "docker_fork": dock,
        "goals": {
            "env_open_p50_ms": 30,
            "overhead_p50_ms": 1.2,
            "fork_g16_big_ms": 150,
            "fork_big_over_empty": 2,
        },
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
    print(f"fork           {fork}")
    print(f"docker_fork    {dock}")


if __name__ == "__main__":
    main()

"""Session commands: their overhead over a plain exec, and SWE-ReX's client against the
gateway and against ``swerex-remote``, side by side in one run. Prints JSON.

    python bench/session.py [--n 200] [--concurrent 8] [--sleep 0.5] [--repeat 3]

One daemon (process backend), ``tangramd http`` in front of it, and SWE-ReX's own server
``swerex-remote`` on a loopback port, all started here.

- ``client``: ``Client.exec("true", env=e, session=s)`` and ``Client.exec("true", env=e)``
  in one environment, interleaved; p50 of each and of the per-round difference
  (``overhead``: what the session adds over a plain exec; goal <= 1 ms).
- ``swerex``: ``RemoteRuntime.run_in_session(BashAction("true"))`` against the gateway
  and against ``swerex-remote``, interleaved; p50 of each and ``ratio`` (goal <= 0.25).
- ``concurrent``: ``--concurrent`` session commands ``sleep --sleep`` at once, one in each
  of as many sessions, through ``RemoteRuntime``; wall time on each and ``ratio`` (goal
  <= 0.5). Each command is one exec action on one core: with fewer cores than commands
  they run in rounds (here: ``cores``).

Each figure is the median over ``--repeat`` repetitions (each with ``--n`` samples).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
from swerex.runtime.abstract import BashAction, CreateBashSessionRequest
from swerex.runtime.remote import RemoteRuntime

from tangram.client import Client
from tangram.testing import free_port, spawn_daemon, spawn_gateway, wait_for

KEY = "bench-key"


def p50(ms: list[float]) -> float:
    return round(statistics.median(ms), 3)


def client_rounds(socket: str, n: int, warmup: int) -> dict[str, float]:
    """Session exec vs plain exec of ``true`` in one environment, interleaved."""
    with Client(socket) as c:
        env = c.env_open()
        sid = c.session_open(env)
        session: list[float] = []
        plain: list[float] = []
        try:
            for i in range(warmup + n):
                t0 = time.perf_counter()
                r = c.exec("true", env=env, session=sid)
                t1 = time.perf_counter()
                q = c.exec("true", env=env)
                t2 = time.perf_counter()
                assert r.exit_code == 0 and q.exit_code == 0, (r, q)
                if i >= warmup:
                    session.append((t1 - t0) * 1e3)
                    plain.append((t2 - t1) * 1e3)
        finally:
            c.session_close(sid)
            c.env_close(env)
    return {
        "session_p50_ms": p50(session),
        "plain_p50_ms": p50(plain),
        "overhead_p50_ms": p50([a - b for a, b in zip(session, plain, strict=True)]),
    }


async def _runtime_ours(url: str) -> RemoteRuntime:
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{url}/envs", json={}, headers={"X-API-Key": KEY}, timeout=60)
        assert r.status_code == 200, r.text
        opened = r.json()
    return RemoteRuntime(host=opened["swerex_url"], timeout=60, auth_token=KEY)


async def swerex_rounds(
    ours: RemoteRuntime, ref: RemoteRuntime, n: int, warmup: int, name: str
) -> dict[str, float]:
    """``run_in_session(BashAction("true"))`` on each server, interleaved."""
    took: dict[str, list[float]] = {"ours": [], "ref": []}
    for rt in (ours, ref):
        await rt.create_session(CreateBashSessionRequest(session=name))
    for i in range(warmup + n):
        for side, rt in (("ours", ours), ("ref", ref)):
            t0 = time.perf_counter()
            obs = await rt.run_in_session(BashAction(command="true", session=name))
            dt = (time.perf_counter() - t0) * 1e3
            assert obs.exit_code == 0, (side, obs)
            if i >= warmup:
                took[side].append(dt)
    a, b = p50(took["ours"]), p50(took["ref"])
    return {"gateway_p50_ms": a, "swerex_remote_p50_ms": b, "ratio": round(a / b, 4)}


async def concurrent_wall(rt: RemoteRuntime, k: int, sleep_s: float, tag: str) -> float:
    names = [f"{tag}{i}" for i in range(k)]
    for name in names:
        await rt.create_session(CreateBashSessionRequest(session=name))
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(rt.run_in_session(BashAction(command=f"sleep {sleep_s}", session=s)) for s in names)
    )
    wall = time.perf_counter() - t0
    assert all(r.exit_code == 0 for r in results), results
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="latency samples per repetition")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--concurrent", type=int, default=8, help="concurrent session commands")
    parser.add_argument("--sleep", type=float, default=0.5, help="each concurrent command's sleep")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions (medians reported)")
    args = parser.parse_args()
    for name in ("n", "concurrent", "repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    with tempfile.TemporaryDirectory(prefix="tangram-bench-session-") as tmp:
        key = Path(tmp) / "key"
        key.write_text(KEY)
        daemon = spawn_daemon(Path(tmp) / "d", "")
        port = free_port()
        ref_proc = subprocess.Popen(
            ["swerex-remote", "--host", "127.0.0.1", "--port", str(port), "--auth-token", KEY],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp,
        )  # fmt: skip
        try:
            with spawn_gateway(daemon.socket, tmp, "--api-key-file", str(key)) as gw:
                ref = RemoteRuntime(host="http://127.0.0.1", port=port, auth_token=KEY, timeout=60)

                def ref_alive() -> bool:
                    return bool(asyncio.run(ref.is_alive()).is_alive)

                wait_for(ref_alive, 60, "swerex-remote answering", every_s=0.1,
                         ignore=(Exception,))  # fmt: skip
                with Client(daemon.socket) as c:
                    cores = int(c.status()["pools"]["cpu:local"]["capacity"])
                reps: list[dict[str, Any]] = []
                load_before = os.getloadavg()[0]
                for rep in range(args.repeat):
                    row: dict[str, Any] = {
                        "client": client_rounds(daemon.socket, args.n, args.warmup)
                    }

                    async def through_swerex(rep: int = rep) -> dict[str, Any]:
                        ours = await _runtime_ours(gw.url)
                        try:
                            lat = await swerex_rounds(ours, ref, args.n, args.warmup, f"lat{rep}")
                            tag = f"c{rep}_"
                            mine = await concurrent_wall(ours, args.concurrent, args.sleep, tag)
                            theirs = await concurrent_wall(ref, args.concurrent, args.sleep, tag)
                        finally:
                            await ours.close()
                            await ref.close()  # its sessions end; the server stays
                        return {
                            "swerex": lat,
                            "concurrent": {
                                "gateway_wall_s": round(mine, 4),
                                "swerex_remote_wall_s": round(theirs, 4),
                                "ratio": round(mine / theirs, 4),
                            },
                        }

                    row.update(asyncio.run(through_swerex()))
                    reps.append(row)
        finally:
            ref_proc.terminate()
            ref_proc.wait(10)
            daemon.stop()

    def med(section: str) -> dict[str, float]:
        keys = reps[0][section].keys()
        return {k: round(statistics.median(r[section][k] for r in reps), 4) for k in keys}

    report = {
        "backend": "process",
        "n": args.n,
        "repeat": args.repeat,
        "concurrent_commands": args.concurrent,
        "sleep_s": args.sleep,
        "cores": cores,
        "client": med("client"),
        "swerex": med("swerex"),
        "concurrent": med("concurrent"),
        "goals": {"client.overhead_p50_ms": 1.0, "swerex.ratio": 0.25, "concurrent.ratio": 0.5},
        "loadavg": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "repetitions": reps,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

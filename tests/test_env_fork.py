"""Fork and reset of environments (issue 30 item 3): the process backend's overlay layers
(isolated, the default) and copies (``isolation = "none"``), then the ops through a real
daemon, its CLI and its clients. Real namespaces, real mounts, real processes."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from tangramd.backends.base import EnvError, ExecRequest
from tangramd.backends.nsfork import LAYERS, PLAIN
from tangramd.backends.process import ProcessBackend
from tangramd.config import load_config
from tangramd.runtime import make_backend


def backend_for(state: Path, isolation: str) -> ProcessBackend:
    overrides = {"daemon.state_dir": str(state), "cpu.isolation": isolation}
    backend = make_backend(load_config(None, overrides))
    assert isinstance(backend, ProcessBackend)
    assert backend.isolated == (isolation != "none")
    return backend


async def sh(b: ProcessBackend, env: str, cmd: str) -> str:
    res = await b.exec(ExecRequest(env, ["sh", "-c", cmd], (min(os.sched_getaffinity(0)),)))
    assert res.outcome == "ok", res
    return res.stdout


def layers(b: ProcessBackend) -> list[str]:
    return [p.name for p in b.forks.dir.iterdir() if not p.name.startswith(".")]


@pytest.mark.parametrize("isolation", ["namespaces", "none"])
def test_fork_reset_close(tmp_path: Path, isolation: str) -> None:
    b = backend_for(tmp_path / "state", isolation)
    isolated = isolation != "none"

    async def main() -> None:
        await b.create_env("src", None, 256 << 20)
        # files in the home (put and a command's) and, isolated, in the root (/tmp, /srv)
        await b.put("src", "repo/a.txt", b"from source\n")
        await sh(b, "src", "mkdir -p deps && echo installed > deps/lib.txt")
        if isolated:
            await sh(
                b, "src", "echo tmp > /tmp/t.txt && mkdir /testbed && echo srv > /testbed/s.txt"
            )
        await b.fork_env("src", ["c1", "c2"])
        for child in ("c1", "c2"):
            assert await sh(b, child, "cat repo/a.txt deps/lib.txt") == "from source\ninstalled\n"
            assert (await b.get(child, "repo/a.txt", max_bytes=1 << 20))[0] == b"from source\n"
            if isolated:
                assert await sh(b, child, "cat /tmp/t.txt /testbed/s.txt") == "tmp\nsrv\n"
        # writes after the fork: each sees its own only
        await sh(b, "c1", "echo c1 > repo/a.txt && echo new > repo/c1.txt && rm deps/lib.txt")
        await b.put("c2", "repo/a.txt", b"c2\n")
        await sh(b, "src", "echo src > repo/a.txt")
        assert await sh(b, "src", "cat repo/a.txt deps/lib.txt") == "src\ninstalled\n"
        assert await sh(b, "c2", "cat repo/a.txt deps/lib.txt; ls repo") == "c2\ninstalled\na.txt\n"
        assert await sh(b, "c1", "cat repo/a.txt; ls repo; ls -A deps") == "c1\na.txt\nc1.txt\n"
        if isolated:  # the host's root under the layers: untouched, and still there
            await sh(b, "c1", "echo c1 > /testbed/s.txt && rm /tmp/t.txt")
            assert await sh(b, "c2", "cat /testbed/s.txt /tmp/t.txt; ls /usr/bin/env") == (
                "srv\ntmp\n/usr/bin/env\n"
            )
            assert not os.path.exists("/testbed/s.txt")
        # reset: back to the fork point
        await b.reset_env("c1")
        assert await sh(b, "c1", "cat repo/a.txt deps/lib.txt; ls repo") == (
            "from source\ninstalled\na.txt\n"
        )
        await b.reset_env("src")  # the source's fork point is the fork too
        assert await sh(b, "src", "cat repo/a.txt") == "from source\n"
        # a fork of a child: its own writes and its layers'
        await sh(b, "c2", "echo grand > g.txt")
        await b.fork_env("c2", ["g1"])
        assert await sh(b, "g1", "cat g.txt repo/a.txt") == "grand\nc2\n"
        # closing the source keeps the children working; the layers go with the last one
        await b.close_env("src")
        assert await sh(b, "c1", "cat repo/a.txt") == "from source\n"
        assert layers(b)
        for env in ("c1", "c2", "g1"):
            await b.close_env(env)
        assert layers(b) == []
        assert not [p for p in b.envs_dir.iterdir() if not p.name.startswith(".")]

    async def run() -> None:
        try:
            await main()
        finally:  # (its homes unmounted, whatever failed)
            await b.shutdown()

    asyncio.run(run())


@pytest.mark.parametrize("isolation", ["namespaces", "none"])
def test_reset_never_forked_and_refusals(tmp_path: Path, isolation: str) -> None:
    b = backend_for(tmp_path / "state", isolation)

    async def main() -> None:
        await b.create_env("e", None, 256 << 20)
        await b.put("e", "x/y.txt", b"y")
        if isolation != "none":
            await sh(b, "e", "echo t > /tmp/t && echo o > /o")
        await b.reset_env("e")  # back to its opening: empty
        assert await sh(b, "e", "ls -A .") == ""
        if isolation != "none":
            assert await sh(b, "e", "ls /tmp/t /o 2>/dev/null; echo end") == "end\n"
        # a session open in it: refused, with the reason
        await b.open_session("e", "s1")
        with pytest.raises(EnvError, match="session"):
            await b.fork_env("e", ["f"])
        with pytest.raises(EnvError, match="session"):
            await b.reset_env("e")
        await b.close_session("s1")
        with pytest.raises(EnvError, match="no such environment"):
            await b.fork_env("nope", ["f"])
        await b.fork_env("e", ["f"])
        with pytest.raises(EnvError, match="exists"):
            await b.fork_env("e", ["f"])

    async def run() -> None:
        try:
            await main()
        finally:  # (its homes unmounted, whatever failed)
            await b.shutdown()

    asyncio.run(run())


def test_depth_is_bounded(tmp_path: Path) -> None:
    from tangramd.backends.nsfork import MAX_LAYERS

    b = backend_for(tmp_path / "state", "namespaces")

    async def main() -> None:
        await b.create_env("d0", None, 64 << 20)
        env = "d0"
        for depth in range(1, MAX_LAYERS + 1):
            await b.put(env, f"f{depth}", b"x")  # a change: a new layer at each fork
            await b.fork_env(env, [f"d{depth}"])
            env = f"d{depth}"
        assert await sh(b, env, "ls | wc -l") == f"{MAX_LAYERS}\n"
        await b.put(env, "more", b"x")
        with pytest.raises(EnvError, match="MAX_LAYERS"):
            await b.fork_env(env, ["too-deep"])

    async def run() -> None:
        try:
            await main()
        finally:  # (its homes unmounted, whatever failed)
            await b.shutdown()

    asyncio.run(run())


def test_layers_dir_names() -> None:
    assert LAYERS.startswith(".") and PLAIN.startswith(".")


# --- through a real daemon: ops, story, CLI, sync and async clients -----------------------


def ctl(sock: str, *args: str):
    from click.testing import CliRunner

    from tangramctl.main import cli

    return CliRunner().invoke(cli, ["--socket", sock, *args], catch_exceptions=False)


def test_daemon_fork_reset_story_cli(daemon) -> None:
    import json

    from tangram.protocol.errors import BadRequest, NotFound

    c = daemon.client()
    src = c.env_open()
    c.put(src, "repo/setup.txt", b"prepared\n")
    ids = c.env_fork(src, n=3)
    assert len(ids) == 3 and len(set(ids)) == 3 and src not in ids
    for child in ids:
        assert c.exec(["cat", "repo/setup.txt"], env=child).stdout == "prepared\n"
    c.exec(["sh", "-c", "echo mine > repo/setup.txt"], env=ids[0])
    assert c.exec(["cat", "repo/setup.txt"], env=ids[1]).stdout == "prepared\n"
    c.env_reset(ids[0])
    assert c.exec(["cat", "repo/setup.txt"], env=ids[0]).stdout == "prepared\n"
    # the story shows the fork on both sides, and the reset
    assert f"into 3: {', '.join(ids)}" in json.dumps(c.story(src))
    assert f"forked from {src}" in json.dumps(c.story(ids[0]))
    assert "reset" in json.dumps(c.story(ids[0]))
    # errors: unknown env, bad n
    with pytest.raises(NotFound):
        c.env_fork("e" + "0" * 32)
    with pytest.raises(NotFound):
        c.env_reset("e" + "0" * 32)
    for bad in (0, -1, 257, "2", 1.5):
        with pytest.raises(BadRequest, match="n: expected int"):
            c.request("env.fork", {"env": src, "n": bad})
    # a session open in the source: refused, naming why
    session = c.session_open(src)
    with pytest.raises(BadRequest, match="session"):
        c.env_fork(src)
    c.session_close(session)
    # CLI --json shapes
    r = ctl(daemon.socket, "env", "fork", src, "-n", "2", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert set(out) == {"ids", "fork_s"} and len(out["ids"]) == 2 and out["fork_s"] >= 0
    r = ctl(daemon.socket, "env", "reset", out["ids"][0], "--json")
    assert r.exit_code == 0 and json.loads(r.output) == {"id": out["ids"][0], "reset": True}
    r = ctl(daemon.socket, "env", "fork", src)
    assert r.exit_code == 0 and len(r.output.split()) == 1
    # closing the source keeps the children
    c.env_close(src)
    assert c.exec(["cat", "repo/setup.txt"], env=ids[2]).stdout == "prepared\n"
    for env in [*ids, *out["ids"], r.output.strip()]:
        c.env_close(env)
    state = Path(daemon.socket).parent
    layers_dirs = list(state.rglob(LAYERS))
    assert layers_dirs and all(
        not [p for p in d.iterdir() if not p.name.startswith(".")] for d in layers_dirs
    )


def test_async_client_fork_reset(daemon) -> None:
    from tangram.client import AsyncClient

    async def main() -> None:
        async with AsyncClient(daemon.socket) as ac:
            src = await ac.env_open()
            await ac.put(src, "a.txt", b"a")
            (child,) = await ac.env_fork(src)
            await ac.put(child, "b.txt", b"b")
            await ac.env_reset(child)
            res = await ac.exec(["ls"], env=child)
            assert res.stdout == "a.txt\n"
            for env in (src, child):
                await ac.env_close(env)

    asyncio.run(main())


def test_kept_forks_survive_a_restart(tmp_path: Path) -> None:
    """A daemon that stops keeping its environments unmounts the forked homes; the next one
    on the same state dir mounts them again over the same layers."""
    state = tmp_path / "state"
    first = backend_for(state, "namespaces")

    async def before() -> None:
        await first.create_env("src", None, 64 << 20)
        await first.put("src", "f.txt", b"kept\n")
        await first.fork_env("src", ["kid"])
        await first.put("kid", "g.txt", b"mine\n")
        await first.shutdown(keep=["src", "kid"])

    asyncio.run(before())
    assert not os.path.ismount(first.envs_dir / "kid")
    second = backend_for(state, "namespaces")

    async def after() -> None:
        try:
            await second.reconcile({"src": None, "kid": None})
            assert await sh(second, "kid", "cat f.txt g.txt") == "kept\nmine\n"
            assert await sh(second, "src", "cat f.txt; ls") == "kept\nf.txt\n"
            await second.reset_env("kid")
            assert await sh(second, "kid", "ls") == "f.txt\n"
        finally:
            await second.shutdown()
        assert layers(second) == []

    asyncio.run(after())


# --- the core alone: placement, the group's answer, refusals --------------------------------


def _core(mem_gib: int = 8, **cfg):
    from tangram.pools.cpu import CpuCluster, CpuNodePool
    from tangramd.state import Core, CoreConfig

    cluster = CpuCluster([CpuNodePool("local", [[0, 1]], mem_gib << 30)])
    return Core(cluster, {}, CoreConfig(**cfg))


def _opened(core, now: float = 0.0) -> str:
    from tangramd import events as ev

    (create,) = core.handle(ev.OpenEnv(token=1, mem=1 << 30), now)
    core.handle(ev.EnvCreated(env_id=create.env_id), now)
    return create.env_id


def test_core_fork_places_children_and_answers_once() -> None:
    from tangramd import events as ev

    core = _core()
    src = _opened(core)
    out = core.handle(ev.ForkEnv(token=2, env_id=src, n=3), 1.0)
    creates = [c for c in out if isinstance(c, ev.CreateEnv)]
    assert len(creates) == 3 and all(c.fork_of == src and c.mem == 1 << 30 for c in creates)
    assert [c for c in out if isinstance(c, ev.Reply)] == []
    for i, create in enumerate(creates):
        out = core.handle(ev.EnvCreated(env_id=create.env_id), 1.5 + i)
        core.validate()
    (reply,) = [c for c in out if isinstance(c, ev.Reply)]
    assert reply.token == 2 and reply.error is None
    assert reply.result == {"ids": [c.env_id for c in creates], "fork_s": 2.5}
    # 4 GiB held of 8: a fork of 5 more does not fit now, and takes nothing
    (refused,) = core.handle(ev.ForkEnv(token=3, env_id=src, n=5), 5.0)
    assert refused.error[0] == "unschedulable" and "room for 4" in refused.error[1]
    assert len([e for e in core.envs if e.state != "closed"]) == 4
    core.validate()


def test_core_fork_refusals() -> None:
    from tangramd import events as ev

    core = _core()
    src = _opened(core)
    core.handle(ev.SubmitExec(spec=_spec(src), token=5), 1.0)  # placed: an action not done
    (reply,) = [
        c for c in core.handle(ev.ForkEnv(token=6, env_id=src), 1.1) if isinstance(c, ev.Reply)
    ]
    assert reply.error[0] == "bad_request" and "action(s) not done" in reply.error[1]
    (reply,) = core.handle(ev.ForkEnv(token=7, env_id="e" + "1" * 32), 1.2)
    assert reply.error[0] == "not_found"
    coordinator = _core(forks=False)
    src = _opened(coordinator)
    (reply,) = coordinator.handle(ev.ForkEnv(token=8, env_id=src), 0.5)
    assert reply.error[0] == "bad_request" and "cluster coordinator" in reply.error[1]


def _spec(env: str):
    from tangram.protocol.results import ExecSpec

    return ExecSpec(cmd="sleep 10", env=env)

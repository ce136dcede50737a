"""The state package's shape: pure at import, one handler per event, every record born
through its table with a cause, and one story log for every record kind."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tangram.pools.api import ApiPool
from tangram.pools.cpu import CpuCluster, CpuNodePool
from tangram.protocol.results import ExecResult, ExecSpec
from tangramd import events as ev
from tangramd.state import Core, CoreConfig
from tangramd.state.actions import ACTION_EDGES
from tangramd.state.dispatch import HANDLERS, OWNERS
from tangramd.state.envs import ENV_EDGES
from tangramd.state.leases import LEASE_EDGES
from tangramd.state.sessions import SESSION_EDGES
from tangramd.state.story import transition
from tangramd.statedoc import states_of

ROOT = Path(__file__).resolve().parent.parent
STATE = ROOT / "tangramd" / "state"
GIB = 1 << 30
IO_MODULES = (
    "asyncio",
    "subprocess",
    "socket",
    "selectors",
    "ssl",
    "threading",
    "logging",
    "structlog",
    "torch",
    "http",
    "fastapi",
    "uvicorn",
    "docker",
)


def make_core() -> Core:
    cluster = CpuCluster([CpuNodePool("local", [[0, 1]], 8 * GIB)])
    apis = {"search": ApiPool("search", concurrency=1, quota=0, period_s=60.0)}
    return Core(cluster, apis, CoreConfig())


def test_importing_the_state_package_loads_no_io_module() -> None:
    """``import tangramd.state`` in a fresh interpreter adds no asyncio, subprocess, socket,
    threading, logging, structlog, torch or http module to those the interpreter had."""
    code = (
        "import sys, json\n"
        "before = set(sys.modules)\n"
        "import tangramd.state\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    loaded = json.loads(out)
    assert "tangramd.state.core" in loaded  # the import did happen
    bad = [m for m in loaded if m.split(".")[0] in IO_MODULES]
    assert bad == []


def test_every_event_type_has_exactly_one_handler() -> None:
    """The dispatch table covers every event of tangramd.events, and nothing else."""
    events = {
        cls
        for _, cls in inspect.getmembers(ev, inspect.isclass)
        if issubclass(cls, ev.Event) and cls is not ev.Event and cls.__module__ == ev.__name__
    }
    assert set(HANDLERS) == events
    assert all(OWNERS[e].startswith("tangramd.state.") for e in events)


def test_every_record_is_born_in_new_through_its_table() -> None:
    """Each table has one initial state, ``new``: births are edges like any other."""
    for edges in (ACTION_EDGES, ENV_EDGES, LEASE_EDGES, SESSION_EDGES):
        initial, _ = states_of(edges)
        assert initial == ["new"], edges
    from tangramd.state.envs import EnvRec
    from tangramd.state.leases import LeaseRec
    from tangramd.state.sessions import SessionRec

    for rec in (EnvRec, LeaseRec, SessionRec):
        state = next(f for f in dataclasses.fields(rec) if f.name == "state")
        assert state.default == "new", rec


def test_transition_requires_a_cause_and_every_call_gives_one() -> None:
    """``cause`` has no default, and every transition call in the package passes it."""
    assert inspect.signature(transition).parameters["cause"].default is inspect.Parameter.empty
    calls = 0
    for path in STATE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "transition":
                calls += 1
                given = len(node.args) + len(node.keywords)
                assert given == 6, f"{path.name}:{node.lineno} gives {given} arguments"
    assert calls >= 5


def test_story_tells_an_environment_a_session_and_a_lease() -> None:
    """``story`` takes any record id: an environment, a session, a lease and an action each
    give their transitions with the cause of each entry."""
    core = make_core()
    (create,) = core.handle(ev.OpenEnv(token=1), 0.0)
    env_id = create.env_id
    core.handle(ev.EnvCreated(env_id=env_id), 0.1)
    (start,) = core.handle(ev.OpenSession(env_id=env_id, token=2), 0.2)
    core.handle(ev.SessionOpened(session_id=start.session_id), 0.3)
    core.handle(ev.AcquireLease(api="search", token=3), 0.4)
    (grant,) = core.handle(ev.Tick(), 0.5)
    core.handle(ev.SubmitExec(spec=ExecSpec(cmd="true", env=env_id), token=4), 0.6)
    (run,) = core.handle(ev.Tick(), 0.7)
    core.handle(ev.ExecFinished(action_id=run.action_id, result=ExecResult("ok", 0, 0.1)), 0.8)
    core.handle(ev.CloseEnv(env_id=env_id, token=5), 0.9)
    (gone,) = [c for c in core.handle(ev.EnvRemoved(env_id=env_id), 1.0) if isinstance(c, ev.Reply)]

    env = core.read.story(env_id, origin=0.0)
    assert env["kind"] == "environment" and env["state"] == "closed"
    steps = [(e["from"], e["event"]) for e in env["events"]]
    assert steps == [
        ("new", "creating"),
        ("creating", "ready"),
        ("ready", "closing"),
        ("closing", "closed"),
    ]
    assert all(e["cause"] > 0 for e in env["events"])

    session = core.read.story(start.session_id, origin=0.0)
    assert session["kind"] == "session" and session["state"] == "closed"
    assert [e["event"] for e in session["events"]] == ["opening", "open", "closed"]

    lease = core.read.story(grant.result["lease_id"], origin=0.0)
    assert lease["kind"] == "lease" and lease["state"] == "running"
    events = [e["event"] for e in lease["events"]]
    assert events[:2] == ["submitted", "waiting"] and "granted" in events

    action = core.read.story(run.action_id, origin=0.0)
    assert action["kind"] == "action" and action["outcome"] == "ok"
    assert gone.result == {"closed": True}


def test_story_of_an_unknown_id_names_what_it_accepts() -> None:
    """An unknown id is ``not_found``, saying which ids a story exists for."""
    from tangram.protocol.errors import NotFound

    with pytest.raises(NotFound, match="environment, session or lease"):
        make_core().read.story("e999", origin=0.0)


def test_a_lost_node_is_recorded_by_commands_not_by_the_executor(tmp_path: Path) -> None:
    """Persistence is commands in every mode: losing a node emits ``RecordEnv`` for its
    persistent environments (lost for good, with ``lost_node``), and the coordinator's
    SQLite sink stores exactly that record."""
    from tangramd.cluster.store import Store, StoreEnvRecords

    core = Core(CpuCluster([]), {}, CoreConfig())
    core.handle(ev.NodeJoined(node="a", cores_by_numa=((0, 1),), mem_bytes=8 * GIB), 0.0)
    (create,) = core.handle(ev.OpenEnv(token=1), 0.1)
    out = core.handle(ev.EnvCreated(env_id=create.env_id), 0.2)
    (created,) = [c for c in out if isinstance(c, ev.RecordEnv)]
    assert created.record is not None and created.record["lost_node"] == ""

    out = core.handle(ev.NodeLost(node="a", why="test"), 1.0)
    (lost,) = [c for c in out if isinstance(c, ev.RecordEnv)]
    assert lost.env_id == create.env_id
    assert lost.record is not None and lost.record["lost_node"] == "a"

    sink = StoreEnvRecords(Store(str(tmp_path)))
    for cmd in (created, lost):
        sink.put(cmd.env_id, cmd.record)
    (row,) = sink.load().values()
    assert row["id"] == create.env_id and row["node"] == "a" and row["lost_node"] == "a"
    sink.put(create.env_id, None)
    assert sink.load() == {}


def test_tangramctl_story_tells_any_record_of_a_real_daemon(daemon) -> None:
    """On a real ``tangramd up``, ``tangramctl story --json`` takes an environment, a
    session, a lease or an action id and says which kind it is, with every transition."""
    from click.testing import CliRunner

    from tangramctl.main import cli

    def story(record_id: str) -> dict:
        result = CliRunner().invoke(
            cli, ["--socket", daemon.socket, "story", record_id, "--json"], catch_exceptions=False
        )
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    with daemon.client() as c:
        env_id = c.env_open()
        session = c.session_open(env_id)
        action = c.exec("true", env=env_id)
        lease = c.acquire_lease("search")
        c.release_lease(lease)
        c.session_close(session)
        c.env_close(env_id)

    env = story(env_id)
    assert env["kind"] == "environment" and env["state"] == "closed"
    assert [e["event"] for e in env["events"]] == ["creating", "ready", "closing", "closed"]
    assert story(session)["kind"] == "session"
    assert [e["event"] for e in story(session)["events"]] == [
        "opening",
        "open",
        "closing",
        "closed",
    ]
    leased = story(lease)
    assert leased["kind"] == "lease" and leased["outcome"] == "ok"
    assert {"waiting", "granted", "released"} <= {e["event"] for e in leased["events"]}
    ran = story(action.action_id)
    assert ran["kind"] == "action" and ran["outcome"] == "ok"

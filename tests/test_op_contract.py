"""Every op's documented result fields are exactly what the real daemon sends."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
from harness import running_daemon

from tangram import AsyncClient, Client
from tangram.protocol import OPS, ExecSpec
from tangram.protocol.ops import _EXEC_ARGS
from tangram.protocol.results import EXEC_ARG_FIELDS

SERVICES = Path(__file__).parent / "data" / "services"
GPU_CONFIG = "[gpu]\nsimulated = { count = 2, mem_gb = 0.1 }\nnvml = false\n"
PROFILE = {
    "name": "p",
    "dop": {"1": 2.0, "2": 1.1},
    "t1_s": 2.0,
    "eff": {"1": 1.0, "2": 0.9},
    "speedup": {"1": 1.0, "2": 1.8},
    "elastic": True,
}


# Served by `tangramd coordinator` only (tests/test_cluster.py and tests/test_ray.py hold
# them to their docs there).
COORDINATOR_ONLY = {"cluster.join", "node.lost", "node.forget"}


def test_every_documented_result_is_what_the_daemon_sends(tmp_path) -> None:
    """Call each op of the table on a real `tangramd up`; its result keys equal the doc's."""
    with running_daemon(tmp_path, config=GPU_CONFIG) as daemon, daemon.client() as c:
        env = c.env_open()
        result = c.request("exec", {"cmd": "true", "env": env})
        service = {"name": "s", "runtime": "torch", "mem_gb": 0.01, "entry": "tiny_services:small"}
        registered = c.request("service.register", {**service, "path": str(SERVICES)})
        called = c.request("call", {"name": "s", "payload": {"x": 1}})
        session = c.request("session.open", {"env": env})
        lease = c.request("lease.acquire", {"api": "search"})  # its TTL is 2 s: take it last
        args: dict[str, dict[str, Any]] = {
            "story": {"action_id": result["action_id"]},
            "env.close": {"id": env},
            "lease.release": {"lease_id": lease["lease_id"]},
            "profile.get": {"name": "p"},
            "node.drain": {"name": "local"},
            "node.undrain": {"name": "local"},
            "service.set_eff": {"name": "s", "eff": "1:1"},
            "service.remove": {"name": "s"},
            "cancel": {"id": result["action_id"]},  # ended: answered with its outcome
        }
        answers = {
            "exec": result,
            "lease.acquire": lease,
            "session.open": session,
            "service.register": registered,
            "call": called,
        }
        # the environment's own ops before env.close
        answers["env.put"] = c.request("env.put", {"id": env, "path": "f", "data": b"x"})
        answers["env.get"] = c.request("env.get", {"id": env, "path": "f"})
        answers["session.interrupt"] = c.request("session.interrupt", {"id": session["id"]})
        answers["session.close"] = c.request("session.close", {"id": session["id"]})
        answers["env.fork"] = c.request("env.fork", {"env": env, "n": 1})  # (no session now)
        answers["env.reset"] = c.request("env.reset", {"env": answers["env.fork"]["ids"][0]})
        answers["profile.save"] = c.request("profile.save", PROFILE)  # before profile.get
        renew = {"lease": lease["lease_id"], "ttl_s": 5.0}
        answers["lease.renew"] = c.request("lease.renew", renew)  # before lease.release
        for op in [o for o in OPS if o not in answers and o not in COORDINATOR_ONLY]:
            answers[op] = c.request(op, args.get(op, {}))
        assert set(answers) | COORDINATOR_ONLY == set(OPS)
        for op, answer in answers.items():
            assert sorted(answer) == sorted(OPS[op].result_fields), op
        # the second form of a result: cancel of a job's actions (none left: an empty list)
        variants = {"cancel": {"job": "default", "all": True}}
        assert {op for op, spec in OPS.items() if spec.variant} == set(variants)
        for op, op_args in variants.items():
            fields = [item.split(":", 1)[0] for item in OPS[op].variant[1]]  # type: ignore[index]
            assert sorted(c.request(op, op_args)) == sorted(fields), op


def test_exec_args_are_the_exec_spec() -> None:
    """The op table's exec args are the fields of ExecSpec, in order (one shape, one place)."""
    assert tuple(arg.name for arg in _EXEC_ARGS) == EXEC_ARG_FIELDS
    spec = ExecSpec(cmd=["ls"], cpus=(1, 4), eff={1: 1.0, 2: 0.9}, env_vars={"A": "b"})
    assert ExecSpec.from_wire(spec.to_wire()) == spec


@pytest.mark.parametrize("name", [n for n in dir(Client) if not n.startswith("_")])
def test_both_clients_take_the_same_arguments(name: str) -> None:
    """Client and AsyncClient offer the same methods with the same parameters."""
    assert hasattr(AsyncClient, name), f"AsyncClient lacks {name}"
    sync_attr, async_attr = getattr(Client, name), getattr(AsyncClient, name)
    if callable(sync_attr):
        assert inspect.signature(sync_attr).parameters == inspect.signature(async_attr).parameters

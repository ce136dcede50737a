"""The http runtime for real, against the torch worker's vLLM/SGLang sleep/wake server on CPU.

The server is ``python -m tangramd.services.worker --http-port {port}``, started by the
node exactly as a ``vllm serve ... --enable-sleep-mode`` command line would be.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch  # noqa: F401  # the worker's server needs torch (the gpu extra), as CI has it

from tangramd.services import (
    ServiceHost,
    ServiceLoadError,
    ServiceSpec,
    SimulatedGpus,
    discover,
)
from tangramd.services.http_runtime import http_request

SCORER = """
import time

import torch

class Scorer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 4096))

    def handle(self, payload):
        values = payload.get("values")
        if not isinstance(values, list) or not values:
            raise ValueError("'values' must be a non-empty list")
        time.sleep(float(payload.get("sleep", 0)))
        x = torch.tensor(values, dtype=torch.float32)
        return {"score": float((self.weight[: len(values)] * x).sum().detach())}

def make():
    return Scorer()
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("http_models")
    (root / "scorer.py").write_text(SCORER)
    return root


@pytest.fixture(scope="module")
def reference(models: Path) -> Any:
    sys.path.insert(0, str(models))
    try:
        yield importlib.import_module("scorer").make()
    finally:
        sys.path.remove(str(models))


def server_spec(name: str, models: Path, api: str) -> ServiceSpec:
    cmd = (
        f"{sys.executable} -m tangramd.services.worker --name {name} --entry scorer:make "
        f"--path {models} --http-port {{port}}"
    )
    return ServiceSpec(name, "http", 0.01, gpus=(1,), cmd=cmd, route="/score", api=api)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def host(
    loop: asyncio.AbstractEventLoop, models: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceHost]:
    """Two simulated GPUs; a vLLM-style server on GPU 0 and an SGLang-style one on GPU 1."""
    inventory = discover(SimulatedGpus(2, 0.05, 10.0), use_nvml=False)
    host = ServiceHost(inventory, tmp_path_factory.mktemp("http_state"), http_load_timeout_s=120)

    async def setup() -> None:
        await host.register(server_spec("vl", models, "vllm"))
        await host.register(server_spec("sg", models, "sglang"))
        await asyncio.gather(host.ensure_resident("vl", [0]), host.ensure_resident("sg", [1]))

    loop.run_until_complete(asyncio.wait_for(setup(), 120))
    yield host
    loop.run_until_complete(host.close())


def complete(loop: asyncio.AbstractEventLoop, coro: Any) -> Any:
    """Run ``coro`` to its end on ``loop``, failing after 120 s."""
    return loop.run_until_complete(asyncio.wait_for(coro, 120))


def replica(host: ServiceHost, name: str) -> dict[str, Any]:
    (entry,) = [s for s in host.list() if s["name"] == name]
    (only,) = entry["replicas"]
    return {**only, "service": entry}


async def is_sleeping(port: int) -> bool:
    status, body = await http_request(port, "GET", "/is_sleeping")
    assert status == 200
    return bool(json.loads(body)["is_sleeping"])


def test_vllm_sleep_and_wake_up_through_the_server(
    host: ServiceHost, loop: asyncio.AbstractEventLoop, reference: Any
) -> None:
    """Evict is POST /sleep?level=1 and restore POST /wake_up; results survive both."""
    payload = {"values": [1.0, 2.0, 3.0]}
    expected = reference.handle(payload)["score"]
    first = complete(loop, host.call("vl", [0], payload, timeout=30))
    assert first.outcome == "ok" and first.result["score"] == pytest.approx(expected)
    port = replica(host, "vl")["port"]
    assert complete(loop, is_sleeping(port)) is False
    complete(loop, host.evict("vl", [0]))
    assert complete(loop, is_sleeping(port)) is True
    assert replica(host, "vl")["state"] == "backed_up"
    again = complete(loop, host.call("vl", [0], payload, timeout=30))
    assert again.outcome == "ok" and again.result["score"] == pytest.approx(expected)
    assert again.restore_s > 0 and complete(loop, is_sleeping(port)) is False
    assert replica(host, "vl")["service"]["restores"] == 1


def test_sglang_release_and_resume_memory(
    host: ServiceHost, loop: asyncio.AbstractEventLoop, reference: Any
) -> None:
    """The SGLang flavour evicts with /release_memory_occupation and restores with /resume."""
    port = replica(host, "sg")["port"]
    complete(loop, host.evict("sg", [1]))
    assert complete(loop, is_sleeping(port)) is True
    restored = complete(loop, host.ensure_resident("sg", [1]))
    assert restored.needed and complete(loop, is_sleeping(port)) is False
    result = complete(loop, host.call("sg", [1], {"values": [0.5]}, timeout=30))
    assert result.result["score"] == pytest.approx(reference.handle({"values": [0.5]})["score"])


def test_server_rejection_is_failed_with_its_message(
    host: ServiceHost, loop: asyncio.AbstractEventLoop
) -> None:
    """A 4xx from the server is outcome 'failed' carrying the server's error text."""
    bad = complete(loop, host.call("vl", [0], {"values": "nope"}, timeout=30))
    assert bad.outcome == "failed"
    assert bad.error == "ValueError: 'values' must be a non-empty list"


def test_slow_call_times_out_and_the_server_stays(
    host: ServiceHost, loop: asyncio.AbstractEventLoop
) -> None:
    """A call past its timeout ends 'timeout' without restarting the model server."""
    pid = replica(host, "sg")["pid"]
    slow = complete(loop, host.call("sg", [1], {"values": [1.0], "sleep": 1.5}, timeout=0.3))
    assert slow.outcome == "timeout"
    after = complete(loop, host.call("sg", [1], {"values": [1.0]}, timeout=30))
    assert after.outcome == "ok"
    assert replica(host, "sg")["pid"] == pid and replica(host, "sg")["state"] == "resident"


def test_killed_server_is_infra_error_then_restarted(
    host: ServiceHost, loop: asyncio.AbstractEventLoop, reference: Any
) -> None:
    """A dead server fails its call with 'infra_error'; the next call starts a new one."""
    pid = replica(host, "vl")["pid"]
    os.kill(pid, signal.SIGKILL)
    crashed = complete(loop, host.call("vl", [0], {"values": [1.0]}, timeout=30))
    assert crashed.outcome == "infra_error"
    again = complete(loop, host.call("vl", [0], {"values": [1.0]}, timeout=60))
    assert again.outcome == "ok" and replica(host, "vl")["pid"] != pid
    assert again.result["score"] == pytest.approx(reference.handle({"values": [1.0]})["score"])


def test_server_that_exits_at_start_names_the_service(
    host: ServiceHost, loop: asyncio.AbstractEventLoop
) -> None:
    """A server command that dies at start-up is a load error with its exit status and log."""
    cmd = f"{sys.executable} -c \"import sys; print('bad flag {{port}}'); sys.exit(3)\""
    complete(loop, host.register(ServiceSpec("dead", "http", 0.01, cmd=cmd)))
    with pytest.raises(ServiceLoadError, match=r"(?s)'dead'.*status 3.*bad flag"):
        complete(loop, host.ensure_resident("dead", [0]))

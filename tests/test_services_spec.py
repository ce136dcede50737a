"""Service registrations, their persistence, and the GPU inventory (no torch, no processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tangram.pools.gpu import GpuNodePool
from tangramd.services.inventory import SimulatedGpus, discover, visible_devices
from tangramd.services.spec import GB, ServiceRegistry, ServiceSpec, SpecError

TORCH = {"name": "rm", "runtime": "torch", "mem_gb": 2, "entry": "pkg.mod:make"}
HTTP = {"name": "llm", "runtime": "http", "mem_gb": 16, "cmd": "vllm serve m --port {port}"}


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"name": "bad name"}, "name", "letters, digits"),
        ({"runtime": "onnx"}, "runtime", "torch, http"),
        ({"mem_gb": 0}, "mem_gb", "positive"),
        ({"mem_gb": True}, "mem_gb", "positive"),
        ({"gpus": 3}, "gpus", "1, 2, 4, 8"),
        ({"gpus": [1, 16]}, "gpus", "16 is not an allowed"),
        ({"gpus": []}, "gpus", "GPU count"),
        ({"entry": "no_colon"}, "entry", "MODULE:FACTORY"),
        ({"entry": None}, "entry", "MODULE:FACTORY"),
        ({"path": "relative/dir"}, "path", "absolute"),
        ({"cmd": "vllm serve"}, "cmd", "only for runtime 'http'"),
        ({"color": "red"}, "color", "unknown field"),
    ],
)
def test_torch_spec_errors_name_the_field(changes: dict, field: str, words: str) -> None:
    """A bad torch registration is refused with an error naming the field and what is allowed."""
    with pytest.raises(SpecError, match=words) as info:
        ServiceSpec.from_json({**TORCH, **changes})
    assert info.value.field == field
    assert repr(field) in str(info.value)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"cmd": "vllm serve m --port 8000"}, "cmd"),
        ({"cmd": "vllm 'unclosed {port}"}, "cmd"),
        ({"api": "tgi"}, "api"),
        ({"route": "v1/completions"}, "route"),
    ],
)
def test_http_spec_errors_name_the_field(changes: dict, field: str) -> None:
    """An http registration needs a {port} command, a known sleep API and an absolute route."""
    with pytest.raises(SpecError) as info:
        ServiceSpec.from_json({**HTTP, **changes})
    assert info.value.field == field


def test_spec_round_trips_and_normalises_gpus() -> None:
    """A spec survives JSON; ``gpus`` accepts an int or a list and is kept sorted and unique."""
    spec = ServiceSpec.from_json({**TORCH, "gpus": [4, 1, 4], "path": "/opt/models"})
    assert spec.gpus == (1, 4)
    assert ServiceSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert ServiceSpec.from_json({**TORCH, "gpus": 2}).gpus == (2,)
    http = ServiceSpec.from_json({**HTTP, "api": "sglang", "route": "/generate"})
    assert ServiceSpec.from_json(http.to_json()) == http
    assert spec.pool_spec().mem_bytes == 2 * GB == spec.mem_bytes


def test_registry_persists_atomically(tmp_path: Path) -> None:
    """Registrations survive a reload, removal is persisted, and no temp file is left behind."""
    registry = ServiceRegistry(tmp_path)
    registry.add(ServiceSpec.from_json(TORCH))
    registry.add(ServiceSpec.from_json(HTTP))
    registry.remove("rm")
    again = ServiceRegistry(tmp_path)
    assert [spec.name for spec in again.load()] == ["llm"]
    assert sorted(os.listdir(tmp_path)) == ["services.json"]


def test_registry_names_a_corrupt_file(tmp_path: Path) -> None:
    """A corrupt registry is an error naming the file, not a silent empty registry."""
    (tmp_path / "services.json").write_text('{"services": [{"name": "x"}]}')
    with pytest.raises(ValueError, match=r"services\.json"):
        ServiceRegistry(tmp_path).load()
    assert ServiceRegistry(tmp_path / "fresh").load() == []


def test_simulated_inventory_without_nvml() -> None:
    """No NVML library: the simulated GPUs alone form the inventory and the pool over them."""

    def missing() -> object:
        raise ImportError("libnvidia-ml.so.1: cannot open shared object file")

    inventory = discover(SimulatedGpus(2, 24, 12.5), nvml=missing)
    assert "libnvidia-ml" in str(inventory.nvml_error)
    assert [gpu.local for gpu in inventory.gpus] == [0, 1]
    assert all(gpu.simulated for gpu in inventory.gpus)
    assert visible_devices(inventory.gpus) == ""
    pool = inventory.node_pool("n0")
    assert isinstance(pool, GpuNodePool)
    assert (pool.n_gpus, pool.mem_per_gpu, pool.h2d_bytes_per_s) == (2, 24 * GB, 12.5 * GB)


class FakeNvml:
    """A recording stand-in for pynvml: four GPUs whose NVML order differs from PCI order."""

    def __init__(self) -> None:
        self.buses = ["0000:C1:00.0", "0000:41:00.0", "0000:81:00.0", "0000:01:00.0"]
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        self.calls.append("init")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.buses)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetPciInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(busId=self.buses[h].encode())

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA H200"

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h}"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(total=141 * GB)

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        return 10 if {a, b} <= {1, 3} or {a, b} <= {0, 2} else 40  # pairs behind a switch


def test_nvml_inventory_orders_by_pci_bus_and_adds_simulated() -> None:
    """NVML GPUs come in PCI bus order (buddies share a switch), then the simulated ones."""
    fake = FakeNvml()
    inventory = discover(SimulatedGpus(4, 80, 25), nvml=lambda: fake)
    assert inventory.nvml_error is None
    real = [gpu for gpu in inventory.gpus if not gpu.simulated]
    assert [gpu.cuda_index for gpu in real] == [3, 1, 2, 0]
    assert visible_devices(real[:2]) == "3,1"
    assert inventory.topology[0][1] == 10 and inventory.topology[0][2] == 40
    assert len(inventory) == 8 and inventory.node_pool("n").n_gpus == 8
    assert fake.calls == ["init", "shutdown"]


def test_inventory_with_three_gpus_is_no_buddy_pool() -> None:
    """A GPU count the buddy pool cannot split is refused with the allowed counts."""
    inventory = discover(SimulatedGpus(3, 8, 10), use_nvml=False)
    with pytest.raises(ValueError, match="1, 2, 4, 8"):
        inventory.node_pool("n")


def test_importing_the_service_layer_does_not_import_torch() -> None:
    """The daemon can import its service layer on hosts without torch."""
    code = "import sys, tangramd.services; sys.exit('torch' in sys.modules)"
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 0

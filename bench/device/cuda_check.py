"""GPU-machine checks of the service runtime (run by bench/device/gpu_check.sh).

    python bench/device/cuda_check.py torch OUT.json   # torch runtime on the first NVML GPU
    python bench/device/cuda_check.py vllm OUT.json    # http runtime against a real vLLM
    python bench/device/cuda_check.py elastic OUT.json # a 2-GPU replica, 2 replicas, batching

Each check writes one JSON object with ``"ok"`` and what it measured; the process exits 0
when the check passed, 1 when it ran and failed, 2 when it could not run (what is missing).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tangramd.services import ServiceHost, ServiceSpec, discover  # noqa: E402

EXAMPLES = ROOT / "examples" / "services"
TEST_SERVICES = ROOT / "tests" / "data" / "services"
RAMP = """
import torch

class Ramp(torch.nn.Module):  # 100 MB of float32, used when transformers is not installed
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.0, 1.0, 25_000_000))

    def handle(self, payload):
        return {"y": float((self.weight * float(payload["x"])).sum().detach().cpu())}

def make():
    return Ramp()
"""


def gpu_used_bytes(cuda_index: int) -> int:
    """Memory in use on the GPU (NVML), whoever holds it."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(cuda_index)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    finally:
        pynvml.nvmlShutdown()


def first_gpu() -> tuple[Any, Any]:
    inventory = discover()
    real = [gpu for gpu in inventory.gpus if not gpu.simulated]
    if not real:
        raise SystemExit(_skip(f"no NVML GPU: {inventory.nvml_error}"))
    return inventory, real[0]


_OUT: Path | None = None


def _skip(reason: str) -> int:
    _write({"ok": False, "skipped": reason})
    return 2


def _write(result: dict[str, Any]) -> None:
    assert _OUT is not None
    _OUT.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, indent=1, default=str))


async def check_torch() -> dict[str, Any]:
    """Register the example reward model, restore onto the GPU, evict (GPU memory really
    drops), restore (same scores), kill the worker (infra_error, then a restart)."""
    inventory, gpu = first_gpu()
    result: dict[str, Any] = {"gpu": gpu.to_json()}
    with tempfile.TemporaryDirectory() as state:
        host = ServiceHost(inventory, state)
        try:
            try:
                import transformers  # noqa: F401  # the example model needs it

                spec = ServiceSpec(
                    "reward", "torch", 0.2, entry="reward:reward_large", path=str(EXAMPLES)
                )
                payload = {"prompt": "2+2?", "responses": ["4", "5", "four"]}
            except ImportError:
                (Path(state) / "ramp.py").write_text(RAMP)
                spec = ServiceSpec("reward", "torch", 0.2, entry="ramp:make", path=state)
                payload = {"x": 3.0}
            result["module"] = spec.entry
            t0 = time.perf_counter()
            await host.register(spec)
            result["register_s"] = time.perf_counter() - t0
            chunk = [gpu.local]
            base = gpu_used_bytes(gpu.cuda_index)
            restored = await host.ensure_resident("reward", chunk)
            resident = gpu_used_bytes(gpu.cuda_index)
            first = await host.call("reward", chunk, payload, 60)
            await host.evict("reward", chunk)
            evicted = gpu_used_bytes(gpu.cuda_index)
            second = await host.call("reward", chunk, payload, 60)
            pid = next(r["pid"] for r in host.list()[0]["replicas"] if r["state"] == "resident")
            slow = asyncio.ensure_future(host.call("reward", chunk, payload, 60))
            os.kill(pid, signal.SIGKILL)
            killed = await slow
            third = await host.call("reward", chunk, payload, 120)
            result.update(
                restore=restored._asdict(),
                restore_gbps=restored.nbytes / restored.copy_s / 1e9 if restored.copy_s else None,
                gpu_used={"before": base, "resident": resident, "evicted": evicted},
                freed_bytes=resident - evicted,
                first=first._asdict(),
                after_restore=second._asdict(),
                killed=killed._asdict(),
                after_restart=third._asdict(),
                services=host.list(),
            )
            result["ok"] = bool(
                first.outcome == second.outcome == third.outcome == "ok"
                and first.result == second.result == third.result
                and killed.outcome in ("infra_error", "ok")  # ok if it finished before the kill
                and resident - evicted >= 0.8 * restored.nbytes
            )
        finally:
            await host.close()
    return result


def tiny_llama(directory: Path) -> None:
    """A random-weight Llama saved locally: vLLM needs a model and nothing can be downloaded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)


async def check_vllm() -> dict[str, Any]:
    """Start ``vllm serve --enable-sleep-mode`` through the http runtime, call, sleep (GPU
    memory drops), wake up (same greedy tokens)."""
    if shutil.which("vllm") is None:
        raise SystemExit(_skip("vllm is not installed"))
    inventory, gpu = first_gpu()
    result: dict[str, Any] = {"gpu": gpu.to_json()}
    with tempfile.TemporaryDirectory() as state:
        model = Path(state) / "tiny-llama"
        tiny_llama(model)
        cmd = (
            f"vllm serve {model} --port {{port}} --enable-sleep-mode --skip-tokenizer-init "
            "--gpu-memory-utilization 0.2 --max-model-len 256 --enforce-eager"
        )
        mem_gb = 0.2 * gpu.mem_bytes / 1e9
        spec = ServiceSpec("llm", "http", mem_gb, cmd=cmd, route="/v1/completions")
        host = ServiceHost(inventory, state, http_load_timeout_s=240)
        try:
            await host.register(spec)
            chunk = [gpu.local]
            payload = {"model": str(model), "prompt": [1, 2, 3], "max_tokens": 4}
            # greedy; logprobs and token ids make the answers comparable without a tokenizer
            payload.update(temperature=0, logprobs=1, return_token_ids=True)
            t0 = time.perf_counter()
            await host.ensure_resident("llm", chunk)
            result["start_s"] = time.perf_counter() - t0
            awake = gpu_used_bytes(gpu.cuda_index)
            first = await host.call("llm", chunk, payload, 120)
            slept = await host.evict("llm", chunk)
            asleep = gpu_used_bytes(gpu.cuda_index)
            second = await host.call("llm", chunk, payload, 120)
            result.update(
                sleep_s=slept.seconds,
                gpu_used={"awake": awake, "asleep": asleep},
                first=first._asdict(),
                after_wake=second._asdict(),
                services=host.list(),
                log=(Path(state) / "services" / "llm.1.log").read_text()[-4000:],
            )

            def tokens(reply: Any) -> Any:
                return None if reply.result is None else reply.result.get("choices")

            result["ok"] = bool(
                first.outcome == second.outcome == "ok"
                and tokens(first) is not None
                and tokens(first) == tokens(second)
                and asleep < awake
            )
        finally:
            await host.close()
    return result


async def check_elastic() -> dict[str, Any]:
    """Elastic GPU calls on real GPUs (issue 33 item 2): the layered test service on one GPU
    and as a 2-GPU replica (two workers, one per device: both devices hold memory while it
    is resident, and the answer is the 1-GPU answer, to the bit); then two 1-GPU replicas of
    a batching service, each sent a batch of 4 calls at once (one forward pass per replica,
    every caller its own answer). With one GPU the 2-GPU parts are recorded as skipped and
    the batching runs on the one replica."""
    inventory = discover()
    real = [gpu for gpu in inventory.gpus if not gpu.simulated]
    if not real:
        raise SystemExit(_skip(f"no NVML GPU: {inventory.nvml_error}"))
    result: dict[str, Any] = {"gpus": [gpu.to_json() for gpu in real]}
    two = len(real) >= 2
    x = {"x": [3, -1, 4, 1, -5, 9]}
    with tempfile.TemporaryDirectory() as state:
        host = ServiceHost(inventory, state)
        try:
            mlp = ServiceSpec(
                "mlp",
                "torch",
                0.05,
                gpus=(1, 2),
                entry="mlp_services:small",
                path=str(TEST_SERVICES),
            )
            batch = ServiceSpec(
                "batch",
                "torch",
                0.05,
                entry="batch_services:small",
                path=str(TEST_SERVICES),
                max_batch=4,
            )
            await asyncio.gather(host.register(mlp), host.register(batch))
            one = await host.call("mlp", [real[0].local], x, 120)
            result["one_gpu"] = one._asdict()
            await host.evict("mlp", [real[0].local])
            ok = one.outcome == "ok"
            if two:
                pair = [real[0].local, real[1].local]
                before = [gpu_used_bytes(g.cuda_index) for g in real[:2]]
                spread = await host.call("mlp", pair, x, 120)
                during = [gpu_used_bytes(g.cuda_index) for g in real[:2]]
                row = next(r for r in host.list() if r["name"] == "mlp")
                workers = next(r for r in row["replicas"] if r["gpus"] == pair)["workers"]
                await host.evict("mlp", pair)
                result["two_gpus"] = {
                    "call": spread._asdict(),
                    "gpu_used_before": before,
                    "gpu_used_resident": during,
                    "workers": workers,
                }
                ok = ok and bool(
                    spread.outcome == "ok"
                    and spread.result is not None
                    and one.result is not None
                    and spread.result["y"] == one.result["y"]
                    and len({w["pid"] for w in workers}) == 2
                    and all(d > b for d, b in zip(during, before, strict=True))
                )
            else:
                result["two_gpus"] = {"skipped": f"{len(real)} NVML GPU(s)"}
            chunks = [[gpu.local] for gpu in real[:2]]
            payloads = [{"x": float(i), "id": f"c{i}"} for i in range(4)]
            batches = await asyncio.gather(
                *(host.call_batch("batch", chunk, payloads, 120) for chunk in chunks)
            )
            result["batches"] = [[r._asdict() for r in replies] for replies in batches]
            pids = {r.result["pid"] for replies in batches for r in replies if r.result}
            ok = ok and bool(
                all(r.outcome == "ok" and r.batch == 4 for replies in batches for r in replies)
                and all(
                    r.result is not None and r.result["id"] == p["id"] and r.result["batch"] == 4
                    for replies in batches
                    for r, p in zip(replies, payloads, strict=True)
                )
                and len(pids) == len(chunks)  # one replica (process) per chunk
            )
            result["services"] = host.list()
            result["ok"] = ok
        finally:
            await host.close()
    return result


CHECKS = {"torch": check_torch, "vllm": check_vllm, "elastic": check_elastic}


def main() -> int:
    global _OUT
    which, out = sys.argv[1], Path(sys.argv[2])
    _OUT = out
    try:
        result = asyncio.run(CHECKS[which]())
    except SystemExit as stop:
        return int(stop.code or 0)
    except Exception as exc:  # report, do not lose the other checks' output
        _write({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return 1
    _write(result)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())

"""Restore bandwidth of the torch service runtime next to a bare torch copy of the same bytes.

    python bench/gpu_restore.py [--sizes 64,256,1024,2048] [--repeat 3] [--json]

For each size (MB = 2^20 bytes) a module of that many bytes of parameters (many tensors, as
a model has) is registered with a real ``ServiceHost``; the bench evicts and restores it
``--repeat`` times and reports the best restore: ``copy_gbps`` (the copy inside the worker)
and ``host_gbps`` (as the caller waits for it: the pipe round trip included). Next to it,
in the same run, interleaved with the restores, the best bare ``torch`` copy of the same
number of bytes into a fresh buffer on the same device, made by this process
(``bare_gbps``); ``ratio = copy_gbps / bare_gbps`` (goal >= 0.8).

Device: the first NVML GPU when there is one (pinned host backup, host-to-device copy: on
an H100/H200 class GPU the goal is >= 45 GB/s), else the CPU (a simulated GPU whose link is
not throttled; the copy is host memory to host memory).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tangramd.services import ServiceHost, ServiceSpec, SimulatedGpus, discover

MB = 1 << 20
GB = 1e9
BLOB = '''
import torch

class Blob(torch.nn.Module):
    """{size} bytes of float32 parameters in tensors of at most 64 MiB, like a model's."""

    def __init__(self, size):
        super().__init__()
        sizes, left = [], size // 4
        while left > 0:
            sizes.append(min(left, 16 << 20))
            left -= sizes[-1]
        self.chunks = torch.nn.ParameterList(torch.full((n,), 1.0) for n in sizes)

    def handle(self, payload):
        return {{"sum": float(sum(p[:8].sum() for p in self.chunks).detach())}}

def make():
    return Blob({size})
'''


class BareCopy:
    """A bare ``torch`` copy of the same bytes: host source (pinned on CUDA) made once,
    then each ``once()`` times a fresh device buffer plus the copy, synchronised."""

    def __init__(self, nbytes: int, device: str) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=self.cuda)

    def once(self) -> float:
        torch = self.torch
        start = time.perf_counter()
        dst = torch.empty(self.src.numel(), dtype=torch.uint8, device=self.device)
        dst.copy_(self.src, non_blocking=self.cuda)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        del dst
        if self.cuda:
            torch.cuda.empty_cache()
        return seconds


async def measure(sizes_mb: list[int], repeat: int) -> dict[str, Any]:
    inventory = discover(SimulatedGpus(1, 1e6, 1e9))  # NVML GPUs first; a fast fake otherwise
    gpu = inventory.gpu(0)
    device = "cpu" if gpu.simulated else f"cuda:{gpu.cuda_index}"
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_restore.") as tmp:
        host = ServiceHost(inventory, tmp, load_timeout_s=900)
        try:
            for size_mb in sizes_mb:
                nbytes = size_mb * MB
                name = f"blob{size_mb}"
                (Path(tmp) / f"{name}.py").write_text(BLOB.format(size=nbytes))
                spec = ServiceSpec(
                    name, "torch", (nbytes + MB) / GB, entry=f"{name}:make", path=tmp
                )
                await host.register(spec)
                copies, waits, bares = [], [], []
                bare_copy: BareCopy | None = None
                for _ in range(repeat):  # interleaved, so load drift hits both alike
                    restored = await host.ensure_resident(name, [0])
                    copies.append(restored.copy_s)
                    waits.append(restored.seconds)
                    await host.evict(name, [0])
                    bare_copy = bare_copy or BareCopy(restored.nbytes, device)
                    bares.append(bare_copy.once())
                del bare_copy
                await host.remove(name)
                moved = restored.nbytes
                bare = moved / min(bares) / GB
                copy_gbps = moved / min(copies) / GB
                rows.append(
                    {
                        "size_mb": size_mb,
                        "bytes": moved,
                        "copy_s": round(min(copies), 4),
                        "copy_s_median": round(statistics.median(copies), 4),
                        "host_s": round(min(waits), 4),
                        "copy_gbps": round(copy_gbps, 2),
                        "host_gbps": round(moved / min(waits) / GB, 2),
                        "bare_gbps": round(bare, 2),
                        "ratio": round(copy_gbps / bare, 3),
                    }
                )
        finally:
            await host.close()
    return {
        "device": device,
        "gpu": gpu.name,
        "pinned": not gpu.simulated,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "repeat": repeat,
        "goal_ratio": 0.8,
        "sizes": rows,
        "min_ratio": min(row["ratio"] for row in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256,1024,2048", help="module sizes in MB")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes = [int(part) for part in args.sizes.split(",") if part]
    started = time.perf_counter()
    result = asyncio.run(measure(sizes, args.repeat))
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"device {result['device']} ({result['gpu']}), best of {args.repeat}")
    print(f"{'MB':>6} {'restore GB/s':>13} {'via host':>9} {'bare GB/s':>10} {'ratio':>6}")
    for row in result["sizes"]:
        print(
            f"{row['size_mb']:>6} {row['copy_gbps']:>13} {row['host_gbps']:>9} "
            f"{row['bare_gbps']:>10} {row['ratio']:>6}"
        )


if __name__ == "__main__":
    main()

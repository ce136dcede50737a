"""Torch services that batch, for the dynamic-batching tests (imported by workers only).

``Batcher`` answers ``y = x * sum(weight) + bias`` like ``tiny_services.Scaler``, and also
says which call it answers (``id``, echoed from the payload) and how many calls its forward
pass held (``batch``), so a test can tell an answer matched to the wrong caller.
"""

import os
import time

import torch


class Batcher(torch.nn.Module):
    def __init__(self, n: int, bias: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(n, dtype=torch.float32) / n)
        self.register_buffer("bias", torch.full((1,), bias))

    def handle(self, payload: dict) -> dict:
        return self.handle_batch([payload])[0] | {"batch": 1, "single": True}

    def handle_batch(self, payloads: list) -> list:
        if any(p.get("boom") for p in payloads):
            raise RuntimeError(f"boom in a batch of {len(payloads)}")
        if any("started" in p for p in payloads):  # a test waits for this: the pass runs
            for p in payloads:
                if "started" in p:
                    open(p["started"], "w").close()
        time.sleep(max(float(p.get("sleep", 0)) for p in payloads))
        xs = torch.tensor([float(p["x"]) for p in payloads])
        ys = xs * self.weight.sum() + self.bias  # one pass over the batch
        return [
            {"y": float(y), "id": p.get("id"), "batch": len(payloads), "pid": os.getpid()}
            for p, y in zip(payloads, ys.tolist(), strict=True)
        ]


def expected(n: int, bias: float, x: float) -> float:
    """What ``Batcher(n, bias)`` answers for ``x`` (computed without torch)."""
    return x * sum(i / n for i in range(n)) + bias


def small() -> Batcher:
    return Batcher(1000, 0.5)


def medium() -> Batcher:
    return Batcher(3000, 1.5)


class Single(torch.nn.Module):
    """No handle_batch: registering it with max_batch > 1 is refused."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    def handle(self, payload: dict) -> dict:
        return {"y": float(self.weight.sum()) * float(payload.get("x", 1))}


def single() -> Single:
    return Single()

"""Tiny torch services for the daemon's service tests (imported by worker processes only).

``Scaler`` answers ``y = x * sum(weight) + bias`` with ``weight`` a ramp, so an answer is
right only if every byte of the weights came back after an eviction and restore.
"""

import os
import time

import torch


class Scaler(torch.nn.Module):
    def __init__(self, n: int, bias: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(n, dtype=torch.float32) / n)
        self.register_buffer("bias", torch.full((1,), bias))

    def handle(self, payload: dict) -> dict:
        if "x" not in payload:
            raise ValueError("payload needs 'x'")
        if "started" in payload:  # a test waits for this file: the call is in the handler
            open(payload["started"], "w").close()
        time.sleep(float(payload.get("sleep", 0)))
        y = (self.weight * float(payload["x"])).sum() + self.bias
        answer = {"y": float(y.detach()), "pid": os.getpid()}
        if "pad" in payload:  # an answer of that many bytes more (past a response's limit)
            answer["pad"] = b"\0" * int(payload["pad"])
        return answer


def expected(n: int, bias: float, x: float) -> float:
    """What ``Scaler(n, bias)`` answers for ``x`` (computed without torch)."""
    return x * sum(i / n for i in range(n)) + bias


def small() -> Scaler:
    return Scaler(1000, 0.5)


def medium() -> Scaler:
    return Scaler(3000, 1.5)


def large() -> Scaler:
    return Scaler(5000, 2.5)


def broken() -> Scaler:
    raise RuntimeError("no weights here")

"""A layered torch service for the elastic GPU tests (imported by worker processes only).

``Mlp`` is three linear layers with small integer weights, so every sum is exact in float32
whichever order a kernel adds in: a replica split over k workers must answer exactly what one
worker answers. ``handle`` reports which worker (pid) ran it and how much of the module that
worker holds on its device (its shard), besides the answer.
"""

import os
import time

import torch


class Mlp(torch.nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.layers = torch.nn.Sequential()
        for i in range(depth):
            layer = torch.nn.Linear(width, width)
            with torch.no_grad():
                layer.weight.copy_(torch.randint(-2, 3, (width, width), generator=gen))
                layer.bias.copy_(torch.randint(-3, 4, (width,), generator=gen))
            self.layers.append(layer)
            if i < depth - 1:
                self.layers.append(torch.nn.ReLU())
        self.register_buffer("scale", torch.full((1,), 1.0))

    def handle(self, payload: dict) -> dict:
        xs = payload.get("x")
        if not isinstance(xs, list) or not xs:
            raise ValueError("payload needs 'x', a list of numbers")
        if "started" in payload:  # a test waits for this: the handler runs
            open(payload["started"], "w").close()
        time.sleep(float(payload.get("sleep", 0)))
        x = torch.tensor([float(v) for v in xs], dtype=torch.float32)
        x = torch.nn.functional.pad(x, (0, self.layers[0].in_features - len(xs)))
        y = self.layers(x.to(self.scale.device)) * self.scale
        held = sum(t.numel() * t.element_size() for t in self.parameters())
        return {"y": [float(v) for v in y.cpu()], "pid": os.getpid(), "held_bytes": held}


def small() -> Mlp:
    return Mlp(64, 3)

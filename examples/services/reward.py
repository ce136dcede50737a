"""Small reward models for the GPU service runtime: ``transformers`` configs, random weights.

Nothing is downloaded: each factory builds a GPT-2 style sequence classifier from a config
with seeded random weights, and text is tokenised as UTF-8 bytes, so a score depends only on
the text and the seed. Three services (register them with ``--entry reward:FACTORY --path
examples/services``):

    factory        weights   mem_gb to register
    reward_small   ~44 MB    0.05
    reward_large   ~101 MB   0.11
    judge          ~68 MB    0.08

``handle({"prompt": str, "response": str})`` -> ``{"score": float, "model": str, "tokens": int}``;
``{"responses": [str, ...]}`` with the prompt scores several at once (``"scores"``).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GPT2Config, GPT2ForSequenceClassification

MAX_TOKENS = 256
BYTE_OFFSET = 4  # ids 0..3 are reserved (0 = padding)


def encode(text: str) -> list[int]:
    """UTF-8 bytes shifted past the reserved ids, cut to ``MAX_TOKENS`` (keeps the tail)."""
    return [b + BYTE_OFFSET for b in text.encode()][-MAX_TOKENS:] or [BYTE_OFFSET]


class RewardModel(torch.nn.Module):
    """A GPT-2 classifier with one output: the reward of a (prompt, response) pair."""

    def __init__(self, name: str, *, width: int, layers: int, seed: int) -> None:
        super().__init__()
        config = GPT2Config(
            vocab_size=256 + BYTE_OFFSET,
            n_positions=MAX_TOKENS,
            n_embd=width,
            n_layer=layers,
            n_head=8,
            num_labels=1,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
        with torch.random.fork_rng(devices=[]):  # seeded weights, caller's RNG untouched
            torch.manual_seed(seed)
            self.net = GPT2ForSequenceClassification(config)
        self.net.eval()  # no dropout: a score is a function of the text
        self.model_name = name

    @torch.no_grad()
    def score(self, prompt: str, responses: list[str]) -> list[float]:
        device = next(self.parameters()).device
        rows = [encode(f"{prompt}\n{response}") for response in responses]
        width = max(len(row) for row in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
        logits = self.net(input_ids=ids.to(device), attention_mask=(ids != 0).to(device)).logits
        return [float(value) for value in logits[:, 0].float().cpu()]

    def handle(self, payload: dict[str, Any]) -> dict[str, Any]:
        prompt = payload.get("prompt", "")
        if not isinstance(prompt, str):
            raise ValueError("'prompt' must be a string")
        if "responses" in payload:
            responses = payload["responses"]
            if not (isinstance(responses, list) and responses):
                raise ValueError("'responses' must be a non-empty list of strings")
            if not all(isinstance(r, str) for r in responses):
                raise ValueError("'responses' must be a non-empty list of strings")
            return {"scores": self.score(prompt, responses), "model": self.model_name}
        response = payload.get("response")
        if not isinstance(response, str):
            raise ValueError("payload needs 'response' (a string) or 'responses' (a list)")
        tokens = len(encode(f"{prompt}\n{response}"))
        return {
            "score": self.score(prompt, [response])[0],
            "model": self.model_name,
            "tokens": tokens,
        }


def reward_small() -> RewardModel:
    return RewardModel("reward_small", width=384, layers=6, seed=1)


def reward_large() -> RewardModel:
    return RewardModel("reward_large", width=512, layers=8, seed=2)


def judge() -> RewardModel:
    return RewardModel("judge", width=512, layers=5, seed=3)

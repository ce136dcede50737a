"""The example reward model (a random-weight ``transformers`` GPT-2) through the torch runtime."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from tangramd.services import ServiceHost, ServiceSpec, SimulatedGpus, discover

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "services"
PAYLOAD = {"prompt": "What is 2 + 2?", "responses": ["4", "five", "It is 4."]}


def test_reward_model_scores_survive_evict_and_restore(tmp_path: Path) -> None:
    """The served reward model scores exactly as the same model built here, before and after
    an eviction; a bad payload is 'failed' with the model's message."""

    async def scenario() -> None:
        host = ServiceHost(discover(SimulatedGpus(1, 1.0, 50.0), use_nvml=False), tmp_path)
        spec = ServiceSpec("rm", "torch", 0.05, entry="reward:reward_small", path=str(EXAMPLES))
        registering = asyncio.ensure_future(host.register(spec))
        await asyncio.sleep(0)  # the worker starts; build the reference meanwhile
        sys.path.insert(0, str(EXAMPLES))
        try:
            import reward

            expected = reward.reward_small().handle(PAYLOAD)
        finally:
            sys.path.remove(str(EXAMPLES))
        try:
            entry = await asyncio.wait_for(registering, 120)
            assert 40e6 < entry["module_bytes"] <= spec.mem_bytes
            first = await host.call("rm", [0], PAYLOAD, timeout=60)
            await host.evict("rm", [0])
            second = await host.call("rm", [0], PAYLOAD, timeout=60)
            bad = await host.call("rm", [0], {"prompt": "no response"}, timeout=60)
        finally:
            await host.close()
        assert first.outcome == second.outcome == "ok"
        assert first.result == second.result
        assert first.result["scores"] == pytest.approx(expected["scores"], abs=1e-5)
        assert len(set(first.result["scores"])) == 3  # the scorer tells the answers apart
        assert second.restore_s > 0
        assert bad.outcome == "failed" and "needs 'response'" in bad.error

    asyncio.run(scenario())

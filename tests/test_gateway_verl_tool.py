"""tangram.integrations.verl: the verl tool, loaded by verl's own registry from the example YAML."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from verl_loader import verl_module

import tangram.integrations

EXAMPLE = Path(tangram.integrations.__file__).parent / "verl_tool_config.yaml"


def test_import_tangram_does_not_need_verl():
    """`import tangram` (and its client) never imports verl."""
    code = "import sys, tangram, tangram.client, tangram.integrations; print('verl' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_tool_runs_code_per_trajectory_and_releases(daemon, monkeypatch):
    """One environment per trajectory (files persist between calls), reward from the last
    run, timeouts reported to the model, the environment closed at release."""
    monkeypatch.setenv("TANGRAM_SOCKET", daemon.socket)
    registry = verl_module("verl.tools.tool_registry")
    (tool,) = registry.initialize_tools_from_config(str(EXAMPLE))
    assert tool.name == "code_interpreter"
    assert tool.get_openai_tool_schema().function.parameters.required == ["code"]

    async def rollout() -> None:
        a, _ = await tool.create("traj-a")
        b, _ = await tool.create("traj-b")
        response, step_reward, metrics = await tool.execute(
            a, {"code": "open('memo.txt', 'w').write('kept'); print(6 * 7)"}
        )
        assert response.text == "42\n" and step_reward == 0.0
        assert metrics["outcome"] == "ok" and metrics["cores"] == 1 and metrics["act_s"] > 0
        response, _, _ = await tool.execute(a, {"code": "print(open('memo.txt').read())"})
        assert response.text == "kept\n"
        assert await tool.calc_reward(a) == 1.0
        probe = "import os; print(os.path.exists('memo.txt')); raise SystemExit(2)"
        response, _, metrics = await tool.execute(b, {"code": probe})
        assert response.text == "False\n\n[exit code 2]" and metrics["exit_code"] == 2
        assert await tool.calc_reward(b) == 0.0
        tool.timeout_s = 0.5
        response, _, metrics = await tool.execute(b, {"code": "while True: pass"})
        assert metrics["outcome"] == "timeout" and "timed out" in response.text
        response, _, _ = await tool.execute(b, {"code": ""})
        assert response.text.startswith("error:")
        await tool.release(a)
        await tool.release(b)

    asyncio.run(rollout())
    with daemon.client() as c:
        assert c.env_list() == []

"""A verl tool that runs the model's code as tangram actions: ``TangramCodeTool``.

verl's multi-turn rollout calls ``create`` once per trajectory, ``execute`` for every tool
call, ``calc_reward`` and ``release`` at the end. Here each trajectory gets one tangram
environment (opened at ``create`` with the request id as its trajectory, closed at
``release``), so files a call writes are there for the next; each ``execute`` is one exec
action carrying the code as a file, which waits for its cores and runs pinned to them.
The step reward is 0; ``calc_reward`` is 1.0 when the last run exited 0.

Use it from a tool config (see ``verl_tool_config.yaml`` next to this module)::

    tools:
      - class_name: tangram.integrations.verl.TangramCodeTool
        config: {type: native, language: python, timeout_s: 30, cpus: 1}

Config keys: ``socket`` (default ``$TANGRAM_SOCKET`` or the usual path), ``language``
(``python`` or ``bash``), ``timeout_s``, ``cpus`` (int, or ``[min, max]`` elastic), ``mem``
(e.g. ``"1GiB"``), ``image`` (docker backend), ``max_output_chars`` (what the model sees).
Importing this module needs verl; ``import tangram`` does not.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from tangram.client import AsyncClient, ExecResult
from tangram.integrations._common import render_result, result_metrics

RUNNERS = {"python": ("main.py", "python3 main.py"), "bash": ("main.sh", "/bin/bash main.sh")}

DEFAULT_SCHEMA = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Run a program and see its stdout, stderr and exit code.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The program to run."}},
            "required": ["code"],
        },
    },
}


@dataclass
class _Instance:
    env: str
    last: ExecResult | None = None


class TangramCodeTool(BaseTool):
    """Runs code in a per-trajectory tangram environment (see the module doc)."""

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None):
        self._schema = tool_schema or OpenAIFunctionToolSchema.model_validate(DEFAULT_SCHEMA)
        super().__init__(config, self._schema)
        language = config.get("language", "python")
        if language not in RUNNERS:
            raise ValueError(f"language {language!r}: want one of {sorted(RUNNERS)}")
        self.source, self.command = RUNNERS[language]
        self.timeout_s = float(config.get("timeout_s", 30))
        cpus = config.get("cpus", 1)
        self.cpus = tuple(cpus) if isinstance(cpus, list) else int(cpus)
        self.mem = config.get("mem")
        self.image = config.get("image")
        self.max_output_chars = int(config.get("max_output_chars", 4096))
        self.socket = config.get("socket")
        self._instances: dict[str, _Instance] = {}
        self._clients: dict[asyncio.AbstractEventLoop, AsyncClient] = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self._schema

    def _client(self) -> Any:
        """One AsyncClient per event loop (verl may drive tools from several)."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = self._clients[loop] = AsyncClient(self.socket)
        return client

    async def create(
        self, instance_id: str | None = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid.uuid4())
        env = await self._client().env_open(image=self.image, mem=self.mem, trajectory=instance_id)
        self._instances[instance_id] = _Instance(env)
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        instance = self._instances[instance_id]
        code = parameters.get("code")
        if not isinstance(code, str) or not code.strip():
            return (
                ToolResponse(text="error: the 'code' parameter must be a non-empty string"),
                0.0,
                {},
            )
        client = self._client()
        result: ExecResult = await client.exec(  # the code goes in with the exec: one trip
            self.command,
            env=instance.env,
            files={self.source: code.encode()},
            cpus=self.cpus,
            timeout_s=self.timeout_s,
            task=f"verl/{self.name}",
        )
        instance.last = result
        return ToolResponse(text=self._render(result)), 0.0, result_metrics(result)

    def _render(self, result: ExecResult) -> str:
        return render_result(result, timeout_s=self.timeout_s, max_chars=self.max_output_chars)

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        last = self._instances[instance_id].last
        return 1.0 if last is not None and last.ok else 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        instance = self._instances.pop(instance_id, None)
        if instance is not None:
            await self._client().env_close(instance.env)

"""A SkyRL-gym environment whose code runs as tangram actions: ``TangramCodeEnv``.

SkyRL's generator makes one environment per trajectory (``skyrl_gym.make(id, env_config=,
extras=)``), calls ``init(prompt)``, then ``step(action)`` with each model turn until
``done``, then ``close()``. Here the trajectory gets one tangram environment, opened at
``init`` (its trajectory id is ``extras["uid"]`` when given) and closed at ``close``, so
files a turn writes are there for the next. A turn's ``<python>…</python>`` or
``<bash>…</bash>`` block is one exec action carrying the code as a file (it waits for its
cores and runs pinned to them); its output comes back as the next user message
(``<output>…</output>``). The episode ends at ``<answer>…</answer>`` or after
``max_turns``; the reward is 1.0 when ``extras["reward_spec"]["tests"]`` (a shell command
run in the trajectory's environment, e.g. ``python3 -m pytest -q``) exits 0, else 0.0
(and 0.0 without tests). ``extras["files"]`` ({path: text}) is written into the
environment at ``init`` (the task's starting files)::

    from tangram.integrations import skyrl
    skyrl.register()  # skyrl_gym id "tangram_code"
    env = skyrl_gym.make("tangram_code", env_config={"timeout_s": 30}, extras={...})

``env_config`` keys: ``socket`` (default ``$TANGRAM_SOCKET`` or the usual path),
``timeout_s`` (per turn), ``tests_timeout_s`` (the reward's tests), ``cpus`` (int, or
``[min, max]`` elastic), ``mem`` (e.g. ``"1GiB"``), ``image`` (docker backend),
``max_output_chars`` (what the model sees). Importing this module
needs ``skyrl-gym``; ``import tangram`` does not.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput, ConversationType

from tangram.client import Client, ExecResult
from tangram.integrations._common import render_result, result_metrics

ENV_ID = "tangram_code"
RUNNERS = {
    "python": ("main.py", ["python3", "main.py"]),
    "bash": ("main.sh", ["/bin/bash", "main.sh"]),
}
_BLOCK = re.compile(r"<(python|bash)>(.*?)</\1>", re.DOTALL)


def register(env_id: str = ENV_ID) -> None:
    """Register ``TangramCodeEnv`` with skyrl_gym under ``env_id`` (idempotent)."""
    import skyrl_gym

    if env_id not in skyrl_gym.registry:
        skyrl_gym.register(id=env_id, entry_point=f"{__name__}:TangramCodeEnv")


def _get(config: Any, key: str, default: Any) -> Any:
    """A key of an omegaconf DictConfig or a plain mapping (SkyRL passes either)."""
    if config is None:
        return default
    value = config.get(key, default)
    return default if value is None else value


class TangramCodeEnv(BaseTextEnv):  # type: ignore[misc]  # skyrl_gym is untyped
    """Multi-turn code environment on a per-trajectory tangram environment."""

    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        extras = dict(extras or {})
        self.max_turns = int(extras.get("max_turns", 5))
        spec = extras.get("reward_spec") or {}
        self.tests: str | None = spec.get("tests") if isinstance(spec, Mapping) else None
        self.files: dict[str, str] = dict(extras.get("files") or {})
        self.trajectory = str(extras.get("uid") or uuid.uuid4())
        self.timeout_s = float(_get(env_config, "timeout_s", 30))
        self.tests_timeout_s = float(_get(env_config, "tests_timeout_s", 300))
        cpus = _get(env_config, "cpus", 1)
        self.cpus = tuple(cpus) if isinstance(cpus, list | tuple) else int(cpus)
        self.mem = _get(env_config, "mem", None)
        self.image = _get(env_config, "image", None)
        self.max_output_chars = int(_get(env_config, "max_output_chars", 4096))
        self.client = Client(_get(env_config, "socket", None))
        self.env: str | None = None
        self.chat_history: ConversationType = []

    # ------------------------------------------------------------------ SkyRL-gym API
    def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        self.turns = 0
        self.chat_history = list(prompt)
        if self.env is None:
            self.env = self.client.env_open(
                image=self.image, mem=self.mem, trajectory=self.trajectory
            )
            if self.files:  # the task's starting files, in the same round trip as a no-op
                self._exec(["true"], files=self.files)
        return prompt, {"env": self.env}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        self.chat_history.append({"role": "assistant", "content": action})
        if ("<answer>" in action and "</answer>" in action) or self.turns >= self.max_turns:
            reward, tests = self._reward()
            return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata=tests)
        match = _BLOCK.search(action)
        if match is None:
            observation = "No <python>…</python> or <bash>…</bash> block to run."
            metadata: dict[str, Any] = {}
        else:
            source, argv = RUNNERS[match.group(1)]
            result = self._exec(argv, files={source: match.group(2)})
            observation = f"<output>{self._render(result)}</output>"
            metadata = result_metrics(result)
        message = {"role": "user", "content": observation}
        self.chat_history.append(message)
        return BaseTextEnvStepOutput(
            observations=[message], reward=0.0, done=False, metadata=metadata
        )

    def close(self) -> None:
        env, self.env = self.env, None
        try:
            if env is not None:
                self.client.env_close(env)
        finally:
            self.client.close()

    # ------------------------------------------------------------------ helpers
    def _exec(self, argv: list[str] | str, **kw: Any) -> ExecResult:
        assert self.env is not None, "init() opens the environment"
        kw.setdefault("timeout_s", self.timeout_s)
        return self.client.exec(argv, env=self.env, cpus=self.cpus, task="skyrl", **kw)

    def _render(self, result: ExecResult) -> str:
        return render_result(result, timeout_s=self.timeout_s, max_chars=self.max_output_chars)

    def _reward(self) -> tuple[float, dict[str, Any]]:
        if self.tests is None or self.env is None:
            return 0.0, {}
        result = self._exec(self.tests, timeout_s=self.tests_timeout_s)
        return (1.0 if result.ok else 0.0), {"tests": result_metrics(result)}

"""The SkyRL-gym adapter (``tangram.integrations.skyrl``) driven the way SkyRL's generator
drives an environment: ``skyrl_gym.make`` → ``init`` → ``step``… → ``close``, against a real
daemon, with the real ``skyrl-gym`` package."""

from __future__ import annotations

import subprocess
import sys

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv

from tangram.integrations import skyrl

BUGGY = "def add(a, b):\n    return a - b\n"
TESTS = "from calc import add\n\ndef test_add():\n    assert add(2, 3) == 5\n"


def _make(daemon, **extras):
    skyrl.register()
    env = skyrl_gym.make(
        skyrl.ENV_ID,
        env_config={"socket": daemon.socket, "timeout_s": 2},
        extras={
            "max_turns": 6,
            "files": {"calc.py": BUGGY, "test_calc.py": TESTS},
            "reward_spec": {"tests": "python3 -m pytest -q -p no:cacheprovider test_calc.py"},
            **extras,
        },
    )
    assert isinstance(env, BaseTextEnv)
    return env


def test_an_episode_runs_turns_in_one_environment_and_rewards_passing_tests(daemon):
    """Files of one turn are there for the next; the tests decide the reward; close frees it."""
    env = _make(daemon, uid="traj-1")
    prompt = [{"role": "user", "content": "fix calc.py"}]
    assert env.init(prompt)[0] == prompt
    with daemon.client() as c:
        assert [e["trajectory"] for e in c.env_list()] == ["traj-1"]
    out = env.step("<python>from calc import add\nprint(add(2, 3))</python>")
    assert not out["done"] and out["reward"] == 0.0
    assert out["observations"] == [{"role": "user", "content": "<output>-1\n</output>"}]
    assert out["metadata"]["outcome"] == "ok" and out["metadata"]["cores"] == 1
    # the fix changes the file's size: a same-size edit within the second keeps the stale .pyc
    fix = env.step("<bash>sed -i 's/a - b/b + a  # fixed/' calc.py && echo fixed</bash>")
    assert fix["observations"][0]["content"] == "<output>fixed\n</output>"
    slow = env.step("<python>while True: pass</python>")
    assert "[timed out after 2 s]" in slow["observations"][0]["content"]
    nothing = env.step("I think it is done")
    assert "No <python>" in nothing["observations"][0]["content"]
    end = env.step("<answer>done</answer>")
    assert end["done"] and end["reward"] == 1.0 and end["observations"] == [], end
    assert end["metadata"]["tests"]["exit_code"] == 0
    env.close()
    with daemon.client() as c:
        assert c.env_list() == []


def test_failing_tests_and_max_turns_give_no_reward(daemon):
    env = _make(daemon, max_turns=2)
    env.init([{"role": "user", "content": "fix calc.py"}])
    first = env.step("<bash>exit 4</bash>")
    assert first["observations"][0]["content"] == "<output>\n[exit code 4]</output>"
    last = env.step("<bash>true</bash>")  # the second turn is the last one
    assert last["done"] and last["reward"] == 0.0
    assert last["metadata"]["tests"]["exit_code"] == 1
    env.close()


def test_import_tangram_does_not_import_skyrl_gym():
    code = "import sys, tangram, tangram.integrations; assert 'skyrl_gym' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)

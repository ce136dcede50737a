"""A small CPU-bound pytest suite for the backends, the example rollout and profiling.

Sixteen independent tests, each burning about 0.25 s of pure-Python CPU on a deterministic
computation, so that ``pytest -n K`` on K pinned cores shows the speed-up of elastic DoP.
The file is named so that the repository's own test run does not collect it; the
``pytest.ini`` next to it makes ``pytest`` run from this directory find it. Set
CPU_SUITE_SCALE to scale the work per test (default 1.0).
"""

import os

import pytest

SCALE = float(os.environ.get("CPU_SUITE_SCALE", "1.0"))
ROUNDS = int(1_400_000 * SCALE)


def burn(seed: int, rounds: int = ROUNDS) -> int:
    """A deterministic integer walk (LCG mixing) that the interpreter cannot shortcut."""
    x = seed
    for i in range(rounds):
        x = (x * 1103515245 + 12345 + i) & 0x7FFFFFFF
    return x


@pytest.mark.parametrize("seed", range(16))
def test_burn(seed: int) -> None:
    """The walk stays a 31-bit value (the point is the CPU it burns, not the check)."""
    assert 0 <= burn(seed) < 2**31

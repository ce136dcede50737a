"""Shared fixtures: the test daemon, and the hypothesis profiles.

``daemon``: one validated ``tangramd up`` (``harness.running_daemon``: the test config,
invariants checked after every event, a clean log at teardown) shared by a module's tests.
A module that needs other ``tangramd up`` arguments overrides ``daemon_args``; a test that
needs a daemon of its own calls ``harness.running_daemon`` itself.

Hypothesis: ``ci`` is the default profile (100 examples a property). ``HYPOTHESIS_PROFILE=
thorough`` runs 1,000 for every property that does not fix its own count: a bug hunt after
touching the codec, the pools or the scheduler.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from harness import running_daemon
from hypothesis import settings

from tangram.testing import SpawnedDaemon

# No per-example deadline: the suite shares two cores with other work, where a wall-clock
# deadline fails on load, not on a slow algorithm. Tests that set their own keep theirs.
settings.register_profile("ci", deadline=None, print_blob=True)
settings.register_profile("thorough", deadline=None, print_blob=True, max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module")
def daemon_args() -> tuple[str, ...]:
    """Extra ``tangramd up`` arguments for the module's ``daemon`` (override in a module)."""
    return ()


@pytest.fixture(scope="module")
def daemon(
    daemon_args: tuple[str, ...], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SpawnedDaemon]:
    """One validated daemon shared by the module's tests; its log must stay clean."""
    with running_daemon(tmp_path_factory.mktemp("daemon"), *daemon_args) as d:
        yield d

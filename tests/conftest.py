"""Shared fixtures: the test daemon, and the hypothesis profiles.

``daemon``: one validated ``tangramd up`` (``harness.running_daemon``: the test config,
invariants checked after every event, a clean log at teardown) shared by a module's tests.
A module that needs other ``tangramd up`` arguments overrides ``daemon_args``; a test that
needs a daemon of its own calls ``harness.running_daemon`` itself. ``stack``: the same with
the HTTP gateway in front (``gateway_args``, ``gateway_in_process``).

Hypothesis: ``ci`` is the default profile (100 examples a property). ``HYPOTHESIS_PROFILE=
thorough`` runs 1,000 for every property that does not fix its own count: a bug hunt after
touching the codec, the pools or the scheduler.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from harness import Stack, running_daemon, running_stack
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


@pytest.fixture(scope="module")
def gateway_args() -> tuple[str, ...]:
    """Extra gateway options for the module's ``stack`` (override in a module)."""
    return ()


@pytest.fixture(scope="module")
def gateway_in_process() -> bool:
    """Whether the daemon of the module's ``stack`` serves HTTP itself (``tangramd up
    --http``) rather than a ``tangramd http`` in front of it (override in a module)."""
    return False


@pytest.fixture(scope="module")
def stack(
    gateway_args: tuple[str, ...],
    gateway_in_process: bool,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    """A validated daemon and the HTTP gateway in front of it, shared by the module's tests;
    both logs must stay clean."""
    tmp = tmp_path_factory.mktemp("gw")
    with running_stack(tmp, *gateway_args, in_process=gateway_in_process) as s:
        yield s


@pytest.fixture
def sandbox_fusion_endpoint(stack: Stack) -> str:
    """The sandbox-fusion client's endpoint (a global of that module) set to ``stack``."""
    import sandbox_fusion

    sandbox_fusion.set_endpoint(stack.url)
    return stack.url

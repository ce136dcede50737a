"""The waits the tests use instead of fixed sleeps (``tangram.testing``)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tangram.testing import wait_for, wait_for_async


def test_wait_for_returns_the_first_truthy_value() -> None:
    """The check is polled until it returns something truthy, which is returned."""
    calls = itertools.count()
    assert wait_for(lambda: next(calls) >= 3 and "ready", 5, "three polls", every_s=0) == "ready"


def test_wait_for_times_out_naming_what_and_the_last_ignored_error() -> None:
    """A check never true raises TimeoutError naming what was awaited and why it was not."""

    def refused() -> bool:
        raise ConnectionRefusedError("not yet")

    with pytest.raises(TimeoutError, match=r"the daemon: not within 0.05 s .*not yet"):
        wait_for(refused, 0.05, "the daemon", ignore=(OSError,))


def test_wait_for_lets_other_errors_through() -> None:
    """An error the caller did not list as 'not yet' propagates at once."""
    with pytest.raises(KeyError):
        wait_for(lambda: {}["missing"], 5, "a key", ignore=(OSError,))


def test_wait_for_async_awaits_a_coroutine_check_while_the_loop_runs() -> None:
    """In an event loop the check may be async, and other tasks progress between polls."""

    async def main() -> str:
        done = asyncio.Event()
        asyncio.get_running_loop().call_later(0.02, done.set)

        async def check() -> str | None:
            return "set" if done.is_set() else None

        return await wait_for_async(check, 5, "the event")

    assert asyncio.run(main()) == "set"
    with pytest.raises(TimeoutError, match="never: not within"):
        asyncio.run(wait_for_async(lambda: False, 0.02, "never"))


def test_wait_for_stops_at_once_on_a_fatal_error_it_would_otherwise_ignore() -> None:
    """An error of a ``fatal`` type propagates at the first poll even when ``ignore``
    covers it (the cluster harness: a daemon that exited cannot become ready)."""

    class Exited(RuntimeError):
        pass

    calls = itertools.count()

    def check() -> bool:
        next(calls)
        raise Exited("gone")

    with pytest.raises(Exited):
        wait_for(check, 5.0, "never", ignore=(Exception,), fatal=(Exited,))
    assert next(calls) == 1

"""The router's table: which handler owns each event type.

Each handler module (:mod:`tangramd.state.handlers`) registers its handlers with
:func:`handles`; :mod:`tangramd.state.core` imports every such module, so the table is
complete once the package is imported, and
``tests/test_state.py`` checks that every event type of :mod:`tangramd.events` has exactly
one handler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from tangramd import events as ev

if TYPE_CHECKING:
    from tangramd.state.context import Core

E = TypeVar("E", bound=ev.Event)
Handler = Callable[["Core", Any, float, list[ev.Command]], None]

HANDLERS: dict[type[ev.Event], Handler] = {}
OWNERS: dict[type[ev.Event], str] = {}  # event type -> the module (book) that handles it


def handles(
    event: type[E],
) -> Callable[
    [Callable[[Core, E, float, list[ev.Command]], None]],
    Callable[[Core, E, float, list[ev.Command]], None],
]:
    """Register the decorated function as the one handler of ``event``."""

    def register(
        fn: Callable[[Core, E, float, list[ev.Command]], None],
    ) -> Callable[[Core, E, float, list[ev.Command]], None]:
        if event in HANDLERS:
            raise RuntimeError(f"{event.__name__} is handled twice ({OWNERS[event]})")
        HANDLERS[event] = fn
        OWNERS[event] = fn.__module__
        return fn

    return register

"""Logging setup of the daemons (docs/design.md §6): structlog, one event per line.

- JSON lines when stderr is not a terminal (systemd's journal, CI logs) or when asked
  (``log_format = "json"``); a coloured console renderer on a terminal.
- ISO-8601 UTC timestamps, the level, the logger name and snake_case event names
  (``action_placed``, ``env_created``) with bound context (``action_id``, ``node``).
- The standard library's ``logging`` (docker SDK, urllib3, asyncio) goes through the same
  renderer, so the journal holds one format.

Loggers are not cached on first use: ``structlog.testing.capture_logs()`` must keep working
in tests after the daemon configured logging, and a dict lookup per event is cheap next to
the I/O of writing the line.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from typing import Any, Final, TextIO

import structlog

LEVELS: Final = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
FORMATS: Final = ("auto", "json", "console")


def resolve_format(fmt: str, stream: TextIO | None = None) -> str:
    """``"auto"`` → ``"console"`` on a terminal, else ``"json"``; other values unchanged."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} (allowed: {', '.join(FORMATS)})")
    if fmt != "auto":
        return fmt
    return "console" if _isatty(stream if stream is not None else sys.stderr) else "json"


def _level(level: str | int) -> int:
    if isinstance(level, int):
        return level
    try:
        return LEVELS[level.lower()]
    except KeyError:
        raise ValueError(f"log level {level!r} (allowed: {', '.join(LEVELS)})") from None


def configure_logging(
    fmt: str = "auto", level: str | int = "info", *, stream: TextIO | None = None
) -> str:
    """Configure structlog and stdlib logging to write to ``stream`` (stderr by default).

    Returns the resolved format (``"json"`` or ``"console"``). Raises ValueError for an
    unknown format or level. Safe to call again (e.g. after reading the config file).
    """
    stream = stream if stream is not None else sys.stderr
    resolved = resolve_format(fmt, stream)
    numeric = _level(level)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: Any
    if resolved == "json":
        # Locals stay out of tracebacks: they can hold secrets and whole command outputs.
        tracebacks = structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        shared.append(structlog.processors.ExceptionRenderer(tracebacks))
        shared.append(_lead_keys_first)
        renderer = structlog.processors.JSONRenderer(sort_keys=False)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=_isatty(stream))
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    # Our own events skip the standard library (a LogRecord, the handler chain, a second
    # processor pass: three quarters of the cost of a line): the same processors render
    # them and the line goes to the same stream under the handler's lock.
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=functools.partial(_LineWriter, stream, handler),
        cache_logger_on_first_use=False,
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_tangram", False)]:
        root.removeHandler(old)
    handler._tangram = True  # type: ignore[attr-defined]  # marks our handler for reconfigure
    root.addHandler(handler)
    root.setLevel(numeric)
    return resolved


class _LineWriter:
    """The logger behind structlog's: writes each rendered event as one line to the
    stream, under the standard library handler's lock (no line interleaves with a record
    of ``logging``). ``name`` is the one given to ``structlog.get_logger`` (the ``logger``
    key)."""

    __slots__ = ("_handler", "_stream", "name")

    def __init__(self, stream: TextIO, handler: logging.Handler, name: str | None = None) -> None:
        self._stream = stream
        self._handler = handler
        self.name = name

    def msg(self, message: str) -> None:
        self._handler.acquire()
        try:
            self._stream.write(message + "\n")
            self._stream.flush()
        finally:
            self._handler.release()

    debug = info = warning = warn = error = err = critical = fatal = exception = log = msg


_LEAD_KEYS: Final = ("timestamp", "level", "event", "logger")


def _lead_keys_first(_logger: Any, _method: str, event_dict: Any) -> Any:
    """Put timestamp, level, event and logger first so a line reads left to right."""
    lead = {key: event_dict.pop(key) for key in _LEAD_KEYS if key in event_dict}
    lead.update(event_dict)
    return lead


def _isatty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return isatty is not None and isatty()


def get_logger(name: str | None = None, **context: Any) -> Any:
    """A structlog logger, optionally with bound context (``node=...``)."""
    logger = structlog.get_logger(name)
    return logger.bind(**context) if context else logger


__all__ = ["FORMATS", "LEVELS", "configure_logging", "get_logger", "resolve_format"]


def log_soon(logger: Any, event: str, **fields: Any) -> None:
    """Log ``event`` on the next turn of the running event loop: formatting and writing a
    line is a tenth of a millisecond, which must not delay a spawn or an answer that is on
    its way (an exec's placement and end, a created environment)."""
    asyncio.get_running_loop().call_soon(functools.partial(logger.info, event, **fields))

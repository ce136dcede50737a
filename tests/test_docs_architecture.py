"""docs/architecture.md lists every event and command of tangramd.events, as rendered here.

The two lists sit between ``<!-- BEGIN events -->`` / ``<!-- END events -->`` and
``<!-- BEGIN commands -->`` / ``<!-- END commands -->`` and are generated from the
dataclasses themselves (name, fields, the first paragraph of the docstring), like the op
table of docs/protocol.md. Regenerate them after changing an event or a command with

    python tests/test_docs_architecture.py
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"

if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from tangramd import events as ev  # noqa: E402  # after the path fix above

KINDS = {"events": ev.Event, "commands": ev.Command}
REGENERATE = "docs/architecture.md is stale: run `python tests/test_docs_architecture.py`"


def _kind_classes(base: type) -> list[type]:
    """The concrete subclasses of ``base`` that ``tangramd.events`` exports, in source order."""
    found = {
        cls
        for cls in vars(ev).values()
        if isinstance(cls, type) and issubclass(cls, base) and cls is not base
    }
    return sorted(found, key=lambda c: (c.__module__, inspect.getsourcelines(c)[1], c.__name__))


def _meaning(cls: type) -> str:
    """The first paragraph of the class's own docstring on one line ('' without one: a
    dataclass without a docstring gets its signature as ``__doc__``)."""
    doc = cls.__dict__.get("__doc__") or ""
    if not doc.strip() or doc.startswith(f"{cls.__name__}("):
        return ""
    first = inspect.cleandoc(doc).split("\n\n", 1)[0]
    return " ".join(first.split()).replace("|", "\\|")


def _field(f: dataclasses.Field[object]) -> str:
    text = f"{f.name}: {f.type}"
    if f.default is not dataclasses.MISSING:
        text += f" = {f.default!r}"
    elif f.default_factory is not dataclasses.MISSING:
        text += f" = {f.default_factory.__name__}()"
    return f"`{text}`".replace("|", "\\|")


def render(kind: str) -> str:
    """The Markdown list of one kind ("events" or "commands") as docs/architecture.md has it."""
    base = KINDS[kind]
    classes = _kind_classes(base)
    common = {f.name for f in dataclasses.fields(base)}
    lines = [
        f"{len(classes)} {kind}, generated from `tangramd/events.py`"
        + (" (every command also has `cause: int`, the stimulus id)." if common else "."),
        "",
        f"| {kind[:-1]} | fields | meaning |",
        "| --- | --- | --- |",
    ]
    for cls in classes:
        fields = [_field(f) for f in dataclasses.fields(cls) if f.name not in common]
        row = f"| `{cls.__name__}` | {', '.join(fields) or '–'} | {_meaning(cls) or '–'} |"
        lines.append(row)
    return "\n".join(lines)


def block(text: str, kind: str) -> str:
    """What docs/architecture.md holds between the markers of ``kind``."""
    match = re.search(rf"<!-- BEGIN {kind} -->\n(.*?)\n<!-- END {kind} -->", text, re.S)
    assert match is not None, f"docs/architecture.md has no <!-- BEGIN/END {kind} --> markers"
    return match.group(1).strip()


def regenerate() -> None:
    """Rewrite the generated blocks of docs/architecture.md in place."""
    text = ARCHITECTURE.read_text()
    for kind in KINDS:
        text = re.sub(
            rf"<!-- BEGIN {kind} -->\n.*?<!-- END {kind} -->",
            lambda m, k=kind: f"<!-- BEGIN {k} -->\n{render(k)}\n<!-- END {k} -->",
            text,
            flags=re.S,
        )
    ARCHITECTURE.write_text(text)


def test_event_list_is_up_to_date() -> None:
    """The event list of docs/architecture.md is exactly what tangramd.events renders."""
    assert block(ARCHITECTURE.read_text(), "events") == render("events"), REGENERATE


def test_command_list_is_up_to_date() -> None:
    """The command list of docs/architecture.md is exactly what tangramd.events renders."""
    assert block(ARCHITECTURE.read_text(), "commands") == render("commands"), REGENERATE


def test_every_event_and_command_is_listed_once() -> None:
    """Each event and command class appears in exactly one row of its list."""
    text = ARCHITECTURE.read_text()
    for kind, base in KINDS.items():
        rows = block(text, kind)
        classes = _kind_classes(base)
        assert classes, f"tangramd.events exports no {kind}"
        for cls in classes:
            assert rows.count(f"| `{cls.__name__}` |") == 1, cls.__name__


def test_architecture_walks_the_four_request_paths() -> None:
    """The page walks exec, a GPU call, a cluster exec and HTTP /run_code, each with its
    count of reshapes."""
    text = ARCHITECTURE.read_text()
    for path in ("exec", "GPU call", "cluster exec", "/run_code"):
        assert re.search(rf"^### .*{re.escape(path)}", text, re.M | re.I), path
    assert text.count("Reshapes:") >= 4


if __name__ == "__main__":
    regenerate()
    print(f"rewrote the generated lists of {ARCHITECTURE}")

"""The scheduler and the simulator keep their place in the layers, TYPE_CHECKING included.

``tangram.sched`` owns the pool protocol it consumes, so it never imports ``tangram.pools``;
no part of the ``tangram`` library imports the programs ``tangramd`` or ``tangramctl``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imported(path: Path) -> set[str]:
    """Every module named by an import statement of ``path``, at any depth (type-only too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


RULES = [
    ("tangram/sched", ("tangram.pools", "tangram.sim", "tangram.client", "tangramd", "tangramctl")),
    ("tangram/sim", ("tangramd", "tangramctl")),
    ("tangram/pools", ("tangram.sim", "tangramd", "tangramctl")),
]


@pytest.mark.parametrize(("folder", "banned"), RULES, ids=[r[0] for r in RULES])
def test_no_upward_import(folder: str, banned: tuple[str, ...]) -> None:
    """No module of ``folder`` imports a layer above it."""
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files
    bad = [
        f"{f.relative_to(ROOT)}: {name}"
        for f in files
        for name in sorted(imported(f))
        if any(name == b or name.startswith(b + ".") for b in banned)
    ]
    assert bad == []


def test_walker_sees_type_checking_imports(tmp_path: Path) -> None:
    """An import hidden under ``if TYPE_CHECKING:`` still counts as a dependency."""
    probe = tmp_path / "probe.py"
    probe.write_text("if TYPE_CHECKING:\n    import tangram.pools\n")
    assert "tangram.pools" in imported(probe)

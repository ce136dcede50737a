"""The pure core (model, sched, pools) never imports I/O, clocks or logging, even transitively."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "tangram"
FORBIDDEN = frozenset(
    {
        "asyncio",
        "socket",
        "time",
        "docker",
        "pynvml",
        "structlog",
        "subprocess",
        "os",
        "threading",
        "logging",
        "selectors",
    }
)


def module_file(module: str, root: Path = ROOT) -> Path | None:
    """The source file of a module under ``root``, or None for modules from elsewhere."""
    path = root.joinpath(*module.split("."))
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return None


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def runtime_imports(source: str, module: str, is_package: bool) -> set[str]:
    """Absolute names of every module ``source`` imports at run time (TYPE_CHECKING excluded).

    ``from pkg import name`` also yields ``pkg.name``: it is the submodule when one exists.
    """
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return found


def own_parents(module: str) -> list[str]:
    """Subpackages Python runs on the way to ``module``. The top-level package is exempt:
    ``tangram/__init__`` re-exports the client, which is not part of the pure core."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


def forbidden_chain(start: Path, root: Path = ROOT) -> list[str] | None:
    """The import chain from ``start`` to a forbidden module, or None when it is pure."""
    first = module_name(start, root)
    queue: list[tuple[str, list[str]]] = [(first, [first])]
    seen = {first}
    while queue:
        module, chain = queue.pop(0)
        path = module_file(module, root)
        if path is None:
            continue
        is_package = path.name == "__init__.py"
        for name in sorted(runtime_imports(path.read_text(), module, is_package)):
            if name.split(".")[0] in FORBIDDEN:
                return [*chain, name]
            if name.split(".")[0] != PACKAGE:
                continue
            for target in [*own_parents(name), name]:
                if target not in seen and module_file(target, root) is not None:
                    seen.add(target)
                    queue.append((target, [*chain, target]))
    return None


def pure_modules() -> list[Path]:
    files = [ROOT / "tangram" / "model.py"]
    for folder in (
        ROOT / "tangram" / "model",
        ROOT / "tangram" / "sched",
        ROOT / "tangram" / "pools",
    ):
        if folder.is_dir():
            files.extend(sorted(folder.rglob("*.py")))
    return [f for f in files if f.is_file()]


@pytest.mark.parametrize("path", pure_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_module_imports_no_io(path: Path) -> None:
    """No pure-core module reaches asyncio, sockets, time, docker, NVML, logging or the OS."""
    chain = forbidden_chain(path)
    assert chain is None, " -> ".join(chain or [])


IMPORT_CASES = [
    ("plain", "import time\n", "time"),
    ("dotted", "import os.path\n", "os.path"),
    ("from", "from asyncio import sleep\n", "asyncio"),
    ("from dotted", "from logging.handlers import X\n", "logging.handlers"),
    ("relative sibling", "from .cpu import X\n", "tangram.pools.cpu"),
    ("relative parent submodule", "from .. import model\n", "tangram.model"),
    ("inside a function", "def f():\n    import socket\n", "socket"),
]


@pytest.mark.parametrize(
    ("source", "expected"), [c[1:] for c in IMPORT_CASES], ids=[c[0] for c in IMPORT_CASES]
)
def test_import_walker_sees_every_import_form(source: str, expected: str) -> None:
    """The walker resolves plain, dotted, from-, relative and nested imports."""
    assert expected in runtime_imports(source, "tangram.pools.x", is_package=False)


def test_import_walker_ignores_type_checking_imports() -> None:
    """Imports under `if TYPE_CHECKING:` never run, so they do not count."""
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import socket\n"
    assert "socket" not in runtime_imports(source, "tangram.pools.x", is_package=False)


def test_forbidden_import_is_found_through_the_package(tmp_path: Path) -> None:
    """A pure module that imports a sibling which imports `time` is caught, with the chain."""
    pkg = tmp_path / "tangram" / "sched"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from tangram.sched.b import helper\n")
    (pkg / "b.py").write_text("from . import c\n")
    (pkg / "c.py").write_text("import time\n")
    chain = forbidden_chain(pkg / "a.py", tmp_path)
    assert chain == ["tangram.sched.a", "tangram.sched.b", "tangram.sched.c", "time"]
    assert forbidden_chain(pkg / "__init__.py", tmp_path) is None


# --------------------------------------------------------------------------- layer contract

# Lower layers never import higher ones; within one rank only the same group. `tangram`
# (the package __init__) re-exports the client lazily and is exempt.
LAYERS: dict[str, int] = {
    "tangram.version": 0,
    "tangram.model": 0,
    "tangram.sched": 1,
    "tangram.pools": 2,
    "tangram.protocol": 3,
    "tangram.client": 4,
    "tangram.sim": 4,
    "tangram.testing": 5,
    "tangram.integrations": 5,
    "tangramd": 6,
    "tangramctl": 7,
}
LAYERED = ("tangram", "tangramd", "tangramctl")


def layer_of(module: str) -> str | None:
    """The layer group of a module (its longest prefix in LAYERS), None for `tangram` itself."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in LAYERS:
            return prefix
    return None


def all_imports(source: str, module: str, is_package: bool) -> set[str]:
    """Every project module ``source`` imports, TYPE_CHECKING and function-level included.

    ``from pkg import name`` counts as importing ``pkg.name`` when that is a module, else
    ``pkg`` (so a package's own ``__init__`` does not look like a cycle with its modules).
    """
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if module_file(sub) is not None else base)
    return {name for name in found if name.split(".")[0] in LAYERED and module_file(name)}


def project_modules() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for top in LAYERED:
        for path in sorted((ROOT / top).rglob("*.py")):
            module = module_name(path)
            graph[module] = all_imports(path.read_text(), module, path.name == "__init__.py")
    return graph


def test_layers_never_import_upward() -> None:
    """model ← sched ← pools ← protocol ← client, sim ← tangramd ← tangramctl, counting
    TYPE_CHECKING and function-level imports: no module imports a higher layer."""
    bad = []
    for module, targets in project_modules().items():
        own = layer_of(module)
        if own is None:
            continue
        for target in targets:
            other = layer_of(target)
            if other is None or other == own:
                continue
            if LAYERS[other] >= LAYERS[own]:
                bad.append(f"{module} -> {target}")
    assert not bad, "upward or sideways imports:\n" + "\n".join(sorted(bad))


def test_no_import_cycles() -> None:
    """No two project modules import each other, directly or through others."""
    graph = project_modules()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    assert not cycles, f"import cycles: {cycles}"


def test_layer_walker_counts_type_checking_imports(tmp_path: Path) -> None:
    """An import under `if TYPE_CHECKING:` is still a dependency for the layer contract."""
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tangramd import state\n"
    assert "tangramd.state" in all_imports(source, "tangram.sched.x", is_package=False)

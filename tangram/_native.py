"""The scheduling core, compiled by mypyc or interpreted: one source, chosen at ``import tangram``.

``pip install`` compiles ``MODULES`` (the action model, the scheduler, the pools: the pure
core every scheduling pass runs; and the simulator's event loop that drives it) with mypyc
into C extensions placed next to their sources (setup.py). It is the same code: mypyc
compiles the type-annotated Python, so the compiled pass makes the same decisions as the
interpreted one (``tests/test_native.py`` compares them on random snapshots) in fewer
instructions (docs/results.md, ``bench/sched.py``). The build is optional: with no C
compiler, or ``TANGRAM_PURE_BUILD=1`` at install, nothing is compiled and nothing changes
but speed.

Python imports an extension before a source of the same name, and compiled modules call each
other's native classes directly, so the choice is all or nothing, made once per process by
``select()`` (``tangram/__init__.py`` calls it before any of these modules is imported):

- the sources when ``TANGRAM_PURE=1`` (the reference; how to debug or profile the core);
- the sources, with a warning, when a compiled module is missing or its source is not the
  one it was compiled from (an edited checkout: a stale extension must never run code the
  source no longer has; ``pip install -e .`` rebuilds). The build records each source's
  SHA-256 in ``tangram/_native.json`` (``record()``, called by setup.py);
- the sources, silently, when nothing was compiled;
- else the extensions.

``ACTIVE`` says which was chosen and ``REASON`` why (the daemon's ``status`` op reports
which). Reads only these files and the record (about 0.5 ms); imports none of the modules.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

# The mypyc group: its runtime and the compiled code of every module of MODULES are in one
# shared library, tangram/_native_core__mypyc.<abi>.so; each module has a small shim beside
# its source.
GROUP = "tangram._native_core"
MODULES = (
    "tangram.model",
    "tangram.sched.dp",
    "tangram.sched.operators",
    "tangram.sched.pool",
    "tangram.sched.price",
    "tangram.sched.replay",
    "tangram.sched.schedule",
    "tangram.sched.share",
    "tangram.pools.api",
    "tangram.pools.buddy",
    "tangram.pools.cpu",
    "tangram.pools.gpu",
    # the simulator's event loop and its runs: the driver a simulated pass runs in
    "tangram.sim.runs",
    "tangram.sim.engine",
)
ROOT = Path(__file__).resolve().parent.parent  # the directory holding the tangram package
RECORD = ROOT / "tangram" / "_native.json"  # written by the build: the sources compiled

ACTIVE = False
REASON = "not selected yet"


def _source(name: str) -> Path:
    return ROOT.joinpath(*name.split(".")).with_suffix(".py")


def _extension(name: str) -> Path | None:
    stem = ROOT.joinpath(*name.split("."))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = stem.with_name(stem.name + suffix)
        if path.exists():
            return path
    return None


def digest(name: str) -> str:
    return hashlib.sha256(_source(name).read_bytes()).hexdigest()


def record() -> None:
    """Write the SHA-256 of every source of MODULES (setup.py: the sources it compiles)."""
    doc = {"modules": {name: digest(name) for name in MODULES}}
    RECORD.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def check(compiled: Sequence[str]) -> tuple[bool, str, bool]:
    """(compiled modules usable, why, whether that is worth a warning), given the modules
    of MODULES that have an extension."""
    if os.environ.get("TANGRAM_PURE") == "1":
        return False, "TANGRAM_PURE=1: the core runs interpreted", False
    shared = _extension(GROUP + "__mypyc")
    if shared is None and not compiled:
        return False, "the core is not compiled (installed without mypyc or a C compiler)", False
    if shared is None:
        return False, f"the compiled core's library {GROUP}__mypyc is missing", True
    missing = [name for name in MODULES if name not in compiled]
    if missing:
        return False, f"{missing[0]} is not compiled: the core runs interpreted", True
    try:
        built = json.loads(RECORD.read_text())["modules"]
    except (OSError, ValueError, KeyError, TypeError):
        return (
            False,
            f"no record of the compiled sources ({RECORD.name}): the core runs interpreted",
            True,
        )
    for name in MODULES:
        if not isinstance(built, dict) or built.get(name) != digest(name):
            src = _source(name).relative_to(ROOT)
            return (
                False,
                f"{src} is not the source its compiled module was built from: the core runs "
                "interpreted (`pip install -e .` recompiles it)",
                True,
            )
    return True, "compiled by mypyc", False


class _Sources(importlib.abc.MetaPathFinder):
    """Meta path finder: the modules of MODULES from their ``.py`` sources."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in MODULES:
            return None
        return importlib.util.spec_from_file_location(fullname, _source(fullname))


def select() -> bool:
    """Choose once per process where MODULES come from (module doc); returns ACTIVE."""
    global ACTIVE, REASON
    if REASON != "not selected yet":
        return ACTIVE
    compiled = [name for name in MODULES if _extension(name) is not None]
    ACTIVE, REASON, warn = check(compiled)
    if not ACTIVE and compiled:
        # an extension is there: without this finder Python would import it, not the source
        sys.meta_path.insert(0, _Sources())
    if warn:
        warnings.warn(REASON, RuntimeWarning, stacklevel=2)
    return ACTIVE

"""verl's own modules without ``verl/__init__.py``, which imports ray, torch and tensordict.

The reward functions and the tool base class need none of those: the parent packages are
registered as bare packages over verl's real directories, and the modules themselves are
imported unchanged from the installed verl (``pip install --no-deps verl`` + ray, omegaconf).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path


def verl_module(name: str) -> types.ModuleType:
    """Import ``verl.<...>`` with its parent packages' ``__init__`` files skipped."""
    if "verl" in sys.modules:  # registered by an earlier call (a bare package, no spec)
        root = Path(next(iter(sys.modules["verl"].__path__)))
    else:
        spec = importlib.util.find_spec("verl")  # locates verl without executing it
        assert spec is not None and spec.submodule_search_locations, "verl is not installed"
        root = Path(next(iter(spec.submodule_search_locations)))
    parts = name.split(".")
    for depth in range(1, len(parts)):
        parent = ".".join(parts[:depth])
        if parent not in sys.modules:
            package = types.ModuleType(parent)
            package.__path__ = [str(root.joinpath(*parts[1:depth]))]
            sys.modules[parent] = package
    return importlib.import_module(name)

"""Loading a repository script (bench/*.py, bench/paper/*.py, examples/*.py) as a module in a
test. The script's own folder is on ``sys.path`` while it loads, for the siblings it imports
(bench/paper's ``common.py``), and is taken off again after."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_script(path: Path, name: str) -> ModuleType:
    """``path`` (absolute, or relative to the repository) executed as module ``name``."""
    path = path if path.is_absolute() else REPO / path
    folder = str(path.parent)
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(folder)

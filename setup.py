"""The optional C extensions of arl-tangram (its metadata is in pyproject.toml).

- ``tangramd.backends._lodger``: the lodger loop in C (tangramd/backends/_lodger.c);
- the scheduling core (``tangram/_native.py``: ``MODULES``), compiled by mypyc from its
  type-annotated sources.

Both are optional: without a C compiler, or with ``TANGRAM_PURE_BUILD=1``, the install still
succeeds and the same code runs interpreted (the lodgers' Python loop, the core's sources).
"""

from __future__ import annotations

import os
import runpy

from setuptools import Extension, setup

ext_modules = [
    Extension("tangramd.backends._lodger", ["tangramd/backends/_lodger.c"], optional=True)
]
if os.environ.get("TANGRAM_PURE_BUILD") != "1":
    native = runpy.run_path("tangram/_native.py")  # MODULES and GROUP; it imports nothing
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("mypyc is not installed: the scheduling core stays interpreted")
    else:
        paths = [m.replace(".", "/") + ".py" for m in native["MODULES"]]
        # the sources compiled, by SHA-256 (tangram/_native.json): import tells a later edit
        native["record"]()
        for ext in mypycify(paths, group_name=native["GROUP"], opt_level="3"):
            ext.optional = True  # no C compiler: the sources run (tangram/_native.py)
            ext_modules.append(ext)

setup(ext_modules=ext_modules)

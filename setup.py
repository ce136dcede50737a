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
import sys

from setuptools import Extension, setup

ext_modules = [
    Extension("tangramd.backends._lodger", ["tangramd/backends/_lodger.c"], optional=True)
]
# An editable install (`pip install -e .`) uses the extensions in the source tree: when those
# are there, for this interpreter, and were compiled from the sources as they are now (the
# check `import tangram` makes, tangram/_native.py), compiling them again (1-2 min) changes
# nothing. A fresh venv on an already built tree skips it; TANGRAM_REBUILD=1 forces it.
EDITABLE = bool({"editable_wheel", "develop"} & set(sys.argv))
# pip runs this file three times an install: for the build's requirements (egg_info), its
# metadata (dist_info), then the build. Only the build needs mypyc (10-20 s a run just to
# analyse the sources and write their C).
BUILDING = bool(
    {"build", "build_ext", "bdist_wheel", "bdist_egg", "editable_wheel", "develop", "install"}
    & set(sys.argv)
)
METADATA_ONLY = bool({"egg_info", "dist_info"} & set(sys.argv)) and not BUILDING

if os.environ.get("TANGRAM_PURE_BUILD") != "1" and not METADATA_ONLY:
    native = runpy.run_path("tangram/_native.py")  # MODULES and GROUP; it imports nothing
    built = [name for name in native["MODULES"] if native["_extension"](name) is not None]
    if EDITABLE and native["check"](built)[0] and os.environ.get("TANGRAM_REBUILD") != "1":
        print(
            "the compiled scheduling core in the tree is current (tangram/_native.json): "
            "not compiled again (TANGRAM_REBUILD=1 forces it)"
        )
    else:
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

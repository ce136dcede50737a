"""The compiled core (mypyc, tangram/_native.py) decides as its sources do, and is chosen safely.

CI installs with a C compiler, so the core is compiled there and ``scripts/test.sh`` sets
``TANGRAM_EXPECT_COMPILED=1``: a build that silently fell back to the sources fails here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tangram
from tangram import _native

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

compiled = pytest.mark.skipif(
    not _native.ACTIVE and os.environ.get("TANGRAM_EXPECT_COMPILED") != "1",
    reason=f"the core is not compiled here ({_native.REASON})",
)


def _python(code: str, *, pure: bool, path: Path = TESTS, cwd: Path = TESTS) -> str:
    env = dict(os.environ, PYTHONPATH=str(path))
    env.pop("TANGRAM_PURE", None)
    if pure:
        env["TANGRAM_PURE"] = "1"
    out = subprocess.run(
        [sys.executable, "-W", "always", "-c", code],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    return out.stdout + out.stderr


def test_core_is_compiled_where_ci_expects_it() -> None:
    if os.environ.get("TANGRAM_EXPECT_COMPILED") == "1":
        assert _native.ACTIVE, _native.REASON
    # either way, the modules come from where select() says
    import tangram.model
    import tangram.sched.replay

    for module in (tangram.model, tangram.sched.replay):
        assert module.__file__ is not None
        assert module.__file__.endswith(".py") != _native.ACTIVE, (module.__file__, _native.REASON)


@compiled
def test_compiled_and_interpreted_passes_decide_alike_on_random_snapshots() -> None:
    """Property: on 1,200 random snapshots (every rule, order and depth 1-3), the compiled
    pass and the interpreted one return the same decision, floats to the last bit."""
    code = (
        "import json, native_snapshots as m, tangram._native as n\n"
        "print(json.dumps([n.ACTIVE, m.decisions(range(1200))]))"
    )
    mine_active, mine = json.loads(_python(code, pure=False))
    ref_active, ref = json.loads(_python(code, pure=True))
    assert (mine_active, ref_active) == (True, False)
    assert len(mine) == len(ref) == 1200
    differ = [seed for seed, (a, b) in enumerate(zip(mine, ref, strict=True)) if a != b]
    assert not differ, f"seeds {differ[:5]}: {mine[differ[0]]} != {ref[differ[0]]}"
    # the snapshots are not trivial: most place something, some leave work waiting
    assert sum("placements=()" not in d for d in mine) > 1000
    assert sum("waiting=()" not in d for d in mine) > 300


@compiled
def test_compiled_simulator_run_matches_the_interpreted_one() -> None:
    """A mixed workload (test runs, tool calls, search and teacher calls on 4 x 64 cores)
    through the simulator: the same summary either way (the load meter, the passes over
    time and the pools' state all go through the compiled core)."""
    code = (
        "import json\n"
        "from pathlib import Path\n"
        "from tangram.sim import generate, load_cluster, parse_policy, simulate\n"
        f"cl = load_cluster(Path({str(REPO / 'config' / 'cluster-mixed.toml')!r}))\n"
        "tr = generate('mixed', cl, 24, seed=3)\n"
        "print(json.dumps(simulate(cl, tr, parse_policy('tangram')).summary, sort_keys=True))"
    )
    mine = json.loads(_python(code, pure=False))
    ref = json.loads(_python(code, pure=True))
    assert mine == ref
    assert mine["actions"] > 500


def _copy_of_the_package(tmp_path: Path) -> Path:
    root = tmp_path / "site"
    shutil.copytree(
        Path(tangram.__file__).parent,
        root / "tangram",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return root


PROBE = (
    "import tangram._native as n, tangram.sched.replay as r\n"
    "print('ACTIVE', n.ACTIVE, r.__file__.endswith('.py'))\n"
    "print('REASON', n.REASON)"
)


@compiled
def test_an_edited_source_runs_interpreted_with_a_warning_until_rebuilt(tmp_path: Path) -> None:
    root = _copy_of_the_package(tmp_path)
    out = _python(PROBE, pure=False, path=root, cwd=tmp_path)
    assert "ACTIVE True False" in out, out  # the copy is compiled and current
    src = root / "tangram" / "sched" / "price.py"
    original = src.read_text()
    src.write_text(original + "\n# an edit after the build\n")
    out = _python(PROBE, pure=False, path=root, cwd=tmp_path)
    assert "ACTIVE False True" in out, out
    assert "RuntimeWarning" in out
    assert "sched/price.py is not the source its compiled module was built from" in out
    src.write_text(original)  # the edit undone: the compiled core is current again
    out = _python(PROBE, pure=False, path=root, cwd=tmp_path)
    assert "ACTIVE True False" in out, out
    (root / "tangram" / "_native.json").unlink()  # compiled, but no record of what from
    out = _python(PROBE, pure=False, path=root, cwd=tmp_path)
    assert "ACTIVE False True" in out and "no record of the compiled sources" in out, out


@compiled
def test_a_missing_compiled_module_runs_everything_interpreted(tmp_path: Path) -> None:
    root = _copy_of_the_package(tmp_path)
    for ext in (root / "tangram" / "pools").glob("gpu.*.so"):
        ext.unlink()
    out = _python(PROBE, pure=False, path=root, cwd=tmp_path)
    assert "ACTIVE False True" in out, out
    assert "tangram.pools.gpu is not compiled" in out


def test_tangram_pure_runs_the_sources() -> None:
    out = _python(PROBE, pure=True)
    assert "ACTIVE False True" in out, out
    assert "TANGRAM_PURE=1" in out
    assert "Warning" not in out  # asked for: nothing to warn about

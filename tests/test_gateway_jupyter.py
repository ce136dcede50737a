"""`tangramd http` as SandboxFusion's /run_jupyter: the sandbox-fusion client's own
``run_jupyter`` / ``run_jupyter_async`` against a real gateway and daemon."""

from __future__ import annotations

import asyncio
import base64

import httpx
import pytest
import sandbox_fusion as sfc


@pytest.mark.usefixtures("sandbox_fusion_endpoint")
def test_cells_share_one_kernel_and_report_as_sandbox_fusion():
    """SandboxFusion's own jupyter test cases: state across cells, the last expression as
    display data, stderr, an error that does not stop the next cells."""
    cells = [
        'a = "hello"',
        "a",
        "print(a)",
        'import sys\nsys.stderr.write("This is an error message\\n")',
        "assert False",
        "print(a)",
    ]
    resp = sfc.run_jupyter(sfc.RunJupyterRequest(cells=cells), max_attempts=1)
    assert resp.status == sfc.RunStatus.Success and resp.driver.return_code == 0
    c = resp.cells
    assert [x.stdout for x in c] == ["", "", "hello\n", "", "", "hello\n"]
    assert c[1].display == [{"text/plain": "'hello'"}]
    assert c[3].stderr == "This is an error message\n"
    assert c[4].error[0]["ename"] == "AssertionError"
    assert any("<cell 4>" in line for line in c[4].error[0]["traceback"])
    assert c[0].error == c[5].error == []


@pytest.mark.usefixtures("sandbox_fusion_endpoint")
def test_subprocess_output_display_files_and_a_figure():
    """Output of a child process counts (fd-level capture); display() and a matplotlib
    figure become MIME bundles; files go in and fetch_files come back."""
    cells = [
        "import subprocess; subprocess.run(['echo', 'child'])",
        "display(1, 'x'); open('data.txt').read()",
        "import matplotlib.pyplot as plt\nplt.plot([1, 2], [3, 4])\nplt.show()",
        "open('out.txt', 'w').write('made')",
    ]
    request = sfc.RunJupyterRequest(
        cells=cells,
        files={"data.txt": base64.b64encode(b"in").decode()},
        fetch_files=["out.txt", "missing.txt"],
    )
    resp = asyncio.run(sfc.run_jupyter_async(request, max_attempts=1))
    assert resp.status == sfc.RunStatus.Success, resp
    c = resp.cells
    assert c[0].stdout == "child\n"
    assert [d["text/plain"] for d in c[1].display] == ["1", "'x'", "'in'"]
    png = base64.b64decode(c[2].display[0]["image/png"])
    assert png.startswith(b"\x89PNG") and c[2].error == []
    assert resp.files == {"out.txt": base64.b64encode(b"made").decode()}


def test_timeouts_and_bad_requests(stack):
    """cell_timeout interrupts one cell (the next still runs); total_timeout ends the run as
    Failed with the driver's TimeLimitExceeded; bad input is a 422 or a SandboxError."""
    r = httpx.post(
        f"{stack.url}/run_jupyter",
        json={"cells": ["import time; time.sleep(30)", "print('next')"], "cell_timeout": 0.5},
        timeout=60,
    ).json()
    assert r["status"] == "Success"
    assert r["cells"][0]["error"][0]["ename"] == "TimeoutError"
    assert r["cells"][1]["stdout"] == "next\n"
    total = httpx.post(
        f"{stack.url}/run_jupyter",
        json={"cells": ["print('a', flush=True)", "while True: pass"], "total_timeout": 1},
        timeout=60,
    ).json()
    assert total["status"] == "Failed" and total["cells"] == []
    assert total["driver"]["status"] == "TimeLimitExceeded"
    bad = httpx.post(f"{stack.url}/run_jupyter", json={"cells": "x"}, timeout=10)
    assert bad.status_code == 422 and "detail" in bad.json()
    wrong_kernel = httpx.post(
        f"{stack.url}/run_jupyter", json={"cells": [], "kernel": "julia"}, timeout=10
    )
    assert wrong_kernel.status_code == 422
    not_b64 = httpx.post(
        f"{stack.url}/run_jupyter", json={"cells": ["1"], "files": {"a": "!!"}}, timeout=10
    ).json()
    assert not_b64["status"] == "SandboxError" and "base64" in not_b64["message"]
    killed = httpx.post(
        f"{stack.url}/run_jupyter", json={"cells": ["import os; os._exit(3)"]}, timeout=60
    ).json()
    assert killed["status"] == "Failed" and killed["driver"]["return_code"] == 3
    assert httpx.get(f"{stack.url}/health", timeout=10).json()["ok"]

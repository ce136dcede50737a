"""SandboxFusion's /run_code on the default (isolated) backend: ``memory_limit_MB`` is a
real limit, and throwaway environments share nothing, ``/tmp`` included (issue 30)."""

from __future__ import annotations

import httpx
from harness import running_stack


def run_code(url: str, code: str, **kw: object) -> dict[str, object]:
    body = {"code": code, "language": "python", **kw}
    resp = httpx.post(f"{url}/run_code", json=body, timeout=60).json()
    assert isinstance(resp, dict)
    return resp


def test_memory_hog_is_killed_with_sandbox_fusions_status(tmp_path):
    """Under ``memory_limit_MB`` = 128 a 512 MiB allocation is killed (status Failed, the
    command Finished with SIGKILL's 137, as SandboxFusion reports a killed run), while
    64 MiB under 256 succeeds."""
    hog = "b = bytearray(512 << 20); print('ALLOCATED')"
    fits = "b = bytearray(64 << 20); print(len(b))"
    with running_stack(tmp_path) as stack:
        killed = run_code(stack.url, hog, memory_limit_MB=128)
        ok = run_code(stack.url, fits, memory_limit_MB=256)
    run = killed["run_result"]
    assert isinstance(run, dict)
    assert killed["status"] == "Failed", killed
    assert run["status"] == "Finished" and run["return_code"] == 137, run
    assert "ALLOCATED" not in str(run["stdout"])
    assert ok["status"] == "Success", ok


def test_throwaway_environments_share_no_tmp(tmp_path):
    """What one /run_code leaves in /tmp, the next one does not see."""
    write = "open('/tmp/left.txt', 'w').write('from the first')"
    read = "import os; print(os.path.exists('/tmp/left.txt'))"
    with running_stack(tmp_path) as stack:
        first = run_code(stack.url, write)
        second = run_code(stack.url, read)
    assert first["status"] == "Success", first
    assert second["status"] == "Success", second
    assert second["run_result"]["stdout"] == "False\n", second  # type: ignore[index]

"""SandboxFusion's ``POST /run_jupyter``, served as one exec action.

The models re-declare SandboxFusion's (``RunJupyterRequest`` in ``sandbox/runners/types.py``,
``RunJupyterResponse`` in ``sandbox/server/sandbox_api.py``). SandboxFusion starts a real
Jupyter kernel; here a small kernel-like driver (``jupyter_kernel.py``, standard library
only) runs the cells in order in one Python process, in a throwaway environment, as one
exec action: the driver, the cells and the request's ``files`` go in with the exec and the
cells' results and ``fetch_files`` come back with it (one round trip to the daemon).

Status rules, as SandboxFusion's handler: the driver finished → ``Success`` with one
result per cell (a cell that raised is data: its ``error``); the driver timed out
(``total_timeout``) or died → ``Failed`` with the driver's result and no cells; the sandbox
itself failed → ``SandboxError``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from tangram.client import AsyncClient, ExecResult
from tangram.model import TangramError
from tangramd.gateway.sandbox_fusion import (
    CommandRunResult,
    CommandRunStatus,
    MemoryLimitMB,
    RunStatus,
    Text,
    command_result,
    decode_files,
    encode_files,
    mem_bytes,
    positive,
)

KERNEL = Path(__file__).with_name("jupyter_kernel.py")
KERNEL_FILE = ".tangram_kernel.py"
INPUT_FILE = ".tangram_cells.json"
OUTPUT_FILE = ".tangram_cells_out.json"


class RunJupyterRequest(BaseModel):
    cells: list[Text] = Field(..., description="list of code blocks to run in jupyter notebook")
    cell_timeout: float = Field(0, description="max run time for each of the cells")
    total_timeout: float = Field(45, description="max run time for all the cells")
    memory_limit_MB: MemoryLimitMB = -1
    kernel: Literal["python3"] = "python3"
    files: dict[Text, str] = Field({}, description="file path -> base64 content")
    fetch_files: list[Text] = Field([], description="file paths to fetch after execution")


class CellRunResult(BaseModel):
    stdout: str
    stderr: str
    display: list[dict[str, Any]]
    error: list[dict[str, Any]]


class RunJupyterResponse(BaseModel):
    status: RunStatus
    message: str
    driver: CommandRunResult | None = None
    cells: list[CellRunResult] = []
    executor_pod_name: str | None = None
    files: dict[str, str] = {}


@functools.cache
def _kernel_source() -> bytes:
    return KERNEL.read_bytes()  # read once per gateway process, not once per request


def _error(message: str, driver: CommandRunResult | None = None) -> RunJupyterResponse:
    return RunJupyterResponse(status=RunStatus.SandboxError, message=message, driver=driver)


async def run_jupyter(
    client: AsyncClient, request: RunJupyterRequest, *, cpus: int = 1
) -> tuple[RunJupyterResponse, ExecResult | None]:
    """Run the cells; return the response and the exec result behind it."""
    files = decode_files(request.files)
    if isinstance(files, str):
        return _error(files), None
    config = {"cells": request.cells, "cell_timeout": request.cell_timeout}
    files[KERNEL_FILE] = _kernel_source()
    files[INPUT_FILE] = json.dumps(config).encode()
    ops: Any = client  # the shared op methods return coroutines on an AsyncClient
    try:
        result: ExecResult = await ops.exec(
            ["python3", KERNEL_FILE, INPUT_FILE, OUTPUT_FILE],
            files=files,
            fetch=[*request.fetch_files, OUTPUT_FILE],
            env_vars={"MPLBACKEND": "Agg"},  # figures are rendered, never shown on a screen
            timeout_s=positive(request.total_timeout),
            mem=mem_bytes(request.memory_limit_MB),
            cpus=cpus,
            task="run_jupyter/python3",
        )
    except TangramError as exc:
        return _error(f"{exc.code}: {exc.message}"), None
    driver = command_result(result)
    if driver.status == CommandRunStatus.Error:
        return _error(driver.stderr or "the sandbox failed", driver), result
    fetched = dict(result.files)
    output = fetched.pop(OUTPUT_FILE, None)
    if driver.status != CommandRunStatus.Finished or output is None:
        return RunJupyterResponse(status=RunStatus.Failed, message="", driver=driver), result
    try:
        cells = json.loads(output)["cells"]
    except (ValueError, KeyError, TypeError):  # a cell overwrote the driver's answer
        return RunJupyterResponse(status=RunStatus.Failed, message="", driver=driver), result
    return (
        RunJupyterResponse(
            status=RunStatus.Success,
            message="",
            driver=driver,
            cells=[CellRunResult(**cell) for cell in cells],
            files=encode_files(fetched),
        ),
        result,
    )

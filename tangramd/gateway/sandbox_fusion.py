"""SandboxFusion's ``POST /run_code``, served by tangram actions.

The request and response models re-declare SandboxFusion's server models
(``sandbox/server/sandbox_api.py`` and ``sandbox/runners/types.py``) field for field, so
its clients (the ``sandbox-fusion`` package, verl's ``sandbox_fusion`` reward functions)
talk to us unchanged. The status rules are its ``parse_run_status``:

- a command that ran and exited non-zero is ``Failed`` (HTTP 200, not an error);
- a timeout is ``Failed`` with ``run_result.status == "TimeLimitExceeded"``;
- a failure of the sandbox itself (daemon unreachable, environment lost, refused) is
  ``SandboxError`` with the reason in ``message`` and ``run_result.stderr``;
- a malformed request is HTTP 422 with FastAPI's JSON error body.

Unlike SandboxFusion we never send ``null`` for ``stdout``, ``stderr``, ``execution_time``
or ``message``. Each request runs in its own throwaway environment: without a compile step
it is one exec action in a throwaway environment, one round trip to the daemon (the source
and the request's ``files`` travel with the exec, ``fetch_files`` come back with its
result); with a compile step the gateway opens an environment and runs the compile action
and the run action in it, then closes it.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field

from tangram.client import AsyncClient, ExecResult
from tangram.model import TangramError

Language = Literal[
    "python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript",
    "sql", "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest",
    "junit", "kotlin_script", "jest", "verilog", "python_gpu", "lean", "swift", "racket",
]  # fmt: skip


MAX_MEMORY_LIMIT_MB = 1 << 30  # 1 PiB: larger is a 422 (the daemon's sizes are 64-bit)


def _utf8(text: str) -> str:
    """``text`` if it can be encoded as UTF-8; JSON's ``"\\ud800"`` (a lone surrogate)
    cannot, and would fail later, as a 500, where the request is sent to the daemon."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(f"not UTF-8 text: a lone surrogate at index {exc.start}") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]
MemoryLimitMB = Annotated[
    int,
    Field(le=MAX_MEMORY_LIMIT_MB, description="maximum memory allowed in megabytes"),
]


class RunCodeRequest(BaseModel):
    compile_timeout: float = Field(10, description="compile timeout for compiled languages")
    run_timeout: float = Field(10, description="code run timeout")
    memory_limit_MB: MemoryLimitMB = -1
    code: Text = Field(..., description="the code to run")
    stdin: Text | None = Field(None, description="optional string to pass into stdin")
    language: Language = Field(..., description="the language or execution mode to run the code")
    files: dict[Text, str | None] = Field({}, description="file path -> base64 content")
    fetch_files: list[Text] = Field([], description="file paths to fetch after execution")


class RunStatus(str, Enum):
    Success = "Success"
    Failed = "Failed"
    SandboxError = "SandboxError"


class CommandRunStatus(str, Enum):
    Finished = "Finished"
    Error = "Error"
    TimeLimitExceeded = "TimeLimitExceeded"


class CommandRunResult(BaseModel):
    status: CommandRunStatus
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    status: RunStatus
    message: str
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = {}


@dataclass(frozen=True, slots=True)
class Recipe:
    """How one language runs: the source file, an optional compile step, the run step."""

    source: str
    run: str
    compile: str | None = None
    run_argv: tuple[str, ...] = field(init=False)  # ``run`` and ``compile`` split once
    compile_argv: tuple[str, ...] | None = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "run_argv", tuple(shlex.split(self.run)))
        argv = None if self.compile is None else tuple(shlex.split(self.compile))
        object.__setattr__(self, "compile_argv", argv)


RECIPES: dict[str, Recipe] = {
    "python": Recipe("main.py", "python3 main.py"),
    "pytest": Recipe("test_main.py", "python3 -m pytest -q -p no:cacheprovider test_main.py"),
    "bash": Recipe("main.sh", "/bin/bash main.sh"),
    "cpp": Recipe("main.cpp", "./test", "g++ -std=c++17 main.cpp -o test"),
    "nodejs": Recipe("main.js", "node main.js"),
}


def command_result(result: ExecResult) -> CommandRunResult:
    """One exec action's result as SandboxFusion reports a command."""
    if result.outcome in ("ok", "failed"):
        return CommandRunResult(
            status=CommandRunStatus.Finished,
            execution_time=result.exec_s,
            return_code=result.exit_code,
            stdout=result.stdout,
            stderr=result.stderr,
        )
    if result.outcome == "timeout":  # the limit bounds the wait for a core and memory too
        waited = result.detail if result.detail.startswith("waited ") else ""
        return CommandRunResult(
            status=CommandRunStatus.TimeLimitExceeded,
            execution_time=result.exec_s,
            stdout=result.stdout,
            stderr=f"{result.stderr}{waited}" if waited else result.stderr,
        )
    why = result.detail or result.outcome
    return CommandRunResult(
        status=CommandRunStatus.Error,
        execution_time=result.exec_s,
        stdout=result.stdout,
        stderr=f"{result.stderr}{why}" if result.stderr else why,
    )


def run_status(compile_result: CommandRunResult | None, run: CommandRunResult | None) -> RunStatus:
    """SandboxFusion's ``parse_run_status``: Error wins, then timeouts and non-zero exits."""
    results = [r for r in (compile_result, run) if r is not None]
    if any(r.status == CommandRunStatus.Error for r in results):
        return RunStatus.SandboxError
    if any(r.status == CommandRunStatus.TimeLimitExceeded for r in results):
        return RunStatus.Failed
    if any(r.return_code not in (None, 0) for r in results):
        return RunStatus.Failed
    return RunStatus.Success


def positive(seconds: float) -> float:
    return max(float(seconds), 0.001)  # SandboxFusion's wait_for(0) times out at once


def mem_bytes(limit_mb: int) -> int | None:
    """SandboxFusion's ``memory_limit_MB`` as the environment's size (-1: the default)."""
    return limit_mb << 20 if limit_mb > 0 else None


def sandbox_error(message: str) -> RunCodeResponse:
    return RunCodeResponse(
        status=RunStatus.SandboxError,
        message=message,
        run_result=CommandRunResult(
            status=CommandRunStatus.Error, execution_time=0.0, stdout="", stderr=message
        ),
    )


def _respond(
    compile_res: ExecResult | None, run_res: ExecResult | None, files: dict[str, str]
) -> RunCodeResponse:
    compile_result = command_result(compile_res) if compile_res is not None else None
    run_result = command_result(run_res) if run_res is not None else None
    status = run_status(compile_result, run_result)
    message = ""
    if status == RunStatus.SandboxError:
        failed = next(
            r for r in (compile_result, run_result) if r and r.status == CommandRunStatus.Error
        )
        message = failed.stderr or ""
    return RunCodeResponse(
        status=status,
        message=message,
        compile_result=compile_result,
        run_result=run_result,
        files=files,
    )


def decode_files(files: Mapping[str, str | None]) -> dict[str, bytes] | str:
    """A request's base64 files as bytes (``None`` contents skipped, as SandboxFusion does),
    or what is wrong with one."""
    out: dict[str, bytes] = {}
    for path, content in files.items():
        if content is None:
            continue
        try:
            out[path] = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            return f"files[{path!r}]: not valid base64"
    return out


def encode_files(files: Mapping[str, bytes]) -> dict[str, str]:
    """Fetched files as a response carries them (base64)."""
    return {path: base64.b64encode(data).decode() for path, data in files.items()}


async def run_code(
    client: AsyncClient, request: RunCodeRequest, *, cpus: int = 1
) -> tuple[RunCodeResponse, list[ExecResult]]:
    """Run one ``/run_code`` request; return the response and the exec results behind it.

    Without a compile step the whole request is one exec action in a throwaway environment,
    one round trip to the daemon: the source and the request's files go in with the exec
    (``files``), the command runs as an argv (no wrapper shell) and ``fetch_files`` come
    back with its result. With a compile step the gateway opens an environment and runs
    the compile action (carrying the files) and the run action (fetching the files) in it.
    """
    recipe = RECIPES.get(request.language)
    if recipe is None:
        served = ", ".join(sorted(RECIPES))
        return sandbox_error(f"language {request.language!r} is not served here ({served})"), []
    decoded = decode_files(request.files)
    if isinstance(decoded, str):
        return sandbox_error(decoded), []
    files = {**decoded, recipe.source: request.code.encode()}
    stdin = request.stdin.encode() if request.stdin else None
    fetch = list(request.fetch_files) or None
    ops: Any = client  # the shared op methods return coroutines on an AsyncClient
    task = f"run_code/{request.language}"
    try:
        if recipe.compile is None:
            result: ExecResult = await ops.exec(
                recipe.run_argv,
                files=files,
                fetch=fetch,
                stdin=stdin,
                timeout_s=positive(request.run_timeout),
                mem=mem_bytes(request.memory_limit_MB),
                cpus=cpus,
                task=task,
            )
            return _respond(None, result, encode_files(result.files)), [result]
        return await _compile_and_run(ops, request, recipe, files, fetch, stdin, cpus)
    except TangramError as exc:
        return sandbox_error(f"{exc.code}: {exc.message}"), []


async def _compile_and_run(
    ops: Any,
    request: RunCodeRequest,
    recipe: Recipe,
    files: dict[str, bytes],
    fetch: list[str] | None,
    stdin: bytes | None,
    cpus: int,
) -> tuple[RunCodeResponse, list[ExecResult]]:
    assert recipe.compile_argv is not None
    # the open waits for memory at most as long as both steps may take in all
    limit = positive(request.compile_timeout) + positive(request.run_timeout)
    env_id: str = await ops.env_open(mem=mem_bytes(request.memory_limit_MB), timeout_s=limit)
    task = f"run_code/{request.language}"
    try:
        compile_res: ExecResult = await ops.exec(
            recipe.compile_argv,
            env=env_id,
            files=files,
            timeout_s=positive(request.compile_timeout),
            cpus=cpus,
            task=f"{task}/compile",
        )
        if not compile_res.ok:
            return _respond(compile_res, None, {}), [compile_res]
        run_res: ExecResult = await ops.exec(
            recipe.run_argv,
            env=env_id,
            fetch=fetch,
            stdin=stdin,
            timeout_s=positive(request.run_timeout),
            cpus=cpus,
            task=task,
        )
        return _respond(compile_res, run_res, encode_files(run_res.files)), [compile_res, run_res]
    finally:
        with contextlib.suppress(TangramError):
            await ops.env_close(env_id)

"""SWE-ReX's remote runtime API at ``/swerex/{env_id}``, on a tangram environment.

SWE-agent style agents drive a sandbox through ``swerex.runtime.remote.RemoteRuntime``;
pointed at ``http://HOST:PORT/swerex/ENV`` it talks to an environment opened through the
client, ``tangramctl env open`` or ``POST /envs``. The models re-declare SWE-ReX's
(``swerex/runtime/abstract.py``) and errors travel as its server sends them: HTTP 511 with
``{"swerexception": {"message", "class_path", "traceback", "extra_info"}}``, so its client
re-raises ``CommandTimeoutError``, ``SessionDoesNotExistError``,
``BashIncorrectSyntaxError``, ``NonZeroExitCodeError``, ``FileNotFoundError``, …

Each command is one exec action (it waits for its core, runs pinned to it, releases it):
``execute`` in the environment, ``run_in_session`` in a tangram shell session (named
sessions map to session ids per environment). Differences from SWE-ReX's own server:
``execute``'s ``env`` adds variables rather than replacing the environment, a string
command always runs through ``/bin/sh -c``, and an interactive program
(``is_interactive_command``) runs on a terminal of its own (``bash -c`` in the session's
directory and exported variables), not in the session's shell (see
``run_interactive``). Paths are the environment's: relative to its working directory;
the process backend refuses paths outside the environment.

Life cycle: ``POST /envs`` opens an environment (its memory reserved; the open waits at
most its ``timeout``, 60 s by default, for memory, then fails naming what it needed);
SWE-ReX's ``close`` (``RemoteRuntime.close``) ends the runtime's sessions and closes an
environment this gateway opened, freeing its memory at once; ``DELETE /envs/{id}``
closes any environment. An environment nobody closes goes after the daemon's idle TTL
(``[cpu] env_idle_ttl_s``). A command's ``timeout`` bounds its wait for a core and
memory as well as its run. An ``execute`` whose HTTP client disconnects is cancelled
(by its ``ref``: withdrawn if it waits, killed if it runs), since one without a
``timeout`` would otherwise hold its cores for as long as it runs, unread.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import json
import re
import subprocess
import tarfile
import traceback
import zipfile
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Depends, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from tangram.client import AsyncClient, ExecResult
from tangram.model import TangramError
from tangram.protocol.errors import BadRequest, NotFound
from tangramd.backends.nsfiles import MAX_EXTRACT_BYTES, MAX_EXTRACT_MEMBERS
from tangramd.gateway.callers import CALLER, caller_label

EXC = "swerex.exceptions."
PS1 = "SHELLPS1PREFIX"  # SWE-ReX's prompt: the expect_string of a command that ran to its end
ANSI_ESCAPE = re.compile(r"\x1B[@-_][0-?]*[ -/]*[@-~]")

# The session's terminal for interactive commands (``swerex_pty.py``, stdlib only, run by
# the environment's python3: see there).
_HERE = Path(__file__).resolve().parent
PTY_HELPER = (_HERE / "swerex_pty.py").read_text()
PTY_CLIENT = (_HERE / "swerex_pty_client.py").read_text()
SYNTAX_CHECK_TIMEOUT_S = 5.0

# --------------------------------------------------------------------------- models


class CreateBashSessionRequest(BaseModel):
    startup_source: list[str] = []
    session: str = "default"
    session_type: Literal["bash"] = "bash"
    startup_timeout: float = 1.0


class BashAction(BaseModel):
    command: str
    session: str = "default"
    timeout: float | None = None
    is_interactive_command: bool = False
    is_interactive_quit: bool = False
    check: Literal["silent", "raise", "ignore"] = "raise"
    error_msg: str = ""
    expect: list[str] = []
    action_type: Literal["bash"] = "bash"


class BashInterruptAction(BaseModel):
    session: str = "default"
    timeout: float = 0.2
    n_retry: int = 3
    expect: list[str] = []
    action_type: Literal["bash_interrupt"] = "bash_interrupt"


class CloseBashSessionRequest(BaseModel):
    session: str = "default"
    session_type: Literal["bash"] = "bash"


class Command(BaseModel):
    command: str | list[str]
    timeout: float | None = None
    shell: bool = False
    check: bool = False
    error_msg: str = ""
    env: dict[str, str] | None = None
    cwd: str | None = None
    merge_output_streams: bool = False


class ReadFileRequest(BaseModel):
    path: str
    encoding: str | None = None
    errors: str | None = None


class WriteFileRequest(BaseModel):
    content: str
    path: str


OPEN_TIMEOUT_S = 60.0  # POST /envs: the longest an open waits for memory by default


class OpenEnvRequest(BaseModel):
    image: str | None = None
    mem: int | None = None
    trajectory: str | None = None
    # the most the open waits for memory, then 504 "timeout: waited … for memory: needs …"
    timeout: float | None = Field(default=OPEN_TIMEOUT_S, gt=0)


class ForkEnvRequest(BaseModel):
    n: Any = 1  # (checked by the daemon: bad_request naming n and its allowed values)


# --------------------------------------------------------------------------- errors


class RemoteError(Exception):
    """An exception SWE-ReX's client re-raises by class path (HTTP 511)."""

    def __init__(self, class_path: str, message: str, extra_info: dict[str, Any] | None = None):
        super().__init__(message)
        self.class_path = class_path
        self.message = message
        self.extra_info = extra_info or {}


def exception_response(exc: RemoteError) -> JSONResponse:
    body = {
        "message": exc.message,
        "class_path": exc.class_path,
        "traceback": "".join(traceback.format_exception_only(type(exc), exc)),
        "extra_info": exc.extra_info,
    }
    return JSONResponse(status_code=511, content={"swerexception": body})


def _from_tangram(exc: TangramError, path: str = "") -> RemoteError:
    where = f"{path}: " if path else ""
    if isinstance(exc, NotFound):
        return RemoteError("builtins.FileNotFoundError", f"{where}{exc.message}")
    if isinstance(exc, BadRequest):
        return RemoteError("builtins.ValueError", f"{where}{exc.message}")
    return RemoteError(EXC + "SwerexException", f"{exc.code}: {exc.message}")


# --------------------------------------------------------------------------- runtime


class Runtimes:
    """Named bash sessions per environment: ``(env, name) -> tangram session id``, and
    the environments this gateway opened (``POST /envs``): SWE-ReX's ``close`` closes
    those (see :meth:`close`)."""

    def __init__(self, client: AsyncClient, observe: Any) -> None:
        self.default_client: Any = client  # the shared op methods return coroutines here
        self.observe = observe  # (kind, ExecResult) -> None: the gateway's metrics
        self.sessions: dict[tuple[str, str], str] = {}
        self.opened: set[str] = set()
        self.owners: dict[str, str] = {}  # env -> the label of the key that opened it
        self.interactive: set[tuple[str, str]] = set()  # sessions with a program on a pty
        self.refs = itertools.count(1)  # exec refs (unique on each client's connection)

    @property
    def client(self) -> Any:
        """The daemon client of the request's caller (its key's user)."""
        caller = CALLER.get()
        return self.default_client if caller is None else caller.client

    def check_owner(self, env: str) -> None:
        """Raise ``not_found`` when ``env`` was opened here by another key: to any other
        key it does not exist (issue 30, item 4)."""
        owner = self.owners.get(env)
        if owner is not None and owner != caller_label():
            raise NotFound(f"no environment {env!r}")

    async def exec(self, kind: str, cmd: Any, **kw: Any) -> ExecResult:
        result: ExecResult = await self.client.exec(cmd, task=f"swerex/{kind}", **kw)
        self.observe(f"swerex/{kind}", result)
        return result

    def session(self, env: str, name: str) -> str:
        sid = self.sessions.get((env, name))
        if sid is None:
            raise RemoteError(EXC + "SessionDoesNotExistError", f"session {name!r} does not exist")
        return sid

    async def create_session(self, env: str, req: CreateBashSessionRequest) -> dict[str, Any]:
        if (env, req.session) in self.sessions:
            raise RemoteError(EXC + "SessionExistsError", f"session {req.session} already exists")
        sid = await self.client.session_open(env)
        self.sessions[(env, req.session)] = sid
        output = ""
        for path in req.startup_source:
            result = await self.exec("create_session", f"source {_quote(path)}", session=sid)
            output += result.stdout + result.stderr
        return {"output": output, "session_type": "bash"}

    async def run_in_session(self, env: str, action: BashAction | BashInterruptAction) -> Any:
        sid = self.session(env, action.session)
        if isinstance(action, BashInterruptAction):
            if (env, action.session) in self.interactive:
                return await self.interrupt_interactive(env, sid, action)
            await self.client.session_interrupt(sid)
            return _observation("", 0)
        if (
            action.is_interactive_command
            or action.is_interactive_quit
            or (env, action.session) in self.interactive
        ):
            return await self.run_interactive(env, sid, action)
        await _check_syntax(action.command)
        # A group keeps the shell's state (cd, variables) and merges stderr as a terminal would;
        # its leading ':' lets an empty or comment-only command run (a bare "{ }" is a bash
        # syntax error) and leaves $? as SWE-ReX's shell has it then: 0.
        result = await self.exec(
            "run_in_session", "{ :\n" + action.command + "\n} 2>&1", session=sid,
            timeout_s=action.timeout,
        )  # fmt: skip
        if result.outcome == "timeout":
            raise RemoteError(
                EXC + "CommandTimeoutError",
                f"timeout after {action.timeout} seconds while running command {action.command!r}"
                + _waited(result),
            )
        if result.outcome not in ("ok", "failed"):
            raise RemoteError(EXC + "SwerexException", result.detail or result.outcome)
        # the output as the shell wrote it, as SWE-ReX gives it: leading spaces, blank lines
        # and the trailing newline are part of an agent's observation
        output = result.stdout + result.stderr
        if action.check == "ignore":
            return _observation(output, None)
        if action.check == "raise" and result.exit_code != 0:
            msg = (
                f"Command {action.command!r} failed with exit code {result.exit_code}. "
                f"Here is the output:\n{output!r}"
            )
            raise RemoteError(
                EXC + "NonZeroExitCodeError",
                f"{action.error_msg}: {msg}" if action.error_msg else msg,
            )
        return _observation(output, result.exit_code)

    async def _pty(self, sid: str, request: dict[str, Any], start: str | None) -> dict[str, Any]:
        """One exchange with the session's program on a pseudo-terminal (``PTY_HELPER``, a
        background job of the session's shell; ``start``: the command that starts it)."""
        ask = f'python3 -c {_quote(PTY_CLIENT)} "$__tangram_pty" {_quote(json.dumps(request))}'
        if start is not None:
            ask = (
                "__tangram_pty=$(mktemp -d) && "
                f'{{ python3 -c {_quote(PTY_HELPER)} "$__tangram_pty" {_quote(start)} & '
                f"disown; }} 2>/dev/null && {ask}"
            )
        wait = request.get("timeout")
        result = await self.exec(
            "run_in_session", ask, session=sid, timeout_s=None if wait is None else wait + 30
        )
        try:
            reply: dict[str, Any] = json.loads(result.stdout)
        except ValueError:
            raise RemoteError(
                EXC + "SwerexException",
                f"interactive command: no answer from its terminal ({result.outcome}, "
                f"exit {result.exit_code}): {(result.stdout + result.stderr)[-2000:]}",
            ) from None
        return reply

    async def run_interactive(self, env: str, sid: str, action: BashAction) -> dict[str, Any]:
        """An interactive action as SWE-ReX's server runs it (pexpect on its shell): the
        line goes to the program on the session's terminal, and the answer is what it
        printed up to the first ``expect`` pattern (regular expressions) or, as SWE-ReX's
        prompt, until the program exits. A program is started by the first interactive
        command on a terminal of its own, in the session's directory and exported
        variables (``bash -c``: a ``read`` there sets nothing in the session's shell)."""
        key = (env, action.session)
        running = key in self.interactive
        request = {
            "send": action.command + "\n" if running else None,
            "expect": action.expect,
            "timeout": action.timeout,
        }
        reply = await self._pty(sid, request, None if running else action.command)
        if "gone" in reply:  # the program had ended: the line is for the session's shell,
            self.interactive.discard(key)  # as SWE-ReX's shell would read it next
            rest = _strip_control_chars(reply.get("output", ""))
            observation = await self.run_in_session(env, action)
            observation["output"] = rest + observation["output"]
            return dict(observation)
        self.interactive.add(key)
        if reply.get("timeout"):
            raise RemoteError(
                EXC + "CommandTimeoutError",
                f"timeout after {action.timeout} seconds while running command {action.command!r}",
            )
        output = _strip_control_chars(reply.get("output", ""))
        exit_code: int | None = 0
        if "exited" in reply:
            self.interactive.discard(key)
            expect_string = PS1
            if not (action.is_interactive_command or action.is_interactive_quit):
                exit_code = int(reply["exited"])
        else:
            expect_string = action.expect[int(reply["matched"])]
        if action.is_interactive_command and not action.is_interactive_quit:
            output = output.lstrip().removeprefix(action.command).strip()
        observation = _observation(output, exit_code)
        observation["expect_string"] = expect_string
        return observation

    async def interrupt_interactive(
        self, env: str, sid: str, action: BashInterruptAction
    ) -> dict[str, Any]:
        """^C to the program on the session's terminal, ``n_retry`` times, each waiting
        ``timeout`` for it to end (or for an ``expect`` pattern); then it is killed."""
        key = (env, action.session)
        output = ""
        for attempt in range(action.n_retry + 1):
            last = attempt == action.n_retry
            request = {"send": None if last else "\x03", "kill": last,
                       "expect": action.expect, "timeout": action.timeout}  # fmt: skip
            reply = await self._pty(sid, request, None)
            output += reply.get("output", "")
            if "exited" in reply or "matched" in reply:
                if "exited" in reply:
                    self.interactive.discard(key)
                expect = PS1 if "exited" in reply else action.expect[int(reply["matched"])]
                observation = _observation(_strip_control_chars(output).strip(), 0)
                observation["expect_string"] = expect
                return observation
        raise RemoteError("pexpect.exceptions.TIMEOUT", "Failed to interrupt session")

    async def close_session(self, env: str, req: CloseBashSessionRequest) -> dict[str, Any]:
        sid = self.session(env, req.session)
        del self.sessions[(env, req.session)]
        self.interactive.discard((env, req.session))
        with contextlib.suppress(NotFound):  # the environment (and its shells) went away
            await self.client.session_close(sid)
        return {"session_type": "bash"}

    async def exec_while_connected(
        self, gone: Awaitable[Any], kind: str, cmd: Any, **kw: Any
    ) -> ExecResult:
        """``exec`` that is cancelled (``cancel`` by its ``ref``: withdrawn if it waits,
        killed if it runs) when ``gone`` (the HTTP client hung up) comes first; its result
        is then the ``cancelled`` one, answered to nobody."""
        client = self.client
        ref = f"swerex-{next(self.refs)}"
        run = asyncio.ensure_future(self.exec(kind, cmd, ref=ref, **kw))
        watch = asyncio.ensure_future(gone)
        try:
            await asyncio.wait((run, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not run.done():
            with contextlib.suppress(TangramError):  # it ended meanwhile: nothing to cancel
                await client.request("cancel", {"ref": ref})
        return await run

    async def execute(
        self, env: str, command: Command, gone: Awaitable[Any] | None = None
    ) -> dict[str, Any]:
        """SWE-ReX's ``execute``; ``gone``: resolves when the HTTP client hangs up, which
        cancels the command (it would otherwise run on, holding its cores, with nobody to
        read its result: the one route whose command may have no timeout)."""
        cmd: Any = command.command
        if cmd == "" or cmd == []:  # SWE-ReX runs it: nothing, exit 0 (an exec needs a command)
            cmd = ":"
        if command.merge_output_streams:
            cmd = (
                "exec 2>&1; " + cmd
                if isinstance(cmd, str)
                else ["/bin/sh", "-c", 'exec 2>&1; exec "$@"', "sh", *cmd]
            )
        kw = {"env": env, "timeout_s": command.timeout, "env_vars": command.env, "cwd": command.cwd}
        if gone is None:
            result = await self.exec("execute", cmd, **kw)
        else:
            result = await self.exec_while_connected(gone, "execute", cmd, **kw)
        if result.outcome == "timeout":
            raise RemoteError(
                EXC + "CommandTimeoutError",
                f"Timeout ({command.timeout}s) exceeded while running command" + _waited(result),
            )
        if result.outcome == "rejected":
            raise RemoteError("builtins.ValueError", result.detail)
        if result.outcome in ("infra_error", "cancelled"):  # cancelled: `tangramctl cancel`
            raise RemoteError(EXC + "SwerexException", result.detail or result.outcome)
        if command.check and result.exit_code != 0:
            msg = (
                f"Command {command.command!r} failed with exit code {result.exit_code}. "
                f"Stdout:\n{result.stdout!r}\nStderr:\n{result.stderr!r}"
            )
            raise RemoteError(
                EXC + "NonZeroExitCodeError",
                f"{command.error_msg}: {msg}" if command.error_msg else msg,
            )
        return {"stdout": result.stdout, "stderr": result.stderr, "exit_code": result.exit_code}

    async def read_file(self, env: str, req: ReadFileRequest) -> dict[str, Any]:
        try:
            data, is_tar = await self.client.get(env, req.path)
        except TangramError as exc:
            raise _from_tangram(exc, req.path) from None
        if is_tar:
            raise RemoteError("builtins.IsADirectoryError", f"{req.path}: is a directory")
        try:
            content = data.decode(req.encoding or "utf-8", req.errors or "strict")
        except (UnicodeDecodeError, LookupError) as exc:
            raise RemoteError("builtins.ValueError", f"{req.path}: {exc}") from None
        return {"content": content}

    async def write_file(self, env: str, req: WriteFileRequest) -> dict[str, Any]:
        try:
            await self.client.put(env, req.path, req.content.encode())
        except TangramError as exc:
            raise _from_tangram(exc, req.path) from None
        return {}

    async def upload(self, env: str, data: bytes, target: str, unzip: bool) -> dict[str, Any]:
        try:
            if unzip:  # (a zip inflates: off the loop, its declared sizes checked first)
                tar = await asyncio.to_thread(zip_to_tar, data)
                await self.client.put(env, target, tar, tar=True)
            else:
                await self.client.put(env, target, data)
        except TangramError as exc:
            raise _from_tangram(exc, target) from None
        return {}

    async def close(self, env: str) -> dict[str, Any]:
        """SWE-ReX's ``close`` (``RemoteRuntime.close``): the runtime ends. Its sessions
        end, and so does the environment when this gateway opened it (``POST /envs``):
        its memory is free at once, not after the idle TTL. An environment opened
        elsewhere (a client, ``tangramctl env open``) belongs to its opener and stays
        open (``DELETE /envs/{id}`` or ``env.close`` closes it). Closing twice is fine."""
        await self.close_sessions(env)
        if env in self.opened:
            self.opened.discard(env)
            with contextlib.suppress(NotFound):
                await self.client.env_close(env)
            self.owners.pop(env, None)
        return {}

    async def close_sessions(self, env: str) -> None:
        for (owner, name), sid in list(self.sessions.items()):
            if owner == env:
                del self.sessions[(owner, name)]
                self.interactive.discard((owner, name))
                with contextlib.suppress(NotFound):
                    await self.client.session_close(sid)


def _waited(result: ExecResult) -> str:
    """Why a timeout came before the command ran, if it did (a command's timeout bounds its
    wait for a core and memory too): `` (waited 2.0 s for memory: needs 1 GiB, …)``."""
    return f" ({result.detail})" if result.detail.startswith("waited ") else ""


def _observation(output: str, exit_code: int | None) -> dict[str, Any]:
    return {
        "output": output,
        "exit_code": exit_code,
        "failure_reason": "",
        "expect_string": PS1,  # the command ran to its end: SWE-ReX's shell is at its prompt
        "session_type": "bash",
    }


def _strip_control_chars(text: str) -> str:
    """As SWE-ReX cleans what its terminal gave: ANSI escapes out, "\\r\\n" as "\\n"."""
    return ANSI_ESCAPE.sub("", text).replace("\r\n", "\n")


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


async def _check_syntax(command: str) -> None:
    """``bash -n``, as SWE-ReX checks a command before it reaches the shell (parse only).

    A blocking ``subprocess.run`` on a worker thread: asyncio's subprocess transport
    (child watcher, pipe protocols) made this ~8 ms of a session command in the gateway's
    process, against ~2 ms for the spawn itself."""
    try:
        done = await asyncio.to_thread(
            subprocess.run, ["bash", "-n"], input=command.encode() + b"\n",
            capture_output=True, timeout=SYNTAX_CHECK_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return  # cannot tell: let the shell report it
    if done.returncode == 0:
        return
    stdout = done.stdout.decode(errors="backslashreplace")
    stderr = done.stderr.decode(errors="backslashreplace")
    raise RemoteError(
        EXC + "BashIncorrectSyntaxError",
        f"Error (exit code {done.returncode}) while checking bash command \n{command!r}\n"
        f"---- Stderr ----\n{stderr}\n---- Stdout ----\n{stdout}",
        {"bash_stdout": stdout, "bash_stderr": stderr},
    )


def zip_to_tar(data: bytes, cap: int = MAX_EXTRACT_BYTES) -> bytes:
    """A zip archive's files and directories as a gzip'd tar stream (what env.put
    extracts). Refused before anything is inflated when the sizes its directory declares
    come to more than ``cap`` bytes, or it has more than ``MAX_EXTRACT_MEMBERS`` entries
    (a member never inflates past its declared size: ``zipfile`` stops there)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        infos = zf.infolist()
        total = sum(info.file_size for info in infos)
        if total > cap or len(infos) > MAX_EXTRACT_MEMBERS:
            raise ValueError(
                f"the zip archive unpacks to {total} bytes in {len(infos)} entries "
                f"(at most {cap} bytes and {MAX_EXTRACT_MEMBERS} entries)"
            )
        with tarfile.open(fileobj=out, mode="w:gz", compresslevel=1) as tf:
            for info in infos:
                member = tarfile.TarInfo(info.filename.rstrip("/"))
                if info.is_dir():
                    member.type, member.mode = tarfile.DIRTYPE, 0o755
                    tf.addfile(member)
                    continue
                with zf.open(info) as src:
                    member.size, member.mode = info.file_size, 0o644
                    tf.addfile(member, src)
    return out.getvalue()


# --------------------------------------------------------------------------- routes


async def guard(call: Awaitable[Any]) -> Any:
    """Any failure of a runtime call as SWE-ReX's server reports it (511 + class path)."""
    try:
        return await call
    except RemoteError:
        raise
    except TangramError as exc:
        raise _from_tangram(exc) from None
    except Exception as exc:  # e.g. a bad zip upload: SWE-ReX transfers every exception
        class_path = f"{type(exc).__module__}.{type(exc).__name__}"
        raise RemoteError(class_path, str(exc)) from None


async def _hung_up(request: Request) -> None:
    """Return once the HTTP client of ``request`` (its body read) has disconnected: the
    server's ``receive`` then answers ``http.disconnect`` (also once the response is
    complete, by which time nobody waits on this)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def router(runtimes: Runtimes) -> APIRouter:
    """The ``/swerex/{env}`` routes, ``POST /envs`` and ``POST /envs/{env}/fork``; a route
    naming an environment another key opened answers 404 ``not_found``."""

    async def owned(request: Request) -> None:
        env = request.path_params.get("env")
        if env is not None:
            runtimes.check_owner(env)

    api = APIRouter(dependencies=[Depends(owned)])

    @api.post("/envs")
    async def open_env(request: Request, body: OpenEnvRequest | None = None) -> Any:
        body = body or OpenEnvRequest()
        env_id = await runtimes.client.env_open(
            image=body.image, mem=body.mem, trajectory=body.trajectory, timeout_s=body.timeout
        )
        runtimes.opened.add(env_id)
        runtimes.owners[env_id] = caller_label()
        base = str(request.base_url).rstrip("/")
        return {"id": env_id, "swerex_url": f"{base}/swerex/{env_id}"}

    @api.post("/envs/{env}/fork")
    async def fork_env(env: str, request: Request, body: ForkEnvRequest | None = None) -> Any:
        """``env.fork``: the children belong to the key that forks (as ``POST /envs``)."""
        n = 1 if body is None else body.n
        ids = await runtimes.client.env_fork(env, n=n)
        for env_id in ids:
            runtimes.opened.add(env_id)
            runtimes.owners[env_id] = caller_label()
        base = str(request.base_url).rstrip("/")
        return {"ids": ids, "swerex_urls": [f"{base}/swerex/{env_id}" for env_id in ids]}

    @api.delete("/envs/{env}")
    async def close_env(env: str) -> Any:
        await runtimes.close_sessions(env)
        runtimes.opened.discard(env)
        await runtimes.client.env_close(env)
        runtimes.owners.pop(env, None)
        return {"id": env, "closed": True}

    @api.get("/swerex/{env}/is_alive")
    async def is_alive(env: str) -> Any:
        # Answered at once (the client waits 0.15 s): one read of the daemon's env list.
        try:
            envs = await asyncio.wait_for(runtimes.client.env_list(), 0.1)
        except (TangramError, asyncio.TimeoutError) as exc:
            return {"is_alive": False, "message": f"tangramd: {exc}"}
        if any(row.get("id") == env and row.get("state") == "ready" for row in envs):
            return {"is_alive": True, "message": ""}
        return {"is_alive": False, "message": f"environment {env} is not open"}

    @api.post("/swerex/{env}/create_session")
    async def create_session(env: str, req: CreateBashSessionRequest) -> Any:
        return await guard(runtimes.create_session(env, req))

    @api.post("/swerex/{env}/run_in_session")
    async def run_in_session(env: str, action: BashAction | BashInterruptAction) -> Any:
        return await guard(runtimes.run_in_session(env, action))

    @api.post("/swerex/{env}/close_session")
    async def close_session(env: str, req: CloseBashSessionRequest) -> Any:
        return await guard(runtimes.close_session(env, req))

    @api.post("/swerex/{env}/execute")
    async def execute(env: str, command: Command, request: Request) -> Any:
        return await guard(runtimes.execute(env, command, gone=_hung_up(request)))

    @api.post("/swerex/{env}/read_file")
    async def read_file(env: str, req: ReadFileRequest) -> Any:
        return await guard(runtimes.read_file(env, req))

    @api.post("/swerex/{env}/write_file")
    async def write_file(env: str, req: WriteFileRequest) -> Any:
        return await guard(runtimes.write_file(env, req))

    @api.post("/swerex/{env}/upload")
    async def upload(
        env: str,
        file: UploadFile = File(...),  # noqa: B008  # FastAPI's declaration style
        target_path: str = Form(...),
        unzip: bool = Form(False),
    ) -> Any:
        try:
            data = await file.read()
        finally:
            await file.close()
        return await guard(runtimes.upload(env, data, target_path, unzip))

    @api.post("/swerex/{env}/close")
    async def close(env: str) -> Any:
        return await guard(runtimes.close(env))

    return api

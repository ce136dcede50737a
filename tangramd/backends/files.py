"""File transfer into and out of an environment: single files as bytes, directories as tar.

``env.put`` writes ``data`` at a path inside the environment (a file, or, with ``tar``, the
members of a tar stream extracted into a directory); ``env.get`` reads a file, or a
directory as a tar stream of its contents (member names relative to it). Tar members are
extracted with the ``data`` filter (no absolute names, no links out, no devices), after
the stream's declared sizes are checked (``nsfiles.check_tar``), and a get never exceeds
``max_bytes``.

The process backend does them where no race reaches outside the environment
(``nsfiles.py``): for an isolated environment, in a file helper inside it, as its user
(:func:`put_by_helper` / :func:`get_by_helper`; paths are the environment's own, ``/tmp``
and ``/testbed`` included); otherwise with :func:`put_local` / :func:`get_local`, walking
from the environment's directory with ``openat2(RESOLVE_BENEATH)`` (no ``..``, no symlink
out). The Docker backend ships the same tar streams through the engine's archive API
and uses :func:`single_file_tar` / :func:`strip_top_dir` to speak them.

:func:`exec_with_files` runs an exec action whose spec carries ``files`` and ``fetch``
(one-shot transfer): it writes the files through the backend's ``put``, runs the command,
and reads the fetched paths through its ``get``, all inside the one action, so a
throwaway sandbox run (SandboxFusion's ``/run_code``) is a single round trip to the daemon
on every backend.
"""

from __future__ import annotations

import asyncio
import errno
import io
import os
import stat
import tarfile
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any, NoReturn

from tangram.protocol.results import MAX_FILES_BYTES, ExecResult
from tangramd.backends import nsfiles
from tangramd.backends.base import Backend, ExecRequest, PathEscape, infra_error
from tangramd.backends.nsfiles import NotAFile, TooLarge

__all__ = ["NotAFile", "TooLarge"]


def _escape(e: nsfiles.Escape) -> PathEscape:
    return PathEscape(str(e))


def put_local(
    base: str, path: str, data: bytes, *, tar: bool, owner: tuple[int, int] | None
) -> int:
    """Write ``data`` at ``path`` inside the directory ``base`` (a real path), walking from
    it with ``openat2`` (``nsfiles.Walk``); what it makes belongs to ``owner`` (None: the
    caller). Return the bytes written."""
    walk = nsfiles.Walk(base, beneath=True)
    try:
        if tar:
            return nsfiles.put_tar(walk, path, data, owner=owner, dir_mode=0o700)
        return nsfiles.put_file(walk, path, (data,), owner=owner, file_mode=0o600, dir_mode=0o700)
    except nsfiles.Escape as e:
        raise _escape(e) from None


def get_local(base: str, path: str, *, max_bytes: int) -> tuple[bytes, bool]:
    """Read ``path`` inside the directory ``base`` (a real path): ``(bytes, False)`` for a
    file, ``(tar, True)`` for a directory. Raise FileNotFoundError, PathEscape, TooLarge or
    NotAFile (a FIFO, a socket, a device)."""
    try:
        return nsfiles.get(nsfiles.Walk(base, beneath=True), path, max_bytes=max_bytes)
    except nsfiles.Escape as e:
        raise _escape(e) from None


def get_small(base: str, path: str, *, max_bytes: int, limit: int) -> tuple[bytes, bool] | None:
    """:func:`get_local` for a regular file of at most ``limit`` bytes (read at once, where
    a thread would cost more than the read); None for anything else (a directory, a larger
    file), which the caller reads with :func:`get_local`. Never blocks: a FIFO is opened
    non-blocking and refused."""
    try:
        fd, st = nsfiles.open_for_get(nsfiles.Walk(base, beneath=True), path)
    except nsfiles.Escape as e:
        raise _escape(e) from None
    try:
        if stat.S_ISDIR(st.st_mode) or (stat.S_ISREG(st.st_mode) and st.st_size > limit):
            return None
        data = nsfiles.read_file(fd, path, st, min(max_bytes, limit))
    except TooLarge:
        if limit >= max_bytes:
            raise
        return None  # over what is read at once, maybe not over max_bytes: the slow path
    finally:
        os.close(fd)
    return data, False


def _raise_for(head: dict[str, Any]) -> NoReturn:
    """A file helper's error reply as the exception the same failure raises here."""
    kind, message = head.get("error"), str(head.get("message", ""))
    if kind == "too_large":
        raise TooLarge(message)
    if kind == "not_a_file":
        raise NotAFile(message)
    if kind == "escape":
        raise PathEscape(message)
    if kind == "tar":
        raise tarfile.TarError(message)
    if kind == "os" and head.get("errno") in (errno.EACCES, errno.EPERM, errno.EROFS):
        raise Denied(f"{message} (as the environment's user)")
    if kind == "os":  # (OSError picks the subclass: FileNotFoundError for ENOENT, …)
        raise OSError(int(head.get("errno") or errno.EIO), message)
    raise OSError(errno.EIO, message)


class Denied(PathEscape):
    """The environment's user may not do that there (a host file only root may read, a
    read-only directory): the caller's mistake, as a path out of it is."""


class HelperLost(Exception):
    """The file helper could not enter the environment: its keeper is gone (ESRCH)."""


async def put_by_helper(
    spawner: Any, request: dict[str, Any], path: str, data: bytes, *, tar: bool
) -> int:
    """``put`` done by a file helper (``nsfiles.serve``): ``request`` says where (its
    ``sandbox`` or ``user``, ``cwd``)."""
    req = {**request, "do": "put", "path": path, "tar": tar, "size": len(data)}
    try:
        head, _ = await nsfiles.call(spawner, req, data)
    except nsfiles.HelperError as e:
        _lost_or_raise(e.head)
    return int(head.get("size", len(data)))


async def get_by_helper(
    spawner: Any, request: dict[str, Any], path: str, *, max_bytes: int
) -> tuple[bytes, bool]:
    """``get`` done by a file helper (see :func:`put_by_helper`)."""
    req = {**request, "do": "get", "path": path, "max_bytes": max_bytes}
    try:
        head, body = await nsfiles.call(spawner, req, max_reply=max_bytes)
    except nsfiles.HelperError as e:
        _lost_or_raise(e.head)
    if len(body) != head.get("size"):
        raise OSError(errno.EIO, "the file helper's answer was cut short")
    return body, bool(head.get("tar"))


def _lost_or_raise(head: dict[str, Any]) -> NoReturn:
    if head.get("stage") == "enter" and head.get("errno") == errno.ESRCH:
        raise HelperLost(head.get("message", ""))
    _raise_for(head)


def single_file_tar(name: str, data: bytes, mode: int = 0o644) -> bytes:
    """A tar stream holding one regular file ``name`` (for the engine's archive API)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as archive:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mode = mode
        archive.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def strip_top_dir(data: bytes) -> bytes:
    """The tar stream of a directory ``d/…`` as its contents ``…`` (the top entry dropped)."""
    out = io.BytesIO()
    with (
        tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as src,
        tarfile.open(fileobj=out, mode="w") as dst,
    ):
        for member in src.getmembers():
            _top, sep, rest = member.name.partition("/")
            if not sep or not rest:
                continue
            member.name = rest
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    return out.getvalue()


def only_file(data: bytes) -> tuple[bytes, bool] | None:
    """``(content, False)`` if the tar stream holds one regular file, else None."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
        members = archive.getmembers()
        if len(members) == 1 and members[0].isfile():
            stream = archive.extractfile(members[0])
            assert stream is not None
            return stream.read(), False
    return None


def start_exec(
    backend: Backend,
    req: ExecRequest,
    done: Callable[[ExecResult], None],
    spawn: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    """Run ``req`` on ``backend`` and call ``done`` with its result, once, on the loop. A
    backend with ``start_exec`` (the process backend) spawns within this call and reports
    the end from the loop turn that sees it, with no task in between; other backends, and
    execs with ``files`` to write or ``fetch`` to read back, run in a task (``spawn``). A
    failure of any kind is an ``infra_error`` result, never an exception here."""
    start = getattr(backend, "start_exec", None)
    if start is None or req.files or req.fetch:
        spawn(_exec_then(backend, req, done))
        return
    try:
        start(req, done)
    except Exception as exc:  # a backend failure of any kind is an infra error
        asyncio.get_running_loop().call_soon(done, _failed(exc))


async def _exec_then(
    backend: Backend, req: ExecRequest, done: Callable[[ExecResult], None]
) -> None:
    try:
        res = await exec_with_files(backend, req)
    except Exception as exc:
        res = _failed(exc)
    done(res)


def _failed(exc: Exception) -> ExecResult:
    return infra_error(f"{type(exc).__name__}: {exc}")


async def exec_with_files(backend: Backend, req: ExecRequest) -> ExecResult:
    """``backend.exec(req)`` with the request's ``files`` written into the environment
    before and its ``fetch`` paths read back after (``ExecResult.files``).

    A file that cannot be written makes the action an ``infra_error`` (the command does not
    run), as a sandbox that cannot restore a request's files does. A fetched path that is
    missing, not a regular file, outside the environment or over what is left of the
    8 MiB budget is left out (named in ``detail`` unless it is simply absent).
    """
    for path, data in req.files.items():
        try:
            await backend.put(req.env_id, path, data)
        except Exception as e:  # a bad path, a directory in the way, a lost environment
            return ExecResult("infra_error", detail=f"files: {path}: {e}")
    res = await backend.exec(req)
    if not req.fetch or res.outcome not in ("ok", "failed", "timeout"):
        return res
    got: dict[str, bytes] = {}
    left_out: list[str] = []
    budget = MAX_FILES_BYTES
    for path in req.fetch:
        try:
            data, is_tar = await backend.get(req.env_id, path, max_bytes=budget)
        except FileNotFoundError:
            continue
        except (TooLarge, NotAFile, PathEscape, OSError, tarfile.TarError) as e:
            left_out.append(f"{path} ({e})")
            continue
        if is_tar:
            continue  # a directory: SandboxFusion fetches regular files only
        got[path] = data
        budget -= len(data)
    detail = res.detail
    if left_out:
        detail = "; ".join(
            [*([detail] if detail else []), "fetch left out: " + ", ".join(left_out)]
        )
    return replace(res, files=got, detail=detail)

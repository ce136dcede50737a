"""File transfer into and out of an environment: single files as bytes, directories as tar.

``env.put`` writes ``data`` at a path inside the environment (a file, or, with ``tar``, the
members of a tar stream extracted into a directory); ``env.get`` reads a file, or a
directory as a tar stream of its contents (member names relative to it). Every path is
confined to the environment: no ``..`` part, and a symlink that points out of it is
refused rather than followed (``base.confine``). Tar members are extracted with the
``data`` filter (no absolute names, no links out, no devices), and the result never
exceeds ``max_bytes``.

The process backend uses :func:`put_local` / :func:`get_local` on the environment's
directory; the Docker backend ships the same tar streams through the engine's archive API
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
from typing import Any

from tangram.protocol.results import MAX_FILES_BYTES, ExecResult
from tangram.tarsafe import extract_member
from tangramd.backends.base import Backend, ExecRequest, PathEscape, confine_real, infra_error


class TooLarge(ValueError):
    """What would be transferred is over the size cap."""


class NotAFile(ValueError):
    """What was asked for is neither a regular file nor a directory (a FIFO, a socket)."""


def _make_dirs(base: str, path: str, owner: tuple[int, int] | None) -> None:
    """``os.makedirs(path)`` below ``base``; those it creates belong to ``owner`` (the
    environment's user must be able to enter what a put made for it)."""
    missing = []
    here = path
    while here != base and here.startswith(base) and not os.path.lexists(here):
        missing.append(here)
        here = os.path.dirname(here)
    os.makedirs(path, exist_ok=True)
    if owner is not None:
        for made in missing:
            os.lchown(made, *owner)


def put_local(
    base: str, path: str, data: bytes, *, tar: bool, owner: tuple[int, int] | None
) -> int:
    """Write ``data`` at ``path`` inside the directory ``base`` (a real path: see
    ``base.confine_real``); return the bytes written."""
    target = confine_real(base, path)
    if tar:
        _make_dirs(base, target, owner)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
            for member in archive.getmembers():
                confine_real(target, member.name)  # a link written earlier may point out
                extract_member(archive, member, target)
        if owner is not None:
            for dirpath, dirnames, filenames in os.walk(target):
                for name in [*dirnames, *filenames]:
                    os.lchown(os.path.join(dirpath, name), *owner)
        return len(data)
    if target == base:
        raise IsADirectoryError(f"{path}: is a directory (send a tar stream)")
    parent = os.path.dirname(target)
    if parent != base:  # a file in a subdirectory: create the parents, check they stay inside
        _make_dirs(base, parent, owner)
        confine_real(base, parent)
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    except IsADirectoryError:
        raise IsADirectoryError(f"{path}: is a directory (send a tar stream)") from None
    try:
        if owner is not None:
            os.fchown(fd, *owner)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    return len(data)


def get_local(base: str, path: str, *, max_bytes: int) -> tuple[bytes, bool]:
    """Read ``path`` inside the directory ``base`` (a real path): ``(bytes, False)`` for a
    file, ``(tar, True)`` for a directory. Raise FileNotFoundError, PathEscape, TooLarge or
    NotAFile (a FIFO, a socket, a device)."""
    target = confine_real(base, path)
    fd = _open_read(target, path)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return _tar_dir(target, path, max_bytes=max_bytes), True
        return _read_file(fd, path, st, max_bytes), False
    finally:
        os.close(fd)


def get_small(base: str, path: str, *, max_bytes: int, limit: int) -> tuple[bytes, bool] | None:
    """:func:`get_local` for a regular file of at most ``limit`` bytes (read at once, where
    a thread would cost more than the read); None for anything else (a directory, a larger
    file), which the caller reads with :func:`get_local`. Never blocks: a FIFO is opened
    non-blocking and refused."""
    target = confine_real(base, path)
    fd = _open_read(target, path)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode) or (stat.S_ISREG(st.st_mode) and st.st_size > limit):
            return None
        data = _read_file(fd, path, st, min(max_bytes, limit))
    except TooLarge:
        if limit >= max_bytes:
            raise
        return None  # over what is read at once, maybe not over max_bytes: the slow path
    finally:
        os.close(fd)
    return data, False


def _open_read(target: str, path: str) -> int:
    try:  # non-blocking: opening a FIFO must not wait for a writer
        return os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:  # the last part is a symlink (replaced since confine)
            raise PathEscape(f"{path!r} is a symlink") from None
        raise


def _read_file(fd: int, path: str, st: os.stat_result, max_bytes: int) -> bytes:
    if not stat.S_ISREG(st.st_mode):
        raise NotAFile(f"{path}: not a regular file or directory")
    chunks: list[bytes] = []
    size = 0
    while True:  # up to max_bytes + 1 (the file may grow while it is read)
        chunk = os.read(fd, max_bytes + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if size > max_bytes:
            raise TooLarge(f"{path}: more than {max_bytes} bytes")
    return b"".join(chunks)


def _tar_dir(target: str, path: str, *, max_bytes: int) -> bytes:
    total = 0
    for dirpath, _dirs, names in os.walk(target):
        for name in names:
            total += os.lstat(os.path.join(dirpath, name)).st_size
            if total > max_bytes:
                raise TooLarge(f"{path}: more than {max_bytes} bytes")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as archive:
        for name in sorted(os.listdir(target)):
            archive.add(os.path.join(target, name), arcname=name)  # symlinks stored as links
    if buf.tell() > max_bytes:
        raise TooLarge(f"{path}: more than {max_bytes} bytes as a tar stream")
    return buf.getvalue()


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

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

import io
import os
import tarfile
from dataclasses import replace
from pathlib import Path

from tangram.protocol.results import MAX_FILES_BYTES, ExecResult
from tangramd.backends.base import Backend, ExecRequest, PathEscape, confine


class TooLarge(ValueError):
    """What would be transferred is over the size cap."""


def _extract_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    data_filter = getattr(tarfile, "data_filter", None)
    if data_filter is not None:
        return data_filter(member, dest)  # type: ignore[no-any-return]  # typeshed lag
    # Python without extraction filters: refuse the dangerous member kinds ourselves.
    if member.name.startswith("/") or ".." in member.name.split("/"):
        raise PathEscape(f"tar member {member.name!r} leaves the directory")
    if member.issym() or member.islnk() or member.isdev():
        raise PathEscape(f"tar member {member.name!r} is a link or device")
    return member


def put_local(
    root: Path, path: str, data: bytes, *, tar: bool, owner: tuple[int, int] | None
) -> int:
    """Write ``data`` at ``path`` inside ``root``; return the bytes written."""
    target = confine(root, path)
    if tar:
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
            for member in archive.getmembers():
                confine(target, member.name)  # a link written earlier may point out
                archive.extract(member, target, filter=_extract_filter)
        if owner is not None:
            for dirpath, dirnames, filenames in os.walk(target):
                for name in [*dirnames, *filenames]:
                    os.lchown(os.path.join(dirpath, name), *owner)
        return len(data)
    if target.is_dir():
        raise IsADirectoryError(f"{path}: is a directory (send a tar stream)")
    target.parent.mkdir(parents=True, exist_ok=True)
    confine(root, str(target.parent))  # created parents stay inside
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    if owner is not None:
        os.chown(target, *owner)
    return len(data)


def get_local(root: Path, path: str, *, max_bytes: int) -> tuple[bytes, bool]:
    """Read ``path`` inside ``root``: ``(bytes, False)`` for a file, ``(tar, True)`` for a
    directory. Raise FileNotFoundError, PathEscape or TooLarge."""
    target = confine(root, path)
    if target.is_dir():
        total = 0
        for dirpath, _dirs, files in os.walk(target):
            for name in files:
                total += os.lstat(os.path.join(dirpath, name)).st_size
                if total > max_bytes:
                    raise TooLarge(f"{path}: more than {max_bytes} bytes")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as archive:
            for entry in sorted(target.iterdir()):
                archive.add(entry, arcname=entry.name)  # symlinks stored as links
        if buf.tell() > max_bytes:
            raise TooLarge(f"{path}: more than {max_bytes} bytes as a tar stream")
        return buf.getvalue(), True
    fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise TooLarge(f"{path}: more than {max_bytes} bytes")
    return data, False


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
        except (TooLarge, PathEscape, OSError, tarfile.TarError) as e:
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

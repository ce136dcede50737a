"""Extract tar streams under the rules of PEP 706's ``data`` filter on every Python we run
on: with ``tarfile``'s own filter where it exists (3.11.4 and later), else (Debian 12's
3.11.2 has no ``filter=`` argument) by refusing here what that filter refuses for our
streams: absolute names, ``..``, links and special files, and by dropping set-id bits and
the archive's owners. Stdlib only: the daemon (``env.put``) and ``tangramctl env get``
both use it."""

from __future__ import annotations

import tarfile

DATA_FILTER = getattr(tarfile, "data_filter", None)


class UnsafeMember(tarfile.TarError):
    """A member the ``data`` filter would refuse (a ``tarfile.FilterError`` where it exists)."""


def extract_member(archive: tarfile.TarFile, member: tarfile.TarInfo, dest: str) -> None:
    """Extract one ``member`` of ``archive`` into the directory ``dest``, or raise
    ``tarfile.TarError`` (``UnsafeMember`` or ``tarfile.FilterError``)."""
    if DATA_FILTER is not None:
        archive.extract(member, dest, filter=DATA_FILTER)  # type: ignore[call-arg,unused-ignore]
        return
    name = member.name
    if name.startswith("/") or ".." in name.split("/"):
        raise UnsafeMember(f"tar member {name!r} leaves the directory")
    if not (member.isfile() or member.isdir()):
        raise UnsafeMember(f"tar member {name!r} is a link, device or FIFO")
    member.mode &= 0o777 if member.isdir() else 0o755
    member.uid = member.gid = 0
    member.uname = member.gname = ""
    archive.extract(member, dest)


def extract_all(archive: tarfile.TarFile, dest: str) -> None:
    """Extract every member of ``archive`` into ``dest``; the first unsafe one raises."""
    for member in archive.getmembers():
        extract_member(archive, member, dest)

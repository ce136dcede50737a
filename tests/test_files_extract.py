"""Tar extraction into an environment on every Python CI may run: 3.11.4+ extracts with
PEP 706's ``data`` filter, Debian 12's 3.11.2 (no ``filter=``) with our own checks
(``tangram.tarsafe``). Our checks run on every Python (the filter is hidden from them);
PEP 706's where this Python has it. On real directories."""

from __future__ import annotations

import io
import os
import stat
import tarfile

import pytest

from tangram import tarsafe
from tangramd.backends import files
from tangramd.backends.base import PathEscape


def _tar(*infos: tuple[tarfile.TarInfo, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as archive:
        for info, data in infos:
            info.size = len(data) if info.isfile() else 0
            archive.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return buf.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, link: str = ""):
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.linkname = kind, mode, link
    return info


# Our own checks always; PEP 706's filter only where this Python has one to test.
FLAVOURS = ["ours"] + (["pep706"] if tarsafe.DATA_FILTER is not None else [])


@pytest.fixture(params=FLAVOURS)
def flavour(request, monkeypatch):
    if request.param == "ours":
        monkeypatch.setattr(tarsafe, "DATA_FILTER", None)
    return request.param


def test_files_and_directories_extract(tmp_path, flavour):
    data = _tar(
        (_member("a.txt"), b"a"),
        (_member("s", tarfile.DIRTYPE, 0o755), b""),
        (_member("s/b.txt", mode=0o4755), b"bb"),
    )
    assert files.put_local(str(tmp_path), "t", data, tar=True, owner=None) == len(data)
    assert (tmp_path / "t/a.txt").read_bytes() == b"a"
    assert (tmp_path / "t/s/b.txt").read_bytes() == b"bb"
    mode = os.stat(tmp_path / "t/s/b.txt").st_mode
    assert not mode & stat.S_ISUID, oct(mode)  # set-id bits never survive


@pytest.mark.parametrize(
    "member",
    [
        _member("../evil"),
        _member("/abs/evil"),
        _member("l", tarfile.SYMTYPE, link="/etc"),
        _member("d", tarfile.CHRTYPE),
    ],
    ids=["dotdot", "absolute", "symlink-out", "device"],
)
def test_escaping_members_are_refused(tmp_path, flavour, member):
    with pytest.raises((PathEscape, tarfile.TarError)):  # the path check, else the filter
        files.put_local(str(tmp_path), "t", _tar((member, b"x")), tar=True, owner=None)
    assert not (tmp_path / "evil").exists() and not os.path.lexists(tmp_path / "t/l")


def test_extract_all_is_what_env_get_uses(tmp_path, flavour):
    """``tangramctl env get -o DIR`` of a directory: every member, or the first bad one raises."""
    good = _tar((_member("x.txt"), b"x"), (_member("sub/y.txt"), b"yy"))
    with tarfile.open(fileobj=io.BytesIO(good)) as archive:
        tarsafe.extract_all(archive, str(tmp_path / "out"))
    assert (tmp_path / "out/sub/y.txt").read_bytes() == b"yy"
    bad = _tar((_member("ok.txt"), b"x"), (_member("l", tarfile.LNKTYPE, link="/etc/passwd"), b""))
    with tarfile.open(fileobj=io.BytesIO(bad)) as archive, pytest.raises(tarfile.TarError):
        tarsafe.extract_all(archive, str(tmp_path / "bad"))
    assert not os.path.lexists(tmp_path / "bad/l")

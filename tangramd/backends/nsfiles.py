"""File operations of the process backend, done where nothing can race them out of the
environment (issue 30). Standard library only: the fork server, which runs under
``python -I -S``, loads this file by path.

Two ways in, one set of operations (``put`` a file, ``put`` a tar stream into a directory,
``get`` a file or a directory as a tar stream):

- **Inside** (an isolated environment, ``nsbox.py``): the fork server forks a short-lived
  *file helper* (:func:`serve`) that closes every descriptor of the fork server's but one
  socket to the daemon and enters the environment's mount and user namespaces as its exec
  children do (``nsbox.enter_for_good``: root inside, mapped to the environment's host uid,
  no capability; not its cgroups: a cgroup v1 join waits milliseconds, and the transfer's
  cap bounds what a helper holds), changes to the environment's home and does the
  operation there. Paths resolve against the environment's own root, as a command's do:
  ``/testbed``, ``/tmp``, ``/root`` are the environment's, ``..`` and symlinks go where
  they go inside, and nothing outside is reachable by any path or race. What it creates
  belongs to the environment's user. The data goes over the socket (the daemon sends a
  put's bytes, reads a get's), not through the fork server.
- **Beneath** (``isolation = "none"``): the daemon (or, for a root daemon and an
  environment of another user, a file helper switched to that user) walks from a
  descriptor of the environment's directory with ``openat2(RESOLVE_BENEATH |
  RESOLVE_NO_MAGICLINKS)`` (kernels before 5.6: one ``O_NOFOLLOW`` step per part, no
  symlink followed): no check-then-open, a symlink swapped in mid-walk makes the walk fail,
  not leave. Directories it makes are opened without following links and handed to the
  environment's user.

A tar stream is checked before anything is extracted (:func:`check_tar`): the sizes its
headers declare, in all, at most ``MAX_EXTRACT_BYTES``, and at most
``MAX_EXTRACT_MEMBERS`` members; a gzip stream whose trailer already says more is refused
without inflating. Extraction itself goes through ``tangram/tarsafe.py`` (PEP 706's
``data`` filter).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import io
import json
import os
import socket
import stat
import struct
import tarfile
from typing import Any

MAX_EXTRACT_BYTES = 1 << 30  # what a tar stream put may unpack to, in all (declared sizes)
MAX_EXTRACT_MEMBERS = 100_000
O_PATH = getattr(os, "O_PATH", 0o10000000)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08
_SYS_OPENAT2 = 437  # the same number on every architecture (the generic table)
_CHUNK = 1 << 18
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class TooLarge(ValueError):
    """What would be transferred (or extracted) is over the size cap."""


class NotAFile(ValueError):
    """What was asked for is neither a regular file nor a directory (a FIFO, a socket)."""


class Escape(ValueError):
    """A path that would leave the environment's directory (``isolation = "none"``)."""


class _OpenHow(ctypes.Structure):
    _fields_ = [  # struct open_how
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


_libc = ctypes.CDLL(None, use_errno=True)
_has_openat2: bool | None = None  # None: not tried yet


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """``openat2(2)`` (Linux 5.6); OSError(ENOSYS) where the kernel has none."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    fd = _libc.syscall(
        _SYS_OPENAT2, dirfd, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how)
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return int(fd)


class Walk:
    """Where paths resolve: ``top`` (a directory descriptor) and how.

    ``beneath`` (``isolation = "none"``): relative to the environment's directory, never
    out of it (an absolute path must name a place in it; ``..`` is refused). Otherwise
    (inside an environment, as its user): as the process itself resolves them, from its
    root or its working directory."""

    def __init__(self, top: str, *, beneath: bool, here: str | None = None) -> None:
        self.top = top.rstrip("/") or "/"
        self.here = here or self.top  # ``top`` as opened (the working directory: ".")
        self.beneath = beneath
        self.resolve = RESOLVE_NO_MAGICLINKS | (RESOLVE_BENEATH if beneath else 0)

    def parts(self, path: str) -> tuple[str, list[str]]:
        """(where the walk starts, the parts below it)."""
        if "\0" in path:
            raise Escape(f"{path!r}: NUL is not allowed")
        parts = [p for p in path.split("/") if p and p != "."]
        if not self.beneath:
            return ("/" if path.startswith("/") else "."), parts
        if ".." in parts:
            raise Escape(f"{path!r}: '..' is not allowed")
        if path.startswith("/"):
            top = [p for p in self.top.split("/") if p]
            if parts[: len(top)] != top:
                raise Escape(f"{path!r} leaves the environment")
            parts = parts[len(top) :]
        return self.here, parts

    def open(self, start: str, parts: list[str], flags: int, mode: int = 0) -> int:
        """Open ``parts`` below ``start`` (a symlink last part followed, within bounds)."""
        global _has_openat2
        base = os.open(start, _DIR_FLAGS)
        try:
            rel = "/".join(parts) or "."
            if _has_openat2 is not False:
                try:
                    fd = openat2(base, rel, flags, mode, self.resolve)
                    _has_openat2 = True
                    return fd
                except OSError as e:
                    if e.errno == errno.EXDEV or (e.errno == errno.ELOOP and self.beneath):
                        raise Escape(f"{'/'.join(parts)!r} leaves the environment") from None
                    if e.errno != errno.ENOSYS:
                        raise
                    _has_openat2 = False
            return self._step_by_step(base, parts, flags, mode)
        finally:
            os.close(base)

    def _step_by_step(self, base: int, parts: list[str], flags: int, mode: int) -> int:
        """(No openat2) one ``O_NOFOLLOW`` open per part from ``base``: no symlink and no
        ``..`` is followed at all, inside or not."""
        if ".." in parts:
            raise Escape(f"{'/'.join(parts)!r}: '..' needs openat2 (Linux 5.6)")
        fd = os.dup(base)
        try:
            for part in parts[:-1]:
                nxt = _open_no_link(part, _DIR_FLAGS, fd)
                os.close(fd)
                fd = nxt
            if not parts:
                return os.open(".", flags | os.O_CLOEXEC, mode, dir_fd=fd)
            return _open_no_link(parts[-1], flags | os.O_CLOEXEC, fd, mode)
        finally:
            os.close(fd)

    def make_dirs(
        self, start: str, parts: list[str], *, owner: tuple[int, int] | None, mode: int
    ) -> int:
        """The directory ``parts`` below ``start``, made where missing (each one made is
        opened without following links, then given to ``owner``); its descriptor."""
        try:
            return self.open(start, parts, _DIR_FLAGS)
        except FileNotFoundError:
            pass
        fd = os.open(start, _DIR_FLAGS)
        try:
            for i, part in enumerate(parts):
                try:
                    nxt = self.open(start, parts[: i + 1], _DIR_FLAGS)
                except FileNotFoundError:
                    made = True
                    try:
                        os.mkdir(part, mode, dir_fd=fd)
                    except FileExistsError:
                        made = False  # made meanwhile
                    nxt = _open_no_link(part, _DIR_FLAGS, fd, was="became")
                    if made:
                        if owner is not None:
                            os.fchown(nxt, *owner)
                        os.fchmod(nxt, mode)  # whatever the umask
                os.close(fd)
                fd = nxt
            return os.dup(fd)
        finally:
            os.close(fd)


def _open_no_link(name: str, flags: int, dir_fd: int, mode: int = 0o777, was: str = "is") -> int:
    """``name`` below ``dir_fd`` opened without following a link (``O_NOFOLLOW``); a link
    there is an :class:`Escape` ("'name' is a symlink")."""
    try:
        return os.open(name, flags | os.O_NOFOLLOW, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Escape(f"{name!r} {was} a symlink") from None
        raise


# --- the operations (in the daemon, or in a file helper as the environment's user) -------

_in_helper = False  # (a file helper) its /proc/self may not be its own: inside an
# environment it sees the environment's /proc, of a pid namespace it is not in


def _dir_path(fd: int) -> str:
    """A path to the directory open as ``fd``: the file helper changes into it (``.``), the
    daemon names it through its descriptor (``/proc/self/fd/N``: no path walked again)."""
    if _in_helper:
        os.fchdir(fd)
        return "."
    return f"/proc/self/fd/{fd}"


def put_file(
    walk: Walk,
    path: str,
    chunks: Any,
    *,
    owner: tuple[int, int] | None,
    file_mode: int,
    dir_mode: int,
) -> int:
    """Write the bytes of ``chunks`` (an iterable of bytes) at ``path``, its parents made
    as needed; the bytes written. A symlink or anything but a regular file at ``path`` is
    refused, and so (``owner`` set: a root daemon) is a file of another user with more than
    one link (a hard link to a file outside)."""
    start, parts = walk.parts(path)
    if not parts:
        raise IsADirectoryError(errno.EISDIR, f"{path}: is a directory (send a tar stream)")
    parent = walk.make_dirs(start, parts[:-1], owner=owner, mode=dir_mode)
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(parts[-1], flags, file_mode, dir_fd=parent)
    except IsADirectoryError:
        raise IsADirectoryError(
            errno.EISDIR, f"{path}: is a directory (send a tar stream)"
        ) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Escape(f"{path!r} is a symlink") from None
        if e.errno == errno.ENXIO:  # a FIFO nobody reads
            raise NotAFile(f"{path}: not a regular file") from None
        raise
    finally:
        os.close(parent)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotAFile(f"{path}: not a regular file")
        if owner is not None and st.st_nlink > 1 and st.st_uid != owner[0]:
            raise Escape(f"{path!r} is a hard link to another user's file")
        os.set_blocking(fd, True)
        os.ftruncate(fd, 0)
        if owner is not None and (st.st_uid, st.st_gid) != owner:
            os.fchown(fd, *owner)
        size = 0
        for chunk in chunks:
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]
            size += len(chunk)
        return size
    finally:
        os.close(fd)


def open_for_get(walk: Walk, path: str) -> tuple[int, os.stat_result]:
    """A descriptor of what ``path`` names (never blocking: a FIFO opens and is refused by
    the caller) and its ``fstat``."""
    start, parts = walk.parts(path)
    fd = walk.open(start, parts, os.O_RDONLY | os.O_NONBLOCK)
    try:
        return fd, os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise


def read_file(fd: int, path: str, st: os.stat_result, max_bytes: int) -> bytes:
    """A regular file's bytes, at most ``max_bytes`` (TooLarge past them)."""
    if not stat.S_ISREG(st.st_mode):
        raise NotAFile(f"{path}: not a regular file or directory")
    chunks: list[bytes] = []
    size = 0
    while True:  # up to max_bytes + 1 (the file may grow while it is read)
        chunk = os.read(fd, min(_CHUNK * 4, max_bytes + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if size > max_bytes:
            raise TooLarge(f"{path}: more than {max_bytes} bytes")
    return b"".join(chunks)


def tar_dir(top: str, path: str, *, max_bytes: int) -> bytes:
    """The directory ``top``'s contents as a tar stream (member names relative to it;
    symlinks stored as links), at most ``max_bytes``."""
    total = 0
    for dirpath, _dirs, names in os.walk(top):
        for name in names:
            total += os.lstat(os.path.join(dirpath, name)).st_size
            if total > max_bytes:
                raise TooLarge(f"{path}: more than {max_bytes} bytes")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as archive:
        for name in sorted(os.listdir(top)):
            archive.add(os.path.join(top, name), arcname=name)
    if buf.tell() > max_bytes:
        raise TooLarge(f"{path}: more than {max_bytes} bytes as a tar stream")
    return buf.getvalue()


def check_tar(data: bytes, path: str, cap: int = MAX_EXTRACT_BYTES) -> None:
    """Refuse a tar stream whose members would unpack to more than ``cap`` bytes, or that
    has more than ``MAX_EXTRACT_MEMBERS`` members, before anything is extracted: a gzip
    stream whose trailer says more is refused without inflating; otherwise the headers are
    read in order (inflating at most up to the first one past the cap, writing nothing)."""
    if data[:2] == b"\x1f\x8b" and len(data) >= 18:
        (isize,) = struct.unpack("<I", data[-4:])  # (the size mod 2**32, last member's)
        if isize > cap:
            raise TooLarge(f"{path}: the tar stream unpacks to more than {cap} bytes")
    total = count = 0
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
        while True:
            member = archive.next()
            if member is None:
                return
            total += max(member.size, 0)
            count += 1
            if total > cap:
                raise TooLarge(f"{path}: the tar stream unpacks to more than {cap} bytes")
            if count > MAX_EXTRACT_MEMBERS:
                raise TooLarge(f"{path}: more than {MAX_EXTRACT_MEMBERS} tar members")


@functools.cache
def _tarsafe() -> Any:
    """``tangram/tarsafe.py``: imported in the daemon, loaded by path in the fork server."""
    try:
        from tangram import tarsafe

        return tarsafe
    except ImportError:
        import importlib.util

        here = os.path.dirname(os.path.abspath(__file__))
        path = os.path.join(os.path.dirname(os.path.dirname(here)), "tangram", "tarsafe.py")
        spec = importlib.util.spec_from_file_location("_tangram_tarsafe", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


def extract_into(dest: str, data: bytes, path: str) -> None:
    """Extract the tar stream ``data`` into the directory ``dest`` (the caller's working
    directory as ``"."``, or a path), every member through ``tarsafe``."""
    extract = _tarsafe().extract_member
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
        for member in archive:
            if member.name.startswith("/") or ".." in member.name.split("/"):
                raise Escape(f"tar member {member.name!r} leaves the directory")
            extract(archive, member, dest)


def put_tar(
    walk: Walk, path: str, data: bytes, *, owner: tuple[int, int] | None, dir_mode: int
) -> int:
    """Extract the tar stream ``data`` into the directory ``path`` (made as needed), after
    :func:`check_tar`; what it makes is given to ``owner`` (None: it is the caller's)."""
    check_tar(data, path)
    start, parts = walk.parts(path)
    fd = walk.make_dirs(start, parts, owner=owner, mode=dir_mode)
    try:
        dest = _dir_path(fd)
        extract_into(dest, data, path)
        if owner is not None:
            for dirpath, dirnames, filenames in os.walk(dest):
                for name in [*dirnames, *filenames]:
                    os.lchown(os.path.join(dirpath, name), *owner)
    finally:
        os.close(fd)
    return len(data)


def get(walk: Walk, path: str, *, max_bytes: int) -> tuple[bytes, bool]:
    """``(bytes, False)`` for a file, ``(tar stream, True)`` for a directory."""
    fd, st = open_for_get(walk, path)
    try:
        if stat.S_ISDIR(st.st_mode):
            return tar_dir(_dir_path(fd), path, max_bytes=max_bytes), True
        return read_file(fd, path, st, max_bytes), False
    finally:
        os.close(fd)


# --- the file helper (forked by the fork server) -------------------------------------------


def _recv_exactly(sock: socket.socket, size: int) -> Any:
    """The next ``size`` bytes from ``sock``, as chunks."""
    left = size
    while left > 0:
        chunk = sock.recv(min(_CHUNK, left))
        if not chunk:
            raise ConnectionError("the daemon closed the transfer")
        left -= len(chunk)
        yield chunk


def _reply(sock: socket.socket, head: dict[str, Any], body: bytes = b"") -> None:
    sock.sendall(json.dumps(head).encode() + b"\n")
    if body:
        sock.sendall(body)


def _error(e: BaseException) -> dict[str, Any]:
    for kind, cls in (
        ("too_large", TooLarge),
        ("not_a_file", NotAFile),
        ("escape", Escape),
        ("tar", tarfile.TarError),
    ):
        if isinstance(e, cls):
            return {"error": kind, "message": str(e)}
    if isinstance(e, OSError):
        return {"error": "os", "errno": e.errno or 0, "message": e.strerror or str(e)}
    return {"error": "other", "message": f"{type(e).__name__}: {e}"}


def _close_all_but(keep: int) -> None:
    """Close every descriptor of the fork server's but ``keep``; 0-2 on /dev/null."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        if fd != null:
            os.dup2(null, fd)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd != keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def serve(msg: dict[str, Any], sock_fd: int, nsbox: Any = None) -> None:
    """(The file helper, just forked by the fork server) become the environment's user,
    where it lives, and do ``msg``'s operation, talking to the daemon on ``sock_fd``."""
    global _in_helper
    _in_helper = True
    _close_all_but(sock_fd)
    sock = socket.socket(fileno=sock_fd)
    sock.setblocking(True)
    try:
        with open("/proc/self/oom_score_adj", "w") as f:  # (not the daemon's protection)
            f.write(str(msg.get("oom_score_adj", 0)))
        # (the fork server's SCHED_BATCH keeps it off the daemon's core; the daemon waits
        # for this one's answer: woken as any process is)
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        box, user = msg.get("sandbox"), msg.get("user")
        if box is not None:
            nsbox.enter_for_good(box)
            os.chdir(msg["cwd"])  # its home, inside
        else:  # (in first: the way there may be closed to its user)
            os.chdir(msg["cwd"])
            if user is not None:
                os.setgroups([])
                os.setresgid(user[1], user[1], user[1])
                os.setresuid(user[0], user[0], user[0])
        os.umask(0o022 if box is not None else 0o077)
    except BaseException as e:
        _reply(sock, {**_error(e), "stage": "enter"})
        return
    inside = box is not None
    walk = Walk("." if inside else msg["cwd"], beneath=not inside, here=".")
    path = msg["path"]
    modes = {"file_mode": 0o644, "dir_mode": 0o755} if inside else {}
    file_mode, dir_mode = modes.get("file_mode", 0o600), modes.get("dir_mode", 0o700)
    try:
        if msg["do"] == "get":
            data, is_tar = get(walk, path, max_bytes=msg["max_bytes"])
            _reply(sock, {"size": len(data), "tar": is_tar}, data)
            return
        chunks = _recv_exactly(sock, msg["size"])
        if msg.get("tar"):
            size = put_tar(walk, path, b"".join(chunks), owner=None, dir_mode=dir_mode)
        else:
            size = put_file(walk, path, chunks, owner=None, file_mode=file_mode, dir_mode=dir_mode)
        _reply(sock, {"size": size})
    except BaseException as e:
        with contextlib.suppress(OSError):
            _reply(sock, _error(e))


# --- the daemon's end ------------------------------------------------------------------


class HelperError(Exception):
    """What the file helper answered instead of a result (``head``: its reply)."""

    def __init__(self, head: dict[str, Any]) -> None:
        super().__init__(head.get("message", "the file helper failed"))
        self.head = head


async def call(
    spawner: Any, request: dict[str, Any], payload: bytes = b"", *, max_reply: int = 0
) -> tuple[dict[str, Any], bytes]:
    """Have the fork server fork a file helper for ``request`` (``spawner``: the backend's
    ``Spawner``), send it ``payload``, and read its answer: ``(head, body)``. Raises
    HelperError with what it said instead, OSError when it died without a word."""
    import asyncio  # (the daemon's end only: the fork server never imports it)

    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if len(payload) > _CHUNK or max_reply > _CHUNK:  # (fewer turns of the loop per MiB)
        for sock in (ours, theirs):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    try:
        try:
            request = {"op": "files", "lodge": False, **request}
            await spawner.spawn(request, {"sock": theirs.fileno()})
        finally:
            theirs.close()
        ours.setblocking(False)
        if payload:
            # (it may answer before it has read it all: a refusal; then read why)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                await loop.sock_sendall(ours, payload)
        # the answer: a line of JSON, then (a get) ``size`` bytes; not its exit, which
        # comes later (an exit, its address space torn down, takes milliseconds)
        buf = bytearray()
        end = -1
        while end < 0:
            chunk = await loop.sock_recv(ours, 1 << 16)
            if not chunk:
                raise OSError(errno.EIO, "the file helper ended without an answer")
            buf += chunk
            end = buf.find(b"\n")
            if end < 0 and len(buf) > 1 << 16:
                raise OSError(errno.EIO, "the file helper's answer is malformed")
        head = json.loads(bytes(buf[:end]))
        if "error" in head:
            raise HelperError(head)
        size = head.get("size", 0) if "tar" in head else 0
        if not isinstance(size, int) or not 0 <= size <= max_reply:
            raise TooLarge(f"{request.get('path')}: more than {max_reply} bytes")
        body = bytearray(buf[end + 1 :])
        while len(body) < size:
            chunk = await loop.sock_recv(ours, min(1 << 20, size - len(body)))
            if not chunk:
                raise OSError(errno.EIO, "the file helper's answer was cut short")
            body += chunk
    finally:
        ours.close()
    return head, bytes(body)

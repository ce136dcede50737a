"""env.put / env.get where a command in the environment races them (issue 30, item 2).

On the isolated default a put or get runs in a file helper inside the environment, as its
user (``nsfiles.py``); with ``isolation = "none"`` the daemon walks from the environment's
directory with ``openat2(RESOLVE_BENEATH)``. Either way a command that swaps a directory
for a symlink to ``/etc`` (and a file for a symlink to a root-only host file) in a tight
loop must never get a put or a get outside: the root-only file is never read, never
written, never chowned. Real daemon, real environment, real racing process.

``TANGRAM_RACE_OPS`` sets the puts and gets of a race (in all; CI's default is small, the
``slow`` run does 10,000)."""

from __future__ import annotations

import asyncio
import io
import os
import stat
import struct
import sys
import tarfile
import threading
import uuid
import zipfile
import zlib
from pathlib import Path

import pytest

from tangram.protocol.errors import TangramError
from tangram.testing import wait_for
from tangramd.backends.base import PathEscape
from tangramd.backends.process import SANDBOX_ID_BASE, ProcessBackend
from tangramd.gateway.swerex import zip_to_tar

sys.path.insert(0, str(Path(__file__).parent))
from backend_conformance import ex, new_env
from test_sandbox_hostile import default_backend

RACE_OPS = int(os.environ.get("TANGRAM_RACE_OPS", "300"))
RACER = r"""
import ctypes, os, sys
top, secret_dir, secret = sys.argv[1], sys.argv[2], sys.argv[3]
libc = ctypes.CDLL(None, use_errno=True)
name = os.path.basename(secret)
os.makedirs(f"{top}/d", exist_ok=True)
for path in (f"{top}/d/{name}", f"{top}/f"):
    with open(path, "w") as f:
        f.write("decoy")
os.symlink(secret_dir, f"{top}/dl")  # swapped with d: the directory, or a link to /etc
os.symlink(secret, f"{top}/fl")  # swapped with f: the file, or a link to the secret

def exchange(a, b):  # renameat2(RENAME_EXCHANGE): one atomic swap
    if libc.syscall(316, -100, a.encode(), -100, b.encode(), 2) != 0:
        raise OSError(ctypes.get_errno(), "renameat2")

swaps = 0
while not os.path.exists(f"{top}/stop"):
    exchange(f"{top}/d", f"{top}/dl")
    exchange(f"{top}/f", f"{top}/fl")
    swaps += 1
with open(f"{top}/swaps", "w") as f:
    f.write(str(swaps))
"""


@pytest.fixture
def secret():
    """A root-only host file in /etc (the lower layer of every isolated environment)."""
    path = Path(f"/etc/tangram-race-{uuid.uuid4().hex[:8]}")
    path.write_text("SECRET")
    os.chmod(path, 0o600)
    yield path
    path.unlink()


def _check_secret(secret: Path) -> None:
    st = secret.stat()
    assert (secret.read_text(), st.st_uid, st.st_gid) == ("SECRET", 0, 0)
    assert stat.S_IMODE(st.st_mode) == 0o600


def _race(put, get, top: str, secret: Path, ops: int) -> dict[str, int]:
    """``ops`` puts and gets in all (two gets for each put) of the racer's two paths; what
    they saw, counted. Fails at the first get that reads the secret."""
    seen = {"decoy": 0, "refused": 0, "put": 0}
    name = secret.name
    for i in range(ops):
        path = f"{top}/d/{name}" if i % 2 else f"{top}/f"
        try:
            if i % 3 == 2:
                put(path, b"mine")
                seen["put"] += 1
            else:
                data = get(path)
                assert data in (b"decoy", b"mine"), data  # never the secret
                seen["decoy"] += 1
        except (TangramError, OSError, ValueError):
            seen["refused"] += 1
    return seen


def test_symlink_swap_race_through_the_daemon(daemon, secret):
    """Root inside an isolated environment swaps /testbed/d with a link to /etc and
    /testbed/f with a link to a root-only host file, as fast as it can, while the test
    puts and gets those paths through the daemon: no get returns the secret, no put
    touches it, and nothing new appears in the host's /etc."""
    with daemon.client() as c, daemon.client() as racer_client:
        env = c.env_open()
        try:
            c.put(env, "/testbed/racer.py", RACER.encode())
            done: list[object] = []
            racer = threading.Thread(
                target=lambda: done.append(
                    racer_client.exec(
                        ["python3", "/testbed/racer.py", "/testbed", "/etc", str(secret)],
                        env=env,
                        timeout_s=600,
                    )
                )
            )
            before = set(os.listdir("/etc"))
            racer.start()
            try:
                # the racer is up once its links exist
                wait_for(
                    lambda: _exists(c, env, "/testbed/fl"), 30, "the racer's links", every_s=0.05
                )
                seen = _race(
                    lambda p, d: c.put(env, p, d),
                    lambda p: c.get(env, p)[0],
                    "/testbed",
                    secret,
                    RACE_OPS,
                )
            finally:
                c.put(env, "/testbed/stop", b"")
                racer.join(60)
            result = done[0]
            assert result.outcome == "ok", result  # type: ignore[attr-defined]
            swaps = int(c.get(env, "/testbed/swaps")[0])
        finally:
            c.env_close(env)
    _check_secret(secret)
    assert set(os.listdir("/etc")) == before
    # the race was run: both sides of the swap were met, the racer swapped meanwhile
    assert seen["decoy"] > 0 and seen["refused"] > 0 and swaps > RACE_OPS // 10, (seen, swaps)


def _exists(c, env: str, path: str) -> bool:
    r = c.exec(["test", "-L", path], env=env)
    return r.exit_code == 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_symlink_swap_race_10000(daemon, secret, monkeypatch):
    """The same race against 10,000 puts and gets."""
    monkeypatch.setattr(sys.modules[__name__], "RACE_OPS", 10_000)
    test_symlink_swap_race_through_the_daemon(daemon, secret)


def test_symlink_swap_race_without_isolation(tmp_path, secret):
    """``isolation = "none"``, a root daemon, an environment of an unprivileged user: the
    same race against the daemon's own walk (openat2 beneath the environment's directory)."""
    backend = ProcessBackend(
        tmp_path / "state", isolation="none", default_user=(65534, 65534), use_cgroups=False
    )
    os.chmod(tmp_path, 0o755)
    try:
        env = new_env(backend)
        home = str(backend.env_dir(env))
        racer = _fork_racer(home, secret, backend.default_user)
        loop = asyncio.new_event_loop()
        try:
            wait_for(lambda: os.path.islink(f"{home}/fl"), 30, "the racer's links")
            seen = _race(
                lambda p, d: loop.run_until_complete(backend.put(env, p, d)),
                lambda p: loop.run_until_complete(backend.get(env, p, max_bytes=1 << 20))[0],
                home,
                secret,
                RACE_OPS,
            )
        finally:
            Path(home, "stop").touch()
            loop.close()
            assert os.waitstatus_to_exitcode(os.waitpid(racer, 0)[1]) == 0
        swaps = int(Path(home, "swaps").read_text())
    finally:
        asyncio.run(backend.shutdown())
    _check_secret(secret)
    assert seen["decoy"] > 0 and seen["refused"] > 0 and swaps > RACE_OPS // 10, (seen, swaps)


def _fork_racer(home: str, secret: Path, user: tuple[int, int] | None) -> int:
    """The racer as a process of the environment's user in its directory (what a command
    there is, without isolation); its pid."""
    assert user is not None
    pid = os.fork()
    if pid == 0:  # (the child runs the racer's loop and exits, never back into pytest)
        code = 1
        try:
            os.chdir(home)  # (first: the way there is closed to its user in a pytest tmp)
            os.setgroups([])
            os.setresgid(user[1], user[1], user[1])
            os.setresuid(user[0], user[0], user[0])
            sys.argv = ["racer", ".", "/etc", str(secret)]
            exec(compile(RACER, "racer", "exec"), {"__name__": "__main__"})
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


@pytest.fixture
def backend(tmp_path):
    b = default_backend(tmp_path / "state")
    yield b
    asyncio.run(b.shutdown())


def _tar(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_absolute_paths_and_ownership_inside(backend):
    """Absolute paths are the environment's own (/testbed, /tmp), relative ones its home;
    what a put makes belongs to the environment's user (root inside, its unprivileged uid
    outside) with the modes a container's would have, and commands use it as their own."""
    env = new_env(backend)

    def run(coro):
        return asyncio.run(coro)

    assert run(backend.put(env, "/testbed/pkg/mod.py", b"x = 1\n")) == 6
    assert run(backend.put(env, "/tmp/scratch/in.txt", b"tmp")) == 3
    assert run(backend.put(env, "rel/file", b"rel")) == 3
    run(backend.put(env, "/testbed/tree", _tar({"a/b.txt": b"b"}), tar=True))
    r = ex(
        backend,
        env,
        "cd /testbed && stat -c '%u:%g %a %n' pkg pkg/mod.py tree tree/a tree/a/b.txt "
        "/tmp/scratch ~/rel && echo new > pkg/new && cat /tmp/scratch/in.txt ~/rel/file",
    )
    assert r.outcome == "ok", r
    lines = r.stdout.splitlines()
    assert lines[-1] == "tmprel", r.stdout
    modes = {name: f"{ids} {mode}" for ids, mode, name in (x.split(" ", 2) for x in lines[:-1])}
    assert all(v.startswith("0:0 ") for v in modes.values()), modes  # root inside
    assert modes["pkg"] == "0:0 755" and modes["pkg/mod.py"] == "0:0 644", modes
    assert run(backend.get(env, "/testbed/pkg/new", max_bytes=100)) == (b"new\n", False)
    assert run(backend.get(env, "/tmp/scratch/in.txt", max_bytes=100)) == (b"tmp", False)
    data, is_tar = run(backend.get(env, "/testbed/pkg", max_bytes=1 << 20))
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        assert is_tar and sorted(archive.getnames()) == ["mod.py", "new"]
    # outside, the home's files belong to the environment's unprivileged host uid
    home = backend.env_dir(env)
    assert os.stat(home / "rel").st_uid >= SANDBOX_ID_BASE
    assert os.stat(home / "rel/file").st_uid >= SANDBOX_ID_BASE
    # and the host's root-only files stay unreadable, the host's /etc unwritable
    with pytest.raises(PathEscape, match="ermission denied"):
        run(backend.get(env, "/etc/shadow", max_bytes=1 << 20))
    with pytest.raises(PathEscape, match="ermission denied"):
        run(backend.put(env, "/etc/tangram-evil", b"x"))
    assert not os.path.exists("/etc/tangram-evil")


def _bomb_tar(declared: int, gz: bool) -> bytes:
    """A tar stream whose first member declares ``declared`` bytes (and holds a few)."""
    info = tarfile.TarInfo("zeros")
    info.size = declared
    raw = info.tobuf(format=tarfile.GNU_FORMAT) + b"\0" * 4096
    return _gzip(raw) if gz else raw


def _gzip(raw: bytes) -> bytes:
    z = zlib.compressobj(1, zlib.DEFLATED, 31)
    return z.compress(raw) + z.flush()


def _zip_bomb(declared: int) -> bytes:
    """A zip whose one entry declares ``declared`` bytes (its directory says so)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("zeros", b"\0" * 1024)
    data = bytearray(buf.getvalue())
    central = data.rfind(b"PK\x01\x02")
    struct.pack_into("<I", data, central + 24, declared)  # its uncompressed size
    return bytes(data)


@pytest.mark.parametrize("gz", [False, True], ids=["tar", "tar.gz"])
def test_extraction_bombs_are_refused_before_inflating(backend, gz):
    """A tar stream that declares more than the cap is refused by its header, before any
    of its data is inflated or written; so is a zip (SWE-ReX's upload) by its directory."""
    env = new_env(backend)
    bomb = _bomb_tar(3 << 30, gz)
    with pytest.raises(ValueError, match="unpacks to more than"):
        asyncio.run(backend.put(env, "/testbed/bomb", bomb, tar=True))
    r = ex(backend, env, "ls -A /testbed/bomb 2>/dev/null | wc -l")
    assert r.stdout.strip() == "0", r  # nothing was extracted
    with pytest.raises(ValueError, match="unpacks to"):
        zip_to_tar(_zip_bomb(3 << 30))


def test_a_zip_upload_within_the_cap_extracts(backend):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("repo/setup.py", "print('hi')\n")
        zf.writestr("repo/src/", "")
    env = new_env(backend)
    asyncio.run(backend.put(env, "/testbed/up", zip_to_tar(buf.getvalue()), tar=True))
    r = ex(backend, env, "cat /testbed/up/repo/setup.py && test -d /testbed/up/repo/src")
    assert (r.outcome, r.stdout) == ("ok", "print('hi')\n"), r


def test_without_isolation_what_a_put_makes_is_the_users(tmp_path):
    """``isolation = "none"`` under a root daemon: a put's parents, its file and a tar
    stream's members belong to the environment's user (the tar extracted, a directory's
    get walked, as that user); absolute paths must name a place in its directory."""
    backend = ProcessBackend(
        tmp_path / "state", isolation="none", default_user=(65534, 65534), use_cgroups=False
    )
    try:
        env = new_env(backend)
        home = backend.env_dir(env)
        assert asyncio.run(backend.put(env, "a/b/c.txt", b"c")) == 1
        asyncio.run(backend.put(env, str(home / "t"), _tar({"sub/f": b"f"}), tar=True))
        for rel in ("a", "a/b", "a/b/c.txt", "t", "t/sub", "t/sub/f"):
            st = os.lstat(home / rel)
            assert (st.st_uid, st.st_gid) == (65534, 65534), rel
            if not rel.startswith("t/"):  # (a tar member keeps its archive's mode)
                assert not stat.S_IMODE(st.st_mode) & 0o077, (rel, oct(st.st_mode))
        data, is_tar = asyncio.run(backend.get(env, "t", max_bytes=1 << 20))
        with tarfile.open(fileobj=io.BytesIO(data)) as archive:
            assert is_tar and sorted(archive.getnames()) == ["sub", "sub/f"]
        for path in ("/etc/passwd", "../x"):
            with pytest.raises(PathEscape):
                asyncio.run(backend.get(env, path, max_bytes=1 << 20))
    finally:
        asyncio.run(backend.shutdown())

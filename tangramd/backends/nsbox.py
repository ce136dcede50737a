"""Kernel-namespace sandboxes for the process backend's environments (standard library only:
the fork server, which runs under ``python -I -S``, loads this file by path).

An isolated environment has one *keeper*: a process forked by the fork server into a new
pid namespace, where it is pid 1. Before it settles it builds the environment's world, as
the host's root, in namespaces owned by the host's user namespace (so that nothing inside
can change them later):

- a mount namespace whose root is an overlay: the host's root read-only as the lower layer,
  a per-environment upper (``<root_dir>/sandbox/<env>/upper``) that takes every write, with
  the host's other mounts bound read-only at their places, a fresh ``/proc`` (the pid
  namespace's), ``/sys`` read-only (``/sys/fs/cgroup`` with it), a minimal ``/dev``, empty
  private ``/tmp``, ``/var/tmp`` and ``/run``, the daemon's state directory hidden under an
  empty tmpfs, and the environment's own directory bound back read-write at its path (its
  home and default working directory);
- a network namespace with the loopback interface only (``env_network = "none"``);
- ipc and uts namespaces;
- then a user namespace, entered last, that maps uid and gid 0 inside to the environment's
  unprivileged host uid and gid. The keeper drops every capability and waits, reaping
  orphans; killing it (``close_env``) kills everything in the pid namespace. It outlives
  its fork server (as a command outlives a crashed daemon): the backend finds it in the
  environment's cgroups and kills it before it builds the environment again.

An exec enters the keeper's namespaces from the spawning loop (:func:`spawn`): the helper
sets its children's pid namespace to the keeper's, forks, and the child joins the
environment's memory and pids cgroups, enters the mount, network, ipc and uts namespaces,
then the user namespace, becomes root there with no capability, for good (securebits
``NOROOT`` locked, no new privileges: it cannot mount, leave its cpuset or write a cgroup
file) and execs. A lodger of one environment and core set does the same once, for itself
(:func:`enter_for_good`), and then spawns there with ``posix_spawn``. Nothing is built per
exec.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import platform
import signal
import socket
import struct
import sys
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
MOUNT_ATTR_RDONLY = 1
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
_SYSCALLS = {  # (pivot_root, mount_setattr) by machine
    "x86_64": (155, 442),
    "aarch64": (41, 442),
}
# The paths of the host whose mounts are not bound into an environment: it gets its own.
# Empty in each environment (opaque in its upper layer, the host's mounts there not bound):
# /run too, so that no host socket a stranger may connect to (a bus, a daemon's) is
# reachable by path: a Unix socket does not care about network namespaces.
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/run")
OWN_MOUNTS = ("/proc", "/sys", "/dev", *PRIVATE_DIRS)

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def setns(fd: int, flags: int) -> None:
    _check(_libc.setns(fd, flags), "setns")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    ret = _libc.mount(
        None if src is None else src.encode(),
        target.encode(),
        None if fstype is None else fstype.encode(),
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    _check(ret, f"mount {src or fstype} on {target}")


def _prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), "prctl")


def _syscall_nr(index: int) -> int | None:
    nrs = _SYSCALLS.get(platform.machine())
    return None if nrs is None else nrs[index]


def _pivot_root(new: str, old: str) -> None:
    nr = _syscall_nr(0)
    if nr is None:
        raise OSError(0, f"pivot_root: unknown machine {platform.machine()}")
    _check(_libc.syscall(nr, new.encode(), old.encode()), "pivot_root")


class _MountAttr(ctypes.Structure):
    _fields_ = [  # ctypes' own declaration
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _read_only(target: str, recursive: bool) -> None:
    """Make a bind mount read-only (with everything below it when ``recursive``)."""
    nr = _syscall_nr(1)
    if nr is not None:
        attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
        flags = AT_RECURSIVE if recursive else 0
        ret = _libc.syscall(
            nr, AT_FDCWD, target.encode(), flags, ctypes.byref(attr), ctypes.sizeof(attr)
        )
        if ret == 0:
            return
    # (no mount_setattr: Linux < 5.12) this mount only, keeping the flags it must keep
    st = os.statvfs(target)
    keep = st.f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)


def drop_capabilities() -> None:
    """Empty the bounding set (root's next exec gets no capability) and forbid new ones."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        with contextlib.suppress(OSError):
            _prctl(PR_CAPBSET_DROP, cap)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)


def _unescape(path: str) -> str:
    """A mount point as /proc/self/mountinfo writes it (octal escapes) as a path."""
    if "\\" not in path:
        return path
    return path.encode().decode("unicode_escape").encode("latin-1").decode()


def host_mounts() -> list[str]:
    """The mount points of this mount namespace, parents first."""
    points: list[str] = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 4:
                points.append(_unescape(parts[4]))
    return points


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _loopback_up() -> None:
    """``ip link set lo up`` in this network namespace."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, siocgifflags, req))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _prepare_upper(box: dict[str, Any]) -> None:
    """The upper layer before the first mount: its root belongs to the environment's user
    (root inside owns ``/``, as in a container), ``/tmp`` and ``/var/tmp`` are private and
    empty (opaque), and the directories on the way to the interpreter that others may not
    cross (``/root`` under pyenv) may be crossed, not listed."""
    upper, uid, gid = box["upper"], box["uid"], box["gid"]
    fresh = not os.listdir(upper) and not box.get("lowers")  # (forked: its layers have them)
    os.chown(upper, uid, gid)
    os.chmod(upper, 0o755)
    if not fresh:
        return
    for path in box.get("traverse", ()):
        st = os.stat(path)
        mine = upper + path
        os.makedirs(mine, exist_ok=True)
        os.chown(mine, st.st_uid, st.st_gid)
        os.chmod(mine, (st.st_mode & 0o7777) | 0o001)
    for path in PRIVATE_DIRS:
        mine = upper + path
        os.makedirs(mine, exist_ok=True)
        os.chown(mine, uid, gid)
        os.chmod(mine, 0o755 if path == "/run" else 0o1777)
        os.setxattr(mine, "trusted.overlay.opaque", b"y")


def _make_dev(dev: str) -> None:
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k")
    for name in ("null", "zero", "full", "random", "urandom", "tty"):
        target = f"{dev}/{name}"
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o666))
        _mount(f"/dev/{name}", target, None, MS_BIND)
    os.mkdir(f"{dev}/shm", 0o1777)
    _mount("tmpfs", f"{dev}/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    os.mkdir(f"{dev}/pts", 0o755)
    with contextlib.suppress(OSError):
        _mount(
            "devpts",
            f"{dev}/pts",
            "devpts",
            MS_NOSUID | MS_NOEXEC,
            "newinstance,ptmxmode=0666,mode=620",
        )
        os.symlink("pts/ptmx", f"{dev}/ptmx")
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{dev}/{name}")


def _lowers(box: dict[str, Any]) -> str:
    """The root overlay's ``lowerdir``: the host's root, under a forked environment's
    frozen layers (``nsfork.py``, newest first). Those lie on the host's root filesystem,
    which overlayfs refuses as a lower layer beside them (overlapping layers): there the
    host's root comes through a read-only overlay of its own (over an empty tmpfs), a
    filesystem of its own, mounted here in the keeper's namespace."""
    lowers = box.get("lowers")
    if not lowers:
        return "/"
    _mount("tmpfs", box["empty"], "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=4k")
    _mount("overlay", box["base"], "overlay", MS_RDONLY, f"lowerdir=/:{box['empty']}")
    return ":".join([*lowers, box["base"]])


def build_root(box: dict[str, Any]) -> None:
    """(The keeper, in its new mount namespace, as the host's root) mount the environment's
    root at ``box["merged"]`` and switch to it (see the module doc)."""
    new = box["merged"].rstrip("/")
    hide = [h.rstrip("/") or "/" for h in box["hide"]]
    os.umask(0o022)  # (what it makes on the way to the home: crossable by root inside)
    mounts = host_mounts()
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _prepare_upper(box)
    _mount(
        "overlay",
        new,
        "overlay",
        0,
        f"lowerdir={_lowers(box)},upperdir={box['upper']},workdir={box['work']}",
    )
    skip = (*OWN_MOUNTS, *hide, new)
    for point in mounts:
        if point == "/" or any(_under(point, top) for top in skip):
            continue
        target = new + point
        try:
            _mount(point, target, None, MS_BIND)
            _read_only(target, recursive=False)
        except OSError:
            continue  # (a mount point the lower layer does not show, or one hidden meanwhile)
    for path in box.get("binds", ()):  # the daemon's own interpreter and code, read-only,
        target = new + path  # where a private /tmp would hide them (hidden dirs stay hidden)
        try:
            os.makedirs(target, exist_ok=True)
            _mount(path, target, None, MS_BIND | MS_REC)
            _read_only(target, recursive=True)
        except OSError:
            continue
    _mount("proc", f"{new}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount("/sys", f"{new}/sys", None, MS_BIND | MS_REC)
    _read_only(f"{new}/sys", recursive=True)
    _make_dev(f"{new}/dev")
    for top in hide:
        if os.path.isdir(new + top):
            _mount("tmpfs", new + top, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=64k")
    home = box["home"]
    os.makedirs(new + home, exist_ok=True)
    _mount(home, new + home, None, MS_BIND)
    if box.get("hostname"):
        with contextlib.suppress(OSError):
            socket.sethostname(box["hostname"])
    if box.get("net") == "none":
        _loopback_up()
    os.chdir(new)
    _pivot_root(".", ".")
    _check(_libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")


def _close_fds(keep: tuple[int, ...]) -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def keeper(box: dict[str, Any], status_w: int, go_r: int) -> None:
    """(pid 1 of the environment's pid namespace) build the environment, enter its user
    namespace once the parent has mapped it, then reap orphans until killed. Never
    returns."""
    _close_fds((status_w, go_r))
    try:
        for tasks in box.get("cgroups", ()):
            _write(tasks, "0")
        flags = CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS
        if box.get("net") == "none":
            flags |= CLONE_NEWNET
        unshare(flags)
        build_root(box)
        unshare(CLONE_NEWUSER)
        os.write(status_w, b"map\n")
        if os.read(go_r, 16) != b"go":
            os._exit(1)
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
        with contextlib.suppress(OSError):  # no user namespace inside this one
            _write("/proc/sys/user/max_user_namespaces", "0")
        drop_capabilities()
        _prctl(PR_SET_DUMPABLE, 0)
        os.write(status_w, b"ok\n")
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.write(status_w, f"error {e}\n".encode())
        os._exit(1)
    os.close(status_w)
    os.close(go_r)
    os.closerange(0, 3)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    while True:
        with contextlib.suppress(ChildProcessError, InterruptedError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        signal.sigwait({signal.SIGCHLD})


def _read_line(fd: int) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 256)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


_own_pidns: int | None = None


def _own_pid_ns() -> int:
    global _own_pidns
    if _own_pidns is None:
        _own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    return _own_pidns


def _fork_in_pid_ns(enter: int | None) -> int:
    """``os.fork`` with the child in a new pid namespace (``enter`` None) or in the pid
    namespace of the pidfd ``enter``; this process stays where it was."""
    if enter is None:
        unshare(CLONE_NEWPID)
    else:
        setns(enter, CLONE_NEWPID)
    pid = -1
    try:
        pid = os.fork()
    finally:
        if pid != 0:  # (this process, the fork done or failed) back to its own
            setns(_own_pid_ns(), CLONE_NEWPID)
    return pid


def open_keeper(box: dict[str, Any]) -> int:
    """(The fork server) start an environment's keeper; its pid, once it has settled.
    Raises OSError with the keeper's own words when it could not build the environment."""
    _own_pid_ns()
    status_r, status_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = _fork_in_pid_ns(None)
    if pid == 0:
        keeper(box, status_w, go_r)
    os.close(status_w)
    os.close(go_r)
    try:
        said = _read_line(status_r)
        if said == "map":
            _write(f"/proc/{pid}/uid_map", f"0 {box['uid']} 1\n")
            _write(f"/proc/{pid}/gid_map", f"0 {box['gid']} 1\n")
            os.write(go_w, b"go")
            said = _read_line(status_r)
        if said != "ok":
            raise OSError(0, said.removeprefix("error ") or "the keeper died")
    except BaseException:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        raise
    finally:
        os.close(status_r)
        os.close(go_w)
    return pid


_pylibc = ctypes.PyDLL(None, use_errno=True)  # (fork: holds the GIL across the call)
PR_SET_SECUREBITS = 28
# root gains no capability at exec, and this cannot be undone (locked)
SECURE_NOROOT = 0x0F  # NOROOT, NOROOT_LOCKED, NO_SETUID_FIXUP, NO_SETUID_FIXUP_LOCKED
_CAP_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


_NO_CAPS = (_CapHeader(_CAP_VERSION_3, 0), (_CapData * 2)())


def _strings(items: list[str]) -> Any:
    arr = (ctypes.c_char_p * (len(items) + 1))()
    arr[:-1] = [item.encode() for item in items]
    return arr


def _fail_child(report: int, stage: str) -> None:
    code = ctypes.get_errno()
    with contextlib.suppress(OSError):
        os.write(report, f"{stage} {code} {os.strerror(code)}".encode())
    os._exit(127)


def _child(
    joins: list[int],
    pidfd: int,
    cwd: bytes,
    stdio: tuple[int, int, int],
    umask: int,
    setsid: bool,
    exe: tuple[bytes, Any, Any],
    report: int,
) -> None:
    """(The forked child of an exec: few Python steps, each page it touches is a copy)
    enter the environment and exec; never returns."""
    libc = _libc
    for fd in joins:
        if libc.write(fd, b"0", 1) != 1:
            _fail_child(report, "cgroup")
    if libc.setns(pidfd, CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET) != 0:
        _fail_child(report, "setns")
    if libc.setns(pidfd, CLONE_NEWUSER) != 0:
        _fail_child(report, "setns")
    if (
        libc.setgroups(0, None) != 0
        or libc.setresgid(0, 0, 0) != 0
        or libc.setresuid(0, 0, 0) != 0
        or libc.prctl(PR_SET_SECUREBITS, SECURE_NOROOT, 0, 0, 0) != 0
        or libc.capset(ctypes.byref(_NO_CAPS[0]), _NO_CAPS[1]) != 0
        or libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
    ):
        _fail_child(report, "identity")
    if libc.chdir(cwd) != 0:
        _fail_child(report, "cwd")
    libc.umask(umask)
    if libc.dup2(stdio[0], 0) < 0 or libc.dup2(stdio[1], 1) < 0 or libc.dup2(stdio[2], 2) < 0:
        _fail_child(report, "stdio")
    if setsid:
        libc.setsid()
    libc.signal(signal.SIGPIPE, 0)  # (ignored by Python: SIG_DFL for the command)
    libc.signal(signal.SIGXFSZ, 0)
    libc.execvpe(*exe)
    _fail_child(report, "exec")


def enter_for_good(box: dict[str, Any]) -> None:
    """(A lodger of one isolated environment, already in its exec cgroup) join the
    environment's cgroups and namespaces for good, become root there with no capability
    and keep it that way for every child (securebits ``NOROOT`` locked, no new privileges):
    its ``posix_spawn`` children are then born inside, at no cost per spawn."""
    _own_pid_ns()
    for tasks in box.get("cgroups", ()):
        _write(tasks, "0")
    pidfd = os.pidfd_open(box["pid"])
    try:
        setns(pidfd, CLONE_NEWPID)  # (for its children)
        setns(pidfd, CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET)
        setns(pidfd, CLONE_NEWUSER)
    finally:
        os.close(pidfd)
    os.setgroups([])
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    _prctl(PR_SET_SECUREBITS, SECURE_NOROOT)
    _check(_libc.capset(ctypes.byref(_NO_CAPS[0]), _NO_CAPS[1]), "capset")
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    os.chdir("/")


def spawn(msg: dict[str, Any], stdio: dict[str, int]) -> int:
    """(The fork server or a lodger, already in the exec's cgroup and on its cores) spawn
    ``msg``'s command inside its environment; the child's pid (as this side sees it).

    Everything the child needs is prepared here, before the fork: the child makes a few
    C calls and execs (``libc`` fork: no Python after-fork hooks; a bare-name command is
    looked up in its ``PATH`` inside the environment, by ``execvpe``).

    Raises OSError: ``errno`` set; ``filename`` "cwd" when the working directory is
    missing inside, "exec" when the command could not be exec'd."""
    box = msg["sandbox"]
    _own_pid_ns()
    argv, env = msg["argv"], msg["env"]
    path = env.get("PATH", os.defpath)
    if os.environ.get("PATH") != path:  # (execvpe searches the caller's PATH)
        os.environ["PATH"] = path
    exe = (argv[0].encode(), _strings(argv), _strings([f"{k}={v}" for k, v in env.items()]))
    joins: list[int] = []
    devnull = None
    pidfd = report_r = report_w = -1
    try:
        for tasks in box.get("cgroups", ()):
            joins.append(os.open(tasks, os.O_WRONLY | os.O_CLOEXEC))
        pidfd = os.pidfd_open(box["pid"])
        stdin = stdio.get("stdin")
        if stdin is None:
            stdin = devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        report_r, report_w = os.pipe2(os.O_CLOEXEC)
        fds = (stdin, stdio["stdout"], stdio["stderr"])
        cwd = msg["cwd"].encode()
        setns(pidfd, CLONE_NEWPID)
        try:
            pid = int(_pylibc.fork())
            if pid == 0:
                _child(joins, pidfd, cwd, fds, msg["umask"], msg.get("setsid", True), exe, report_w)
        finally:
            setns(_own_pid_ns(), CLONE_NEWPID)
        if pid < 0:
            _check(pid, "fork")
        os.close(report_w)
        report_w = -1
        said = b""
        while chunk := os.read(report_r, 4096):
            said += chunk
    finally:
        for fd in (*joins, pidfd, report_r, report_w, -1 if devnull is None else devnull):
            if fd >= 0:
                os.close(fd)
    if said:
        os.waitpid(pid, 0)
        stage, code, text = [*said.decode(errors="replace").split(" ", 2), "", ""][:3]
        err = OSError(int(code) if code.isdigit() else 0, f"{stage}: {text}")
        err.filename = stage
        raise err
    return pid


def probe(scratch: str) -> str:
    """'' when this host lets the fork server build an environment (run as the fork
    server would: root, single-threaded), else why not. Builds and kills one keeper in
    ``scratch`` (an empty directory, removed by the caller)."""
    if os.geteuid() != 0:
        return "the daemon is not root"
    if not hasattr(os, "pidfd_open"):
        return "no pidfd_open (Linux < 5.3)"
    if _syscall_nr(0) is None:
        return f"pivot_root's number is not known on {platform.machine()}"
    box: dict[str, Any] = {"hide": [scratch], "net": "none", "uid": 65534, "gid": 65534}
    for name in ("upper", "work", "merged", "home"):
        box[name] = os.path.join(scratch, name)
        os.mkdir(box[name], 0o700)
    try:
        pid = open_keeper(box)
    except OSError as e:
        return str(e)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return ""


def enter(req: dict[str, Any]) -> int:
    """(``nsbox.py enter JSON``: a session's shell, started by the daemon) join
    ``req["join"]`` (the session's cgroups), run ``req``'s command inside its environment
    in this process group, pass it SIGINT, SIGTERM and SIGHUP, and exit as it does."""
    _write("/proc/self/oom_score_adj", str(req.get("oom_score_adj", 0)))
    for tasks in req.get("join", ()):
        _write(tasks, "0")
    pid = spawn(req, {"stdin": 0, "stdout": 1, "stderr": 2})
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda num, _frame: os.kill(pid, num))
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


if __name__ == "__main__":  # python -I -S nsbox.py probe DIR | enter JSON
    if len(sys.argv) == 3 and sys.argv[1] == "probe":
        why = probe(sys.argv[2])
        if why:
            print(why)
        sys.exit(1 if why else 0)
    if len(sys.argv) == 3 and sys.argv[1] == "enter":
        import json

        try:
            sys.exit(enter(json.loads(sys.argv[2])))
        except OSError as e:
            print(f"tangram: cannot enter the environment: {e}", file=sys.stderr)
            sys.exit(126)
    sys.exit(2)

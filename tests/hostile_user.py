"""A throwaway unprivileged local user for the hostile-user tests (created, then removed)."""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class LocalUser:
    name: str
    uid: int
    gid: int

    @property
    def ids(self) -> tuple[int, int]:
        return (self.uid, self.gid)


@contextlib.contextmanager
def local_user() -> Iterator[LocalUser]:
    """Create a fresh unprivileged user (no home, no login shell) and remove it afterwards."""
    name = f"tgh{uuid.uuid4().hex[:8]}"
    subprocess.run(
        ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "--user-group", name],
        check=True,
        capture_output=True,
    )
    entry = pwd.getpwnam(name)
    try:
        yield LocalUser(name, entry.pw_uid, entry.pw_gid)
    finally:
        _kill_processes_of(entry.pw_uid)
        subprocess.run(["userdel", name], capture_output=True)


def _kill_processes_of(uid: int) -> None:
    """SIGKILL, by pid, whatever the throwaway user still runs (its uid is ours alone)."""
    for proc in psutil.process_iter(["uids"]):
        uids = proc.info["uids"]
        if uids is not None and uid in (uids.real, uids.effective):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc.pid, signal.SIGKILL)


def in_child_as(uid: int, gid: int, work: Callable[[], bytes]) -> bytes:
    """Run ``work`` in a forked child that dropped to uid/gid (no supplementary groups) and
    return what it returned; the child's failure fails the caller's assertion."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to the user, work, report, exit
        code = 1
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            os.write(write_fd, work())
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    data = b""
    while chunk := os.read(read_fd, 65536):
        data += chunk
    os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return data

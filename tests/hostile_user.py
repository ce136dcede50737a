"""A throwaway unprivileged local user for the hostile-user tests (created, then removed)."""

from __future__ import annotations

import contextlib
import pwd
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass


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
    try:
        entry = pwd.getpwnam(name)
        yield LocalUser(name, entry.pw_uid, entry.pw_gid)
    finally:
        subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
        subprocess.run(["userdel", name], capture_output=True)

"""Start a real ``tangramd up`` subprocess on a temp socket (shared by the daemon tests)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tangram import Client


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    socket: str
    state_dir: str
    log_path: Path

    def client(self, **kw: object) -> Client:
        return Client(self.socket, **kw)  # type: ignore[arg-type]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"tangramd did not stop on {sig}:\n{self.log()}") from None


def write_config(path: Path, extra: str = "") -> Path:
    path.write_text(
        "[sched]\ncoalesce_ms = 1.0\n\n"
        '[[api]]\nname = "search"\nconcurrency = 2\nquota = 0\nperiod_s = 60\nttl_s = 2\n\n'
        '[[api]]\nname = "strict"\nconcurrency = 1\noverflow = "reject"\n\n' + extra
    )
    return path


@contextlib.contextmanager
def running_daemon(tmp: Path, *args: str, config: str = "") -> Iterator[Daemon]:
    sock = str(tmp / "tangramd.sock")
    state = str(tmp / "state")
    cfg = write_config(tmp / "tangram.toml", config)
    log_path = tmp / "tangramd.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", TANGRAM_VALIDATE="1")
    cmd = [
        sys.executable,
        "-m",
        "tangramd.main",
        "up",
        "--config",
        str(cfg),
        "--socket",
        sock,
        "--state-dir",
        state,
        *args,
    ]
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
    daemon = Daemon(proc, sock, state, log_path)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"tangramd exited early ({proc.returncode}):\n{daemon.log()}")
            if os.path.exists(sock):
                try:
                    with Client(sock) as c:
                        c.ping()
                    break
                except Exception:
                    pass
            if time.monotonic() > deadline:
                raise AssertionError(f"tangramd did not come up:\n{daemon.log()}")
            time.sleep(0.05)
        yield daemon
    finally:
        if proc.poll() is None:
            daemon.stop()
    assert "invariant_violated" not in daemon.log(), daemon.log()
    assert "Traceback" not in daemon.log(), daemon.log()

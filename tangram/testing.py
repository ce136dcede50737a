"""Start ``tangramd up`` as a subprocess on a private socket (examples, benchmarks, tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tangram.client import Client


@dataclass
class SpawnedDaemon:
    proc: subprocess.Popen[bytes]
    socket: str
    state_dir: str
    log_path: Path

    def client(self, **kw: object) -> Client:
        return Client(self.socket, **kw)  # type: ignore[arg-type]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send ``sig`` and wait; returns the exit status (kills and raises on a hang)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"tangramd did not stop on signal {sig}:\n{self.log()}") from None


def spawn_daemon(
    workdir: str | os.PathLike[str],
    config: str = "",
    *args: str,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 30.0,
) -> SpawnedDaemon:
    """Write ``config`` to ``workdir/tangram.toml``, start the daemon, wait until it answers."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    sock = str(work / "tangramd.sock")
    state = str(work / "state")
    cfg = work / "tangram.toml"
    cfg.write_text(config)
    log_path = work / "tangramd.log"
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
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=full_env)
    daemon = SpawnedDaemon(proc, sock, state, log_path)
    deadline = time.monotonic() + ready_timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"tangramd exited early ({proc.returncode}):\n{daemon.log()}")
        if os.path.exists(sock):
            try:
                with Client(sock, connect_timeout_s=1.0) as c:
                    c.ping()
                return daemon
            except Exception:
                pass
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"tangramd did not come up:\n{daemon.log()}")
        time.sleep(0.05)

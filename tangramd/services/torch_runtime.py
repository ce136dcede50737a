"""The torch runtime: a replica is a ``tangramd.services.worker`` process on a pipe.

The worker is not bound to GPUs: every GPU is visible to it (NVML order, via
``CUDA_DEVICE_ORDER=PCI_BUS_ID``) and each restore names the device, so one worker with its
host backup can be restored onto whatever chunk the pool picks. A multi-GPU chunk restores
the module onto the chunk's first GPU; the module may use the others itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import tangramd
from tangramd.services import wire
from tangramd.services.inventory import Gpu
from tangramd.services.runtime_base import (
    Moved,
    ReplicaCrashed,
    Reply,
    ServiceLoadError,
    log_tail,
)
from tangramd.services.spec import ServiceSpec

PACKAGE_ROOT = str(Path(tangramd.__file__).resolve().parent.parent)


def device_of(gpus: tuple[Gpu, ...]) -> str:
    """The torch device a chunk's replica runs on: its first GPU, or the CPU if simulated."""
    first = gpus[0] if gpus else None
    return "cpu" if first is None or first.cuda_index is None else f"cuda:{first.cuda_index}"


class TorchReplica:
    """Host side of one worker process: framed requests, one at a time, crash detection."""

    def __init__(
        self,
        spec: ServiceSpec,
        log_path: Path,
        *,
        python: str = sys.executable,
        load_timeout_s: float = 300.0,
    ) -> None:
        self.spec = spec
        self.log_path = log_path
        self.python = python
        self.load_timeout_s = load_timeout_s
        self.proc: asyncio.subprocess.Process | None = None
        self._nbytes: int | None = None
        self._lock = asyncio.Lock()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def nbytes(self) -> int | None:
        return self._nbytes

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    async def start(self, gpus: tuple[Gpu, ...] = ()) -> None:
        """Spawn the worker, which builds the module and backs it up; wait for its hello."""
        argv = [self.python, "-m", "tangramd.services.worker", "--name", self.spec.name]
        argv += ["--entry", str(self.spec.entry), "--device", device_of(gpus)]
        if self.spec.path:
            argv += ["--path", self.spec.path]
        env = dict(os.environ)
        env.update(self.spec.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # cuda:i is NVML GPU i
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                env=env,
                start_new_session=True,  # a ^C to the daemon must not reach the workers
                limit=wire.MAX_FRAME + 4,
            )
        try:
            hello = await asyncio.wait_for(self._read(), self.load_timeout_s)
        except (ReplicaCrashed, TimeoutError) as exc:
            await self.close()
            tail = log_tail(self.log_path)
            raise ServiceLoadError(
                f"service {self.spec.name!r}: worker did not start ({exc})"
                + (f"; its log ends:\n{tail}" if tail else "")
            ) from None
        if not hello.get("ok"):
            await self.close()
            raise ServiceLoadError(str(hello.get("error")))
        self._nbytes = int(hello["nbytes"])

    async def restore(self, gpus: tuple[Gpu, ...]) -> Moved:
        reply = await self._request({"op": "restore", "device": device_of(gpus)})
        return Moved(int(reply["bytes"]), float(reply["seconds"]))

    async def evict(self) -> Moved:
        reply = await self._request({"op": "evict"})
        return Moved(int(reply["bytes"]), float(reply["seconds"]))

    async def call(self, payload: dict[str, Any], timeout: float) -> Reply:
        """One call; on timeout the worker is killed (a handler cannot be interrupted)."""
        start = time.perf_counter()
        try:
            reply = await asyncio.wait_for(
                self._request({"op": "call", "payload": payload}, failed_ok=True), timeout
            )
        except TimeoutError:
            await self.close()
            raise
        exec_s = float(reply.get("exec_s", time.perf_counter() - start))
        if reply.get("ok"):
            return Reply(True, reply["result"], None, exec_s)
        return Reply(False, None, str(reply.get("error")), exec_s)

    async def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.returncode is None:
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 0.5)  # an idle worker exits at EOF
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()

    async def _request(self, msg: dict[str, Any], *, failed_ok: bool = False) -> dict[str, Any]:
        async with self._lock:
            proc = self.proc
            if proc is None or proc.returncode is not None or proc.stdin is None:
                raise ReplicaCrashed(self._gone())
            try:
                proc.stdin.write(wire.encode(msg))
                await proc.stdin.drain()
                reply = await self._read()
            except (ConnectionError, ReplicaCrashed):
                raise ReplicaCrashed(self._gone()) from None
        if reply.get("ok") or (failed_ok and reply.get("kind") == "failed"):
            return reply
        raise ReplicaCrashed(f"service {self.spec.name!r}: worker error: {reply.get('error')}")

    async def _read(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            return await wire.read_frame_async(self.proc.stdout)
        except wire.WireError as exc:
            raise ReplicaCrashed(str(exc)) from None

    def _gone(self) -> str:
        code = None if self.proc is None else self.proc.returncode
        how = "is not running" if code is None else f"exited with status {code}"
        return f"service {self.spec.name!r}: worker {how}"

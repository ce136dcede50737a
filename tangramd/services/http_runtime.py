"""The http runtime: a model server started by the node, driven over loopback HTTP.

A replica is one server process bound to one chunk (``CUDA_VISIBLE_DEVICES``: the chunk's
GPUs), told the chunk's size: ``{tp}`` in the command line becomes the GPU count, and a
command without ``{tp}`` gets ``--tensor-parallel-size K`` appended on chunks of K > 1 GPUs
(vLLM's and SGLang's flag; a one-GPU server runs the command as written). Eviction and
restore use the server's own API, as documented upstream:

- vLLM (``api = "vllm"``), server started with ``--enable-sleep-mode`` and
  ``VLLM_SERVER_DEV_MODE=1`` (the node sets it): ``POST /sleep?level=1`` offloads the weights
  to CPU memory and drops the KV cache, ``POST /wake_up`` restores, ``GET /is_sleeping``
  answers ``{"is_sleeping": bool}``.
- SGLang (``api = "sglang"``), server started with ``--enable-memory-saver``:
  ``POST /release_memory_occupation`` and ``POST /resume_memory_occupation`` with a JSON body.

Calls POST the payload as JSON to ``spec.route``; 2xx is ``ok``, 4xx is ``failed`` (the
server rejected the payload), 5xx or a broken connection is an infrastructure error.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import socket
import time
from pathlib import Path
from typing import Any

from tangramd.services.inventory import Gpu, visible_devices
from tangramd.services.runtime_base import (
    Moved,
    ReplicaCrashed,
    ServiceLoadError,
    WorkerReply,
    log_tail,
)
from tangramd.services.spec import ServiceSpec

# api -> (path, JSON body); level 1 keeps the weights in host memory (the backup)
SLEEP: dict[str, tuple[str, Any]] = {
    "vllm": ("/sleep?level=1", None),
    "sglang": ("/release_memory_occupation", {}),
}
WAKE: dict[str, tuple[str, Any]] = {
    "vllm": ("/wake_up", None),
    "sglang": ("/resume_memory_occupation", {}),
}
CONTROL_TIMEOUT_S = 600.0  # waking a 100 GB model takes seconds; a wedged server, forever


class HttpError(Exception):
    """No HTTP answer at all (refused, reset, malformed)."""


async def http_request(
    port: int, method: str, path: str, body: Any = None, *, timeout: float = 30.0
) -> tuple[int, bytes]:
    """One HTTP/1.1 request to 127.0.0.1:``port``; ``(status, body)``."""
    data = b"" if body is None else json.dumps(body).encode()
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )

    async def exchange() -> tuple[int, bytes]:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError as exc:
            raise HttpError(f"cannot connect to 127.0.0.1:{port}: {exc}") from None
        try:
            writer.write(head.encode() + data)
            await writer.drain()
            raw = await reader.read()
        except OSError as exc:
            raise HttpError(f"connection to 127.0.0.1:{port} failed: {exc}") from None
        finally:
            writer.close()
        return _parse_response(raw)

    return await asyncio.wait_for(exchange(), timeout)


def _parse_response(raw: bytes) -> tuple[int, bytes]:
    header, sep, rest = raw.partition(b"\r\n\r\n")
    lines = header.split(b"\r\n")
    parts = lines[0].split() if lines and lines[0] else []
    if not sep or len(parts) < 2 or not parts[1].isdigit():
        raise HttpError(f"malformed HTTP response {raw[:80]!r}")
    headers = {}
    for line in lines[1:]:
        key, _, value = line.partition(b":")
        headers[key.strip().lower()] = value.strip().lower()
    if headers.get(b"transfer-encoding") == b"chunked":
        rest = _unchunk(rest)
    return int(parts[1]), rest


def _unchunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2 :]
    return bytes(out)


def free_port() -> int:
    """A loopback port nobody listens on now (the server binds it right after)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def server_argv(cmd: str, port: int, gpus: int) -> list[str]:
    """The server's command line for a chunk of ``gpus`` GPUs: ``{port}`` and ``{tp}``
    filled in, or ``--tensor-parallel-size`` appended (more than one GPU, no ``{tp}``)."""
    argv = shlex.split(cmd.replace("{port}", str(port)).replace("{tp}", str(max(gpus, 1))))
    if gpus > 1 and "{tp}" not in cmd:
        argv += ["--tensor-parallel-size", str(gpus)]
    return argv


class HttpReplica:
    """One model server process on one chunk of GPUs."""

    def __init__(self, spec: ServiceSpec, log_path: Path, *, load_timeout_s: float = 900.0):
        self.spec = spec
        self.log_path = log_path
        self.load_timeout_s = load_timeout_s
        self.port: int | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def nbytes(self) -> int | None:
        return None  # the server does not say; the node accounts the registered mem_gb

    async def start(self, gpus: tuple[Gpu, ...]) -> None:
        """Start the server on ``gpus`` and wait until ``GET /health`` answers 200."""
        self.port = free_port()
        argv = server_argv(str(self.spec.cmd), self.port, len(gpus))
        env = dict(os.environ)
        env.update(self.spec.env)
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(gpus)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        if self.spec.api == "vllm":
            env["VLLM_SERVER_DEV_MODE"] = "1"  # vLLM serves /sleep, /wake_up only then
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with self.log_path.open("ab") as log:
                # in the service's own directory, never the daemon's working directory
                # (`python -m SERVER` would import a module planted there, as root)
                self.proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdout=log,
                    stderr=log,
                    env=env,
                    cwd=self.spec.path or str(self.log_path.parent),
                    start_new_session=True,
                )
        except OSError as exc:
            raise ServiceLoadError(
                f"service {self.spec.name!r}: cannot start {argv[0]!r}: {exc}"
            ) from None
        deadline = time.monotonic() + self.load_timeout_s
        while time.monotonic() < deadline:
            if not self.alive:
                break
            try:
                status, _ = await http_request(self.port, "GET", "/health", timeout=5.0)
                if status == 200:
                    return
            except (HttpError, TimeoutError):
                pass  # not listening yet
            await asyncio.sleep(0.1)
        code = None if self.proc is None else self.proc.returncode
        await self.close()
        tail = log_tail(self.log_path)
        why = f"exited with status {code}" if code is not None else "did not become healthy"
        raise ServiceLoadError(
            f"service {self.spec.name!r}: server {why}"
            + (f"; its log ends:\n{tail}" if tail else "")
        )

    async def restore(self, gpus: tuple[Gpu, ...]) -> Moved:
        path, body = WAKE[self.spec.api]
        seconds = await self._control(path, body)
        if self.spec.api == "vllm":
            status, raw = await self._get("/is_sleeping")
            if status != 200 or json.loads(raw).get("is_sleeping"):
                raise ReplicaCrashed(f"service {self.spec.name!r}: still asleep after wake_up")
        return Moved(self.spec.mem_bytes, seconds)

    async def evict(self) -> Moved:
        path, body = SLEEP[self.spec.api]
        return Moved(self.spec.mem_bytes, await self._control(path, body))

    async def is_sleeping(self) -> bool:
        status, raw = await self._get("/is_sleeping")
        return bool(status == 200 and json.loads(raw).get("is_sleeping"))

    async def call(self, payload: dict[str, Any], timeout: float) -> WorkerReply:
        async with self._lock:
            return await self._call(payload, timeout)

    async def _call(self, payload: dict[str, Any], timeout: float) -> WorkerReply:
        start = time.perf_counter()
        status, raw = await self._send("POST", self.spec.route, payload, timeout)
        exec_s = time.perf_counter() - start
        try:
            data = json.loads(raw) if raw else {}
        except ValueError:
            data = {"text": raw.decode(errors="replace")}
        if 200 <= status < 300:
            return WorkerReply(
                True, data if isinstance(data, dict) else {"result": data}, None, exec_s
            )
        message = _error_text(data) or f"HTTP {status}"
        if 400 <= status < 500:
            return WorkerReply(False, None, message, exec_s)
        raise ReplicaCrashed(f"service {self.spec.name!r}: server answered {status}: {message}")

    async def call_batch(self, payloads: list[dict[str, Any]], timeout: float) -> list[WorkerReply]:
        """Several calls sent to the server at once (an engine that batches itself merges
        them); each reply has its own ``exec_s``. ``ReplicaCrashed`` if any broke."""
        async with self._lock:  # (no sleep or wake between them)
            replies = await asyncio.gather(*(self._call(p, timeout) for p in payloads))
        return list(replies)

    async def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.returncode is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # vLLM spawns engine processes in its group
        except ProcessLookupError:
            return
        try:
            await asyncio.wait_for(proc.wait(), 15.0)
        except TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()

    async def _control(self, path: str, body: Any) -> float:
        start = time.perf_counter()
        async with self._lock:
            status, raw = await self._send("POST", path, body, CONTROL_TIMEOUT_S)
        if status != 200:
            raise ReplicaCrashed(
                f"service {self.spec.name!r}: POST {path} answered {status}: {raw[:200]!r}"
            )
        return time.perf_counter() - start

    async def _get(self, path: str) -> tuple[int, bytes]:
        async with self._lock:
            return await self._send("GET", path, None, 30.0)

    async def _send(self, method: str, path: str, body: Any, timeout: float) -> tuple[int, bytes]:
        if not self.alive or self.port is None:
            raise ReplicaCrashed(f"service {self.spec.name!r}: server is not running")
        try:
            return await http_request(self.port, method, path, body, timeout=timeout)
        except HttpError as exc:
            raise ReplicaCrashed(f"service {self.spec.name!r}: {exc}") from None


def _error_text(data: Any) -> str | None:
    if isinstance(data, dict):
        error = data.get("error", data.get("detail", data.get("message")))
        if isinstance(error, dict):  # OpenAI style {"error": {"message": ...}}
            error = error.get("message")
        return None if error is None else str(error)
    return None

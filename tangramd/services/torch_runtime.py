"""The torch runtime: a fork server per service, and one replica process per instance.

``ForkServer`` starts ``tangramd.services.worker --fd N`` once per service: it runs the
factory and makes the host backup (shared memory) once. Each ``TorchReplica`` is a fork of
it, talking to the host over its own socket, so a second replica or a restart after a crash
costs a fork instead of a model build, and all replicas share one backup. If the factory
initialises CUDA (forking would be unsafe) each replica is a freshly spawned worker instead.

Replicas are not bound to GPUs: every GPU is visible (NVML order, via
``CUDA_DEVICE_ORDER=PCI_BUS_ID``) and each restore names the device, so one replica can be
restored onto whatever chunk of its size the pool picks. A replica for a chunk of k GPUs is
k worker processes, forked (or spawned) together, each holding a shard of the module on its
own GPU of the chunk (``tangramd.services.shards``: a tensor split of the linear layers;
on simulated GPUs, k CPU workers); worker 0 runs the handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import tangramd
from tangramd.services import wire
from tangramd.services.inventory import Gpu
from tangramd.services.runtime_base import (
    Moved,
    ReplicaCrashed,
    ServiceLoadError,
    WorkerReply,
    log_tail,
)
from tangramd.services.spec import ServiceSpec

PACKAGE_ROOT = str(Path(tangramd.__file__).resolve().parent.parent)


def device_of(gpus: tuple[Gpu, ...]) -> str:
    """The torch device a chunk's replica runs on: its first GPU, or the CPU if simulated."""
    first = gpus[0] if gpus else None
    return "cpu" if first is None or first.cuda_index is None else f"cuda:{first.cuda_index}"


def _worker_env(spec: ServiceSpec, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(spec.env)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # cuda:i is NVML GPU i
    env.update(extra)
    return env


# The worker runs isolated (-I: no current directory, PYTHONPATH or user site on sys.path;
# -u: its log is complete when it crashes), so a module planted where the daemon was
# started (a torch.py in root's cwd) is never imported by a worker running as root. It
# finds tangramd in the interpreter's packages (an install, editable or not), else where
# this daemon found it (appended: a source tree run through PYTHONPATH); the service's
# --path is the only other directory added (worker.build).
_WORKER_BOOT = (
    "import runpy, sys; sys.path.append(sys.argv.pop(1)); "
    "runpy.run_module('tangramd.services.worker', run_name='__main__', alter_sys=True)"
)


def _worker_argv(python: str, spec: ServiceSpec) -> list[str]:
    argv = [python, "-I", "-u", "-c", _WORKER_BOOT, PACKAGE_ROOT, "--name", spec.name]
    argv += ["--entry", str(spec.entry)]
    return argv + (["--path", spec.path] if spec.path else [])


def _worker_cwd(spec: ServiceSpec, log_path: Path) -> str:
    """Where a worker runs: the service's own directory (its --path), else the daemon's
    private directory of service logs; never the daemon's working directory."""
    return spec.path or str(log_path.parent)


def _load_failed(spec: ServiceSpec, why: object, log: Path) -> ServiceLoadError:
    tail = log_tail(log)
    return ServiceLoadError(
        f"service {spec.name!r}: worker did not start ({why})"
        + (f"; its log ends:\n{tail}" if tail else "")
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ForkServer:
    """Host side of one service's fork server (the holder of the host backup)."""

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
        self.sock: socket.socket | None = None
        self.nbytes: int | None = None
        self.forkable = False
        self._lock = asyncio.Lock()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> None:
        """Run the factory and make the backup; ``ServiceLoadError`` naming the service."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [*_worker_argv(self.python, self.spec), "--fd", str(theirs.fileno())]
        # Fork safety: one torch thread (GNU OpenMP's pool does not survive fork), and
        # torch.cuda.is_available() answered by NVML, not by cuInit (CUDA does not survive
        # fork either).
        env = _worker_env(
            self.spec,
            OMP_NUM_THREADS="1",
            MKL_NUM_THREADS="1",
            PYTORCH_NVML_BASED_CUDA_CHECK="1",
        )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                cwd=_worker_cwd(self.spec, self.log_path),
                pass_fds=(theirs.fileno(),),
                start_new_session=True,  # a ^C to the daemon must not reach the workers
            )
        theirs.close()
        self.sock = ours
        hello = await _hello(self, self._receive(), self.load_timeout_s, self.spec, self.log_path)
        self.nbytes = int(hello["nbytes"])
        self.forkable = bool(hello.get("forkable"))

    async def fork(
        self,
        threads: int,
        *,
        rank: int = 0,
        ranks: int = 1,
        peers: Sequence[socket.socket] = (),
    ) -> tuple[int, socket.socket]:
        """A new replica process (worker ``rank`` of a ``ranks``-GPU replica, with sockets to
        its ``peers``) and the host's end of its socket."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        async with self._lock:
            if not self.alive or self.sock is None:
                raise ReplicaCrashed(f"service {self.spec.name!r}: fork server is not running")
            try:
                ask = {"op": "fork", "threads": threads, "rank": rank, "ranks": ranks}
                request = wire.pack(ask)
                fds = [theirs.fileno(), *(peer.fileno() for peer in peers)]
                socket.send_fds(self.sock, [request], fds)
                reply = await asyncio.wait_for(self._receive(), 30.0)
            except (OSError, TimeoutError) as exc:
                ours.close()
                raise ReplicaCrashed(f"service {self.spec.name!r}: fork failed: {exc}") from None
            finally:
                theirs.close()
        if not reply.get("ok"):
            ours.close()
            raise ReplicaCrashed(f"service {self.spec.name!r}: {reply.get('error')}")
        return int(reply["pid"]), ours

    async def close(self) -> None:
        proc, self.proc = self.proc, None
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()  # the server exits at end of stream; its replicas live on
        if proc is not None and proc.returncode is None:
            try:
                await asyncio.wait_for(proc.wait(), 1.0)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()

    async def _receive(self) -> dict[str, Any]:
        assert self.sock is not None
        loop = asyncio.get_running_loop()
        sock = self.sock
        sock.setblocking(False)
        data = await loop.sock_recv(sock, 1 << 16)
        if not data:
            raise ReplicaCrashed(f"service {self.spec.name!r}: fork server exited")
        return wire.unpack(data)


class _Worker:
    """One process of a replica: its pid, its frames, and whether it has exited."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.pid: int | None = None
        self.proc: asyncio.subprocess.Process | None = None  # spawned workers only
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.exited = asyncio.Event()
        self.hello: dict[str, Any] = {}

    @property
    def alive(self) -> bool:
        if self.pid is None or self.exited.is_set():
            return False
        if self.proc is not None:
            return self.proc.returncode is None
        return _pid_alive(self.pid)


class TorchReplica:
    """Host side of one replica: ``ranks`` worker processes (one per GPU of its chunk, each
    with a shard of the module: ``tangramd.services.shards``), framed requests, one at a
    time, crash detection. Calls go to worker 0; restores and evictions to every worker,
    each onto its own GPU of the chunk."""

    def __init__(
        self,
        spec: ServiceSpec,
        log_path: Path,
        *,
        server: ForkServer | None = None,
        python: str = sys.executable,
        load_timeout_s: float = 300.0,
        ranks: int = 1,
    ) -> None:
        self.spec = spec
        self.log_path = log_path
        self.server = server
        self.python = python
        self.load_timeout_s = load_timeout_s
        self.ranks = ranks
        self._workers: list[_Worker] = []
        self._exited = asyncio.Event()  # any worker exited: the replica is gone
        self._nbytes: int | None = None
        self._lock = asyncio.Lock()
        self.batches = False  # the module has handle_batch (from the worker's hello)

    @property
    def proc(self) -> asyncio.subprocess.Process | None:
        """Worker 0's process when the host spawned it (None: forked by the fork server)."""
        return self._workers[0].proc if self._workers else None

    @property
    def alive(self) -> bool:
        if not self._workers or self._exited.is_set():
            return False
        return all(worker.alive for worker in self._workers)

    @property
    def nbytes(self) -> int | None:
        return self._nbytes

    @property
    def pid(self) -> int | None:
        return self._workers[0].pid if self._workers else None

    @property
    def pids(self) -> list[int]:
        """Every worker's pid, worker 0 first."""
        return [w.pid for w in self._workers if w.pid is not None]

    def workers(self) -> list[dict[str, Any]]:
        """What each worker said when it started: its rank, pid and shard's bytes."""
        return [
            {"rank": w.rank, "pid": w.pid, "shard_bytes": w.hello.get("shard_bytes")}
            for w in self._workers
        ]

    async def wait_exit(self) -> None:
        """Return when a worker has exited (used to notice crashes of idle replicas)."""
        await self._exited.wait()

    async def start(self, gpus: tuple[Gpu, ...] = ()) -> None:
        """Fork the workers from the service's fork server (restarting that server if it
        died), or spawn workers that build the module themselves; wait for their hellos.
        Worker 0 gets one end of a socket pair per other worker, that worker the other."""
        server = self.server
        if server is not None and not server.alive:
            await server.start()
        self._workers = [_Worker(rank) for rank in range(self.ranks)]
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in self._workers[1:]]
        try:
            for worker in reversed(self._workers):  # the others first: the lead's peers wait
                peers = (
                    [ours for ours, _ in pairs] if worker.rank == 0 else [pairs[worker.rank - 1][1]]
                )
                if server is not None and server.forkable:
                    await self._fork(server, worker, peers)
                else:
                    device = device_of(gpus[worker.rank : worker.rank + 1])
                    await self._spawn(worker, device, peers)
        finally:
            for ours, theirs in pairs:
                ours.close()
                theirs.close()
        hellos = await asyncio.gather(
            *(
                _hello(self, self._read(w), self.load_timeout_s, self.spec, self.log_path)
                for w in self._workers
            ),
            return_exceptions=True,
        )
        for hello in hellos:
            if isinstance(hello, BaseException):
                await self.close(grace_s=0.0)
                raise hello
        for worker, hello in zip(self._workers, hellos, strict=True):
            assert isinstance(hello, dict)
            worker.hello = hello
        lead = self._workers[0].hello
        self._nbytes = int(lead["nbytes"])
        self.batches = bool(lead.get("batch"))

    async def _fork(self, server: ForkServer, worker: _Worker, peers: list[socket.socket]) -> None:
        threads = max(1, (os.cpu_count() or 1) // self.ranks)
        try:
            pid, sock = await server.fork(
                threads=threads, rank=worker.rank, ranks=self.ranks, peers=peers
            )
        except ReplicaCrashed as exc:
            await self.close(grace_s=0.0)
            raise ServiceLoadError(str(exc)) from None
        worker.pid = pid
        worker.reader, worker.writer = await asyncio.open_unix_connection(sock=sock)
        self._watch_pid(worker)

    async def _spawn(self, worker: _Worker, device: str, peers: list[socket.socket]) -> None:
        argv = [*_worker_argv(self.python, self.spec), "--device", device]
        if self.ranks > 1:
            fds = ",".join(str(peer.fileno()) for peer in peers)
            argv += ["--rank", str(worker.rank), "--ranks", str(self.ranks), "--peer-fds", fds]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                env=_worker_env(self.spec),
                cwd=_worker_cwd(self.spec, self.log_path),
                pass_fds=tuple(peer.fileno() for peer in peers),
                start_new_session=True,
            )
        worker.proc, worker.pid = proc, proc.pid
        worker.reader, worker.writer = proc.stdout, proc.stdin

        async def reap() -> None:
            await proc.wait()
            worker.exited.set()
            self._exited.set()

        self._reaper = asyncio.get_running_loop().create_task(reap())

    def _watch_pid(self, worker: _Worker) -> None:
        """A forked worker is not our child: a pidfd tells us when it exits."""
        assert worker.pid is not None
        try:
            fd = os.pidfd_open(worker.pid)
        except (AttributeError, OSError):
            return  # no pidfd (old kernel): a crash is noticed on the next request
        loop = asyncio.get_running_loop()

        def exited() -> None:
            loop.remove_reader(fd)
            os.close(fd)
            worker.exited.set()
            self._exited.set()

        loop.add_reader(fd, exited)

    async def restore(self, gpus: tuple[Gpu, ...]) -> Moved:
        """Each worker restores its shard onto its GPU of the chunk (all at once)."""
        replies = await self._each(
            lambda w: {"op": "restore", "device": device_of(gpus[w.rank : w.rank + 1])}
        )
        return _moved(replies)

    async def evict(self) -> Moved:
        replies = await self._each(lambda w: {"op": "evict"})
        return _moved(replies)

    async def call(self, payload: dict[str, Any], timeout: float) -> WorkerReply:
        """One call; on timeout the replica is killed (a handler cannot be interrupted)."""
        start = time.perf_counter()
        try:
            reply = await asyncio.wait_for(
                self._request({"op": "call", "payload": payload}, failed_ok=True), timeout
            )
        except TimeoutError:
            await self.close(grace_s=0.0)
            raise
        exec_s = float(reply.get("exec_s", time.perf_counter() - start))
        if reply.get("ok"):
            return WorkerReply(True, reply["result"], None, exec_s)
        return WorkerReply(False, None, str(reply.get("error")), exec_s)

    async def call_batch(self, payloads: list[dict[str, Any]], timeout: float) -> list[WorkerReply]:
        """Several calls as one forward pass (``handle_batch``); one payload is a plain
        ``call``. Each reply's ``exec_s`` is the pass's. On timeout the replica is killed."""
        if len(payloads) == 1:
            return [await self.call(payloads[0], timeout)]
        start = time.perf_counter()
        try:
            reply = await asyncio.wait_for(
                self._request({"op": "call_batch", "payloads": payloads}), timeout
            )
        except TimeoutError:
            await self.close(grace_s=0.0)
            raise
        exec_s = float(reply.get("exec_s", time.perf_counter() - start))
        results = reply.get("results")
        if not isinstance(results, list) or len(results) != len(payloads):
            raise ReplicaCrashed(f"service {self.spec.name!r}: worker answered a batch wrongly")
        return [
            WorkerReply(True, r.get("result"), None, exec_s)
            if r.get("ok")
            else WorkerReply(False, None, str(r.get("error")), exec_s)
            for r in results
        ]

    async def close(self, grace_s: float = 0.5) -> None:
        """End of stream first (an idle worker exits at once), then SIGKILL; every worker."""
        workers = self._workers
        for worker in workers:
            writer, worker.writer = worker.writer, None
            if writer is not None:
                writer.close()
        deadline = time.monotonic() + grace_s
        while any(w.alive for w in workers) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for worker in workers:
            if worker.pid is None:
                continue
            if worker.alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signal.SIGKILL)
            if worker.proc is not None:
                await worker.proc.wait()
            else:
                for _ in range(100):  # the kernel reaps a fork server's child at once
                    if not _pid_alive(worker.pid):
                        break
                    await asyncio.sleep(0.01)
            worker.exited.set()
        if workers:
            self._exited.set()

    async def _request(self, msg: dict[str, Any], *, failed_ok: bool = False) -> dict[str, Any]:
        """One request to worker 0 (calls)."""
        async with self._lock:
            if not self.alive:
                raise ReplicaCrashed(self._gone())
            reply = await self._exchange(self._workers[0], msg)
        if reply.get("ok") or (failed_ok and reply.get("kind") == "failed"):
            return reply
        raise ReplicaCrashed(f"service {self.spec.name!r}: worker error: {reply.get('error')}")

    async def _each(self, msg: Callable[[_Worker], dict[str, Any]]) -> list[dict[str, Any]]:
        """The same kind of request to every worker at once (restore, evict)."""
        async with self._lock:
            if not self.alive:
                raise ReplicaCrashed(self._gone())
            replies = await asyncio.gather(
                *(self._exchange(w, msg(w)) for w in self._workers), return_exceptions=True
            )
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        for reply in replies:
            assert isinstance(reply, dict)
            if not reply.get("ok"):
                raise ReplicaCrashed(
                    f"service {self.spec.name!r}: worker error: {reply.get('error')}"
                )
        return [r for r in replies if isinstance(r, dict)]

    async def _exchange(self, worker: _Worker, msg: dict[str, Any]) -> dict[str, Any]:
        writer = worker.writer
        if writer is None or not worker.alive:
            raise ReplicaCrashed(self._gone())
        try:
            writer.write(wire.encode(msg))
            await writer.drain()
            return await self._read(worker)
        except (ConnectionError, ReplicaCrashed):
            raise ReplicaCrashed(self._gone()) from None

    async def _read(self, worker: _Worker) -> dict[str, Any]:
        if worker.reader is None:
            raise ReplicaCrashed(self._gone())
        try:
            return await wire.read_frame_async(worker.reader)
        except wire.WireError as exc:
            raise ReplicaCrashed(str(exc)) from None

    def _gone(self) -> str:
        codes = [w.proc.returncode for w in self._workers if w.proc is not None]
        code = next((c for c in codes if c is not None), None)
        how = "is not running" if code is None else f"exited with status {code}"
        which = "worker" if self.ranks == 1 else f"a worker of the {self.ranks}-GPU replica"
        return f"service {self.spec.name!r}: {which} {how}"


def _moved(replies: list[dict[str, Any]]) -> Moved:
    """What the workers of a replica moved together (in parallel: the slowest one's time)."""
    return Moved(sum(int(r["bytes"]) for r in replies), max(float(r["seconds"]) for r in replies))


async def _hello(
    proc: Any, first: Coroutine[Any, Any, dict[str, Any]], timeout_s: float, spec: Any, log: Any
) -> dict[str, Any]:
    """A worker's first message (it built the module, or says why not); on any failure the
    worker is closed and the load error names the service."""
    try:
        hello = await asyncio.wait_for(first, timeout_s)
    except (ReplicaCrashed, TimeoutError) as exc:
        await proc.close()
        raise _load_failed(spec, str(exc) or "timed out", log) from None
    if not hello.get("ok"):
        await proc.close()
        raise ServiceLoadError(str(hello.get("error")))
    return hello

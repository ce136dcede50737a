"""The torch service worker: one process per replica, holding one module and its host backup.

    python -m tangramd.services.worker --name NAME --entry MODULE:FACTORY [--path DIR]
        [--fd N]                              # fork server: backup once, fork replicas
        [--device cpu|cuda:N]                 # pipe mode: one replica on stdin/stdout
          [--rank R --ranks K --peer-fds FD,…]  # … or worker R of a K-GPU replica
        [--http-port PORT]                    # http mode: the vLLM/SGLang sleep/wake subset
          [--tensor-parallel-size K]          # (accepted as an engine's; one process)

``FACTORY()`` returns a ``torch.nn.Module`` defining ``handle(self, payload: dict) -> dict``
and, for dynamic batching (``max_batch`` > 1), ``handle_batch(self, payloads: list[dict]) ->
list[dict]``: one forward pass for several calls, answers in the payloads' order.
The worker backs the module's tensors up in host memory once (pinned on CUDA) and then
serves requests. ``ServiceHost`` runs one fork server per torch service, which makes the
backup once (in shared memory) and forks a replica per request, so a second replica or a
restart costs a fork, not a model build. Replicas (and pipe mode) speak
``tangramd.services.wire`` frames (user code's prints go to stderr). A replica on K GPUs is
K workers, each holding a shard of the module (``tangramd.services.shards``): the host
forks (or spawns) them together, worker 0 with a socket to each other worker. HTTP mode
serves, on 127.0.0.1 only:

- ``GET /health``, ``GET /is_sleeping`` -> ``{"is_sleeping": bool}``
- ``POST /sleep?level=1`` and ``POST /release_memory_occupation``: evict (level 1 only: the
  host backup is kept)
- ``POST /wake_up`` and ``POST /resume_memory_occupation``: restore
- ``POST <any other path>``: the JSON body is the payload of ``handle``; 200 with the result,
  400 ``{"error"}`` when the handler rejects it, 503 while sleeping.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from tangramd.services import wire

if TYPE_CHECKING:
    import socket

    from tangramd.services.shards import Peer


class FactoryError(Exception):
    """The service's factory could not be imported, failed, or returned the wrong thing."""


class Served:
    """The module, its flat weights and the request handlers both modes share."""

    def __init__(
        self, name: str, entry: str, path: str | None, device: str, *, shared: bool = False
    ) -> None:
        module = build(name, entry, path)  # first: a broken factory fails before torch loads
        import torch

        from tangramd.services.weights import FlatWeights

        self.name = name
        self.torch = torch
        self.weights = FlatWeights(module, torch.device(device), shared=shared)
        self.module = module
        self.calls = 0
        self.rank, self.ranks = 0, 1
        self.splits: list[Any] = []

    def shard(self, rank: int, ranks: int, peers: list[Peer]) -> None:
        """Become worker ``rank`` of a ``ranks``-GPU replica: hold only its shard; the lead
        (rank 0) gathers the other workers' rows over ``peers``."""
        from tangramd.services import shards

        self.rank, self.ranks = rank, ranks
        self.splits = shards.plan(self.module, ranks)
        self.weights.shard(shards.pieces(self.weights, self.splits, rank))
        if rank == 0:
            shards.lead(self.splits, peers)

    def info(self) -> dict[str, Any]:
        return {
            "nbytes": self.weights.nbytes,
            "shard_bytes": self.weights.working_bytes,
            "rank": self.rank,
            "ranks": self.ranks,
            "split_layers": len(self.splits),
            "device": str(self.weights.device),
            "resident": self.weights.resident,
            "pid": os.getpid(),
            "calls": self.calls,
            "batch": callable(getattr(self.module, "handle_batch", None)),
        }

    def restore(self, device: str | None = None) -> dict[str, Any]:
        if device is not None and device != str(self.weights.device):
            self.weights.evict()
            self.weights.device = self.torch.device(device)
        moved = self.weights.restore()
        return {"bytes": moved.nbytes, "seconds": moved.seconds}

    def evict(self) -> dict[str, Any]:
        moved = self.weights.evict()
        return {"bytes": moved.nbytes, "seconds": moved.seconds}

    def call(self, payload: Any) -> tuple[bool, Any, float]:
        """``(ok, result or error message, exec seconds)``; a rejection is not a crash."""
        start = time.perf_counter()
        self.calls += 1
        try:
            if not isinstance(payload, dict):
                raise TypeError(f"payload must be a map, got {type(payload).__name__}")
            with self.torch.inference_mode():
                result = self.module.handle(payload)
            if not isinstance(result, dict):
                raise TypeError(f"handle() returned {type(result).__name__}, not a dict")
            wire.encode({"result": result})  # msgpack-able, or the caller could not get it
        except Exception as exc:
            _reraise_lost(exc)
            return False, f"{type(exc).__name__}: {exc}", time.perf_counter() - start
        return True, result, time.perf_counter() - start

    def call_batch(self, payloads: Any) -> tuple[list[tuple[bool, Any]], float]:
        """``handle_batch(payloads)`` as one forward pass: ``[(ok, result or error)]`` in the
        payloads' order, and the pass's seconds. A ``handle_batch`` that raises, or answers
        with anything but one map per payload, fails every call of the batch with its
        message; an answer that cannot be sent fails its own call only."""
        start = time.perf_counter()
        n = len(payloads) if isinstance(payloads, list) else 0
        self.calls += n
        try:
            if not n or not all(isinstance(p, dict) for p in payloads):
                raise TypeError("payloads must be a non-empty list of maps")
            with self.torch.inference_mode():
                answers = self.module.handle_batch(list(payloads))
            if not isinstance(answers, (list, tuple)) or len(answers) != n:
                got = len(answers) if isinstance(answers, (list, tuple)) else None
                raise TypeError(
                    f"handle_batch() returned {type(answers).__name__}"
                    + (f" of {got} answers" if got is not None else "")
                    + f", not a list of {n} answers"
                )
        except Exception as exc:
            _reraise_lost(exc)
            error = f"{type(exc).__name__}: {exc}"
            return [(False, error)] * n, time.perf_counter() - start
        seconds = time.perf_counter() - start
        out: list[tuple[bool, Any]] = []
        for answer in answers:
            if not isinstance(answer, dict):
                out.append((False, f"TypeError: handle_batch() answered a {type(answer).__name__}"))
                continue
            try:
                wire.encode({"result": answer})
            except Exception as exc:
                out.append((False, f"{type(exc).__name__}: {exc}"))
                continue
            out.append((True, answer))
        return out, seconds


def _reraise_lost(exc: BaseException) -> None:
    """A worker of the replica that is gone is the host's problem, not the handler's: the
    call is answered as an error (infra), not as the handler's failure."""
    from tangramd.services.shards import ShardLost

    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ShardLost):
            raise cause
        cause = cause.__cause__ or cause.__context__


def build(name: str, entry: str, path: str | None) -> Any:
    """Import ``MODULE:FACTORY`` (``path`` first on ``sys.path``) and build the module."""
    if path:
        sys.path.insert(0, path)
    module_name, _, factory_name = entry.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), factory_name)
        module = factory()
    except Exception as exc:
        raise FactoryError(
            f"service {name!r}: factory {entry} failed: {type(exc).__name__}: {exc}"
        ) from exc
    import torch

    if not isinstance(module, torch.nn.Module):
        raise FactoryError(
            f"service {name!r}: factory {entry} returned {type(module).__name__}, "
            "not a torch.nn.Module"
        )
    if not callable(getattr(module, "handle", None)):
        raise FactoryError(f"service {name!r}: the module from {entry} has no handle() method")
    return module.eval()


# --------------------------------------------------------------------------- pipe mode


def serve_pipe(args: argparse.Namespace) -> int:
    out = os.fdopen(os.dup(1), "wb")  # replies; fd 1 becomes stderr so prints cannot corrupt
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        served = Served(args.name, args.entry, args.path, args.device)
    except Exception as exc:
        wire.write_frame(out, {"ok": False, "kind": "error", "error": _load_error(args, exc)})
        return 1
    import socket

    peers = [socket.socket(fileno=int(fd)) for fd in args.peer_fds.split(",") if fd]
    return _run_rank(served, args.rank, args.ranks, sys.stdin.buffer, out, peers)


def _run_rank(
    served: Served, rank: int, ranks: int, inp: Any, out: Any, peers: list[socket.socket]
) -> int:
    """Worker ``rank`` of a ``ranks``-GPU replica (1: a whole replica): hello, then serve."""
    if ranks > 1:
        from tangramd.services import shards

        links = [shards.Peer(r, sock) for r, sock in enumerate(peers, 1)] if rank == 0 else []
        served.shard(rank, ranks, links)
        if rank > 0:
            (peer,) = peers
            wire.write_frame(out, {"ok": True, **served.info()})

            def answer(msg: dict[str, Any]) -> dict[str, Any]:
                if msg.get("op") in ("call", "call_batch"):
                    return {"ok": False, "kind": "error", "error": "calls go to worker 0"}
                return _answer(served, msg)

            return shards.serve_shard(served.splits, served.weights, inp, out, peer, answer)
    wire.write_frame(out, {"ok": True, **served.info()})
    return _serve(served, inp, out)


def _serve(served: Served, inp: Any, out: Any) -> int:
    while (msg := wire.read_frame(inp)) is not None:
        wire.write_frame(out, _answer(served, msg))
    return 0


def _load_error(args: argparse.Namespace, exc: BaseException) -> str:
    return str(exc) if isinstance(exc, FactoryError) else _describe(args.name, exc)


# --------------------------------------------------------------------------- fork server


def serve_zygote(args: argparse.Namespace) -> int:
    """Build the module and its backup once, then fork one replica per ``fork`` request.

    The control channel (``--fd``) is a SOCK_SEQPACKET socket: one message per datagram,
    and a ``fork`` request carries the replica's own stream socket as an SCM_RIGHTS fd.
    The zygote never initialises CUDA and runs torch on one thread (``OMP_NUM_THREADS=1``
    from the host), so forking it is safe; the replicas set their thread count after the
    fork. If the factory itself initialises CUDA, the hello says ``forkable: false`` and
    the host starts a fresh worker per replica instead.
    """
    import signal
    import socket

    os.dup2(2, 1)
    sys.stdout = sys.stderr
    ctl = socket.socket(fileno=args.fd)
    try:
        served = Served(args.name, args.entry, args.path, "cpu", shared=True)
    except Exception as exc:
        ctl.send(wire.pack({"ok": False, "kind": "error", "error": _load_error(args, exc)}))
        return 1
    forkable = not served.torch.cuda.is_initialized()
    ctl.send(wire.pack({"ok": True, "forkable": forkable, **served.info()}))
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # replicas are reaped by the kernel
    while True:
        data, fds, _, _ = socket.recv_fds(ctl, 1 << 16, 8)  # host + up to 7 peers
        if not data:
            return 0
        msg = wire.unpack(data)
        if msg.get("op") != "fork" or not fds:
            for fd in fds:
                os.close(fd)
            ctl.send(wire.pack({"ok": False, "kind": "error", "error": "expected fork + fd"}))
            continue
        pid = os.fork()
        if pid == 0:
            ctl.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            rank, ranks = int(msg.get("rank") or 0), int(msg.get("ranks") or 1)
            os._exit(_replica(served, fds, int(msg.get("threads") or 1), rank, ranks))
        for fd in fds:
            os.close(fd)
        ctl.send(wire.pack({"ok": True, "pid": pid}))


def _replica(served: Served, fds: list[int], threads: int, rank: int, ranks: int) -> int:
    """A forked replica (or worker ``rank`` of one on ``ranks`` GPUs): serve the host over
    its own socket, ``fds[0]`` (shares the zygote's backup); ``fds[1:]`` its peers."""
    import socket

    try:
        served.torch.set_num_threads(threads)
        sock = socket.socket(fileno=fds[0])
        inp, out = sock.makefile("rb"), sock.makefile("wb")
        peers = [socket.socket(fileno=fd) for fd in fds[1:]]
        return _run_rank(served, rank, ranks, inp, out, peers)
    except BaseException:
        traceback.print_exc()
        return 1


def _answer(served: Served, msg: dict[str, Any]) -> dict[str, Any]:
    op = msg.get("op")
    try:
        if op == "call":
            if not served.weights.resident:
                return {"ok": False, "kind": "error", "error": "not resident: restore first"}
            ok, value, seconds = served.call(msg.get("payload"))
            if ok:
                return {"ok": True, "result": value, "exec_s": seconds}
            return {"ok": False, "kind": "failed", "error": value, "exec_s": seconds}
        if op == "call_batch":
            if not served.weights.resident:
                return {"ok": False, "kind": "error", "error": "not resident: restore first"}
            answers, seconds = served.call_batch(msg.get("payloads"))
            results = [
                {"ok": True, "result": value} if ok else {"ok": False, "error": value}
                for ok, value in answers
            ]
            return {"ok": True, "results": results, "exec_s": seconds}
        if op == "restore":
            return {"ok": True, **served.restore(msg.get("device"))}
        if op == "evict":
            return {"ok": True, **served.evict()}
        if op == "info":
            return {"ok": True, **served.info()}
        return {"ok": False, "kind": "error", "error": f"unknown op {op!r}"}
    except Exception as exc:  # an OOM on restore, a torch error: the host reports infra
        return {"ok": False, "kind": "error", "error": _describe(served.name, exc)}


def _describe(name: str, exc: BaseException) -> str:
    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return f"service {name!r}: {last}"


# --------------------------------------------------------------------------- http mode


def serve_http(args: argparse.Namespace) -> int:
    import torch

    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    served = Served(args.name, args.entry, args.path, device)
    served.restore()  # a model server starts awake, as vLLM does

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            route = urlsplit(self.path).path
            if route == "/health":
                self._reply(200, {})
            elif route == "/is_sleeping":
                self._reply(200, {"is_sleeping": not served.weights.resident})
            else:
                self._reply(404, {"error": f"no route {route}"})

        def do_POST(self) -> None:
            parts = urlsplit(self.path)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if parts.path in ("/sleep", "/release_memory_occupation"):
                level = parse_qs(parts.query).get("level", ["1"])[0]
                if level != "1":
                    self._reply(400, {"error": f"sleep level {level} not supported (only 1)"})
                else:
                    self._reply(200, served.evict())
            elif parts.path in ("/wake_up", "/resume_memory_occupation"):
                self._reply(200, served.restore())
            elif not served.weights.resident:
                self._reply(503, {"error": "the model is sleeping"})
            else:
                try:
                    payload = json.loads(body or b"{}")
                except ValueError as exc:
                    self._reply(400, {"error": f"body is not JSON: {exc}"})
                    return
                ok, value, _ = served.call(payload)
                self._reply(200, value) if ok else self._reply(400, {"error": value})

        def _reply(self, status: int, data: Any) -> None:
            body = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per request would drown the node's log

    server = HTTPServer(("127.0.0.1", args.http_port), Handler)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tangramd.services.worker")
    parser.add_argument("--name", required=True)
    parser.add_argument("--entry", required=True)
    parser.add_argument("--path")
    parser.add_argument("--device", default=None)
    parser.add_argument("--http-port", type=int)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="http mode: ignored")
    parser.add_argument("--fd", type=int, help="fork-server mode: the control socket")
    parser.add_argument("--rank", type=int, default=0, help="pipe mode: this worker's rank")
    parser.add_argument("--ranks", type=int, default=1, help="pipe mode: workers of the replica")
    parser.add_argument("--peer-fds", default="", help="pipe mode: sockets to the other workers")
    args = parser.parse_args(argv)
    if args.http_port is not None:
        return serve_http(args)
    if args.fd is not None:
        return serve_zygote(args)
    args.device = args.device or "cpu"
    return serve_pipe(args)


if __name__ == "__main__":
    sys.exit(main())

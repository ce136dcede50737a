"""What runs inside Ray for ``tangramctl ray``: the coordinator actor and the node actors.

Plain classes that ``tangramctl.ray`` turns into detached, named Ray actors; this module
imports Ray only inside the methods that talk to it, so the rest of the package never
needs it. Each actor supervises one ``tangramd`` subprocess (``tangramd coordinator`` or
``tangramd node``), unchanged from a systemd deployment: the same flags, config file,
state dir and Unix socket.

- :class:`Coordinator` runs ``tangramd coordinator`` on the Ray head node, listening on
  that node's Ray address, and supervises the cluster: every ``poll_s`` it lists the Ray
  nodes, starts a :class:`Node` actor on each one that has none (pinned there with
  hard node affinity) and tells the coordinator (op ``node.lost``) about every tangram
  node whose Ray node Ray reports dead, so that node's actions end at once instead of
  after the heartbeat timeout. The check is level-triggered: it compares Ray's view with
  the coordinator's each time, so a restarted actor catches up on what it missed.
- :class:`Node` runs ``tangramd node`` with the join command of ``cluster.join`` and
  serves the host's standard socket (``default_socket_path()`` evaluated on that host:
  ``$TANGRAM_SOCKET`` there, else the system path), so ``Client()`` in a Ray worker on
  that host needs no argument.

Death: each ``tangramd`` runs in its own session and gets SIGTERM when its actor's process
dies (``PR_SET_PDEATHSIG``), so a killed actor never leaves a daemon behind and the daemon
still stops cleanly (ends its commands, removes its socket, says goodbye). A daemon that
dies after running a while takes its actor down with it, and Ray restarts the actor
(``max_restarts``), which starts a fresh daemon with the same state dir.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tangram.client import Client
from tangram.protocol.paths import default_socket_path

NAMESPACE = "tangram"  # Ray namespace of every actor `tangramctl ray` starts
COORDINATOR = "tangram-coordinator"
NODE_PREFIX = "tangram-node-"  # + the Ray node id
READY_TIMEOUT_S = 60.0  # for a tangramd subprocess to answer on its socket
STOP_TIMEOUT_S = 30.0  # for a tangramd subprocess to stop on SIGTERM
RESTART_AFTER_S = 10.0  # a daemon that dies later than this is restarted, earlier: failed
LOG_TAIL = 2000  # characters of a daemon's log in an error or a status row
INFO_WAIT_S = 1.0  # for the node actors' answers in a status (a starting one answers later)


def node_name(ray_node_id: str) -> str:
    """The tangram node name of the daemon on a Ray node: stable across restarts."""
    return f"ray-{ray_node_id[:12]}"


def host_cores() -> list[int]:
    """The cores a process may use on the host this runs on (a Ray task on each node runs
    it before ``ray up`` starts anything, to check ``--cpus-per-node`` there)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def gist(text: str) -> str:
    """One line for a failure's text: its first line, and its last one when the rest is a
    log tail or a traceback (which ends with what went wrong)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else ""
    return f"{lines[0].rstrip(':')}: {lines[-1]}"


def default_state_root() -> str:
    """Where the daemons keep their state on each host unless told otherwise."""
    return os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tangram-ray-{os.getuid()}")


def _die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child get SIGTERM when this process dies (Linux).

    The kernel ties PDEATHSIG to the thread that forks; actors fork on their main thread,
    which lives as long as the process.
    """
    parent = os.getpid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):  # not Linux: the actors still stop their daemons
        return lambda: None
    PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died between fork and prctl
            os._exit(1)

    return preexec


class Daemon:
    """One ``tangramd`` subprocess of an actor, its log file and how it ended."""

    def __init__(
        self, args: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.args = list(args)
        self.log_path = log_path
        self.stopping = False
        self.started = time.monotonic()
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tangramd.main", *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                # Its own session: Ray SIGKILLs a dead worker's process group, which would
                # leave the daemon's own children (running commands) behind; PDEATHSIG's
                # SIGTERM instead lets it end them, remove its socket and say goodbye.
                start_new_session=True,
                preexec_fn=_die_with_parent(),
            )

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-LOG_TAIL:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait; SIGKILL if it does not stop in time. Its exit status."""
        self.stopping = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def watch(self, on_crash: Callable[[int], None]) -> None:
        """Call ``on_crash(status)`` (in a thread) if the daemon exits without ``stop``."""

        def wait() -> None:
            status = self.proc.wait()
            if not self.stopping:
                on_crash(status)

        threading.Thread(target=wait, name="tangramd-watch", daemon=True).start()


def _crash_handler(daemon: Daemon, what: str, failed: list[str]) -> Callable[[int], None]:
    """A daemon that ran a while and died takes the actor down (Ray restarts it); one that
    died at start-up (bad config, socket in use, join refused) is a failure to report."""

    def on_crash(status: int) -> None:
        ran = time.monotonic() - daemon.started
        if ran >= RESTART_AFTER_S:
            print(f"{what} exited ({status}) after {ran:.0f} s; restarting", file=sys.stderr)
            os._exit(1)
        failed.append(f"{what} exited ({status}) at start-up:\n{daemon.log_tail()}")

    return on_crash


def _write_config(state: Path, text: str) -> Path:
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = state / "tangram.toml"
    path.write_text(text)
    return path


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):  # the shared root, once its last daemon is gone
        path.parent.rmdir()


def _unlink_socket(path: str) -> None:
    """After our daemon is dead: its socket, if it could not remove it itself. One that
    somebody still listens on is not ours (our daemon failed because it was taken)."""
    if not Path(path).is_socket():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(OSError):
            os.unlink(path)
    except OSError:
        pass  # busy or unreadable: leave it
    finally:
        probe.close()


class Node:
    """The actor on one Ray node: ``tangramd node`` joined to the coordinator."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import ray

        self.ray_node_id = ray.get_runtime_context().get_node_id()
        self.name = node_name(self.ray_node_id)
        self.host = ray.util.get_node_ip_address()
        self.socket = default_socket_path()  # what Client() finds on this host
        self.state = Path(spec.get("state_root") or default_state_root()) / self.name
        config = _write_config(self.state, spec.get("config_text", ""))
        join = spec["join"]
        args = ["node", "--coordinator", join["coordinator"], "--name", self.name]
        args += ["--socket", self.socket, "--state-dir", str(self.state / "state")]
        args += ["--config", str(config)]
        # the token in the environment, never in argv (which `ps` shows every local user)
        env = {"TANGRAM_JOIN_TOKEN": join["token"]} if join.get("token") else {}
        if join.get("ca_sha256"):
            args += ["--ca-sha256", join["ca_sha256"]]
        if spec.get("cpus") is not None:
            args += ["--cpus", spec["cpus"]]
        self.failed: list[str] = []
        self.daemon = Daemon(args, self.state / "tangramd.log", env)
        self.daemon.watch(_crash_handler(self.daemon, f"tangramd node {self.name}", self.failed))

    def info(self) -> dict[str, Any]:
        """Where this node is and how its daemon is."""
        return {
            "name": self.name,
            "ray_node_id": self.ray_node_id,
            "host": self.host,
            "socket": self.socket,
            "pid": self.daemon.proc.pid,
            "alive": self.daemon.alive,
            "failed": self.failed[-1] if self.failed else None,
            # the row names the node: the reason need not
            "reason": gist(self.failed[-1]).removeprefix(f"tangramd node {self.name} ")
            if self.failed
            else None,
        }

    def stop(self) -> dict[str, Any]:
        """Stop the daemon (it ends its actions and says goodbye), remove its state and
        socket. The actor is killed next."""
        status = self.daemon.stop()
        _unlink_socket(self.socket)
        _remove_tree(self.state)
        return {"name": self.name, "exit_status": status}


class Coordinator:
    """The actor on the head node: ``tangramd coordinator`` and the supervisor."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import ray

        self.spec = spec
        self.ray_node_id = ray.get_runtime_context().get_node_id()
        self.host = ray.util.get_node_ip_address()
        self.state = Path(spec.get("state_root") or default_state_root()) / "coordinator"
        config = _write_config(self.state, spec.get("config_text", ""))
        self.socket = str(self.state / "coordinator.sock")
        port_file = self.state / "port"  # the same port after an actor restart: nodes redial
        port = port_file.read_text().strip() if port_file.exists() else "0"
        args = ["coordinator", "--listen", f"{self.host}:{port}", "--socket", self.socket]
        args += ["--state-dir", str(self.state / "state"), "--config", str(config)]
        self.failed: list[str] = []
        self._stop = threading.Event()
        self.daemon = Daemon(args, self.state / "tangramd.log")
        self.join = self._wait_ready()
        port_file.write_text(self.join["coordinator"].rpartition(":")[2])
        self.daemon.watch(_crash_handler(self.daemon, "tangramd coordinator", self.failed))
        self._lock = threading.Lock()
        self._nodes: dict[str, Any] = {}  # Ray node id -> Node actor handle
        self._info: dict[str, dict[str, Any]] = {}  # Ray node id -> its last info()
        self._lost: dict[str, str] = {}  # tangram node name -> why we declared it lost
        self._dead: dict[str, str] = {}  # Ray node id -> why its node actor died for good
        self._errors: list[str] = []
        self._supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
        self._supervisor.start()

    def _wait_ready(self) -> dict[str, Any]:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if not self.daemon.alive:
                raise RuntimeError(f"tangramd coordinator exited:\n{self.daemon.log_tail()}")
            try:
                with Client(self.socket, connect_timeout_s=1.0) as c:
                    return c.cluster_join()
            except Exception as exc:
                if time.monotonic() > deadline:
                    tail = self.daemon.log_tail()
                    self.daemon.stop()
                    raise RuntimeError(f"coordinator not ready: {exc}\n{tail}") from None
            self._stop.wait(0.1)  # poll again: the daemon has no way to tell us

    # ---------------------------------------------------------------- supervision
    def _supervise(self) -> None:
        poll_s = float(self.spec.get("poll_s", 0.5))
        while True:
            try:
                self.reconcile()
            except Exception as exc:  # keep supervising; status shows the last errors
                self._errors = [*self._errors[-4:], f"{type(exc).__name__}: {exc}"]
            if self._stop.wait(poll_s):
                return

    def reconcile(self) -> None:
        """One pass: a node actor on every live Ray node, ``node.lost`` for dead ones."""
        import ray

        rows = ray.nodes()
        alive = {n["NodeID"]: n for n in rows if n.get("Alive")}
        dead = {n["NodeID"] for n in rows if not n.get("Alive")} - alive.keys()
        with self._lock:
            if self._stop.is_set():
                return
            for node_id in alive.keys() - self._nodes.keys():
                self._nodes[node_id] = self._start_node(node_id)
            for node_id in self._nodes.keys() - alive.keys():
                handle = self._nodes.pop(node_id)
                self._info.pop(node_id, None)
                with contextlib.suppress(Exception):  # its node is gone: nothing to stop
                    ray.kill(handle, no_restart=True)
        dead_names = {node_name(node_id): node_id for node_id in dead}
        with Client(self.socket, connect_timeout_s=2.0) as c:
            for row in c.nodes():
                node_id = dead_names.get(row["name"])
                if node_id is not None and row["state"] != "lost":
                    why = f"Ray reports its node {node_id[:12]} dead"
                    c.node_lost(row["name"], why)
                    self._lost[row["name"]] = why

    def _start_node(self, node_id: str) -> Any:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        spec = {k: self.spec.get(k) for k in ("config_text", "cpus", "state_root")}
        spec["join"] = self.join
        options: dict[str, Any] = {
            "name": NODE_PREFIX + node_id,
            "namespace": NAMESPACE,
            "lifetime": "detached",
            "get_if_exists": True,
            "max_restarts": -1,
            "num_cpus": 0,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
        }
        if self.spec.get("runtime_env"):
            options["runtime_env"] = self.spec["runtime_env"]
        return ray.remote(Node).options(**options).remote(spec)

    # ---------------------------------------------------------------- views
    def status(self) -> dict[str, Any]:
        """The coordinator, and per Ray node its tangram node's socket and state."""
        import ray

        with self._lock:
            nodes = dict(self._nodes)
        asked = {node_id: handle.info.remote() for node_id, handle in nodes.items()}
        if asked:  # fresh answers (a restarted actor has a new daemon); the last ones else
            ray.wait(list(asked.values()), num_returns=len(asked), timeout=INFO_WAIT_S)
        for node_id, ref in asked.items():
            if not ray.wait([ref], timeout=0)[0]:
                continue  # starting, or busy: its last answer
            try:
                self._info[node_id] = ray.get(ref)
                self._dead.pop(node_id, None)
            except ray.exceptions.ActorDiedError as exc:  # for good: its constructor failed,
                self._dead[node_id] = gist(str(exc))  # or killed; Ray will not restart it
            except Exception:  # it died just now and Ray restarts it: its last answer
                pass
        try:
            with Client(self.socket, connect_timeout_s=2.0) as c:
                rows = {row["name"]: row for row in c.nodes()}
        except Exception as exc:
            rows = {}
            self._errors = [*self._errors[-4:], f"nodes: {exc}"]
        out = []
        for node_id in sorted(nodes):
            answer = self._info.get(node_id) or {}
            name = node_name(node_id)
            row = rows.get(name) or {}
            # A daemon that exited at start-up never joins: "failed", not "starting"; an
            # actor that died for good has no daemon: "dead". Each says why.
            state, reason = row.get("state", "starting"), None
            if node_id in self._dead:
                state, reason = "dead", f"its actor died: {self._dead[node_id]}"
            elif answer.get("failed"):
                state, reason = "failed", answer.get("reason") or gist(answer["failed"])
            out.append(
                {
                    "name": name,
                    "ray_node_id": node_id,
                    "host": answer.get("host"),
                    "socket": answer.get("socket"),
                    "state": state,
                    "reason": reason,
                    "cores": row.get("cores"),
                    "running": row.get("running"),
                    "pid": answer.get("pid"),
                    "failed": answer.get("failed"),
                }
            )
        # Nodes without a live Ray node: lost with their host (by our word, or they said
        # goodbye first), or joined from outside Ray (a systemd host): all in the cluster.
        listed = {row["name"] for row in out}
        for name, row in sorted(rows.items()):
            if name not in listed:
                why = self._lost.get(name)
                out.append(
                    {"name": name, "state": row["state"], "reason": why, "lost_because": why}
                )
        return {
            "coordinator": {
                "address": self.join["coordinator"],
                "ca_sha256": self.join["ca_sha256"],
                "host": self.host,
                "ray_node_id": self.ray_node_id,
                "socket": self.socket,
                "alive": self.daemon.alive,
                "failed": self.failed[-1] if self.failed else None,
                "reason": gist(self.failed[-1]) if self.failed else None,
            },
            "nodes": out,
            "errors": list(self._errors),
            "spec": {k: v for k, v in self.spec.items() if k != "runtime_env"},
        }

    def stop(self) -> dict[str, Any]:
        """Stop supervising, stop every node (they say goodbye), then the coordinator;
        remove their state. The caller kills the actors."""
        import ray

        self._stop.set()
        self._supervisor.join(STOP_TIMEOUT_S)
        with self._lock:
            nodes, self._nodes = dict(self._nodes), {}
        refs = {node_id: handle.stop.remote() for node_id, handle in nodes.items()}
        stopped, problems = [], []
        for node_id, ref in refs.items():
            try:
                stopped.append(ray.get(ref, timeout=STOP_TIMEOUT_S + 10))
            except Exception as exc:  # dead with its node, or hung: it is killed next
                problems.append(f"{node_name(node_id)}: {type(exc).__name__}")
            with contextlib.suppress(Exception):
                ray.kill(nodes[node_id], no_restart=True)
        status = self.daemon.stop()
        _unlink_socket(self.socket)
        _remove_tree(self.state)
        return {"nodes": stopped, "problems": problems, "coordinator_exit_status": status}

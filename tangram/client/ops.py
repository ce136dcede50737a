"""Every op of the daemon as a client method, declared once for both clients.

``Ops`` builds each request and names the parser of its result; the concrete client
supplies ``_op(op, args, parse)``: :class:`~tangram.client.Client` sends and parses at once,
:class:`~tangram.client.AsyncClient` returns a coroutine that does. So ``Client.exec`` and
``AsyncClient.exec`` take the same arguments by construction (a test holds them to it).

Outcomes of an ``exec`` (``failed``, ``timeout``, ``rejected``, ``infra_error``) are data in
:class:`ExecResult`, not exceptions: a rollout must tell a failed task from a broken cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from tangram.protocol import (
    CallResult,
    CallSpec,
    ExecResult,
    ExecSpec,
    MalformedResponse,
    parse_size,
)

T = TypeVar("T")
Cpus = int | tuple[int, int] | Sequence[int]
Size = int | str


def _drop_none(args: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in args.items() if value is not None}


def _dop_keys(table: Mapping[int | str, float] | None) -> dict[str, float] | None:
    """Profiles are keyed by dop; msgpack map keys must be str on this wire."""
    return None if table is None else {str(key): value for key, value in table.items()}


def _cpus(cpus: Cpus | None) -> int | tuple[int, int] | None:
    if cpus is None or isinstance(cpus, int):
        return cpus
    low, high = cpus  # a [min, max] pair
    return (low, high)


def _size(mem: Size | None) -> int | None:
    return None if mem is None else parse_size(mem)


def _field(key: str, kind: type[T]) -> Callable[[Any], T]:
    """A parser taking ``key`` of type ``kind`` out of a result map."""

    def parse(result: Any) -> T:
        value = result.get(key) if isinstance(result, Mapping) else None
        if not isinstance(value, kind):
            raise MalformedResponse(f"result must contain a {kind.__name__} {key!r}")
        return value

    return parse


def _as_dict(result: Any) -> dict[str, Any]:
    if not isinstance(result, Mapping):
        raise MalformedResponse(f"result must be a map, got {type(result).__name__}")
    return dict(result)


def _none(result: Any) -> None:
    return None


def _file(result: Any) -> tuple[bytes, bool]:
    data = result.get("data") if isinstance(result, Mapping) else None
    if not isinstance(data, bytes):
        raise MalformedResponse("env.get result must contain bytes 'data'")
    return data, bool(result.get("tar"))


class Ops:
    """The op methods shared by both clients (see the module doc)."""

    # the job of this client's actions (``Client(job=...)``, else ``$TANGRAM_JOB``); None:
    # the daemon's "default"
    job: str | None = None

    def _op(self, op: str, args: Mapping[str, Any], parse: Callable[[Any], T]) -> T:
        raise NotImplementedError

    def ping(self) -> dict[str, Any]:
        """``{"pong": True, "version": str}``."""
        return self._op("ping", {}, _as_dict)

    def status(self) -> dict[str, Any]:
        """Daemon summary."""
        return self._op("status", {}, _as_dict)

    def nodes(self) -> list[dict[str, Any]]:
        """Nodes with capacity and usage."""
        return self._op("nodes", {}, _field("nodes", list))

    def node_drain(self, name: str) -> dict[str, Any]:
        """Stop placing new trajectories on node ``name``; ``{"name", "draining"}``."""
        return self._op("node.drain", {"name": name}, _as_dict)

    def node_undrain(self, name: str) -> dict[str, Any]:
        """Place new trajectories on node ``name`` again; ``{"name", "draining"}``."""
        return self._op("node.undrain", {"name": name}, _as_dict)

    def node_lost(self, name: str, why: str | None = None) -> dict[str, Any]:
        """Declare node ``name`` lost now (coordinator socket only); ``{"name",
        "already_lost"}``."""
        args = {"name": name} if why is None else {"name": name, "why": why}
        return self._op("node.lost", args, _as_dict)

    def cluster_join(self, rotate: bool = False) -> dict[str, Any]:
        """``{"coordinator", "token", "ca_sha256"}`` for ``tangramd node`` (coordinator only)."""
        args = {"rotate": True} if rotate else {}
        return self._op("cluster.join", args, _as_dict)

    def queue(self) -> dict[str, Any]:
        """Waiting and running actions."""
        return self._op("queue", {}, _as_dict)

    def story(self, action_id: str) -> dict[str, Any]:
        """Every transition of one action, with its time."""
        return self._op("story", {"action_id": action_id}, _as_dict)

    def env_open(
        self,
        image: str | None = None,
        mem: Size | None = None,
        trajectory: str | None = None,
        *,
        timeout_s: float | None = None,
    ) -> str:
        """Open an environment; return its id.

        ``timeout_s`` bounds the wait for memory: past it the open fails with
        :class:`~tangram.protocol.errors.Timeout` naming the memory it needed (None: wait
        until memory is free; a client that disconnects withdraws the open)."""
        args = _drop_none(
            {"image": image, "mem": _size(mem), "trajectory": trajectory, "timeout_s": timeout_s}
        )
        return self._op("env.open", args, _field("id", str))

    def env_close(self, id: str) -> None:
        """Close an environment."""
        return self._op("env.close", {"id": id}, _none)

    def env_fork(self, id: str, n: int = 1) -> list[str]:
        """Fork an environment into ``n`` new ones that start from a copy-on-write snapshot
        of its files (processes are not copied); return their ids."""
        return self._op("env.fork", {"env": id, "n": n}, _field("ids", list))

    def env_reset(self, id: str) -> None:
        """Put an environment's files back as at its fork point (or at its opening)."""
        return self._op("env.reset", {"env": id}, _none)

    def env_list(self) -> list[dict[str, Any]]:
        """Open environments."""
        return self._op("env.list", {}, _field("envs", list))

    def exec(
        self,
        cmd: str | Sequence[str],
        *,
        env: str | None = None,
        image: str | None = None,
        cpus: Cpus | None = None,
        mem: Size | None = None,
        timeout_s: float | None = None,
        profile: str | None = None,
        elastic: bool | None = None,
        trajectory: str | None = None,
        task: str | None = None,
        t1_s: float | None = None,
        eff: Mapping[int | str, float] | None = None,
        env_vars: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        cwd: str | None = None,
        session: str | None = None,
        files: Mapping[str, bytes | str] | None = None,
        fetch: Sequence[str] | None = None,
        queue_timeout_s: float | None = None,
        ref: str | None = None,
        job: str | None = None,
        api: str | None = None,
    ) -> ExecResult:
        """Run one command as an exec action; failures of the command are in the result.

        ``stdin`` (str is sent as UTF-8) is the command's standard input; ``cwd`` a
        directory inside the environment; ``session`` an open shell session to run in.
        ``files`` (path -> content, str as UTF-8) are written into the environment before
        the command runs and ``fetch`` names files read back after it, into
        ``result.files``: with a throwaway environment, a whole sandbox run (create, put,
        run, get, remove) is this one action and one round trip.
        ``cpus`` unset: one core, or the DoP range of ``profile`` when it is elastic.

        ``timeout_s`` bounds the whole action, waiting (for cores, memory, its
        environment) plus running: the command gets what the wait left. With
        ``queue_timeout_s`` the wait has its own bound and the command all of
        ``timeout_s``. A wait past its bound ends with outcome ``timeout``, ``exec_s`` 0
        and a detail naming what it waited for (``waited 2.0 s for memory: needs 1 GiB,
        0.3 GiB free``). A client that disconnects withdraws its waiting actions (they
        never run); one already running runs to its end.

        ``ref`` names the action on this connection so that ``cancel`` can reach it before
        its id is known; :class:`~tangram.client.AsyncClient` sets one on every exec and
        sends that cancel when the awaiting coroutine is cancelled, and
        :class:`~tangram.client.Client` does on Ctrl-C (``ExecInterrupted``).

        ``job``: the job the action belongs to (fair share across jobs); unset: the
        client's ``job`` (``Client(job=...)``, else ``$TANGRAM_JOB``, else "default").

        ``api``: an API (``[[api]]`` in the config) the command calls: it holds one of its
        slots while it runs, taken together with its cores (it waits until both are free).
        """
        spec = ExecSpec(
            cmd=cmd if isinstance(cmd, str) else list(cmd), env=env, image=image,
            cpus=_cpus(cpus), mem=_size(mem), timeout_s=timeout_s, profile=profile,
            elastic=elastic, trajectory=trajectory, task=task, t1_s=t1_s, eff=_dop_keys(eff),
            env_vars=None if env_vars is None else dict(env_vars),
            stdin=stdin.encode() if isinstance(stdin, str) else stdin, cwd=cwd, session=session,
            files=None if files is None else {
                path: data.encode() if isinstance(data, str) else data
                for path, data in files.items()
            },
            fetch=None if fetch is None else list(fetch), queue_timeout_s=queue_timeout_s,
            ref=ref, job=job or self.job, api=api,
        )  # fmt: skip
        return self._op("exec", spec.to_wire(), ExecResult.from_wire)

    def put(self, env: str, path: str, data: bytes | str, *, tar: bool = False) -> int:
        """Write ``data`` (str as UTF-8) at ``path`` in the environment; with ``tar``,
        extract the tar stream ``data`` into the directory ``path``. Returns the bytes sent."""
        payload = data.encode() if isinstance(data, str) else data
        args = {"id": env, "path": path, "data": payload, "tar": tar or None}
        return self._op("env.put", _drop_none(args), _field("bytes", int))

    def get(self, env: str, path: str) -> tuple[bytes, bool]:
        """Read ``path`` from the environment: ``(bytes, False)`` for a file, ``(tar
        stream of its contents, True)`` for a directory."""
        return self._op("env.get", {"id": env, "path": path}, _file)

    def session_open(self, env: str) -> str:
        """Start a persistent shell in the environment; return the session id."""
        return self._op("session.open", {"env": env}, _field("id", str))

    def session_interrupt(self, id: str) -> bool:
        """Interrupt the session's running command; whether one was running."""
        return self._op("session.interrupt", {"id": id}, _field("interrupted", bool))

    def session_close(self, id: str) -> None:
        """End the session's shell."""
        return self._op("session.close", {"id": id}, _none)

    def acquire_lease(
        self,
        api: str,
        ttl_s: float | None = None,
        policy: str | None = None,
        deadline_s: float | None = None,
        *,
        job: str | None = None,
    ) -> str:
        """Take one unit of an API quota; return the lease id. ``job``: the job it counts
        against (fair share across jobs); unset: the client's, as for ``exec``."""
        args = _drop_none(
            {
                "api": api,
                "ttl_s": ttl_s,
                "policy": policy,
                "deadline_s": deadline_s,
                "job": job or self.job,
            }
        )
        return self._op("lease.acquire", args, _field("lease_id", str))

    def release_lease(self, lease_id: str) -> None:
        """Give a lease back, or withdraw one still waiting for its slot."""
        return self._op("lease.release", {"lease_id": lease_id}, _none)

    def lease_renew(self, lease_id: str, ttl_s: float) -> dict[str, Any]:
        """Extend a lease: it now expires ``ttl_s`` seconds from now; ``{"lease_id",
        "ttl_s", "state"}``. NotFound once it was released or expired."""
        return self._op("lease.renew", {"lease": lease_id, "ttl_s": ttl_s}, _as_dict)

    def cancel(self, action_id: str) -> dict[str, Any]:
        """Cancel an exec or call: a waiting one never runs, a running exec is killed and a
        running GPU call stopped (its replica's workers killed; a batch's rider is
        detached, its leader's pass stopped with its riders): the answer comes once it
        is gone; its outcome is ``cancelled``. Returns
        ``{"action_id", "cancelled", "state", "outcome"}``: an action that had already
        ended gives its outcome and ``cancelled`` False. NotFound for an unknown action,
        or another user's."""
        return self._op("cancel", {"id": action_id}, _as_dict)

    def cancel_job(self, job: str) -> dict[str, Any]:
        """Cancel every queued and running exec and call of ``job`` that this caller may
        see (an operator: all of them; others: their own) in one step; answered once the
        running ones among them are gone. Returns ``{"job", "actions": [{"action_id",
        "cancelled", "state", "outcome"}]}``."""
        return self._op("cancel", {"job": job, "all": True}, _as_dict)

    def api_list(self) -> list[dict[str, Any]]:
        """API endpoints with quotas."""
        return self._op("api.list", {}, _field("apis", list))

    def jobs(self) -> list[dict[str, Any]]:
        """The jobs: terms, queued/running actions, cores and GPUs held, share, ACTs."""
        return self._op("jobs", {}, _field("jobs", list))

    def profile_save(
        self,
        name: str,
        *,
        dop: Mapping[int | str, float],
        t1_s: float,
        eff: Mapping[int | str, float],
        speedup: Mapping[int | str, float],
        elastic: bool,
    ) -> None:
        """Store an elasticity profile."""
        args = {
            "name": name,
            "dop": _dop_keys(dop),
            "t1_s": t1_s,
            "eff": _dop_keys(eff),
            "speedup": _dop_keys(speedup),
            "elastic": elastic,
        }
        return self._op("profile.save", args, _none)

    def profile_get(self, name: str) -> dict[str, Any]:
        """One stored profile."""
        return self._op("profile.get", {"name": name}, _as_dict)

    def profile_list(self) -> list[dict[str, Any]]:
        """Stored profiles."""
        return self._op("profile.list", {}, _field("profiles", list))

    def service_register(
        self,
        name: str,
        *,
        mem_gb: float,
        runtime: str = "torch",
        entry: str | None = None,
        path: str | None = None,
        gpus: int | Sequence[int] = 1,
        cmd: str | None = None,
        route: str | None = None,
        api: str | None = None,
        env: Mapping[str, str] | None = None,
        eff: str | Mapping[int, float] | None = None,
        max_batch: int | None = None,
        batch_window_ms: float | None = None,
        min_resident: int | None = None,
    ) -> dict[str, Any]:
        """Register a GPU model service; returns its ``service list`` entry once loaded.

        torch: ``entry="module:factory"`` (``path`` an absolute directory on the daemon's
        host added to the import path); http: ``cmd`` with ``{port}``. ``eff``: speed-up
        per GPU count (``"1:1,2:1.8"``); ``max_batch``/``batch_window_ms``: concurrent
        calls merged into one forward pass; ``min_resident``: replicas kept on GPUs when
        there is room.
        """
        args = _drop_none(
            {
                "name": name,
                "runtime": runtime,
                "mem_gb": mem_gb,
                "gpus": gpus if isinstance(gpus, int) else list(gpus),
                "entry": entry,
                "path": path,
                "cmd": cmd,
                "route": route,
                "api": api,
                "env": None if env is None else dict(env),
                "eff": eff if eff is None or isinstance(eff, str) else dict(eff),
                "max_batch": max_batch,
                "batch_window_ms": batch_window_ms,
                "min_resident": min_resident,
            }
        )
        return self._op("service.register", args, _as_dict)

    def service_list(self) -> list[dict[str, Any]]:
        """Registered services with their replicas, calls and restores."""
        return self._op("service.list", {}, _field("services", list))

    def service_set_eff(self, name: str, eff: str | Mapping[int, float]) -> dict[str, Any]:
        """Give a registered service a new speed-up table per GPU count (``"1:1,2:1.8"``
        or ``{1: 1.0, 2: 1.8}``); returns its ``service list`` entry."""
        table = eff if isinstance(eff, str) else {str(k): float(v) for k, v in eff.items()}
        return self._op("service.set_eff", {"name": name, "eff": table}, _as_dict)

    def service_remove(self, name: str) -> dict[str, Any]:
        """Remove a service (its queued calls end ``rejected``)."""
        return self._op("service.remove", {"name": name}, _as_dict)

    def call(
        self,
        name: str,
        payload: Mapping[str, Any],
        *,
        timeout: float | None = None,
        timeout_s: float | None = None,
        job: str | None = None,
        gpus: int | None = None,
        ref: str | None = None,
    ) -> CallResult:
        """Call a service as one GPU action; failures of the call are in the result.

        ``timeout`` (seconds; ``timeout_s`` is the same, named as for ``exec``) bounds the
        handler; None: the daemon's ``[gpu] call_timeout_s``. ``job``: the job it counts
        against (fair share across jobs); unset: the client's, as for ``exec``. ``gpus``:
        run at exactly that many GPUs (one of the service's counts); unset: the scheduler
        picks the count by the service's speed-up table (``eff``), its smallest without.

        ``ref`` names the call on this connection, as for ``exec``: ``cancel`` by it
        reaches a call still waiting for its answer. :class:`~tangram.client.Client` sets one
        on every call and, on Ctrl-C, cancels it (a queued call never runs, a running one's
        forward pass is stopped) and raises ``CallInterrupted``;
        :class:`~tangram.client.AsyncClient` does so when the awaiting coroutine is
        cancelled."""
        if timeout is not None and timeout_s is not None and timeout != timeout_s:
            raise ValueError("give timeout or timeout_s, not two different values")
        limit = timeout if timeout is not None else timeout_s
        spec = CallSpec(name, dict(payload), limit, job or self.job, gpus, ref)
        return self._op("call", spec.to_wire(), CallResult.from_wire)


@dataclass(frozen=True, slots=True)
class Env:
    """An open environment: ``exec`` runs in it (awaitable with an ``AsyncClient``)."""

    client: Ops
    id: str

    def exec(self, cmd: str | Sequence[str], **kw: Any) -> ExecResult:
        """``client.exec(cmd, env=self.id, **kw)``."""
        return self.client.exec(cmd, env=self.id, **kw)

    def close(self) -> None:
        """Close the environment."""
        return self.client.env_close(self.id)

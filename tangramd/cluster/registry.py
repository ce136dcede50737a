"""The coordinator's registry of nodes: who may join, who is joined, how each link is.

Secrets: the join token (``cluster join`` prints it; ``--rotate`` replaces it) and one
credential per joined node, issued at its first join and kept by the node in its state dir
for reconnects, so rotating the token never drops a joined node. The registry keeps only a
SHA-256 of each credential. Both live in the coordinator's store
(:mod:`tangramd.cluster.store`), written before the node is told, with each node's last
known capacity: a restarted coordinator still knows its nodes.

The registry does not touch the core: the coordinator turns its answers into events
(``NodeJoined``, ``NodeLost``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tangramd.cluster.link import Link
from tangramd.cluster.store import Store
from tangramd.diskfull import is_disk_full

NODE_STATES = ("ready", "draining", "lost")


@dataclass
class NodeRecord:
    """One node as the coordinator sees it."""

    name: str
    cores_by_numa: tuple[tuple[int, ...], ...] = ()
    mem_bytes: int = 0
    link: Link | None = None
    last_seen: float = 0.0  # monotonic time of the last message on its link
    lost: bool = True  # until it joins; again when it misses heartbeats
    backend: str = ""
    gpus: tuple[dict[str, Any], ...] = ()  # as the node reported them (NVML or simulated)
    restored: bool = False  # known from the store, not yet back since a restart
    remote_conns: dict[int, Any] = field(default_factory=dict)  # node conn id -> ConnInfo
    input_addr: str | None = None  # its input port, host:port (hello's input_addr)
    input_pin: str | None = None  # its certificate's pin (None: plain TCP, --insecure)

    @property
    def cores(self) -> int:
        return sum(len(numa) for numa in self.cores_by_numa)


class Refused(Exception):
    """A join that the coordinator turns down; the message goes to both sides' logs.

    ``retry``: the node may try again later (the refusal is not about its secrets).
    """

    def __init__(self, reason: str, *, retry: bool = False) -> None:
        super().__init__(reason)
        self.retry = retry


class NodeRegistry:
    """Nodes, the join token and node credentials (see the module doc)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.nodes: dict[str, NodeRecord] = {}
        self._credentials: dict[str, str] = {}  # name -> sha256 hex of its credential
        # told what a full disk kept out of the store when that is not worth a refusal
        self.unsaved: Callable[[str, BaseException], object] = lambda what, exc: None
        for known in store.nodes():
            self.nodes[known.name] = NodeRecord(
                known.name, cores_by_numa=known.cores_by_numa, mem_bytes=known.mem_bytes
            )
            if known.credential_sha256:
                self._credentials[known.name] = known.credential_sha256
        self.token = store.get_meta("join_token") or ""
        if not self.token:
            self.token = _new_token()
            store.set_meta("join_token", self.token)

    # ------------------------------------------------------------------ secrets
    def rotate(self) -> str:
        """A new join token; the old one stops working, joined nodes keep their credentials."""
        token = _new_token()
        self.store.set_meta("join_token", token)  # (a full disk: the old one stays)
        self.token = token
        return self.token

    def authenticate(self, name: str, token: str | None, credential: str | None) -> str | None:
        """Check a hello; returns a new credential after a token join, None after a
        credential reconnect; raises Refused with the reason."""
        if credential is not None:
            known = self._credentials.get(name)
            if known is not None and hmac.compare_digest(known, _digest(credential)):
                return None
            if token is None:
                raise Refused(f"unknown credential for node {name!r} (join again with a token)")
        if token is None:
            raise Refused("no join token or credential")
        if not hmac.compare_digest(token.encode(), self.token.encode()):
            raise Refused("wrong join token (see `tangramctl cluster join`)")
        if name in self._credentials:  # a name once joined belongs to its credential
            raise Refused(
                f"node name {name!r} was joined before and belongs to its credential: rejoin "
                f"with it (the node's state dir), or an operator runs "
                f"`tangramctl node forget {name}` first"
            )
        issued = secrets.token_urlsafe(32)
        self.store.set_credential(name, _digest(issued))  # kept before it is handed out
        self._credentials[name] = _digest(issued)
        return issued

    def forget(self, name: str) -> bool:
        """``node.forget``: drop a name's credential, so that a token may join it afresh
        (the host was reinstalled); whether it had one."""
        known = name in self._credentials
        if known:
            self.store.set_credential(name, None)
            del self._credentials[name]
        return known

    # ------------------------------------------------------------------ links
    def attach(
        self,
        name: str,
        link: Link,
        cores_by_numa: tuple[tuple[int, ...], ...],
        mem_bytes: int,
        now: float,
    ) -> tuple[NodeRecord, bool]:
        """The node's link is up; returns its record and whether it was lost (or new)."""
        rec = self.nodes.get(name)
        if rec is None:
            rec = self.nodes[name] = NodeRecord(name)
        old, rec.link = rec.link, link
        if old is not None and old is not link:
            old.close()
        was_lost = rec.lost
        if was_lost:
            rec.cores_by_numa, rec.mem_bytes = cores_by_numa, mem_bytes
            try:  # only what a restarted coordinator shows until the node is back
                self.store.set_capacity(name, cores_by_numa, mem_bytes)
            except Exception as exc:
                if not is_disk_full(exc):
                    raise
                self.unsaved(f"node {name}'s capacity", exc)
        rec.lost = False
        rec.last_seen = now
        return rec, was_lost

    def detach(self, name: str, link: Link) -> NodeRecord | None:
        """The link closed; the node is lost only when the timeout passes (watchdog)."""
        rec = self.nodes.get(name)
        if rec is None or rec.link is not link:
            return None
        rec.link = None
        return rec

    def link_of(self, name: str) -> Link | None:
        rec = self.nodes.get(name)
        if rec is None or rec.lost or rec.link is None or rec.link.closed:
            return None
        return rec.link

    def overdue(self, now: float, timeout_s: float) -> list[NodeRecord]:
        """Live nodes whose last message is older than ``timeout_s``."""
        return [r for r in self.nodes.values() if not r.lost and now - r.last_seen > timeout_s]


def _new_token() -> str:
    return secrets.token_urlsafe(24)


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()

"""What kvstore keeps in etcd, and how nodes and clients find the leading master.

Keys under one prefix (``--etcd-prefix``, default ``/kvstore/default``)::

    <prefix>/leader           {"control": "h:p", "admin": "http://h:p"}   under the leader's lease
    <prefix>/nodes/<node_id>  {"data": "h:p"}                              under the node's lease

The leader's **epoch** is the create revision of its leader key: etcd makes it unique and
increasing, so a higher epoch always names a later leader. Anything else under the prefix, or a
value we cannot decode, is someone else's: it is logged and ignored, never trusted.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.address import Address
from kvstore.errors import EtcdUnavailableError, InvalidRequestError, MasterUnavailableError
from kvstore.etcd import EtcdStore, EtcdThread, KeyValue

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "/kvstore/default"


@dataclass(frozen=True, slots=True)
class EtcdLayout:
    """Where our keys live under ``prefix``."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not self.prefix.startswith("/") or self.prefix.endswith("/") or len(self.prefix) > 200:
            raise InvalidRequestError(
                f"etcd prefix must start with '/', not end with one, got {self.prefix!r}"
            )

    @property
    def leader_key(self) -> bytes:
        return f"{self.prefix}/leader".encode()

    @property
    def nodes_prefix(self) -> bytes:
        return f"{self.prefix}/nodes/".encode()

    def node_key(self, node_id: str) -> bytes:
        return self.nodes_prefix + node_id.encode()


@dataclass(frozen=True, slots=True)
class LeaderRecord:
    """The leading master: where to reach it and its epoch."""

    control: Address
    admin: str
    epoch: int

    @staticmethod
    def encode(control: str, admin: str) -> bytes:
        return json.dumps({"control": control, "admin": admin}).encode()

    @staticmethod
    def from_kv(kv: KeyValue) -> LeaderRecord:
        """Decode a leader key.

        Raises:
            InvalidRequestError: not a record a kvstore master wrote (no lease, bad value).
        """
        if kv.lease == 0:
            raise InvalidRequestError("leader key without a lease: not written by a kvstore master")
        try:
            obj = json.loads(kv.value)
            control = Address.parse(obj["control"])
            admin = str(obj.get("admin", ""))
        except (ValueError, KeyError, TypeError, InvalidRequestError):
            raise InvalidRequestError(
                f"undecodable leader record {kv.value[:80]!r}: not written by a kvstore master"
            ) from None
        return LeaderRecord(control, admin, kv.create_revision)


@dataclass(frozen=True, slots=True)
class NodeRecord:
    node_id: str
    data: str

    @staticmethod
    def encode(data: str) -> bytes:
        return json.dumps({"data": data}).encode()

    @staticmethod
    def from_kv(layout: EtcdLayout, kv: KeyValue) -> NodeRecord:
        """Raises InvalidRequestError for a key or value that is not a node record of ours."""
        node_id = kv.key[len(layout.nodes_prefix) :].decode("utf-8", "replace")
        try:
            obj = json.loads(kv.value)
            data = str(obj["data"])
        except (ValueError, KeyError, TypeError):
            raise InvalidRequestError(
                f"undecodable node record under {kv.key[:120]!r}: ignored"
            ) from None
        if not node_id or "/" in node_id or kv.lease == 0:
            raise InvalidRequestError(f"node record {kv.key[:120]!r} is not ours: ignored")
        return NodeRecord(node_id, data)


async def read_leader(store: EtcdStore, layout: EtcdLayout) -> LeaderRecord | None:
    """The current leader, or None. A foreign value under the leader key is logged and ignored.

    Raises:
        EtcdUnavailableError: etcd did not answer.
    """
    kv = await store.get(layout.leader_key)
    if kv is None:
        return None
    try:
        return LeaderRecord.from_kv(kv)
    except InvalidRequestError as err:
        log.warning("ignoring %s: %s", layout.leader_key.decode(), err.message)
        return None


async def read_members(store: EtcdStore, layout: EtcdLayout) -> dict[str, NodeRecord]:
    """Live node records by node id; foreign keys under ``nodes/`` are logged and skipped."""
    members: dict[str, NodeRecord] = {}
    for kv in await store.get_prefix(layout.nodes_prefix):
        try:
            rec = NodeRecord.from_kv(layout, kv)
        except InvalidRequestError as err:
            log.warning("%s", err.message)
            continue
        members[rec.node_id] = rec
    return members


class LeaderResolver:
    """Finds the leading master for threaded callers (the node agent, the client SDK).

    Args:
        endpoints: etcd addresses.
        layout: our keys in etcd.
    """

    def __init__(self, endpoints: Sequence[Address], layout: EtcdLayout | None = None) -> None:
        self.endpoints = list(endpoints)
        self.layout = layout or EtcdLayout()
        self.etcd = EtcdThread(self.endpoints)

    def resolve(self, timeout: float, interval: float = 0.05) -> LeaderRecord:
        """Poll etcd until a leader is published (bounded).

        Raises:
            MasterUnavailableError: no leader within ``timeout`` (etcd down, or no master).
        """
        deadline = time.monotonic() + timeout
        why = "no master has been elected"
        while True:
            try:
                rec = self.etcd.run(lambda s: read_leader(s, self.layout))
                if rec is not None:
                    return rec
                why = "no master has been elected"
            except EtcdUnavailableError as err:
                why = err.message
            if time.monotonic() >= deadline:
                names = ",".join(str(e) for e in self.endpoints)
                raise MasterUnavailableError(f"no leading master via etcd {names}: {why}")
            time.sleep(interval)

    def close(self) -> None:
        self.etcd.close()

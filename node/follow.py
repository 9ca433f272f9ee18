"""A storage node in an HA cluster: membership under an etcd lease, and following the leader.

``kvstore node --master etcd://HOST:PORT[,HOST:PORT]``: the node keeps
``<prefix>/nodes/<node_id>`` alive under a lease of its own (a crashed node disappears within
the TTL), finds the leading master through etcd, and follows it across failovers: on a lost
connection, ``NOT_LEADER`` or ``STALE_EPOCH`` it looks the leader up again and registers with
its manifest (``agent.py``).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

from kvstore.address import Address
from kvstore.errors import EtcdUnavailableError, InvalidRequestError
from kvstore.etcd import EtcdThread, parse_endpoints
from kvstore.etcd_keys import EtcdLayout, LeaderResolver, NodeRecord
from kvstore.node.daemon import NodeDaemonConfig, StorageNode, run_until_stopped

log = logging.getLogger(__name__)

#: How long one leader lookup may poll before the agent's loop retries.
RESOLVE_TIMEOUT_S = 1.0


class EtcdMembership:
    """Keeps this node's membership key alive under a lease, in a background thread.

    Args:
        etcd: the etcd connection, its own: a call failing on a connection shared with the
            leader lookups cancels the others' calls in flight (their thread ended on it).
        layout: our keys.
        node_id: this node.
        data: the node's data address (``host:port``).
        ttl_s: lease TTL in seconds.
    """

    def __init__(
        self, etcd: EtcdThread, layout: EtcdLayout, node_id: str, data: str, ttl_s: int
    ) -> None:
        if ttl_s < 1:
            raise InvalidRequestError("--etcd-ttl must be at least 1 second")
        self.etcd = etcd
        self.key = layout.node_key(node_id)
        self.value = NodeRecord.encode(data)
        self.ttl_s = ttl_s
        self.lease_id = 0
        self.joined = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-membership", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _join(self) -> None:
        lease = self.etcd.run(lambda s: s.grant_lease(self.ttl_s))
        self.etcd.run(lambda s: s.put(self.key, self.value, lease.lease_id))
        self.lease_id = lease.lease_id
        self.ttl_s = lease.ttl
        self.joined.set()
        log.info("joined etcd membership as %s (lease TTL %ds)", self.key.decode(), lease.ttl)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.lease_id:
                    self._join()
                if self.etcd.run(lambda s, lease_id=self.lease_id: s.keep_alive(lease_id)) <= 0:
                    log.warning("membership lease expired; joining again")
                    self.lease_id = 0
                    continue
            except EtcdUnavailableError as err:
                log.warning("membership keep-alive failed: %s", err.message)
            except Exception:  # this thread must outlive anything etcd does: keep trying
                log.exception("membership keep-alive failed")
            self._stop.wait(max(0.1, self.ttl_s / 4))

    def stop(self) -> None:
        """Leave at once (revoke the lease), so the leader drops this node without waiting."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self.lease_id:
            lease_id = self.lease_id
            with contextlib.suppress(EtcdUnavailableError):
                self.etcd.run(lambda s: s.revoke_lease(lease_id))


def _check_etcd(resolver: LeaderResolver, etcd_url: str, attempts: int = 5) -> None:
    """Bounded retries, then a clear error: etcd must answer before the node starts."""
    last = ""
    for attempt in range(attempts):
        try:
            resolver.etcd.run(lambda s: s.status())
            return
        except EtcdUnavailableError as err:
            last = err.message
            threading.Event().wait(min(0.2 * 2**attempt, 2.0))
    resolver.close()
    raise EtcdUnavailableError(f"etcd at {etcd_url} unreachable after {attempts} tries: {last}")


def serve_node_ha(
    etcd_url: str,
    prefix: str,
    ttl_s: int,
    options: NodeDaemonConfig,
    join_timeout_s: float = 30.0,
) -> None:
    """Run a node that finds its master through etcd, until SIGINT/SIGTERM.

    Raises:
        InvalidRequestError: a malformed etcd URL or prefix.
        EtcdUnavailableError: etcd did not answer in ``join_timeout_s``.
        MasterUnavailableError: no leader accepted the node in time.
    """
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    endpoints = parse_endpoints(etcd_url)
    layout = EtcdLayout(prefix)
    resolver = LeaderResolver(endpoints, layout)

    def leader() -> tuple[Address, int]:
        rec = resolver.resolve(RESOLVE_TIMEOUT_S)
        return rec.control, rec.epoch

    _check_etcd(resolver, etcd_url)
    node = StorageNode(Address("etcd", 0), options)
    node.link.resolver = leader
    node.link.max_backoff_s = 0.2
    member_etcd = EtcdThread(endpoints)
    membership = EtcdMembership(
        member_etcd, layout, node.node_id, f"{options.host}:{node.server.port}", ttl_s
    )

    def leave() -> None:
        membership.stop()
        member_etcd.close()
        resolver.close()

    membership.start()
    if not membership.joined.wait(join_timeout_s):
        leave()
        node.server.stop()
        node.dram.close()
        raise EtcdUnavailableError(f"could not join etcd at {etcd_url} in {join_timeout_s:.0f}s")
    try:
        node.start()
    except BaseException:
        leave()
        raise
    try:
        run_until_stopped(node, etcd_url, stop)
    finally:
        leave()

"""The client's control channel in an HA cluster: find the leading master through etcd, follow it.

``Client.connect("etcd://HOST:PORT[,HOST:PORT]")`` uses :class:`LeaderChannel` instead of a fixed
address. Every request carries the epoch of the leader the client believes in. On a lost
connection, ``NOT_LEADER`` or ``STALE_EPOCH`` the channel looks the leader up again and retries,
for at most ``failover_timeout`` seconds, with one exception: the second phase of a put
(``put_end``/``put_revoke``) is *pinned* to the epoch of its ``put_start`` and never moves to
another leader (its put id means nothing there); it fails, and the caller puts again.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kvstore import auth, protocol
from kvstore.config import Address
from kvstore.discovery import DEFAULT_PREFIX, EtcdLayout, LeaderResolver
from kvstore.errors import (
    KVStoreError,
    KVTimeoutError,
    MasterUnavailableError,
    NodeUnavailableError,
    NotLeaderError,
    ProtocolError,
    StaleEpochError,
)
from kvstore.etcd import parse_endpoints

DEFAULT_FAILOVER_TIMEOUT_S = 15.0
#: A call to a leader that does not answer (paused, partitioned) gives up after this long and
#: looks for another leader.
HA_CALL_TIMEOUT_S = 3.0


class LeaderChannel:
    """Thread-safe: one request at a time under a lock (like the plain control channel).

    Args:
        etcd_url: ``etcd://HOST:PORT[,HOST:PORT]``.
        timeout: the client's per-call timeout (capped at ``HA_CALL_TIMEOUT_S`` per try).
        failover_timeout: how long a call may keep looking for a leader (at most ``timeout``).
        prefix: the cluster's prefix in etcd.
    """

    def __init__(
        self,
        etcd_url: str,
        timeout: float,
        token: auth.Token | None = None,
        *,
        failover_timeout: float = DEFAULT_FAILOVER_TIMEOUT_S,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        self.url = etcd_url
        self.token = token
        self.timeout = min(timeout, HA_CALL_TIMEOUT_S)
        self.failover_timeout = min(failover_timeout, max(timeout, 1.0))
        self.resolver = LeaderResolver(parse_endpoints(etcd_url), EtcdLayout(prefix))
        self.address: Address | None = None
        self.epoch: int | None = None
        self.num_failovers = 0
        self._conn: protocol.FramedSocket | None = None
        self._lock = threading.Lock()

    def _ensure(self, deadline: float) -> protocol.FramedSocket:
        if self._conn is None:
            rec = self.resolver.resolve(max(0.05, deadline - time.monotonic()))
            if self.epoch is not None and rec.epoch != self.epoch:
                self.num_failovers += 1
            self.address, self.epoch = rec.control, rec.epoch
            conn = protocol.FramedSocket.connect(
                rec.control.host, rec.control.port, timeout=self.timeout
            )
            try:
                auth.hello(conn, self.token)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def call(self, verb: str, args: dict[str, Any], pin_epoch: int | None = None) -> Any:
        """Send one request to the leader; see :meth:`call_epoch`."""
        return self.call_epoch(verb, args, pin_epoch)[0]

    def call_epoch(
        self, verb: str, args: dict[str, Any], pin_epoch: int | None = None
    ) -> tuple[Any, int | None]:
        """Send one request to the leader. Returns (the result, the epoch that served it).

        Raises:
            MasterUnavailableError: no leader answered within ``failover_timeout``.
            StaleEpochError, NotLeaderError: a pinned call whose leader is gone.
            KVStoreError: whatever the master answered.
        """
        with self._lock:
            deadline = time.monotonic() + self.failover_timeout
            backoff = 0.02
            while True:
                try:
                    conn = self._ensure(deadline)
                    epoch = self.epoch if pin_epoch is None else pin_epoch
                    if pin_epoch is not None and pin_epoch != self.epoch:
                        raise StaleEpochError(
                            f"the leader changed (epoch {pin_epoch} -> {self.epoch}) during {verb}"
                        )
                    return conn.call(verb, {**args, "epoch": epoch}), epoch
                except (NotLeaderError, StaleEpochError) as err:
                    self._drop()
                    if pin_epoch is not None or time.monotonic() >= deadline:
                        raise err from None
                except ProtocolError:
                    self._drop()
                    raise
                except (MasterUnavailableError, NodeUnavailableError, OSError) as exc:
                    self._drop()
                    if pin_epoch is not None or time.monotonic() >= deadline:
                        if isinstance(exc, TimeoutError):
                            raise KVTimeoutError(
                                f"the leading master did not answer {verb} in time"
                            ) from None
                        msg = exc.message if isinstance(exc, KVStoreError) else str(exc)
                        raise MasterUnavailableError(
                            f"no leading master answered {verb} via {self.url}: {msg}"
                        ) from None
                time.sleep(backoff)
                backoff = min(backoff * 2, 0.2)

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self._drop()
        self.resolver.close()

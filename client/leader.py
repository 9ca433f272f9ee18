"""The client's control channel in an HA cluster: find the leading master through etcd, follow it.

``Client.connect("etcd://HOST:PORT[,HOST:PORT]")`` uses :class:`LeaderChannel` instead of a fixed
address (both implement :class:`kvstore.client.control.ControlChannel`). Every request carries
the epoch of the leader the client believes in. On a lost connection, ``NOT_LEADER`` or
``STALE_EPOCH`` the channel looks the leader up again and retries, for at most
``failover_timeout`` seconds, with one exception: the second phase of a put
(``put_end``/``put_revoke``) is *pinned* to the epoch of its ``put_start`` and never moves to
another leader (its put id means nothing there); it fails, and the caller puts again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from kvstore import auth, protocol
from kvstore.address import Address
from kvstore.client.pipeline import Pipeline, close_released, pipelined
from kvstore.client.releases import LeaseReturns
from kvstore.errors import (
    KVStoreError,
    KVTimeoutError,
    MasterUnavailableError,
    NodeUnavailableError,
    NotLeaderError,
    ProtocolError,
    StaleEpochError,
    UnauthenticatedError,
)
from kvstore.etcd import parse_endpoints
from kvstore.etcd_keys import DEFAULT_PREFIX, EtcdLayout, LeaderResolver

DEFAULT_FAILOVER_TIMEOUT_S = 15.0
#: A call to a leader that does not answer (paused, partitioned) gives up after this long and
#: looks for another leader.
HA_CALL_TIMEOUT_S = 3.0


class LeaderChannel:
    """Thread-safe. Like the plain control channel, every thread's calls to the leader go on
    one :class:`~kvstore.client.pipeline.Pipeline` (replies matched by request id), except the
    requests :func:`~kvstore.client.pipeline.pipelined` keeps off it, which take a connection of
    their own. A new leader gets a new
    pipeline; the old one is closed (its waiters fail and retry, pinned ones fail).

    NOTE: the lock guards only the leader's address, epoch, pipeline and idle connections,
    never a round trip (to etcd or to the master): resolving, connecting and waiting for a
    reply all happen without it.

    Args:
        etcd_url: ``etcd://HOST:PORT[,HOST:PORT]``.
        timeout: the client's per-call timeout (capped at ``HA_CALL_TIMEOUT_S`` per try).
        failover_timeout: how long a call may keep looking for a leader (at most ``timeout``).
        prefix: the cluster's prefix in etcd.
    """

    MAX_IDLE = 4
    #: Finished reads' leases, carried back on every request (see kvstore.client.releases).
    releases: LeaseReturns | None = None

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
        # Idle connections to the leader of ``epoch`` (dropped, all, when it changes), and the
        # pipeline to it (closed when it changes).
        self._idle: list[protocol.FramedSocket] = []
        self._pipeline: Pipeline | None = None
        self._pipeline_epoch: int | None = None
        self._lock = threading.Lock()
        self._closed = False

    def _leader(self, deadline: float) -> tuple[protocol.FramedSocket | None, Address, int | None]:
        """An idle connection to the leader (or None: open one), its address and its epoch."""
        with self._lock:
            if self._idle and self.address is not None:
                return self._idle.pop(), self.address, self.epoch
            address, epoch = self.address, self.epoch
        if address is None:
            rec = self.resolver.resolve(max(0.05, deadline - time.monotonic()))
            with self._lock:
                if self.epoch is not None and rec.epoch != self.epoch:
                    self.num_failovers += 1
                self.address, self.epoch = rec.control, rec.epoch
            address, epoch = rec.control, rec.epoch
        return None, address, epoch

    def _connect(self, address: Address) -> protocol.FramedSocket:
        conn = protocol.FramedSocket.connect(address.host, address.port, timeout=self.timeout)
        try:
            auth.hello(conn, self.token)
        except BaseException:
            conn.close()
            raise
        return conn

    def _release(self, conn: protocol.FramedSocket, epoch: int | None) -> None:
        with self._lock:
            if not self._closed and epoch == self.epoch and len(self._idle) < self.MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    def _forget_leader(self, epoch: int | None) -> None:
        """The leader of ``epoch`` failed us: look it up again on the next try."""
        with self._lock:
            if epoch != self.epoch:
                return  # another thread has already moved on
            self.address = None
            idle, self._idle = self._idle, []
            pipe, self._pipeline = self._pipeline, None
        close_released(idle, pipe)

    def _pipe(self, address: Address, epoch: int | None) -> Pipeline:
        """The pipeline to the leader of ``epoch`` at ``address`` (opened if there is none).

        Raises:
            MasterUnavailableError, KVTimeoutError, OSError: no connection (or hello).
        """
        with self._lock:
            pipe = self._pipeline
            if pipe is not None and pipe.usable and self._pipeline_epoch == epoch:
                return pipe
        fresh = Pipeline(self._connect(address), address)  # (no lock held)
        with self._lock:
            pipe, old = self._pipeline, None
            if (
                self._closed
                or epoch != self.epoch
                or (pipe is not None and pipe.usable and self._pipeline_epoch == epoch)
            ):
                loser = fresh  # closed, moved on, or another thread connected meanwhile
            else:
                loser, old, pipe = None, pipe, fresh
                self._pipeline, self._pipeline_epoch = fresh, epoch
        if old is not None:
            old.close()
        if loser is not None:
            loser.close()
            if pipe is None or not pipe.usable or self._closed:
                raise MasterUnavailableError(f"the leader changed while connecting to {address}")
        return pipe

    def call(self, verb: str, args: dict[str, Any], pin_epoch: int | None = None) -> Any:
        """Send one request to the leader; see :meth:`call_epoch`."""
        return self.call_epoch(verb, args, pin_epoch)[0]

    def call_overlapped(
        self,
        verb: str,
        args: dict[str, Any],
        work: Callable[[], None],
        pin_epoch: int | None = None,
    ) -> tuple[Any, int | None]:
        """``work()``, then :meth:`call_epoch`: no overlap here, because a call may move to
        another leader (and retry) until it is answered, and the retries live in
        :meth:`call_epoch`. ``work``'s error is raised before the call is sent."""
        work()
        return self.call_epoch(verb, args, pin_epoch)

    def call_epoch(
        self, verb: str, args: dict[str, Any], pin_epoch: int | None = None
    ) -> tuple[Any, int | None]:
        """Send one request to the leader. Returns (the result, the epoch that served it).

        Raises:
            MasterUnavailableError: no leader answered within ``failover_timeout``.
            StaleEpochError, NotLeaderError: a pinned call whose leader is gone.
            KVStoreError: whatever the master answered.
        """
        deadline = time.monotonic() + self.failover_timeout
        backoff = 0.02
        if self.releases is not None:
            args = self.releases.attach(args)  # (a retry carries them again: harmless)
        exclusive = not pipelined(verb, args)
        while True:
            conn: protocol.FramedSocket | None = None
            known: int | None = self.epoch
            try:
                conn, address, known = self._leader(deadline)
                epoch = known if pin_epoch is None else pin_epoch
                if pin_epoch is not None and pin_epoch != known:
                    raise StaleEpochError(
                        f"the leader changed (epoch {pin_epoch} -> {known}) during {verb}"
                    )
                if not exclusive:
                    if conn is not None:
                        self._release(conn, known)
                        conn = None
                    pipe = self._pipe(address, known)
                    try_deadline = time.monotonic() + self.timeout
                    return pipe.call(verb, {**args, "epoch": epoch}, try_deadline), epoch
                if conn is None:
                    conn = self._connect(address)
                conn.sock.settimeout(self.timeout)
                result = conn.call(verb, {**args, "epoch": epoch})
                self._release(conn, known)
                return result, epoch
            except (NotLeaderError, StaleEpochError) as err:
                final: KVStoreError = err
            except (ProtocolError, UnauthenticatedError):
                if conn is not None:
                    conn.close()  # the master hangs up after either
                raise
            except KVTimeoutError:
                # The leader did not answer in time (paused, partitioned): look again.
                final = KVTimeoutError(f"the leading master did not answer {verb} in time")
            except KVStoreError as err:
                if not isinstance(err, MasterUnavailableError | NodeUnavailableError):
                    if conn is not None:
                        self._release(conn, known)
                    raise
                final = MasterUnavailableError(
                    f"no leading master answered {verb} via {self.url}: {err.message}"
                )
            except OSError as exc:
                final = (
                    KVTimeoutError(f"the leading master did not answer {verb} in time")
                    if isinstance(exc, TimeoutError)
                    else MasterUnavailableError(
                        f"no leading master answered {verb} via {self.url}: {exc}"
                    )
                )
            # The leader is lost or did not answer: drop the connection and look again, until
            # the call is pinned to that leader or out of time.
            if conn is not None:
                conn.close()
            self._forget_leader(known)
            if pin_epoch is not None or time.monotonic() >= deadline:
                raise final from None
            time.sleep(backoff)
            backoff = min(backoff * 2, 0.2)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            pipe, self._pipeline = self._pipeline, None
        close_released(idle, pipe)
        self.resolver.close()

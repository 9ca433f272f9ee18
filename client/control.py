"""The control channel: how the client's requests reach the master, one interface for all kinds.

The client, the read pipeline and the puts only ever see a :class:`ControlChannel`: send a verb,
get its answer within a timeout, typed errors otherwise. Two channels implement it:

- :class:`FixedChannel` (here): a master at a fixed ``HOST:PORT``. Every thread's requests share
  one pipelined connection (:mod:`kvstore.client.pipeline`); large or long requests take one of
  their own.
- :class:`~kvstore.client.leader.LeaderChannel`: the leading master of an HA cluster, found
  through etcd and followed across failovers (requests carry the leader's epoch).

:func:`open_channel` picks one from the address, so that nothing above this module knows which
kind it holds. Both carry finished reads' leases back on every request (``releases``, see
:mod:`kvstore.client.releases`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvstore import auth, protocol
from kvstore.address import Address
from kvstore.client.leader import LeaderChannel
from kvstore.client.pipeline import Pipeline, close_released, pipelined
from kvstore.client.releases import LeaseReturns
from kvstore.errors import (
    KVStoreError,
    KVTimeoutError,
    MasterUnavailableError,
    NodeUnavailableError,
    ProtocolError,
    UnauthenticatedError,
)
from kvstore.etcd import is_etcd_url

#: Verbs a fixed channel may send again on a fresh connection when a pooled one turns out dead.
_IDEMPOTENT = frozenset(
    {"get_locations", "exists", "stats", "ping", "node_transports", "release_leases"}
)


class ControlChannel(Protocol):
    """What the client needs of its connection to the master. Implementations are thread-safe
    and hold no lock across a round trip.

    Attributes:
        timeout: seconds one try of a call may wait for its answer (a long poll must end well
            inside it, or the channel would call a quiet master a dead one).
        epoch: the epoch of the master the channel follows (None: a fixed master has none).
        releases: finished reads' leases, carried back on every request (set by the client).
    """

    timeout: float
    epoch: int | None
    releases: LeaseReturns | None

    def call(self, verb: str, args: dict[str, Any], pin_epoch: int | None = None) -> Any:
        """One request; its result.

        Args:
            pin_epoch: fail (StaleEpochError) rather than move to another leader than the one
                of this epoch (the second phase of a put: its put id means nothing elsewhere).

        Raises:
            KVTimeoutError, MasterUnavailableError: no answer in time; KVStoreError: the
            master's answer.
        """
        ...

    def call_epoch(
        self, verb: str, args: dict[str, Any], pin_epoch: int | None = None
    ) -> tuple[Any, int | None]:
        """:meth:`call`, and the epoch that served it (pin the put's second phase to it)."""
        ...

    def call_overlapped(
        self,
        verb: str,
        args: dict[str, Any],
        work: Callable[[], None],
        pin_epoch: int | None = None,
    ) -> tuple[Any, int | None]:
        """:meth:`call_epoch` with ``work()`` run (holding no lock) while the master answers,
        where the channel can overlap them; ``work``'s error is raised after the answer."""
        ...

    def close(self) -> None:
        """Close every connection; later calls raise MasterUnavailableError."""
        ...


def open_channel(address: str, timeout: float, token: auth.Token | None) -> ControlChannel:
    """The channel for a master address: ``HOST:PORT`` (fixed), or ``etcd://HOST:PORT[,...]``
    (follow the HA cluster's leader).

    Raises:
        InvalidRequestError: a malformed address.
    """
    if is_etcd_url(address):
        return LeaderChannel(address, timeout, token)
    return FixedChannel(Address.parse(address), timeout, token)


class FixedChannel:
    """The control channel to a master at a fixed address. Thread-safe.

    Every call goes on one shared :class:`~kvstore.client.pipeline.Pipeline`: many threads'
    requests in flight on one connection, replies matched by request id, each call waiting
    only for its own reply and at most ``timeout`` seconds. Verbs that may keep the master busy
    on a connection for long (a long poll, a large listing, a large batch) take a connection of
    their own from a small pool instead, so that they hold up nobody else's answers (see
    :func:`~kvstore.client.pipeline.pipelined`).

    NOTE: ``_lock`` guards only which pipeline is current and the idle exclusive connections,
    never a network round trip: connecting (and the hello) happens outside it, and a call
    waits for its reply holding no lock. So one call that waits (a slow answer, or work
    overlapped with it that itself asks the master) never blocks another thread's call, and no
    call can wait on a lock held by its own thread.
    """

    epoch: int | None = None  # a fixed master has no epoch (see discovery.LeaderChannel)
    #: Finished reads' leases, carried back on every request (see kvstore.client.releases).
    releases: LeaseReturns | None = None
    #: Idle exclusive connections kept for reuse.
    MAX_IDLE = 4

    def __init__(self, address: Address, timeout: float, token: auth.Token | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self.token = token
        self._pipeline: Pipeline | None = None
        self._idle: list[protocol.FramedSocket] = []
        self._lock = threading.Lock()
        self._closed = False
        #: Pipelines opened (the first, and one after each broken or retired one).
        self.num_connects = 0

    def _connect(self, deadline: float) -> protocol.FramedSocket:
        try:
            conn = protocol.FramedSocket.connect(
                self.address.host, self.address.port, timeout=_left(deadline)
            )
        except NodeUnavailableError as err:
            raise MasterUnavailableError(
                f"master {self.address} unreachable: {err.message}"
            ) from None
        try:
            auth.hello(conn, self.token)
        except (OSError, ConnectionError) as exc:
            conn.close()
            if isinstance(exc, TimeoutError):
                raise KVTimeoutError(
                    f"master {self.address} did not answer hello in time"
                ) from None
            raise MasterUnavailableError(
                f"master {self.address} failed during hello: {exc}"
            ) from None
        except BaseException:
            conn.close()
            raise
        return conn

    def _pipe(self, deadline: float) -> tuple[Pipeline, bool]:
        """The current pipeline (a new one if there is none that works) and whether it was
        there before this call."""
        current = self._pipeline
        if current is not None:
            current.check_idle()  # (no lock held: it may read what came while nobody waited)
        with self._lock:
            pipe = self._pipeline
            if pipe is not None and pipe.usable:
                return pipe, True
            if self._closed:
                raise MasterUnavailableError("the client is closed")
        fresh = Pipeline(self._connect(deadline), self.address)  # (no lock held)
        with self._lock:
            pipe = self._pipeline
            if self._closed or (pipe is not None and pipe.usable):
                loser = fresh  # another thread connected meanwhile: use its pipeline
            else:
                loser, pipe = None, fresh
                self._pipeline = fresh
                self.num_connects += 1
        if loser is not None:
            loser.close()
            if pipe is None or not pipe.usable:
                raise MasterUnavailableError("the client is closed")
        return pipe, False

    def call_epoch(
        self, verb: str, args: dict[str, Any], pin_epoch: int | None = None
    ) -> tuple[Any, int | None]:
        """:meth:`call`, and the epoch that served it (None: a fixed master has none)."""
        return self.call(verb, args), None

    def call(self, verb: str, args: dict[str, Any], pin_epoch: int | None = None) -> Any:
        """One request to the master, answered within ``timeout`` seconds.

        Raises:
            KVTimeoutError: no answer in time; MasterUnavailableError: the master is gone;
            KVStoreError: whatever the master answered.
        """
        deadline = time.monotonic() + self.timeout
        if self.releases is not None:
            args = self.releases.attach(args)
        if not pipelined(verb, args):
            return self._call_exclusive(verb, args, deadline)
        while True:
            pipe, reused = self._pipe(deadline)
            try:
                return pipe.call(verb, args, deadline)
            except MasterUnavailableError:
                # A pipeline the master closed meanwhile fails at once: try a fresh one
                # (idempotent verbs only: another may have been served already).
                if reused and verb in _IDEMPOTENT and time.monotonic() < deadline:
                    continue
                raise

    def call_overlapped(
        self,
        verb: str,
        args: dict[str, Any],
        work: Callable[[], None],
        pin_epoch: int | None = None,
    ) -> tuple[Any, int | None]:
        """Send ``verb``, run ``work()`` while the master answers, then read the answer
        (``pin_epoch``: as :meth:`call`, nothing to a fixed master).

        ``work`` runs holding no lock (it may itself call the master: its request goes on the
        same pipeline, its reply is matched by id).

        Returns:
            The result, and None for the epoch (a fixed master has none).

        Raises:
            Whatever ``work`` raises (after the answer was read), or what :meth:`call` raises.
        """
        return self._call_overlapped(verb, args, work), None

    def _call_overlapped(self, verb: str, args: dict[str, Any], work: Callable[[], None]) -> Any:
        deadline = time.monotonic() + self.timeout
        if self.releases is not None:
            args = self.releases.attach(args)
        sent: tuple[Pipeline, int, Any] | None = None
        if not pipelined(verb, args):
            return self._call_exclusive(verb, args, deadline, work)
        try:
            pipe, _ = self._pipe(deadline)
            sent = (pipe, *pipe.send(verb, args, deadline))
        except (MasterUnavailableError, KVTimeoutError):
            sent = None  # call() below tries again, and raises the right error
        try:
            work()
        except BaseException:
            if sent is not None:  # the answer is read and dropped: the work's error wins
                with contextlib.suppress(KVStoreError):
                    sent[0].wait(sent[1], sent[2], deadline, verb)
            raise
        if sent is None:
            return self.call(verb, args)
        pipe, req_id, slot = sent
        try:
            return pipe.wait(req_id, slot, deadline, verb)
        except MasterUnavailableError:
            if verb not in _IDEMPOTENT or time.monotonic() >= deadline:
                raise
        return self.call(verb, args)

    # ---------------------------------------------------------------- exclusive verbs
    def _acquire(self, deadline: float) -> tuple[protocol.FramedSocket, bool]:
        """A connection of this call's own and whether it was idle (it may have gone stale)."""
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is not None:
            conn.sock.settimeout(_left(deadline))
            return conn, True
        return self._connect(deadline), False

    def _release(self, conn: protocol.FramedSocket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    def _call_exclusive(
        self,
        verb: str,
        args: dict[str, Any],
        deadline: float,
        work: Callable[[], None] | None = None,
    ) -> Any:
        """One request on a connection of its own (see :func:`pipeline.pipelined`); ``work``,
        if given, runs once while the master answers (its error is raised after the answer)."""
        work_error: BaseException | None = None
        while True:
            conn, reused = self._acquire(deadline)
            try:
                conn.sock.settimeout(_left(deadline))
                req_id = conn.send_request(verb, args)
                if work is not None:
                    run, work = work, None
                    try:
                        run()
                    except BaseException as exc:  # noqa: BLE001 - raised after the answer
                        work_error = exc
                    conn.sock.settimeout(_left(deadline))
                response, payload_len = conn.read_response()
                if response.req_id != req_id or payload_len:
                    raise ProtocolError(f"response {response.req_id} does not answer {req_id}")
                result = response.unwrap()
            except (ProtocolError, UnauthenticatedError):
                conn.close()  # the master hangs up after either
                raise
            except KVStoreError:
                self._release(conn)
                if work_error is not None:
                    raise work_error from None
                raise
            except (TimeoutError, OSError) as exc:
                conn.close()
                # A pooled connection the master closed meanwhile fails at once: try a fresh
                # one (idempotent verbs only: another may have been served already).
                if reused and verb in _IDEMPOTENT and not isinstance(exc, TimeoutError):
                    continue
                raise self._failure(verb, exc) from None
            self._release(conn)
            if work_error is not None:
                raise work_error
            return result

    def _failure(self, verb: str, exc: BaseException) -> KVStoreError:
        if isinstance(exc, TimeoutError):
            return KVTimeoutError(f"master {self.address} did not answer {verb} in time")
        return MasterUnavailableError(f"master {self.address} failed during {verb}: {exc}")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            pipe, self._pipeline = self._pipeline, None
        close_released(idle, pipe)


def _left(deadline: float) -> float:
    """Seconds until ``deadline`` (monotonic), at least a sliver: a socket timeout of 0 would
    make the socket non-blocking instead of failing at once."""
    return max(0.001, deadline - time.monotonic())

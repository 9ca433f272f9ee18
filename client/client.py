"""The byte-level client SDK: put/get objects by key, zero-copy into caller buffers, in batches.

One master call per batch to learn (or allocate) where the bytes live, then one data call per
storage node, pipelined across nodes. Every object carries an xxh3_64 checksum computed at put;
every full read verifies it, so a read returns the exact bytes or raises.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from kvstore import auth, protocol
from kvstore.buffers import as_bytes_view
from kvstore.client.datapath import DataPath
from kvstore.client.discovery import LeaderChannel
from kvstore.client.locations import LocationCache, same_replica
from kvstore.client.pipeline import Pipeline, pipelined
from kvstore.client.releases import LeaseReturns
from kvstore.client.staging import CudaStaging, PinnedPool, is_cuda_tensor
from kvstore.client.transport import ReadItem, WriteItem
from kvstore.config import Address, encode_key
from kvstore.errors import (
    ChecksumMismatchError,
    InvalidRequestError,
    KVStoreError,
    KVTimeoutError,
    MasterUnavailableError,
    NodeUnavailableError,
    NoSpaceError,
    ProtocolError,
    UnauthenticatedError,
)
from kvstore.etcd import is_etcd_url
from kvstore.types import ObjectInfo, PutTicket, result_from_wire

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
#: Reads of cached locations overlap the master's answer only up to this many bytes per call.
SPECULATE_MAX_BYTES = 2 << 20
#: Lease reads stop trusting a cached answer this long (or a quarter of the lease, if less) before
#: its lease ends as seen from here: room for the request still to reach the node in time.
LEASE_MARGIN_S = 0.5
_IDEMPOTENT = frozenset(
    {"get_locations", "exists", "stats", "ping", "node_transports", "release_leases"}
)


def checksum(view: memoryview) -> int:
    """xxh3_64 of an object's bytes (the checksum stored with every object)."""
    return xxhash.xxh3_64_intdigest(view)


class _ControlChannel:
    """The connections to the master. Thread-safe.

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

    def call_overlapped(self, verb: str, args: dict[str, Any], work: Callable[[], None]) -> Any:
        """Send ``verb``, run ``work()`` while the master answers, then read the answer.

        ``work`` runs holding no lock (it may itself call the master: its request goes on the
        same pipeline, its reply is matched by id).

        Raises:
            Whatever ``work`` raises (after the answer was read), or what :meth:`call` raises.
        """
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
        for conn in idle:
            conn.close()
        if pipe is not None:
            pipe.close()


def _left(deadline: float) -> float:
    """Seconds until ``deadline`` (monotonic), at least a sliver: a socket timeout of 0 would
    make the socket non-blocking instead of failing at once."""
    return max(0.001, deadline - time.monotonic())


class _Scratch:
    """A per-thread receive buffer for :meth:`Client.batch_get`, grown on demand and kept (up
    to ``MAX_SCRATCH`` bytes) so its pages stay mapped between calls."""

    MAX_SCRATCH = 64 << 20

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, size: int) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            buf = bytearray(size)
            if size <= self.MAX_SCRATCH:
                self._local.buf = buf
        return memoryview(buf)


def _call_overlapped(
    control: _ControlChannel | LeaderChannel,
    verb: str,
    args: dict[str, Any],
    work: Callable[[], None],
) -> tuple[Any, int | None]:
    """``control.call_overlapped`` where the channel has it (a fixed master: no epoch); else
    ``work()`` then the call. Returns (the result, the epoch that served it)."""
    overlapped = getattr(control, "call_overlapped", None)
    if overlapped is None:
        work()
        return control.call_epoch(verb, args)
    return overlapped(verb, args, work), None


def _digest(item: ReadItem) -> int:
    """The checksum of what was read: from the transport if it hashed while moving bytes."""
    return item.digest if item.digest is not None else checksum(item.dest)


def _raise_if_error(result: Any) -> Any:
    if isinstance(result, KVStoreError):
        raise result
    return result


class Client:
    """A connection to a kvstore cluster. Thread-safe.

    Use :meth:`connect`; close with :meth:`close` or a ``with`` block.
    """

    def __init__(
        self,
        master: Address | None,
        timeout: float = DEFAULT_TIMEOUT_S,
        token: auth.Token | None = None,
        *,
        control: _ControlChannel | LeaderChannel | None = None,
        shm: bool = True,
        lease_reads: bool = False,
    ) -> None:
        self.master = master
        self.timeout = timeout
        if control is None:
            assert master is not None, "a client needs a master address or a control channel"
            control = _ControlChannel(master, timeout, token)
        self._control = control
        self._data = DataPath(
            timeout, lambda: self._control.call("node_transports", {}), shm=shm, token=token
        )
        #: Leases of finished reads on their way back to the master (kvstore.client.releases).
        self._returns = LeaseReturns(lambda t: self._control.call("release_leases", {"tokens": t}))
        control.releases = self._returns
        # With lease reads the cache owns the leases of the answers it keeps (see locations.py).
        self._cache = LocationCache(give_back=self._returns.give_back if lease_reads else None)
        #: Seconds a get_locations answer may be reused without the master (0: never); set
        #: from the master's ``ping`` at connect when ``lease_reads`` is asked for.
        self._lease_window = 0.0
        self._want_lease_reads = lease_reads
        self._scratch = _Scratch()
        self._staging: CudaStaging | None = None  # made when a CUDA tensor first comes by
        self._staging_lock = threading.Lock()

    @classmethod
    def connect(
        cls,
        address: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        token: str | bytes | auth.Token | None = None,
        shm: bool = True,
        lease_reads: bool = False,
    ) -> Client:
        """Connect to the master at ``HOST:PORT``, or follow the leading master of an HA cluster
        found through etcd at ``etcd://HOST:PORT[,HOST:PORT]``.

        Args:
            address: the master's control address.
            timeout: seconds any one network wait may take.
            token: the cluster token; None reads ``$KVSTORE_TOKEN`` / ``$KVSTORE_TOKEN_FILE``.
            shm: use shared memory for nodes on this host that offer it (``kvstore node --shm``).
            lease_reads: reread a key this client located within the master's read lease
                straight from its node, without asking the master again (one round trip
                instead of two). Bytes are never torn or freed (the lease holds the space; the
                checksum is checked), but another client's overwrite or remove may be seen up
                to one lease (``lease_s``, 5 s by default) late. Right for content-addressed
                keys such as KV blocks; this client's own puts and removes are seen at once.
                Such a client keeps the read lease of each answer it caches until that cache
                entry ends (see :mod:`kvstore.client.locations`); without lease reads every
                read gives its leases back as soon as it is done
                (:mod:`kvstore.client.releases`).

        Raises:
            InvalidRequestError: a malformed address or token.
            MasterUnavailableError: nothing answers there (no leader, for ``etcd://``).
            UnauthenticatedError: the master needs a token and this is not it.
        """
        if token is None:
            token = auth.load_token()
        elif not isinstance(token, auth.Token):
            token = auth.Token(token)
        if is_etcd_url(address):
            client = cls(
                None,
                timeout,
                token,
                control=LeaderChannel(address, timeout, token),
                shm=shm,
                lease_reads=lease_reads,
            )
        else:
            client = cls(Address.parse(address), timeout, token, shm=shm, lease_reads=lease_reads)
        try:
            client._hello(client._control.call("ping", {}))
        except BaseException:
            client.close()
            raise
        return client

    def _hello(self, ping: Any) -> None:
        """Learn from the master's ``ping`` answer how long its read leases hold."""
        lease_s = ping.get("lease_s") if isinstance(ping, dict) else None
        if self._want_lease_reads and isinstance(lease_s, int | float) and lease_s > 0:
            self._lease_window = lease_s - min(LEASE_MARGIN_S, lease_s / 4)

    def close(self) -> None:
        self._returns.close()
        self._control.close()
        self._data.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ================================================================ puts
    def put(self, key: str | bytes, value: Any, *, replicas: int = 1) -> None:
        """Store ``value`` (any contiguous buffer) under ``key``, replacing an earlier value.

        Args:
            replicas: copies on distinct nodes; reads use any live one.

        Raises:
            InvalidRequestError, NoSpaceError, NodeUnavailableError, ObjectBusyError, ...
        """
        _raise_if_error(self.batch_put([key], [value], replicas=replicas)[0])

    def batch_put(
        self, keys: Sequence[str | bytes], values: Sequence[Any], *, replicas: int = 1
    ) -> list[KVStoreError | None]:
        """Store many objects: one master call to allocate, one write per node, one to commit.

        Args:
            replicas: copies of each object on distinct nodes.

        Returns:
            Per key, None on success or the error for that key (nothing stored for it).
        """
        return self._batch_put(keys, values, replicas=replicas)

    def _stager(self, objs: Sequence[Any]) -> CudaStaging | None:
        """The CUDA staging when any of ``objs`` is a CUDA tensor (made on first use), else None."""
        staging = self._staging
        if not (staging.any_device(objs) if staging else any(map(is_cuda_tensor, objs))):
            return None
        with self._staging_lock:
            if self._staging is None:
                self._staging = CudaStaging(PinnedPool())
            return self._staging

    def _batch_put(
        self,
        keys: Sequence[str | bytes],
        values: Sequence[Any],
        commit: dict[str, Any] | None = None,
        replicas: int = 1,
    ) -> list[KVStoreError | None]:
        """``batch_put``; with ``commit``, commits through ``kv_commit`` with those extra args (the
        KV-cache layer indexes the prompt in the same call as the commit). CUDA tensors are
        staged through pinned host buffers first (see :mod:`kvstore.client.staging`)."""
        if len(keys) != len(values):
            raise InvalidRequestError("keys and values differ in length")
        stager = self._stager(values)
        if stager is None:
            return self._batch_put_host(keys, values, commit, replicas)
        with stager.puts(values) as host_values:
            return self._batch_put_host(keys, host_values, commit, replicas)

    def _batch_put_host(
        self,
        keys: Sequence[str | bytes],
        values: Sequence[Any],
        commit: dict[str, Any] | None,
        replicas: int,
    ) -> list[KVStoreError | None]:
        results: list[KVStoreError | None] = [None] * len(keys)
        wire_keys: list[bytes] = []
        views: list[memoryview] = []
        index: list[int] = []
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            try:
                wk, view = encode_key(k), as_bytes_view(v)
            except KVStoreError as err:
                results[i] = err
                continue
            wire_keys.append(wk)
            views.append(view)
            index.append(i)
        # Checksums are filled in while the master answers the first put_start (see _put_round).
        sums: list[int] = []
        # Forgotten before (no read may use the old place once the write starts) and after
        # (an answer looked up meanwhile may name the old object; see LocationCache.put_many).
        self._cache.forget(wire_keys)
        excluded: list[str] = []
        todo = list(range(len(wire_keys)))
        try:
            for _round in range(2):  # a second round retries keys whose node died, elsewhere
                if not todo:
                    break
                lost = {j: results[index[j]] for j in todo} if _round else {}
                todo, dead = self._put_round(
                    todo, wire_keys, views, sums, index, results, excluded, commit, replicas
                )
                excluded.extend(dead)
                for j, err in lost.items():
                    # The retry found no other node: the truth is still that the node died.
                    if isinstance(results[index[j]], NoSpaceError):
                        results[index[j]] = err
        finally:
            self._cache.forget(wire_keys)
        return results

    def _put_round(
        self,
        todo: list[int],
        wire_keys: list[bytes],
        views: list[memoryview],
        sums: list[int],
        index: list[int],
        results: list[KVStoreError | None],
        excluded: list[str],
        commit_extra: dict[str, Any] | None = None,
        replicas: int = 1,
    ) -> tuple[list[int], list[str]]:
        start: dict[str, Any] = {
            "keys": [wire_keys[j] for j in todo],
            "sizes": [len(views[j]) for j in todo],
            "exclude": excluded,
        }
        if replicas != 1:
            start["replicas"] = replicas
        if commit_extra is not None:
            start["kv"] = True  # the KV-cache layer writes kv/ keys (see MasterService.put_start)
        if sums:  # a second round: hashed already
            reply, epoch = self._control.call_epoch("put_start", start)
        else:  # hash the values while the master answers
            reply, epoch = _call_overlapped(
                self._control, "put_start", start, lambda: sums.extend(map(checksum, views))
            )
        tickets: list[tuple[int, PutTicket]] = []
        writes: list[WriteItem] = []
        for j, r in zip(todo, reply, strict=True):
            err, payload = result_from_wire(r)
            if err is not None:
                results[index[j]] = err
                continue
            ticket = PutTicket.from_wire(payload)
            tickets.append((j, ticket))
            for loc in ticket.locations:
                writes.append(WriteItem(loc, views[j], sums[j]))
        self._data.write(writes)
        failed: dict[int, KVStoreError] = {}
        dead_nodes: set[str] = set()
        w = iter(writes)
        for j, ticket in tickets:
            for _loc in ticket.locations:
                item = next(w)
                if item.result is not None:
                    failed.setdefault(j, item.result)
                    if isinstance(item.result, NodeUnavailableError):
                        dead_nodes.add(item.location.node_id)
        commit = [(j, t) for j, t in tickets if j not in failed]
        revoke = [(j, t) for j, t in tickets if j in failed]
        if revoke:
            self._control.call(
                "put_revoke", {"put_ids": [t.put_id for _, t in revoke]}, pin_epoch=epoch
            )
        if commit or commit_extra is not None:
            args = {
                "put_ids": [t.put_id for _, t in commit],
                "checksums": [sums[j] for j, _ in commit],
            }
            # NOTE: pinned: a put id means nothing to another leader.
            if commit_extra is None:
                reply = self._control.call("put_end", args, pin_epoch=epoch)
            else:
                reply = self._control.call("kv_commit", {**args, **commit_extra}, pin_epoch=epoch)[
                    "results"
                ]
            for (j, _), r in zip(commit, reply, strict=True):
                results[index[j]], _ = result_from_wire(r)
        retry = [j for j, _ in revoke if isinstance(failed[j], NodeUnavailableError)]
        for j, _ in revoke:
            results[index[j]] = failed[j]
        return retry, sorted(dead_nodes)

    # ================================================================ gets
    def _locations(self, wire_keys: list[bytes]) -> list[ObjectInfo | KVStoreError]:
        return self._decode_locations(self._control.call("get_locations", {"keys": wire_keys}))

    @staticmethod
    def _decode_locations(reply: Any) -> list[ObjectInfo | KVStoreError]:
        out: list[ObjectInfo | KVStoreError] = []
        for r in reply:
            err, payload = result_from_wire(r)
            out.append(err if err is not None else ObjectInfo.from_wire(payload))
        return out

    def batch_get_into(
        self, keys: Sequence[str | bytes], buffers: Sequence[Any]
    ) -> list[int | KVStoreError]:
        """Read many objects straight into caller buffers (each at least the object's size).

        A CUDA tensor is filled through a pinned host buffer (one H2D copy, only for keys that
        were read whole and verified); see :mod:`kvstore.client.staging`.

        Returns:
            Per key, the number of bytes written into its buffer, or the error for that key.
        """
        if len(keys) != len(buffers):
            raise InvalidRequestError("keys and buffers differ in length")
        stager = self._stager(buffers)
        if stager is None:
            return self._batch_get_into_host(keys, buffers)
        with stager.gets(buffers) as staged:
            results = self._batch_get_into_host(keys, staged.buffers)
            staged.finish(results)
        return results

    def _batch_get_into_host(
        self, keys: Sequence[str | bytes], buffers: Sequence[Any]
    ) -> list[int | KVStoreError]:
        results: list[int | KVStoreError] = [0] * len(keys)
        wire_keys: list[bytes] = []
        dests: list[memoryview] = []
        index: list[int] = []
        for i, (k, b) in enumerate(zip(keys, buffers, strict=True)):
            try:
                wk, dest = encode_key(k), as_bytes_view(b, writable=True)
            except KVStoreError as err:
                results[i] = err
                continue
            wire_keys.append(wk)
            dests.append(dest)
            index.append(i)
        if not wire_keys:
            return results
        self._get(wire_keys, dests, index, results)
        return results

    def _lookup_stamp(self) -> tuple[float, int]:
        """Taken just before asking the master where keys are: until when its read lease on
        the answers holds as seen from here (0 without lease reads), and the cache generation
        (see :meth:`LocationCache.put_many`)."""
        lease_until = time.monotonic() + self._lease_window if self._lease_window else 0.0
        return lease_until, self._cache.generation

    def _leased_read(
        self, wire_keys: list[bytes], dests: list[memoryview], index: list[int], results: list[Any]
    ) -> list[int]:
        """Read the keys whose cached answer is still under lease, without the master.

        Returns:
            The positions (into ``wire_keys``) still to read the usual way.
        """
        leased = self._cache.leased_many(wire_keys, time.monotonic())
        items: list[tuple[int, ObjectInfo, ReadItem]] = []
        rest: list[int] = []
        for j, info in enumerate(leased):
            if info is not None and len(dests[j]) >= info.size:
                items.append((j, info, ReadItem(info.locations[0], dests[j][: info.size])))
            else:
                rest.append(j)
        if not items:
            return rest
        self._data.read([item for _, _, item in items])
        stale: list[bytes] = []
        for j, info, item in items:
            if item.result is None and _digest(item) == info.checksum:
                results[index[j]] = info.size
            else:  # node gone, grant refused, bytes changed: ask the master
                stale.append(wire_keys[j])
                rest.append(j)
        if stale:
            self._cache.forget(stale)
            rest.sort()
        return rest

    def _get(
        self, wire_keys: list[bytes], dests: list[memoryview], index: list[int], results: list[Any]
    ) -> None:
        """Locate and read objects; reads of cached locations overlap the master's answer (or,
        with lease reads, skip it while the lease holds)."""
        if self._lease_window:
            rest = self._leased_read(wire_keys, dests, index, results)
            if not rest:
                return
            if len(rest) < len(wire_keys):
                wire_keys = [wire_keys[j] for j in rest]
                dests = [dests[j] for j in rest]
                index = [index[j] for j in rest]
        cached = self._cache.get_many(wire_keys)
        guesses: dict[int, ReadItem] = {}
        guessed_bytes = 0
        for j, info in enumerate(cached):
            if info is not None and len(dests[j]) >= info.size:
                guesses[j] = ReadItem(info.locations[0], dests[j][: info.size])
                guessed_bytes += info.size
        # NOTE: large reads (where one round trip matters little) do not overlap.
        lease_until, generation = self._lookup_stamp()
        if not guesses or guessed_bytes > SPECULATE_MAX_BYTES:
            infos = self._locations(wire_keys)
            done_with = self._cache.put_many(wire_keys, infos, lease_until, generation)
            try:
                self._read_objects(infos, dests, index, results)
            finally:
                self._returns.give_back(done_with)
            return
        reply, _ = _call_overlapped(
            self._control,
            "get_locations",
            {"keys": wire_keys},
            lambda: self._data.read(list(guesses.values())),
        )
        infos = self._decode_locations(reply)
        done_with = self._cache.put_many(wire_keys, infos, lease_until, generation)
        try:
            self._confirm_guesses(infos, cached, guesses, dests, index, results)
        finally:
            self._returns.give_back(done_with)

    def _confirm_guesses(
        self,
        infos: list[ObjectInfo | KVStoreError],
        cached: list[ObjectInfo | None],
        guesses: dict[int, ReadItem],
        dests: list[memoryview],
        index: list[int],
        results: list[Any],
    ) -> None:
        """Accept the speculative reads the master's fresh answers confirm; redo the others."""
        redo: list[int] = []
        for j, info in enumerate(infos):
            item = guesses.get(j)
            if (
                item is not None
                and isinstance(info, ObjectInfo)
                and item.result is None
                and same_replica(info, cached[j], item.location)  # type: ignore[arg-type]
                and _digest(item) == info.checksum
            ):
                results[index[j]] = info.size
            else:
                redo.append(j)
        if redo:
            self._read_objects(
                [infos[j] for j in redo],
                [dests[j] for j in redo],
                [index[j] for j in redo],
                results,
            )

    def _read_objects(
        self,
        infos: list[ObjectInfo | KVStoreError],
        dests: list[memoryview],
        index: list[int],
        results: list[Any],
    ) -> None:
        """Fill ``dests`` from the first live replica of each object, verifying checksums."""
        pending: list[tuple[int, ObjectInfo, int]] = []  # (j, info, replica number)
        for j, info in enumerate(infos):
            if isinstance(info, KVStoreError):
                results[index[j]] = info
            elif len(dests[j]) < info.size:
                results[index[j]] = InvalidRequestError(
                    f"buffer of {len(dests[j])} bytes is too small for an object of {info.size}"
                )
            elif not info.locations:
                results[index[j]] = NodeUnavailableError("no live replica")
            else:
                pending.append((j, info, 0))
        corrupt: list[list[Any]] = []
        while pending:
            items = [ReadItem(info.locations[r], dests[j][: info.size]) for j, info, r in pending]
            self._data.read(items)
            retry: list[tuple[int, ObjectInfo, int]] = []
            for (j, info, r), item in zip(pending, items, strict=True):
                if item.result is None:
                    if _digest(item) == info.checksum:
                        results[index[j]] = info.size
                        continue
                    # A corrupt replica: report it (the master drops it and copies a good one
                    # back) and read the next replica instead.
                    g = item.location.grant
                    corrupt.append(
                        [g.key, item.location.node_id, g.segment, g.offset, info.checksum]
                    )
                    if r + 1 < len(info.locations):
                        retry.append((j, info, r + 1))
                    else:
                        results[index[j]] = ChecksumMismatchError(
                            "object bytes do not match their checksum (overwritten or corrupt)"
                        )
                elif isinstance(item.result, NodeUnavailableError | ChecksumMismatchError) and (
                    r + 1 < len(info.locations)
                ):
                    retry.append((j, info, r + 1))
                else:
                    results[index[j]] = item.result
            pending = retry
        if corrupt:
            self._report_corrupt(corrupt)

    def _report_corrupt(self, reports: list[list[Any]]) -> None:
        """Tell the master which replicas failed their checksum (best effort: a lost report
        only delays the repair; the next reader reports again)."""
        self._cache.forget([r[0] for r in reports])
        try:
            self._control.call("report_corrupt", {"items": reports})
        except KVStoreError as err:
            log.warning("could not report %d corrupt replica(s): %s", len(reports), err.message)

    def get_into(self, key: str | bytes, buffer: Any) -> int:
        """Read one object into ``buffer``; returns its size.

        Raises:
            KeyNotFoundError, InvalidRequestError (buffer too small), NodeUnavailableError,
            ChecksumMismatchError, ...
        """
        return _raise_if_error(self.batch_get_into([key], [buffer])[0])

    def batch_get(self, keys: Sequence[str | bytes]) -> list[bytes | KVStoreError]:
        """Read many objects. Returns per key its bytes or the error for that key."""
        results: list[Any] = [None] * len(keys)
        wire_keys: list[bytes] = []
        index: list[int] = []
        for i, k in enumerate(keys):
            try:
                wire_keys.append(encode_key(k))
                index.append(i)
            except KVStoreError as err:
                results[i] = err
        if not wire_keys:
            return results
        leased: list[int] = []
        infos: list[ObjectInfo | KVStoreError | None] = [None] * len(wire_keys)
        if self._lease_window:
            infos = list(self._cache.leased_many(wire_keys, time.monotonic()))
            leased = [j for j, info in enumerate(infos) if info is not None]
        done_with = self._locate_missing(wire_keys, infos)
        try:
            self._read_fresh(infos, index, results)  # type: ignore[arg-type]
            # A leased answer that failed (node gone, grant refused, bytes changed): ask the
            # master.
            redo = [j for j in leased if isinstance(results[index[j]], KVStoreError)]
            if redo:
                keys = [wire_keys[j] for j in redo]
                self._cache.forget(keys)
                fresh: list[ObjectInfo | KVStoreError | None] = [None] * len(redo)
                done_with += self._locate_missing(keys, fresh)
                self._read_fresh(fresh, [index[j] for j in redo], results)  # type: ignore[arg-type]
        finally:
            self._returns.give_back(done_with)
        return results

    def _locate_missing(
        self, wire_keys: list[bytes], infos: list[ObjectInfo | KVStoreError | None]
    ) -> list[int]:
        """Fill the None entries of ``infos`` from the master (and remember the answers).

        Returns:
            The lease tokens the caller gives back once its read is done.
        """
        missing = [j for j, info in enumerate(infos) if info is None]
        if not missing:
            return []
        keys = wire_keys if len(missing) == len(wire_keys) else [wire_keys[j] for j in missing]
        lease_until, generation = self._lookup_stamp()
        got = self._locations(keys)
        done_with = self._cache.put_many(keys, got, lease_until, generation)
        for j, info in zip(missing, got, strict=True):
            infos[j] = info
        return done_with

    def _read_fresh(
        self, infos: list[ObjectInfo | KVStoreError], index: list[int], results: list[Any]
    ) -> None:
        """Read objects into new ``bytes`` (through a reused scratch buffer)."""
        sizes = [info.size if isinstance(info, ObjectInfo) else 0 for info in infos]
        # Read into a reused, already-faulted scratch buffer and copy each object out once:
        # a fresh bytearray per object costs zeroing and page faults on top of the copy.
        scratch = self._scratch.get(sum(sizes))
        dests: list[memoryview] = []
        pos = 0
        for n in sizes:
            dests.append(scratch[pos : pos + n])
            pos += n
        self._read_objects(infos, dests, index, results)
        for j, i in enumerate(index):
            if not isinstance(results[i], KVStoreError):
                results[i] = bytes(dests[j])
        for d in dests:
            d.release()

    def get(self, key: str | bytes) -> bytes:
        """Read one object.

        Raises:
            KeyNotFoundError, NodeUnavailableError, ChecksumMismatchError, ...
        """
        return _raise_if_error(self.batch_get([key])[0])

    # ================================================================ the rest
    def batch_exists(self, keys: Sequence[str | bytes]) -> list[bool]:
        """Whether each key is stored (committed). Takes no lease."""
        return list(self._control.call("exists", {"keys": [encode_key(k) for k in keys]}))

    def exists(self, key: str | bytes) -> bool:
        return self.batch_exists([key])[0]

    def batch_remove(self, keys: Sequence[str | bytes]) -> list[KVStoreError | None]:
        wire_keys = [encode_key(k) for k in keys]
        self._cache.forget(wire_keys)
        try:
            reply = self._control.call("remove", {"keys": wire_keys})
        finally:
            self._cache.forget(wire_keys)  # answers looked up meanwhile (see batch_put)
        return [result_from_wire(r)[0] for r in reply]

    def remove(self, key: str | bytes) -> None:
        """Delete one object. Raises KeyNotFoundError when it is not stored."""
        _raise_if_error(self.batch_remove([key])[0])

    def batch_pin(
        self, keys: Sequence[str | bytes], *, ttl: float = 60.0, hard: bool = False
    ) -> list[KVStoreError | None]:
        """Pin many objects; per key None or the error (KeyNotFoundError when missing)."""
        reply = self._control.call(
            "pin", {"keys": [encode_key(k) for k in keys], "ttl_s": ttl, "hard": hard}
        )
        return [result_from_wire(r)[0] for r in reply]

    def pin(self, key: str | bytes, *, ttl: float = 60.0, hard: bool = False) -> None:
        """Keep an object from eviction for ``ttl`` seconds.

        A soft pin (default) makes it go last and only under pressure; a hard pin keeps it until
        :meth:`unpin` or the TTL ends. Pinning again replaces the earlier pin.

        Raises:
            KeyNotFoundError: the key is not stored.
            InvalidRequestError: a TTL out of range.
        """
        _raise_if_error(self.batch_pin([key], ttl=ttl, hard=hard)[0])

    def batch_unpin(self, keys: Sequence[str | bytes]) -> list[KVStoreError | None]:
        reply = self._control.call("unpin", {"keys": [encode_key(k) for k in keys]})
        return [result_from_wire(r)[0] for r in reply]

    def unpin(self, key: str | bytes) -> None:
        """Drop a pin. Raises KeyNotFoundError when the key is not stored."""
        _raise_if_error(self.batch_unpin([key])[0])

    def locate(self, key: str | bytes) -> ObjectInfo:
        """Where an object lives, with a read lease (its grants expire with the lease).

        Pair with :meth:`read_located`; a read after the lease ended fails with
        GrantInvalidError instead of returning bytes that may have been reused. The caller owns
        the lease: give it back with :meth:`release_lease` once done (else the master holds the
        object and any space freed under it until the lease runs out).

        Raises:
            KeyNotFoundError, InvalidRequestError.
        """
        return _raise_if_error(self._locations([encode_key(key)])[0])

    def release_lease(self, info: ObjectInfo) -> None:
        """Give back the read lease of an answer of :meth:`locate` (reads of it are done).

        It travels with this client's next request to the master, or on its own shortly
        after; giving one back twice changes nothing.
        """
        self._returns.give_back([info.lease])

    def read_located(self, info: ObjectInfo, buffer: Any) -> int:
        """Read an object located earlier by :meth:`locate` into ``buffer``; returns its size.

        Raises:
            GrantInvalidError (lease over), NodeUnavailableError, ChecksumMismatchError, ...
        """
        results: list[Any] = [None]
        stager = self._stager([buffer])
        if stager is None:
            self._read_objects([info], [as_bytes_view(buffer, writable=True)], [0], results)
            return _raise_if_error(results[0])
        with stager.gets([buffer]) as staged:
            dest = as_bytes_view(staged.buffers[0], writable=True)
            self._read_objects([info], [dest], [0], results)
            staged.finish(results)
        return _raise_if_error(results[0])

    def list_keys(self, prefix: str | bytes = b"", *, page: int = 10_000) -> list[bytes]:
        """Every stored key that starts with ``prefix``, sorted (wire form: UTF-8 bytes).

        Asked a page at a time (``page`` keys per master call), so one answer stays bounded;
        keys put or removed meanwhile may or may not be listed.

        Raises:
            InvalidRequestError: a prefix that is not str/bytes or too long, or a bad ``page``.
        """
        raw = prefix.encode("utf-8") if isinstance(prefix, str) else prefix
        if not isinstance(raw, bytes):
            raise InvalidRequestError("prefix must be str or bytes")
        out: list[bytes] = []
        after: bytes | None = None
        while True:
            args: dict[str, Any] = {"prefix": raw, "limit": page}
            if after is not None:
                args["after"] = after
            got = list(self._control.call("list_keys", args))
            out.extend(got)
            if len(got) < page:
                return out
            after = got[-1]

    def stats(self) -> dict[str, Any]:
        """The master's cluster figures."""
        return self._control.call("stats", {})

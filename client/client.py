"""The byte-level client SDK: put/get objects by key, zero-copy into caller buffers, in batches.

One master call per batch to learn (or allocate) where the bytes live, then one data call per
storage node, pipelined across nodes. Every object carries an xxh3_64 checksum computed at put;
every full read verifies it, so a read returns the exact bytes or raises.

:class:`Client` is the facade: it checks and encodes the caller's arguments and hands the work to
the parts that own it, each in a module of its own:

- :mod:`kvstore.client.control`: the channel to the master (a fixed address, or the leader of
  an HA cluster: one interface, the client does not know which);
- :mod:`kvstore.client.endpoints`: what to say when the address is not a master's control
  port (a node's data port, an admin API, an ``http://`` URL);
- :mod:`kvstore.client.reads`: the one read pipeline (lease → speculate → locate → read, with
  replica fallback and byte ranges) behind every get and the KV-cache layer's loads;
- :mod:`kvstore.client.puts`: the two-phase put of a batch (one :class:`PutBatch` record);
- :mod:`kvstore.client.datapath`: the bytes to and from the nodes (shm, RDMA, TCP);
- :mod:`kvstore.client.inplace`: zero-copy reads in a same-host node's shared memory;
- :mod:`kvstore.client.locations` and :mod:`kvstore.client.releases`: the answers this client
  remembers, and the read leases it gives back;
- :mod:`kvstore.client.staging`: CUDA tensors through pinned host buffers.

The KV-cache layer (:mod:`kvstore.client.kvcache`), the KV event stream and the engine adapters
use only the public methods here (the prefix verbs :meth:`Client.locate_prefix` and
:meth:`Client.lookup_prefix`, :meth:`Client.batch_put` with a :class:`PromptCommit`,
:meth:`Client.batch_read_located`, :meth:`Client.batch_locate` and :meth:`Client.read_in_place`,
:meth:`Client.release_leases`, the event polls), never a
private member (tests/client/test_layers.py keeps it so).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore import auth
from kvstore.address import Address
from kvstore.client import endpoints
from kvstore.client.blanks import Blanks
from kvstore.client.buffers import Segments, as_bytes_view
from kvstore.client.control import ControlChannel, open_channel
from kvstore.client.datapath import DataPath
from kvstore.client.inplace import InPlaceReads
from kvstore.client.locations import LocationCache
from kvstore.client.puts import PromptCommit, PutBatch, Putter
from kvstore.client.reads import LocatedRead, ReadPipeline
from kvstore.client.releases import LeaseReturns
from kvstore.client.staging import CudaStaging, PinnedPool, is_cuda_tensor
from kvstore.client.transport import checksum
from kvstore.clocks import MasterClock
from kvstore.errors import (
    InvalidRequestError,
    KVStoreError,
    KVTimeoutError,
    ProtocolError,
)
from kvstore.etcd import is_etcd_url
from kvstore.keys import Namespace
from kvstore.kvblocks import tokens_to_wire
from kvstore.limits import MAX_BATCH_KEYS, encode_key
from kvstore.topology import Site
from kvstore.types import ObjectInfo, result_from_wire

__all__ = ["Client", "LocatedRead", "PrefixBlock", "PromptCommit", "checksum"]

DEFAULT_TIMEOUT_S = 30.0
#: How old the master clock's sample may grow before an in-place read asks the master again
#: (the local monotonic clock's rate drifts from the master's wall clock by NTP's corrections).
CLOCK_REFRESH_S = 60.0


def _raise_if_error(result: Any) -> Any:
    if isinstance(result, KVStoreError):
        raise result
    return result


@dataclass(frozen=True, slots=True)
class PrefixBlock:
    """One block of a prompt's cached prefix, as the master's prefix index answers it.

    Attributes:
        key: the block object's key.
        num_tokens: tokens of the prompt this block holds (the last block may hold fewer than
            ``block_size``).
        info: where it lives, with a read lease (give it back with
            :meth:`Client.release_leases`), or the error of a block that vanished between the
            index and the object table.
    """

    key: bytes
    num_tokens: int
    info: ObjectInfo | KVStoreError


def _close_parts(returns: LeaseReturns, control: ControlChannel, data: DataPath) -> None:
    """Close a client's parts: at close(), or when a client nobody closed is collected (its
    sockets, its shared-memory mappings and their descriptors, its lease thread)."""
    returns.close()
    control.close()
    data.close()


class Client:
    """A connection to a kvstore cluster. Thread-safe.

    Use :meth:`connect`; close with :meth:`close` or a ``with`` block.

    Args:
        control: the channel to the master (see :func:`kvstore.client.control.open_channel`).
        timeout: seconds any one network wait may take.
        token: the cluster token for the nodes' data connections.
        shm: use shared memory for nodes on this host that offer it.
        lease_reads: see :meth:`connect`.
        site: where this client runs (see :meth:`connect`); None: nowhere in particular (no
            placement or read order for it).
        blanks: see :meth:`connect`.
    """

    def __init__(
        self,
        control: ControlChannel,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        token: auth.Token | None = None,
        shm: bool = True,
        lease_reads: bool = False,
        site: Site | None = None,
        blanks: bool = True,
    ) -> None:
        self.timeout = timeout
        self.site = site
        self._control = control
        # NOTE: no part refers back to the client (the lambdas take ``control``, not ``self``):
        # a client dropped without close() is collected, and its finalizer closes the parts.
        self._data = DataPath(
            timeout, lambda: control.call("node_transports", {}), shm=shm, token=token
        )
        #: Leases of finished reads on their way back to the master (kvstore.client.releases).
        self._returns = LeaseReturns(lambda t: control.call("release_leases", {"tokens": t}))
        self._finalizer = weakref.finalize(self, _close_parts, self._returns, control, self._data)
        control.releases = self._returns
        # With lease reads the cache owns the leases of the answers it keeps (see locations.py).
        self._cache = LocationCache(give_back=self._returns.give_back if lease_reads else None)
        self._want_lease_reads = lease_reads
        #: The master's wall clock, which its grants expire on (in-place reads ask it).
        self._master_clock = MasterClock()
        self._reads = ReadPipeline(control, self._data, self._cache, self._returns)
        self._puts = Putter(control, self._data, self._cache)
        self._puts.changed = self._reads.changed
        if blanks:
            self._puts.blanks = Blanks(self._master_clock)
            self._puts.home = self._reads.home_of
        # This client's site travels with the calls whose answer depends on it.
        self._site_args = {"at": site.to_wire()} if site is not None else {}
        self._reads.site_args = self._puts.site_args = self._site_args
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
        blanks: bool = True,
        host_id: str | None = None,
        rack: str | None = None,
        zone: str | None = None,
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
            blanks: have the master start a few puts ahead, per node, for the sizes this
                client puts one key at a time (up to 64 KiB): such a put then writes its
                bytes with its key and commits, two round trips instead of three (see
                :mod:`kvstore.client.blanks`). The room they hold (4 or so a node for each of
                4 sizes) is given back at :meth:`close`.
            host_id, rack, zone: where this client runs (:mod:`kvstore.topology`); each None
                reads ``$KVSTORE_HOST_ID`` / ``$KVSTORE_RACK`` / ``$KVSTORE_ZONE``, else the
                hostname (host) or the default rack and zone. The master places this client's
                puts on its host's node while that has room under its high watermark, then in
                its rack, and answers its reads with each object's nearest replica first.

        Raises:
            InvalidRequestError: a malformed address or token.
            WrongEndpointError: ``address`` is not a master's control port (a storage node's
                data port, an admin API, an ``http://`` URL); the message says what to use.
            MasterUnavailableError: nothing answers there (no leader, for ``etcd://``).
            UnauthenticatedError: the master needs a token and this is not it.
        """
        endpoints.check_address(address)
        if token is None:
            token = auth.load_token()
        elif not isinstance(token, auth.Token):
            token = auth.Token(token)
        client = cls(
            open_channel(address, timeout, token),
            timeout=timeout,
            token=token,
            shm=shm,
            lease_reads=lease_reads,
            site=Site.declared(host_id, rack, zone),
            blanks=blanks,
        )
        try:
            try:
                endpoints.check_ping(address, client._ping())
            except (ProtocolError, KVTimeoutError):
                # Not a kvstore frame, or no answer: an HTTP port says so to an HTTP request.
                if not is_etcd_url(address) and endpoints.speaks_http(Address.parse(address)):
                    raise endpoints.http_port_error(address) from None
                raise
            # The nodes' transports, learned up front (not from inside the first read).
            client._data.refresh_offers(force=True)
        except BaseException:
            client.close()
            raise
        return client

    def _ping(self) -> Any:
        """Ask the master how long its read leases hold, and its clock; returns its answer."""
        sent = self._master_clock.sent()
        ping = self._control.call("ping", {})
        if isinstance(ping, dict):
            self._master_clock.observe(ping.get("now_ms"), sent)
        self._hello(ping)
        return ping

    def _hello(self, ping: Any) -> None:
        """Learn from the master's ``ping`` answer how long its read leases hold."""
        lease_s = ping.get("lease_s") if isinstance(ping, dict) else None
        if self._want_lease_reads and isinstance(lease_s, int | float):
            self._reads.use_lease_reads(lease_s)

    @property
    def call_timeout(self) -> float:
        """Seconds one try of a master call may wait for its answer (a long poll must end well
        inside it, or the channel would call a quiet master a dead one)."""
        return self._control.timeout

    def close(self) -> None:
        if self._finalizer.alive:
            self._puts.close()  # (blanks: given back while the channel is open)
        self._finalizer()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stager(self, objs: Sequence[Any]) -> CudaStaging | None:
        """The CUDA staging when any of ``objs`` is a CUDA tensor (made on first use), else None."""
        staging = self._staging
        if not (staging.any_device(objs) if staging else any(map(is_cuda_tensor, objs))):
            return None
        with self._staging_lock:
            if self._staging is None:
                self._staging = CudaStaging(PinnedPool())
            return self._staging

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
        self,
        keys: Sequence[str | bytes],
        values: Sequence[Any],
        *,
        replicas: int = 1,
        prompt: PromptCommit | None = None,
    ) -> list[KVStoreError | None]:
        """Store many objects: one master call to allocate, one write per node, one to commit.
        CUDA tensors are staged through pinned host buffers first (see
        :mod:`kvstore.client.staging`). A value may be a :class:`~kvstore.client.buffers.Segments`:
        the object is its pieces' concatenation, sent without joining them.

        Args:
            replicas: copies of each object on distinct nodes.
            prompt: for the KV-cache layer: the prompt whose block objects these are, indexed
                in the master's prefix index in the same call as the commit.

        Returns:
            Per key, None on success or the error for that key (nothing stored for it).
        """
        if len(keys) != len(values):
            raise InvalidRequestError("keys and values differ in length")
        stager = self._stager(values)
        if stager is None:
            return self._put_host(keys, values, replicas, prompt)
        with stager.puts(values) as host_values:
            return self._put_host(keys, host_values, replicas, prompt)

    def _put_host(
        self,
        keys: Sequence[str | bytes],
        values: Sequence[Any],
        replicas: int,
        prompt: PromptCommit | None,
    ) -> list[KVStoreError | None]:
        results: list[KVStoreError | None] = [None] * len(keys)
        wire_keys: list[bytes] = []
        views: list[memoryview | Segments] = []
        index: list[int] = []
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            try:
                wk, view = encode_key(k), v if type(v) is Segments else as_bytes_view(v)
            except KVStoreError as err:
                results[i] = err
                continue
            wire_keys.append(wk)
            views.append(view)
            index.append(i)
        batch = PutBatch(wire_keys, views, replicas, prompt)
        self._puts.run(batch)
        for i, r in zip(index, batch.results, strict=True):
            results[i] = r
        return results

    # ================================================================ gets
    def get(self, key: str | bytes) -> bytes:
        """Read one object.

        Raises:
            KeyNotFoundError, NodeUnavailableError, ChecksumMismatchError, ...
        """
        return _raise_if_error(self.batch_get([key])[0])

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
        if wire_keys:
            for i, r in zip(index, self._reads.get(wire_keys), strict=True):
                results[i] = r
        return results

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
            return self._get_into_host(keys, buffers)
        with stager.gets(buffers) as staged:
            results = self._get_into_host(keys, staged.buffers)
            staged.finish(results)
        return results

    def _get_into_host(
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
        if wire_keys:
            for i, r in zip(index, self._reads.get_into(wire_keys, dests), strict=True):
                results[i] = r
        return results

    def locate(self, key: str | bytes) -> ObjectInfo:
        """Where an object lives, with a read lease (its grants expire with the lease).

        Pair with :meth:`read_located`; a read after the lease ended fails with
        GrantInvalidError instead of returning bytes that may have been reused. The caller owns
        the lease: give it back with :meth:`release_lease` once done (else the master holds the
        object and any space freed under it until the lease runs out).

        Raises:
            KeyNotFoundError, InvalidRequestError.
        """
        return _raise_if_error(self._reads.locate([encode_key(key)])[0])

    def batch_locate(self, keys: Sequence[str | bytes]) -> list[ObjectInfo | KVStoreError]:
        """:meth:`locate` of many keys in one master call: per key its answer (holding a read
        lease: give them back with :meth:`release_leases` once done) or its error.

        Raises:
            InvalidRequestError: a malformed key or too many keys (nothing is located).
        """
        return self._reads.locate([encode_key(k) for k in keys])

    def read_in_place(self, infos: Sequence[ObjectInfo]) -> InPlaceReads:
        """Zero-copy reads of located objects (:meth:`batch_locate`): each object's bytes in
        place in a same-host node's shared memory (``view(i)``, checked against its checksum
        when taken), where this process maps them (``mapped(i)``; read the others with
        :meth:`batch_read_located`).

        Use it as a context manager; copy out of the views, then ask ``intact()`` before
        trusting the copies, then give the leases back. :mod:`kvstore.client.inplace` says why.
        """
        self._data.refresh_offers({loc.node_id for info in infos for loc in info.locations})
        if self._master_clock.age_s() > CLOCK_REFRESH_S:
            self._ping()
        return InPlaceReads(
            infos, self._data.views, self._reads.report_corrupt, clock_ms=self._master_clock
        )

    def release_lease(self, info: ObjectInfo) -> None:
        """Give back the read lease of an answer of :meth:`locate` (reads of it are done).

        It travels with this client's next request to the master, or on its own shortly
        after; giving one back twice changes nothing.
        """
        self._returns.give_back([info.lease])

    def release_leases(self, infos: Iterable[ObjectInfo]) -> None:
        """:meth:`release_lease` of many answers (of :meth:`locate` or :meth:`locate_prefix`)."""
        self._returns.give_back(info.lease for info in infos)

    def read_located(self, info: ObjectInfo, buffer: Any) -> int:
        """Read an object located earlier by :meth:`locate` into ``buffer``; returns its size.

        Raises:
            GrantInvalidError (lease over), NodeUnavailableError, ChecksumMismatchError, ...
        """
        stager = self._stager([buffer])
        if stager is None:
            read = LocatedRead(info, as_bytes_view(buffer, writable=True))
            self._reads.read([read])
            return _raise_if_error(read.result)
        with stager.gets([buffer]) as staged:
            read = LocatedRead(info, as_bytes_view(staged.buffers[0], writable=True))
            self._reads.read([read])
            staged.finish([read.result])
        return _raise_if_error(read.result)

    def batch_read_located(self, reads: Sequence[LocatedRead]) -> None:
        """Read objects located earlier (:meth:`locate`, :meth:`locate_prefix`) into host
        buffers, whole or by byte ranges; sets each read's ``result`` (its size, or the error).

        A replica that is gone or fails its check falls back to the next; a corrupt one is
        reported to the master. See :class:`~kvstore.client.reads.LocatedRead`.
        """
        self._reads.read(reads)

    # ================================================================ the prefix index
    def locate_prefix(self, namespace: Namespace, tokens: np.ndarray) -> list[PrefixBlock]:
        """The cached prefix of ``tokens`` in ``namespace``'s prefix index, block by block, with
        where each block lives (one master call, ``kv_match``). Each located block holds a read
        lease: give them back with :meth:`release_leases` once the reads are done.

        Raises:
            InvalidRequestError: bad tokens or namespace.
        """
        reply = self._control.call(
            "kv_match", {**_match_args(namespace, tokens), **self._site_args}
        )
        out: list[PrefixBlock] = []
        for key, n, r in reply["blocks"]:
            err, payload = result_from_wire(r)
            out.append(
                PrefixBlock(key, n, err if err is not None else ObjectInfo.from_wire(payload))
            )
        return out

    def lookup_prefix(
        self, namespace: Namespace, tokens: np.ndarray, *, work: Callable[[], None] | None = None
    ) -> int:
        """Leading tokens of ``tokens`` whose KV is cached in ``namespace`` (token-granular).

        One master call, and it takes no read leases (a lookup holds no block from eviction):
        a block may still go before a later load, which then loads less. ``work``, if given,
        runs while the master answers (its error is raised once the answer is read).

        Raises:
            InvalidRequestError: bad tokens or namespace.
        """
        args = {**_match_args(namespace, tokens), "locate": False}
        if work is None:
            reply = self._control.call("kv_match", args)
        else:
            reply, _ = self._control.call_overlapped("kv_match", args, work)
        return sum(n for _, n, _ in reply["blocks"])

    # ================================================================ KV events
    def poll_events(
        self,
        since_seq: int,
        since_epoch: int | None,
        *,
        max_events: int,
        wait_s: float,
        namespaces: list[bytes] | None = None,
    ) -> Any:
        """One ``events`` call: the events after ``(since_epoch, since_seq)``, waiting up to
        ``wait_s`` for some, or the master's resync notice. The raw answer:
        :class:`kvstore.client.events.EventStream` reads it and follows the stream."""
        args: dict[str, Any] = {
            "since_seq": since_seq,
            "since_epoch": since_epoch,
            "max": max_events,
            "wait_s": wait_s,
        }
        if namespaces is not None:
            args["namespaces"] = namespaces
        return self._control.call("events", args)

    def events_snapshot(self, namespaces: list[bytes] | None = None) -> Any:
        """One ``events_snapshot`` call: every indexed block (of ``namespaces``) and the
        position to follow events from. The raw answer (see :mod:`kvstore.client.events`)."""
        args: dict[str, Any] = {} if namespaces is None else {"namespaces": namespaces}
        return self._control.call("events_snapshot", args)

    # ================================================================ the rest
    def _per_key(self, verb: str, wire_keys: list[bytes], **args: Any) -> list[Any]:
        """``verb``'s per-key answers to ``wire_keys``, asked in calls of at most
        :data:`MAX_BATCH_KEYS` keys (the most the master takes in one)."""
        out: list[Any] = []
        for start in range(0, max(len(wire_keys), 1), MAX_BATCH_KEYS):
            chunk = wire_keys[start : start + MAX_BATCH_KEYS]
            out.extend(self._control.call(verb, {"keys": chunk, **args}))
        return out

    def batch_exists(self, keys: Sequence[str | bytes]) -> list[bool]:
        """Whether each key is stored (committed). Takes no lease."""
        return self._per_key("exists", [encode_key(k) for k in keys])

    def exists(self, key: str | bytes) -> bool:
        return self.batch_exists([key])[0]

    def batch_remove(self, keys: Sequence[str | bytes]) -> list[KVStoreError | None]:
        wire_keys = [encode_key(k) for k in keys]
        self._cache.forget(wire_keys)
        self._reads.changed(wire_keys)
        try:
            reply = self._per_key("remove", wire_keys)
        finally:
            self._cache.forget(wire_keys)  # answers looked up meanwhile (see Putter.run)
        return [result_from_wire(r)[0] for r in reply]

    def remove(self, key: str | bytes) -> None:
        """Delete one object. Raises KeyNotFoundError when it is not stored."""
        _raise_if_error(self.batch_remove([key])[0])

    def batch_pin(
        self, keys: Sequence[str | bytes], *, ttl: float = 60.0, hard: bool = False
    ) -> list[KVStoreError | None]:
        """Pin many objects; per key None or the error (KeyNotFoundError when missing)."""
        reply = self._per_key("pin", [encode_key(k) for k in keys], ttl_s=ttl, hard=hard)
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
        reply = self._per_key("unpin", [encode_key(k) for k in keys])
        return [result_from_wire(r)[0] for r in reply]

    def unpin(self, key: str | bytes) -> None:
        """Drop a pin. Raises KeyNotFoundError when the key is not stored."""
        _raise_if_error(self.batch_unpin([key])[0])

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


def _match_args(namespace: Namespace, tokens: np.ndarray) -> dict[str, Any]:
    if not isinstance(namespace, Namespace):
        raise InvalidRequestError("namespace must be a kvstore Namespace")
    return {"namespace": namespace.to_dict(), "tokens": tokens_to_wire(tokens)}

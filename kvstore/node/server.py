"""The storage node's data server: reads and writes byte ranges of granted objects over TCP.

One thread per connection, blocking sockets. Socket calls release the GIL, so the bytes move
at kernel speed: writes ``recv_into`` the arena directly, reads ``sendmsg`` arena memoryviews.

Verbs (request args → response result; payload = raw bytes after the body):

``write``  ``{"items": [[grant, start, length, checksum], ...]}`` + payload (the items' bytes,
           concatenated) → per item ``[code, None | message]``
``read``   ``{"items": [[grant, ranges | None], ...]}`` → per item ``[code, length | message]``
           + payload (the valid items' ranges, concatenated)
``ping``, ``manifest``, ``stats``

Segments other than the DRAM arena (NVMe, HBM) are :class:`~kvstore.node.tiers.Tier` objects:
reads of them go through the same ``read`` verb (the grant names the segment), writes to them
carry whole objects and land in one batch per tier (one lmdb transaction for NVMe).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore import auth, grants, protocol
from kvstore.errors import (
    GrantInvalidError,
    InternalError,
    InvalidRequestError,
    KVStoreError,
    OutOfRangeError,
    ProtocolError,
    UnknownVerbError,
)
from kvstore.node.arena import ShmArena
from kvstore.node.tiers import TIER_NVME, StoredObject, Tier
from kvstore.types import result_to_wire

log = logging.getLogger(__name__)

#: A connection that sends nothing for this long (idle, or stalled mid-payload) is closed.
#: A frame's header and body have a shorter deadline (protocol.frame_deadline_s).
IDLE_TIMEOUT_S = 120.0
#: Verbs that carry a payload, and its most bytes; every other verb takes none.
VERB_MAX_PAYLOAD = {"write": protocol.DEFAULT_MAX_PAYLOAD}
#: A refused request's payload up to this size is read and dropped (the connection stays
#: usable); a larger one is not read at all: the connection is closed after the error.
MAX_DISCARD = 1 << 20
MAX_RANGES_PER_ITEM = 4096


@dataclass(slots=True)
class ManifestEntry:
    key: bytes
    size: int
    checksum: int
    stamp: int = 0  # the write grant's expiry: orders versions of a key (kvstore.manifest)


class Manifest:
    """What this node holds: (segment, offset) → entry. Written by data threads, read by the agent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, int], ManifestEntry] = {}

    def record(self, segment: str, offset: int, entry: ManifestEntry) -> None:
        with self._lock:
            self._entries[(segment, offset)] = entry

    def record_many(self, entries: list[tuple[str, int, ManifestEntry]]) -> None:
        """Record ``(segment, offset, entry)`` triples under one lock."""
        with self._lock:
            for segment, offset, entry in entries:
                self._entries[(segment, offset)] = entry

    def forget(self, items: list[tuple[Any, ...]]) -> None:
        """Drop ``(segment, offset[, stamp])`` entries; with a stamp, only that version."""
        with self._lock:
            for item in items:
                pos = (item[0], item[1])
                entry = self._entries.get(pos)
                if entry is None:
                    continue
                if len(item) > 2 and item[2] and entry.stamp != item[2]:
                    continue  # the extent was reused by a newer write since
                del self._entries[pos]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def clear_volatile(self, durable_segments: set[str]) -> None:
        """Forget every entry except those of tiers that survive a restart (NVMe)."""
        with self._lock:
            self._entries = {p: e for p, e in self._entries.items() if p[0] in durable_segments}

    def snapshot(self) -> list[list[Any]]:
        with self._lock:
            return [
                [seg, off, e.key, e.size, e.checksum, e.stamp]
                for (seg, off), e in self._entries.items()
            ]

    def __len__(self) -> int:
        return len(self._entries)


class DataServer:
    """Serves the data plane for a set of segments (name → arena).

    Args:
        segments: the node's arenas by segment name.
        secret: the key the master signs this node's grants with.
        host, port: where to listen (port 0 picks a free one).
        clock_ms: wall-clock milliseconds, for grant expiry.
        token: the cluster token every connection must present first (None: no check).
    """

    def __init__(
        self,
        segments: dict[str, ShmArena],
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        clock_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        tiers: dict[str, Tier] | None = None,
        token: auth.Token | None = None,
    ) -> None:
        self.segments = segments
        self.token = token
        #: Segments served through the tier interface (NVMe, HBM), by segment name.
        self.tiers: dict[str, Tier] = dict(tiers or {})
        self.secret = secret  # also starts the memo of verified grants
        self.clock_ms = clock_ms
        #: Which allocation owns each granted range now (see grants.WriteClaims).
        self.claims = grants.WriteClaims(lambda: self.clock_ms())
        self.manifest = Manifest()
        for tier in self.tiers.values():
            for obj in tier.stored():
                self.manifest.record(
                    tier.segment,
                    obj.offset,
                    ManifestEntry(obj.key, obj.size, obj.checksum, obj.stamp),
                )
        self._listener = socket.create_server((host, port), backlog=128, reuse_port=False)
        self.host = host
        self.port = self._listener.getsockname()[1]
        self._stopped = threading.Event()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        #: Connections that have not sent their hello yet (bounded; auth.PendingConnections).
        self.pending = auth.PendingConnections()
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="node-accept", daemon=True
        )
        self.num_reads = 0
        self.num_writes = 0
        #: Called with a connection's FramedSocket when it closes (e.g. RDMA queue pair teardown).
        self.on_disconnect: list[Callable[[protocol.FramedSocket], None]] = []
        self._verbs: dict[
            str, Callable[[protocol.FramedSocket, protocol.Request, int, memoryview], None]
        ] = {
            "write": self._write,
            "read": self._read,
            "ping": self._simple(lambda args: {"role": "node"}),
            "manifest": self._simple(lambda args: self.manifest.snapshot()),
            "stats": self._simple(lambda args: self.stats()),
        }

    @property
    def secret(self) -> bytes:
        """The key the master signs this node's grants with."""
        return self.verified.secret

    @secret.setter
    def secret(self, secret: bytes) -> None:
        # A new secret (a new registration) forgets every grant verified under the old one, and
        # stops every write still streaming in under one of them.
        self.verified = grants.VerifiedGrants(secret)
        claims = getattr(self, "claims", None)
        if claims is not None:
            claims.reset()

    def start(self) -> None:
        self._accept_thread.start()

    def stop(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._conns_lock:
            for c in self._conns:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
        self._accept_thread.join(timeout=5)

    def forget(self, items: list[tuple[Any, ...]]) -> None:
        """The master freed these ``(segment, offset[, stamp])``: drop them from the manifest,
        and delete what durable tiers keep for them (NVMe ids are never reused)."""
        self.manifest.forget(items)
        by_tier: dict[str, list[int]] = {}
        for item in items:
            seg, off = item[0], item[1]
            if seg in self.tiers:
                by_tier.setdefault(seg, []).append(off)
        for seg, offsets in by_tier.items():
            self.tiers[seg].forget(offsets)

    def read_object(self, segment: str, offset: int, size: int) -> memoryview:
        """A whole object's bytes from any tier (used by moves between tiers and nodes).

        Raises:
            GrantInvalidError: no such segment; KeyNotFoundError, OutOfRangeError from the tier.
        """
        tier = self.tiers.get(segment)
        if tier is not None:
            return tier.read(offset, size)
        arena = self.segments.get(segment)
        if arena is None:
            raise GrantInvalidError(f"no segment {segment!r} on this node")
        if offset < 0 or size < 0 or offset + size > arena.size:
            raise OutOfRangeError("range lies outside the segment")
        return arena.view[offset : offset + size]

    def store_objects(
        self, segment: str, items: list[tuple[StoredObject, memoryview]]
    ) -> list[KVStoreError | None]:
        """Store whole objects into one segment and record them in the manifest."""
        tier = self.tiers.get(segment)
        if tier is not None:
            results = tier.write(items)
        else:
            arena = self.segments.get(segment)
            if arena is None:
                return [GrantInvalidError(f"no segment {segment!r} on this node")] * len(items)
            results = []
            for obj, data in items:
                if obj.offset < 0 or obj.offset + len(data) > arena.size:
                    results.append(OutOfRangeError("range lies outside the segment"))
                    continue
                arena.view[obj.offset : obj.offset + len(data)] = data
                results.append(None)
        for (obj, _), err in zip(items, results, strict=True):
            if err is None:
                self.manifest.record(
                    segment, obj.offset, ManifestEntry(obj.key, obj.size, obj.checksum, obj.stamp)
                )
        return results

    def stats(self) -> dict[str, Any]:
        return {
            "num_objects": len(self.manifest),
            "num_reads": self.num_reads,
            "num_writes": self.num_writes,
            # Whether every arena's pages are mapped yet (kvstore.pages; False while warming).
            "arenas_warm": all(a.warm() for a in self.segments.values()),
        }

    # ------------------------------------------------------------------ connections
    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(IDLE_TIMEOUT_S)
            with self._conns_lock:
                self._conns.add(conn)
            if self.token is not None:
                self.pending.add(conn, lambda c=conn: c.shutdown(socket.SHUT_RDWR))
            threading.Thread(
                target=self._serve, args=(conn,), name="node-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        fs = protocol.FramedSocket(conn, max_payload=protocol.DEFAULT_MAX_PAYLOAD)
        scratch = memoryview(bytearray(1 << 16))
        gate = auth.Gate(self.token)
        # Without the token proved, the whole hello must arrive, small, by this time.
        hello_by = time.monotonic() + auth.HELLO_TIMEOUT_S
        try:
            while not self._stopped.is_set():
                try:
                    if gate.open:
                        fs.wait_frame()  # idle as long as IDLE_TIMEOUT_S
                        started = time.monotonic()
                        header = fs.read_header(started + protocol.FRAME_TIMEOUT_S)
                        body_by = started + protocol.frame_deadline_s(header.body_len)
                    else:
                        header = fs.read_header(hello_by)
                        body_by = hello_by
                    if header.kind != protocol.KIND_REQUEST:
                        raise ProtocolError("expected a request frame")
                    gate.check_header(header)  # nothing large before the token is proved
                except KVStoreError as err:
                    fs.send_frame(protocol.encode_error(0, err))
                    return
                body = fs.read_body(header, body_by)
                try:
                    request = protocol.decode_request(body)
                    screened = gate.screen(request)
                    if screened is not None:
                        if gate.open:
                            self.pending.discard(conn)
                        if header.payload_len > MAX_DISCARD:
                            screened = (screened[0], True)  # not worth reading: hang up
                        else:
                            fs.discard(header.payload_len, scratch)
                        fs.send_frame(screened[0])
                        if screened[1]:
                            return
                        continue
                    handler = self._verbs.get(request.verb)
                    if handler is None:
                        raise UnknownVerbError(f"unknown verb {request.verb[:64]!r}")
                    if header.payload_len > VERB_MAX_PAYLOAD.get(request.verb, 0):
                        raise ProtocolError(
                            f"{request.verb} takes no payload"
                            if request.verb not in VERB_MAX_PAYLOAD
                            else f"payload too large for {request.verb}"
                        )
                except KVStoreError as err:
                    if not self._refuse(fs, protocol.request_id_of(body), err, header, scratch):
                        return
                    continue
                try:
                    handler(fs, request, header.payload_len, scratch)
                except KVStoreError as err:
                    # Raised before the payload was touched (handlers guarantee it).
                    if not self._refuse(fs, request.req_id, err, header, scratch):
                        return
        except (ConnectionError, TimeoutError, OSError):
            pass  # peer went away or stalled; nothing it sent was acknowledged
        except Exception:
            log.exception("data connection failed")
            with contextlib.suppress(OSError):
                fs.send_frame(protocol.encode_error(0, InternalError("internal error")))
        finally:
            self.pending.discard(conn)
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()
            for hook in self.on_disconnect:
                hook(fs)

    @staticmethod
    def _refuse(
        fs: protocol.FramedSocket,
        req_id: int,
        err: KVStoreError,
        header: protocol.FrameHeader,
        scratch: memoryview,
    ) -> bool:
        """Answer a refused request; returns whether the connection stays usable. Its payload
        is skipped when small, never read when large (a 1 TiB ``ping`` costs nothing)."""
        if header.payload_len > MAX_DISCARD:
            fs.send_frame(protocol.encode_error(req_id, err))
            return False
        fs.discard(header.payload_len, scratch)
        fs.send_frame(protocol.encode_error(req_id, err))
        return True

    def _simple(
        self, fn: Callable[[dict[str, Any]], Any]
    ) -> Callable[[protocol.FramedSocket, protocol.Request, int, memoryview], None]:
        def handler(
            fs: protocol.FramedSocket, req: protocol.Request, payload_len: int, scratch: memoryview
        ) -> None:
            if payload_len:
                raise ProtocolError(f"{req.verb} takes no payload")
            fs.send_frame(protocol.encode_response(req.req_id, fn(req.args)))

        return handler

    # ------------------------------------------------------------------ grants
    def _granted_view(
        self, grant_wire: Any, op: str, remember: bool = True
    ) -> tuple[grants.Grant, memoryview]:
        grant = self.verified.check(grant_wire, op, self.clock_ms(), remember)
        tier = self.tiers.get(grant.segment)
        if tier is not None:
            if op != grants.OP_READ:
                raise InvalidRequestError("tier writes go through the whole-object path")
            return grant, tier.read(grant.offset, grant.size)
        return grant, self._arena_view(grant)

    def _arena_view(self, grant: grants.Grant) -> memoryview:
        """The granted bytes of an arena segment.

        Raises:
            GrantInvalidError: no such segment here; OutOfRangeError: the grant overruns it.
        """
        arena = self.segments.get(grant.segment)
        if arena is None:
            raise GrantInvalidError(f"no segment {grant.segment!r} on this node")
        if grant.offset + grant.size > arena.size:
            raise OutOfRangeError("granted range lies outside the segment")
        return arena.view[grant.offset : grant.offset + grant.size]

    # ------------------------------------------------------------------ verbs
    def _write(
        self,
        fs: protocol.FramedSocket,
        req: protocol.Request,
        payload_len: int,
        scratch: memoryview,
    ) -> None:
        items = req.args.get("items")
        if not isinstance(items, list) or not all(
            isinstance(i, list) and len(i) == 4 for i in items
        ):
            raise InvalidRequestError("write takes items: [[grant, start, length, checksum], ...]")
        lengths = [i[2] for i in items]
        if not all(type(n) is int and n >= 0 for n in lengths):
            raise InvalidRequestError("item lengths must be non-negative integers")
        if sum(lengths) != payload_len:
            raise ProtocolError(
                f"payload of {payload_len} bytes does not match the items' {sum(lengths)}"
            )
        # Check every item before touching the payload, then stream each into place.
        # NOTE: one WriteStream for the whole request: its items share one socket, and fencing
        # any of them shuts that socket down, so they stop together anyway. It is stopped (and
        # its claims released) when the request is over.
        stream = grants.WriteStream(fs.sock)
        now = self.clock_ms()
        plan: list[tuple[KVStoreError | None, grants.Grant | None, memoryview | None]] = []
        wanted: list[tuple[grants.Grant, bool, grants.WriteStream | None]] = []
        for grant_wire, start, length, checksum in items:
            try:
                # Write grants are used once: not worth a place in the memo of verified grants.
                grant = self.verified.check(grant_wire, grants.OP_WRITE, now, remember=False)
                tier = self.tiers.get(grant.segment)
                if tier is not None:
                    if start != 0 or length != grant.size:
                        raise InvalidRequestError(
                            f"writes to segment {grant.segment!r} carry whole objects"
                        )
                    if type(checksum) is not int:
                        raise InvalidRequestError("checksum must be an integer")
                    # (bytes buffered, stored after the payload: no stream to fence)
                    wanted.append((grant, tier.tier == TIER_NVME, None))
                    plan.append((None, grant, None))
                    continue
                view = self._arena_view(grant)
                grants.check_range(grant, start, length)
                if type(checksum) is not int:
                    raise InvalidRequestError("checksum must be an integer")
                wanted.append((grant, False, stream))
                plan.append((None, grant, view[start : start + length]))
            except KVStoreError as err:
                plan.append((err, None, None))
        # Claim every checked item's range at once (see grants.WriteClaims).
        got = iter(self.claims.begin_many(wanted))
        claimed: list[Any] = []  # per planned item, its claim or None
        for k, (err, _, _) in enumerate(plan):
            if err is not None:
                claimed.append(None)
                continue
            c = next(got)
            if isinstance(c, KVStoreError):
                claimed.append(None)
                plan[k] = (c, None, None)
            else:
                claimed.append(c)
        results: list[Any] = []
        # Whole objects for non-arena tiers, stored in one batch per tier after the payload.
        tier_items: dict[str, list[tuple[int, StoredObject, memoryview]]] = {}
        done: set[int] = set()  # planned items whose bytes all arrived
        stored: list[tuple[str, int, ManifestEntry]] = []
        aborted = stream.is_aborted
        try:
            for i, ((err, grant, dest), (_, start, length, checksum)) in enumerate(
                zip(plan, items, strict=True)
            ):
                if grant is not None and dest is None and err is None:
                    buf = memoryview(bytearray(length))
                    fs.recv_into(buf)
                    obj = StoredObject(
                        grant.offset, grant.key, grant.size, checksum, grant.expires_ms
                    )
                    tier_items.setdefault(grant.segment, []).append((len(results), obj, buf))
                    results.append([0, None])
                    continue
                if grant is None or dest is None:
                    fs.discard(length, scratch)
                    results.append(result_to_wire(err))
                    continue
                # No socket read starts once the grant has expired (or a newer write of these
                # bytes fenced this one): no byte of it lands on another allocation's bytes.
                left_s = (grant.expires_ms - self.clock_ms()) / 1000
                fs.recv_into_before(dest, time.monotonic() + left_s, aborted)
                done.add(i)
                if start == 0 and length == grant.size:
                    stored.append(
                        (
                            grant.segment,
                            grant.offset,
                            ManifestEntry(grant.key, grant.size, checksum, grant.expires_ms),
                        )
                    )
                results.append([0, None])
            for segment, batch in tier_items.items():
                now = self.clock_ms()
                live = []
                for i, obj, buf in batch:
                    if now > obj.stamp:  # (the stamp is the write grant's expiry)
                        results[i] = result_to_wire(
                            GrantInvalidError("write grant expired before its bytes arrived")
                        )
                    else:
                        live.append((i, obj, buf))
                errs = self.store_objects(segment, [(obj, buf) for _, obj, buf in live])
                for (i, _, _), e in zip(live, errs, strict=True):
                    results[i] = result_to_wire(e)
                    if e is None:
                        done.add(i)
        finally:
            if stored:
                self.manifest.record_many(stored)
            self.claims.end_many(
                [(c, i in done) for i, c in enumerate(claimed) if c is not None], stream
            )
            stream.stopped.set()
        self.num_writes += len(items)
        fs.send_frame(protocol.encode_response(req.req_id, results))

    def _read(
        self,
        fs: protocol.FramedSocket,
        req: protocol.Request,
        payload_len: int,
        scratch: memoryview,
    ) -> None:
        if payload_len:
            raise ProtocolError("read takes no payload")
        items = req.args.get("items")
        if not isinstance(items, list) or not all(
            isinstance(i, list) and len(i) == 2 for i in items
        ):
            raise InvalidRequestError("read takes items: [[grant, ranges | None], ...]")
        results: list[Any] = []
        views: list[memoryview] = []
        for grant_wire, ranges in items:
            try:
                grant, view = self._granted_view(grant_wire, grants.OP_READ)
                if ranges is None:
                    views.append(view)
                    results.append([0, len(view)])
                    continue
                if not isinstance(ranges, list) or len(ranges) > MAX_RANGES_PER_ITEM:
                    raise InvalidRequestError(
                        f"ranges must be a list of at most {MAX_RANGES_PER_ITEM} pairs"
                    )
                item_views = []
                for r in ranges:
                    if not isinstance(r, list) or len(r) != 2:
                        raise InvalidRequestError("each range must be [start, length]")
                    grants.check_range(grant, r[0], r[1])
                    item_views.append(view[r[0] : r[0] + r[1]])
                views.extend(item_views)
                results.append([0, sum(len(v) for v in item_views)])
            except KVStoreError as err:
                results.append(err.to_wire())
        total = sum(map(len, views))
        self.num_reads += len(items)
        fs.send_frame(protocol.encode_response(req.req_id, results, total), views)

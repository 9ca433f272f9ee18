"""Shared-memory transport: copy object bytes straight from/into a same-host node's arena.

A node started with ``--shm`` advertises its arena file through the master (path, device, inode,
size, its uid and its host's boot id). A client on the same host, running as the same user, maps
the file once and then serves reads and writes with one ``memcpy`` each, no socket, no syscall:
the master still grants exactly which bytes (offset and size), and writes are still committed by
the node (``shm_commit``: grant check, checksum) and the master (``put_end``).

Trust model: the arena file is mode 0600, so only the node's own user can map it, and any process
of that user that maps it can read and write *all* of it: the grant cannot be checked client-side
(its signature key is the node's secret) and does not protect the bytes from such a process. The
shm transport is for clients the node's user already trusts with every object on that node.

Safety checks, per mapping: the file must be on this host (boot id), owned by this uid, a private
regular file, with the inode, device and size the node advertised. Before each batch the client
``fstat``s its open descriptor: a file that was removed (the node stopped or restarted) or
truncated is dropped and the batch falls back to TCP. A truncation racing a copy can still fault
(SIGBUS); only a process of the same user can truncate the file.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
from collections.abc import Sequence
from typing import Any

import xxhash

from kvstore import grants
from kvstore.client.buffers import Segments
from kvstore.client.transport import (
    STREAM_HASH_MIN,
    ReadItem,
    WriteItem,
    payload_parts,
    stream_chunks,
    stream_hash_target,
)
from kvstore.errors import KVStoreError, OutOfRangeError, TransportUnavailableError
from kvstore.pages import Prefaulter, enabled
from kvstore.transports import ShmOffer, ShmSegment, check_same_host_file
from kvstore.types import Location

log = logging.getLogger(__name__)

#: A write is copied in place only while its grant holds at least this much longer (else it goes
#: over TCP, where the node checks every byte against the grant's expiry). Why: once a grant
#: expires the master may give its bytes to the next object, and the node never sees an shm
#: copy; the margin is what a copy that started in time may take (a memcpy of even 64 MiB takes
#: milliseconds). A writer stalled longer than that between this check and its copy (stopped,
#: swapped out) can still hit the next tenant, whose readers then fail its checksum loudly:
#: the shm trust model (every same-user process may write the whole arena) already covers it.
SHM_WRITE_MARGIN_MS = 500


class ShmMapping:
    """One node arena file, mapped read/write in this process.

    Raises:
        TransportUnavailableError: the file is missing, on another host, of another user, or not
            the file the node advertised.
    """

    def __init__(self, seg: ShmSegment, offer: ShmOffer) -> None:
        self.segment = seg
        try:
            check_same_host_file(seg, os.stat(seg.path), offer)
            fd = os.open(seg.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise TransportUnavailableError(f"cannot open {seg.path}: {exc.strerror}") from None
        try:
            check_same_host_file(seg, os.fstat(fd), offer)  # the file we opened, not a swap
            self._mmap = mmap.mmap(fd, seg.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.view = memoryview(self._mmap)
        # First copies into fresh pages would fault page by page (kvstore.pages).
        self._prefault = Prefaulter(self._mmap, seg.size, "shm-prefault") if enabled() else None

    def check(self) -> None:
        """Raises TransportUnavailableError when the file was removed or truncated."""
        try:
            st = os.fstat(self.fd)
        except OSError as exc:
            raise TransportUnavailableError(f"arena file gone: {exc.strerror}") from None
        if st.st_nlink == 0:
            raise TransportUnavailableError("arena file was removed (node stopped or restarted)")
        if st.st_size < self.segment.size:
            raise TransportUnavailableError(
                f"arena file truncated to {st.st_size} of {self.segment.size} bytes"
            )

    def granted(self, grant: grants.Grant, op: str) -> memoryview | None:
        """The bytes of ``grant`` in this mapping (no signature check: see the trust model), or
        None when the grant is for another op, expired or out of the file: that item goes to
        TCP (whose node gives the typed answer), and the mapping, which is fine, stays."""
        if grant.op != op or grant.offset + grant.size > self.segment.size:
            return None
        margin = SHM_WRITE_MARGIN_MS if op == grants.OP_WRITE else 0
        if grant.expires_ms - margin < time.time() * 1000:
            return None
        return self.view[grant.offset : grant.offset + grant.size]

    def close(self) -> None:
        if self._prefault is not None:
            self._prefault.stop()
        self.view.release()
        with contextlib.suppress(BufferError):
            self._mmap.close()
        os.close(self.fd)


class ShmTransport:
    """Mappings of same-host nodes' arenas, made on first use and kept.

    Not thread-safe by itself: the client's data path serialises access to the mapping table;
    copies run without a lock.
    """

    def __init__(self) -> None:
        # (node_id, segment) -> mapping, or the reason it cannot be mapped (not retried).
        self._maps: dict[tuple[str, str], ShmMapping | TransportUnavailableError] = {}
        self._offers: dict[str, ShmOffer] = {}
        self.dropped: set[str] = set()  # nodes whose offer must be fetched again

    def learn(self, node_id: str, offer_wire: Any) -> None:
        """Record a node's shm offer (from ``node_transports``); a new one replaces mappings."""
        try:
            offer = ShmOffer.from_wire(offer_wire)
        except KVStoreError as err:
            log.warning("ignoring node %s's shm offer: %s", node_id, err.message)
            return
        if self._offers.get(node_id) != offer:
            self._offers[node_id] = offer
            self._forget(node_id)

    def _forget(self, node_id: str) -> None:
        for k in [k for k in self._maps if k[0] == node_id]:
            m = self._maps.pop(k)
            if isinstance(m, ShmMapping):
                m.close()

    def mapping(self, node_id: str, segment: str) -> ShmMapping | None:
        """The mapping for ``(node_id, segment)``, or None where shm cannot serve it."""
        key = (node_id, segment)
        m = self._maps.get(key)
        if m is None:
            offer = self._offers.get(node_id)
            seg = offer.segments.get(segment) if offer else None
            if offer is None or seg is None:
                return None
            try:
                m = ShmMapping(seg, offer)
                log.info("node %s segment %s: using shared memory (%s)", node_id, segment, seg.path)
            except TransportUnavailableError as err:
                log.info("node %s segment %s: no shared memory (%s)", node_id, segment, err.message)
                m = err
            self._maps[key] = m
        return m if isinstance(m, ShmMapping) else None

    def drop(self, node_id: str, segment: str, err: TransportUnavailableError) -> None:
        """Stop using a mapping that failed its check (the node is asked again later)."""
        log.warning("node %s segment %s: shared memory dropped (%s)", node_id, segment, err.message)
        m = self._maps.pop((node_id, segment), None)
        if isinstance(m, ShmMapping):
            m.close()
        self._offers.pop(node_id, None)
        self.dropped.add(node_id)

    def close(self) -> None:
        for m in self._maps.values():
            if isinstance(m, ShmMapping):
                m.close()
        self._maps.clear()

    # ---------------------------------------------------------------- copies
    def _granted(
        self, node_id: str, grant: grants.Grant, op: str, checked: set[tuple[str, str]]
    ) -> memoryview | None:
        """The granted bytes in the node's mapped arena, or None where shm does not serve it.

        Each mapping is checked (file still there, same size) once per batch.

        Raises:
            TransportUnavailableError: the mapping went bad; OutOfRangeError: a bad grant.
        """
        m = self.mapping(node_id, grant.segment)
        if m is None:
            return None
        key = (node_id, grant.segment)
        if key not in checked:
            m.check()
            checked.add(key)
        return m.granted(grant, op)

    def view(self, location: Location, checked: set[tuple[str, str]]) -> memoryview | None:
        """A read-only view of a granted read's bytes in place (no copy), or None where shm
        does not serve it (no mapping, the grant expired or is out of the file, the mapping
        failed its check: dropped, as in :meth:`read`). ``checked``: the mappings already
        checked in this batch (see :meth:`_granted`)."""
        if not self._offers:
            return None
        try:
            src = self._granted(location.node_id, location.grant, grants.OP_READ, checked)
        except TransportUnavailableError as err:
            self.drop(location.node_id, location.grant.segment, err)
            return None
        return src.toreadonly() if src is not None else None

    def serves(self, node_id: str) -> bool:
        """Whether this client maps ``node_id``'s arenas (it offered them, and no mapping of
        them failed)."""
        if node_id not in self._offers:
            return False
        return not any(
            k[0] == node_id and not isinstance(m, ShmMapping) for k, m in self._maps.items()
        )

    def copy_at(
        self,
        node_id: str,
        segment: str,
        offset: int,
        dest: memoryview,
        checked: set[tuple[str, str]],
    ) -> int | None:
        """Copy ``len(dest)`` bytes at ``offset`` of a node's arena into ``dest`` (a one-hop
        read, kvstore.placement); returns their xxh3_64, or None where shm cannot serve them
        (the caller checks the checksum: the bytes may change while they are copied).
        ``checked``: the mappings already checked in this batch (see :meth:`_granted`)."""
        m = self.mapping(node_id, segment)
        if m is None or offset < 0 or offset + len(dest) > m.segment.size:
            return None
        key = (node_id, segment)
        if key not in checked:
            try:
                m.check()
            except TransportUnavailableError as err:
                self.drop(node_id, segment, err)
                return None
            checked.add(key)
        src = m.view[offset : offset + len(dest)]
        if len(dest) >= STREAM_HASH_MIN:
            return _copy_hashing(src, dest)
        dest[:] = src
        return xxhash.xxh3_64_intdigest(dest)

    def read(self, items: Sequence[ReadItem]) -> list[ReadItem]:
        """Copy what shm can serve into each item's ``dest``; returns the items left for TCP."""
        if not self._offers:
            return list(items)
        rest: list[ReadItem] = []
        checked: set[tuple[str, str]] = set()
        for item in items:
            loc = item.location
            try:
                src = self._granted(loc.node_id, loc.grant, grants.OP_READ, checked)
                if src is None:
                    rest.append(item)
                    continue
                if item.ranges is None:
                    if len(src) != len(item.dest):
                        raise TransportUnavailableError("destination does not match the grant")
                    if stream_hash_target(item):
                        item.digest = _copy_hashing(src, item.dest)
                    elif type(item.dest) is Segments:  # given as pieces: each in place
                        at = 0
                        for part in item.dest.parts:
                            part[:] = src[at : at + len(part)]
                            at += len(part)
                    else:
                        item.dest[:] = src
                else:
                    assert type(item.dest) is not Segments, "range reads fill one buffer"
                    _copy_ranges(loc.grant, src, item.ranges, item.dest)
                item.filled = len(item.dest)
            except OutOfRangeError as err:
                item.result = err
            except TransportUnavailableError as err:
                self.drop(loc.node_id, loc.grant.segment, err)
                rest.append(item)
        return rest

    def write(self, items: Sequence[WriteItem]) -> tuple[list[WriteItem], list[WriteItem]]:
        """Copy what shm can take into the arenas.

        Returns:
            ``(written, rest)``: items copied in place (still to be committed with
            ``shm_commit``), and items left for TCP.
        """
        if not self._offers:
            return [], list(items)
        written: list[WriteItem] = []
        rest: list[WriteItem] = []
        checked: set[tuple[str, str]] = set()
        for item in items:
            loc = item.location
            try:
                dest = self._granted(loc.node_id, loc.grant, grants.OP_WRITE, checked)
                if dest is None:
                    rest.append(item)
                    continue
                if len(dest) != len(item.data):
                    raise TransportUnavailableError("value does not match the grant")
                at = 0
                for part in payload_parts(item.data):  # an object given as pieces: each in place
                    dest[at : at + len(part)] = part
                    at += len(part)
                written.append(item)
            except TransportUnavailableError as err:
                self.drop(loc.node_id, loc.grant.segment, err)
                rest.append(item)
        return written, rest


def _copy_hashing(src: memoryview, dest: memoryview | Segments) -> int:
    """Copy chunk by chunk, hashing each chunk while it is in cache: a whole copy then a hash
    reads a large object from memory twice (``.venv/bin/python bench/profile_kvcache.py --shm``
    profiles the loads that run this). Returns the xxh3_64 of the bytes copied."""
    h = xxhash.xxh3_64()
    at = 0
    for chunk in stream_chunks(dest):
        n = len(chunk)
        chunk[:] = src[at : at + n]
        h.update(chunk)
        at += n
    return h.intdigest()


def _copy_ranges(
    grant: grants.Grant, src: memoryview, ranges: list[list[int]], dest: memoryview
) -> None:
    for r in ranges:
        if not isinstance(r, list | tuple) or len(r) != 2:
            raise OutOfRangeError("each range must be [start, length]")
        grants.check_range(grant, r[0], r[1])
    if sum(r[1] for r in ranges) != len(dest):
        raise TransportUnavailableError("ranges do not fill the destination")
    pos = 0
    for start, length in ranges:
        dest[pos : pos + length] = src[start : start + length]
        pos += length

"""The NVMe tier: an lmdb environment under the node's data dir.

Layout (two named databases in one environment, ``<data_dir>/nvme``):

``meta``  ``id (8 bytes, big endian)`` → msgpack ``[key, size, checksum, num_chunks, stamp]``
``data``  ``id (8 bytes) ‖ chunk number (4 bytes)`` → up to ``chunk_bytes`` of the object

The id is the replica's offset as the master hands it out for this segment: the master never
reuses an NVMe id, so a late ``forget`` can never delete a newer object. lmdb keys are 8 or 12
bytes, far under lmdb's 511-byte limit whatever the user key is (the user key lives in the
value). Objects larger than one chunk are split, so no single lmdb value grows past
``chunk_bytes``. Every batch of writes is one write transaction; a node restarted on the same
data dir rebuilds its manifest from ``meta`` and reports it when it registers. ``meta`` also
holds the tier's own record under a key that is not 8 bytes long (``_ADVANCE_KEY``), which the
manifest scan skips.

A failed commit (a full file system, an I/O error) leaves lmdb's environment to be reopened:
the tier then reopens it (readers wait, :class:`_EnvGate`), commits once more so that pages
freed by earlier deletes can be reused, and tries the batch again once; what still fails gets
``NoSpaceError`` (the file system is full) or ``TierError``, and nothing of it is stored.

NOTE: lmdb environments must not cross a ``fork()``; the node opens this tier in its own process
after any fork (``StorageNode.__init__``), and nothing forks afterwards.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from pathlib import Path

import lmdb
import msgpack

from kvstore.errors import (
    ChecksumMismatchError,
    InvalidRequestError,
    KeyNotFoundError,
    KVStoreError,
    NoSpaceError,
    TierError,
)
from kvstore.node.tiers import StoredObject, Tier, verify_checksum
from kvstore.types import TIER_NVME

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 4 << 20
#: Map size beyond the capacity. lmdb needs room for its pages, and the master reuses budget
#: freed for objects this node deletes only at its next heartbeat (forgets ride the reply); the
#: master bounds that lag to one capacity (``ByteBudget.limbo_bytes``), so the map holds two.
_OVERHEAD_FRACTION = 1.0
_OVERHEAD_BYTES = 64 << 20
_ID = struct.Struct(">Q")
_CHUNK = struct.Struct(">QI")
#: The tier's own ``meta`` record, rewritten to make a commit (see :meth:`NvmeTier._advance`);
#: not 8 bytes long, so it never names an object.
_ADVANCE_KEY = b"advance"
#: Room a write needs on the file system past its payload (lmdb's pages, its free list), when
#: telling a full file system from a failing one.
_FREE_MARGIN_BYTES = 1 << 20


def _meta_key(offset: int) -> bytes:
    return _ID.pack(offset)


def _chunk_key(offset: int, index: int) -> bytes:
    return _CHUNK.pack(offset, index)


class _EnvGate:
    """Readers share the lmdb environment; a reopen waits for them and holds new ones off.

    Why not one lock: reads come from many data connections at once and must not queue behind
    each other; only a reopen (after a failed commit) needs the environment to itself. A reopen
    waiting at the gate stops new readers, so a steady stream of reads cannot starve it.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._num_readers = 0
        self._closing = False

    def enter(self) -> None:
        with self._cond:
            while self._closing:
                self._cond.wait()
            self._num_readers += 1

    def leave(self) -> None:
        with self._cond:
            self._num_readers -= 1
            if not self._num_readers and self._closing:
                self._cond.notify_all()

    def close(self) -> None:
        """Wait until no reader is inside, and keep new ones out until :meth:`open`."""
        with self._cond:
            assert not self._closing, "one reopen at a time (callers hold the write lock)"
            self._closing = True
            while self._num_readers:
                self._cond.wait()

    def open(self) -> None:
        with self._cond:
            self._closing = False
            self._cond.notify_all()


class NvmeTier(Tier):
    """An lmdb environment holding up to ``capacity`` bytes of objects.

    Args:
        path: the environment's directory (created if missing).
        capacity: bytes of objects the master may place here (> 0).
        segment: the segment name the master knows this tier by.
        chunk_bytes: the largest single lmdb value; bigger objects are split.

    Raises:
        InvalidRequestError: a non-positive capacity or chunk size.
        TierError: the environment cannot be opened (corrupt, unreadable, wrong format).
    """

    tier = TIER_NVME
    durable = True

    def __init__(
        self,
        path: Path,
        capacity: int,
        segment: str = TIER_NVME,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if capacity <= 0:
            raise InvalidRequestError(f"NVMe tier size must be > 0, got {capacity}")
        if chunk_bytes <= 0:
            raise InvalidRequestError(f"chunk size must be > 0, got {chunk_bytes}")
        self.segment = segment
        self.capacity = capacity
        self.chunk_bytes = chunk_bytes
        self.path = path
        self._map_size = int(capacity * (1 + _OVERHEAD_FRACTION)) + _OVERHEAD_BYTES
        path.mkdir(parents=True, exist_ok=True)
        self._open()
        # NOTE: lmdb allows one write transaction at a time; this lock makes writers queue here
        # instead of inside lmdb (where a second writer in the same thread would deadlock).
        # Lock order: ``_write_lock``, then ``_gate`` (a reopen holds both).
        self._write_lock = threading.Lock()
        self._gate = _EnvGate()
        #: Ids whose delete failed with its commit: deleted again before the next write.
        self._unforgotten: set[int] = set()
        self.num_reopens = 0

    def _open(self) -> None:
        try:
            self.env = lmdb.open(
                str(self.path),
                map_size=self._map_size,
                max_dbs=2,
                subdir=True,
                readahead=False,
                max_readers=1024,  # one read transaction per data connection at a time
            )
            self._meta = self.env.open_db(b"meta")
            self._data = self.env.open_db(b"data")
        except lmdb.Error as exc:
            raise TierError(f"cannot open the NVMe tier at {self.path}: {exc}") from None

    def _reopen(self, why: lmdb.Error) -> None:
        """Close and reopen the environment after a failed commit. Call with the write lock.

        Raises:
            TierError: it cannot be opened again (reads and writes fail until it can).
        """
        log.warning("NVMe commit failed (%s): reopening the lmdb environment", why)
        self._gate.close()
        try:
            self.env.close()
            self._open()
        finally:
            self._gate.open()
        self.num_reopens += 1

    def _advance(self) -> None:
        """Commit one small change. Call with the write lock.

        NOTE: lmdb reuses the pages a commit freed only from the second commit after it (the
        last commit's snapshot stays readable), so on a full file system every write after a
        delete fails until something else commits: this is that commit.
        """
        with self.env.begin(write=True) as txn:
            stamp = txn.id().to_bytes(8, "big")  # (a new value: the page is really written)
            txn.put(_ADVANCE_KEY, stamp, db=self._meta)

    # ------------------------------------------------------------------ reads
    def read(self, offset: int, size: int) -> memoryview:
        out = bytearray(size)
        self._gate.enter()
        try:
            with self.env.begin(buffers=True) as txn:
                raw = txn.get(_meta_key(offset), db=self._meta)
                if raw is None:
                    raise KeyNotFoundError(f"no object with id {offset} on the NVMe tier")
                key, stored_size, _checksum, num_chunks, *_ = msgpack.unpackb(bytes(raw))
                if stored_size != size:
                    raise KeyNotFoundError(
                        f"NVMe object {offset} holds {stored_size} bytes, not {size}"
                    )
                pos = 0
                for i in range(num_chunks):
                    chunk = txn.get(_chunk_key(offset, i), db=self._data)
                    if chunk is None:
                        raise ChecksumMismatchError(f"NVMe object {offset} lost chunk {i}")
                    out[pos : pos + len(chunk)] = chunk
                    pos += len(chunk)
                if pos != size:
                    raise ChecksumMismatchError(f"NVMe object {offset} is truncated")
        except lmdb.Error as exc:
            raise TierError(f"NVMe read failed: {exc}") from None
        finally:
            self._gate.leave()
        return memoryview(out)

    def stored(self) -> list[StoredObject]:
        out: list[StoredObject] = []
        self._gate.enter()
        try:
            with self.env.begin() as txn:
                for k, v in txn.cursor(db=self._meta):
                    if len(k) != _ID.size:
                        continue  # the tier's own record (_ADVANCE_KEY)
                    try:
                        key, size, checksum, _n, *rest = msgpack.unpackb(v)
                        (offset,) = _ID.unpack(k)
                    except (ValueError, TypeError, struct.error, msgpack.UnpackException):
                        log.warning("skipping an unreadable NVMe manifest record")
                        continue
                    stamp = int(rest[0]) if rest else 0
                    out.append(
                        StoredObject(
                            self.segment, offset, bytes(key), int(size), int(checksum), stamp
                        )
                    )
        except lmdb.Error as exc:
            raise TierError(f"NVMe manifest scan failed: {exc}") from None
        finally:
            self._gate.leave()
        return out

    # ------------------------------------------------------------------ writes
    def write(self, items: list[tuple[StoredObject, memoryview]]) -> list[KVStoreError | None]:
        results: list[KVStoreError | None] = [None] * len(items)
        good: list[int] = []
        for i, (obj, data) in enumerate(items):
            try:
                if len(data) != obj.size:
                    raise InvalidRequestError("NVMe writes carry whole objects")
                verify_checksum(obj, data)
                good.append(i)
            except KVStoreError as err:
                results[i] = err
        if not good:
            return results
        with self._write_lock:
            try:
                self._forget_again()
                self._put_recovering([items[i] for i in good])
            except lmdb.MapFullError:
                # Too much for one transaction: store what fits, one object at a time.
                for i in good:
                    try:
                        self._put_recovering([items[i]])
                    except lmdb.MapFullError:
                        results[i] = NoSpaceError("the NVMe tier's lmdb file is full")
                    except lmdb.Error as exc:
                        results[i] = self._write_error(exc, items[i][0].size)
                    except TierError as err:
                        results[i] = err
            except lmdb.Error as exc:
                err = self._write_error(exc, sum(items[i][0].size for i in good))
                for i in good:
                    results[i] = err
            except TierError as err:  # (the environment could not be reopened)
                for i in good:
                    results[i] = err
        return results

    def _put_recovering(self, items: list[tuple[StoredObject, memoryview]]) -> None:
        """:meth:`_put_many`; after a failed commit, reopen, commit once (:meth:`_advance`) and
        try once more. Call with the write lock.

        Raises:
            lmdb.MapFullError: the lmdb map is full (nothing reopened).
            lmdb.Error: the second try failed too (the environment is reopened again).
            TierError: the environment could not be reopened.
        """
        try:
            self._put_many(items)
            return
        except lmdb.MapFullError:
            raise
        except lmdb.Error as exc:
            self._reopen(exc)
        try:
            self._advance()
            self._put_many(items)
        except lmdb.MapFullError:
            raise
        except lmdb.Error as exc:
            self._reopen(exc)
            raise

    def _write_error(self, exc: lmdb.Error, num_bytes: int) -> KVStoreError:
        """The typed error of a write that failed with ``exc``: NoSpaceError where the file
        system has no room left for ``num_bytes`` (lmdb reports a short write as an I/O
        error), TierError otherwise."""
        try:
            st = os.statvfs(self.path)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = None
        if free is not None and free < num_bytes + _FREE_MARGIN_BYTES:
            return NoSpaceError(
                f"the NVMe tier's file system is full ({free} bytes free): nothing stored ({exc})"
            )
        return TierError(f"NVMe write failed: {exc}")

    def _put_many(self, items: list[tuple[StoredObject, memoryview]]) -> None:
        step = self.chunk_bytes
        with self.env.begin(write=True) as txn:
            for obj, data in items:
                self._delete_in(txn, obj.offset)
                num_chunks = (len(data) + step - 1) // step
                for i in range(num_chunks):
                    txn.put(
                        _chunk_key(obj.offset, i), data[i * step : (i + 1) * step], db=self._data
                    )
                txn.put(
                    _meta_key(obj.offset),
                    msgpack.packb([obj.key, obj.size, obj.checksum, num_chunks, obj.stamp]),
                    db=self._meta,
                )

    def _delete_in(self, txn: lmdb.Transaction, offset: int) -> bool:
        raw = txn.get(_meta_key(offset), db=self._meta)
        if raw is None:
            return False
        num_chunks = msgpack.unpackb(raw)[3]
        for i in range(num_chunks):
            txn.delete(_chunk_key(offset, i), db=self._data)
        txn.delete(_meta_key(offset), db=self._meta)
        return True

    def forget(self, offsets: list[int]) -> None:
        if not offsets:
            return
        with self._write_lock:
            self._unforgotten.update(offsets)
            self._forget_again()

    def _forget_again(self) -> None:
        """Delete the ids in ``_unforgotten`` (in one commit); a failed commit keeps them there
        for the next write or delete, and reopens the environment. Call with the write lock."""
        if not self._unforgotten:
            return
        offsets = sorted(self._unforgotten)
        try:
            with self.env.begin(write=True) as txn:
                for off in offsets:
                    self._delete_in(txn, off)
        except lmdb.Error as exc:
            log.error("NVMe delete of %d object(s) failed: %s", len(offsets), exc)
            try:
                self._reopen(exc)
            except TierError as err:
                log.error("%s", err.message)
            return
        self._unforgotten.difference_update(offsets)

    def used_bytes(self) -> int:
        """Bytes of objects stored (the payload, not lmdb's pages)."""
        return sum(o.size for o in self.stored())

    def close(self) -> None:
        with self._write_lock:
            self._gate.close()
            try:
                self.env.close()
            finally:
                self._gate.open()  # (later reads fail on the closed environment: TierError)

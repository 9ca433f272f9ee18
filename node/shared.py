"""The shared-file-system tier: objects as files on a POSIX path that outlives every node.

Below NVMe. The path is what 3FS, NFS, Lustre or a cloud file store mount (any directory works);
objects demote to it as to NVMe, are promoted from it on read, and survive the loss of every
node: a restarted cluster, or a second cluster given the same path and namespace, finds them
there. Like NVMe, the master addresses its objects by id (the replica's offset is an id it never
hands out twice for the segment, ``master.budget.ByteBudget``).

Layout, under ``<root>/<namespace>/owners/<owner>/`` (``owner``: the node id that serves it):

``.lock``           held (``flock``, exclusive) by the one node serving the folder
``<id:016x>.kvo``   one object: a header, the key, the bytes
``.tmp-*``          a write in flight (never read; a crash leaves it, the next start removes it)

A file is ``header ‖ key ‖ bytes``; the header (``_HEADER``) holds a magic with the format
version, the key's length, the object's size, checksum (xxh3_64 of the bytes, the checksum the
master keeps) and stamp, and a check of all that and the key seeded by the namespace. **The files
are the manifest**: each carries its own record, so there is no second file to keep in step
with them and nothing to lose between the two.

Rules:

- **Ownership.** Every file belongs to one owner folder, and a node serves exactly the folders
  whose lock it holds, so two nodes on one path never count one file twice. A node locks its own
  folder at start (held by another live process: ``TierError``), then *adopts* every folder
  whose lock is free (its node is gone: killed, or another cluster's, stopped): it moves their
  good files into its own folder under fresh ids and removes the emptied folder. A lock dies
  with its process (SIGKILL included; an NFS client's lock when its lease runs out), so a
  folder is never orphaned for long and never served twice.
- **Atomic writes.** An object is written to a ``.tmp-`` name, fsynced, renamed to its final
  name and the folder fsynced: a reader of the path sees the whole file or none.
- **Checked before served.** At start every file is read and checked (size, header check,
  checksum of the bytes); a torn file (shorter or longer than its header says), a foreign one
  (no magic, a bad header check: another format, another namespace, random bytes) or one whose
  bytes fail their checksum is logged, counted and left where it is: never claimed, never
  served. A read checks the header and the checksum again (the file system is shared: anything
  may have changed it since).
- **Full disk.** A write that meets ENOSPC or EDQUOT removes its temp file and fails with
  ``NoSpaceError`` (other errors: ``TierError``); nothing of it is stored, and the object stays
  in the tier it came from (a demotion that fails leaves the replica where it was).

Fresh ids of adopted files start above every id in the node's own folder and above the wall
clock in microseconds: the master hands a segment's ids out one by one from the largest id
claimed, so no id it gave earlier (a tombstone it may still hold for this node) can reach
there.

Bytes move with ``os.pwritev``/``os.preadv`` and are checked over ``mmap``: no Python loop runs
per byte.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from kvstore.errors import (
    ChecksumMismatchError,
    InvalidRequestError,
    KeyNotFoundError,
    KVStoreError,
    NoSpaceError,
    TierError,
)
from kvstore.node.tiers import StoredObject, Tier, verify_checksum
from kvstore.types import TIER_SHARED

log = logging.getLogger(__name__)

#: magic (format version in its last byte), key length, reserved, size, checksum, stamp, check.
_HEADER = struct.Struct("<8sIIQQQQ")
_MAGIC = b"kvshard\x01"
_SUFFIX = ".kvo"
_TMP_PREFIX = ".tmp-"
_LOCK = ".lock"
#: The longest key a file may name (a header claiming more is foreign).
MAX_KEY_BYTES = 64 << 10
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_FULL = (errno.ENOSPC, errno.EDQUOT)


def check_name(what: str, name: str) -> str:
    """``name`` if it can be one folder's name (letters, digits, ``._-``), else ValueError.

    Raises:
        InvalidRequestError: it cannot.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequestError(
            f"{what} must be 1-128 letters, digits, '.', '_' or '-' (not first), got {name!r}"
        )
    return name


def _seed(namespace: str) -> int:
    return xxhash.xxh3_64_intdigest(namespace.encode())


def encode_header(namespace: str, key: bytes, size: int, checksum: int, stamp: int) -> bytes:
    """A file's header and key, as written before its bytes."""
    fields = _HEADER.pack(_MAGIC, len(key), 0, size, checksum, stamp, 0)[:-8]
    check = xxhash.xxh3_64_intdigest(fields + key, seed=_seed(namespace))
    return fields + check.to_bytes(8, "little") + key


def file_name(offset: int) -> str:
    return f"{offset:016x}{_SUFFIX}"


def _offset_of(name: str) -> int | None:
    if not name.endswith(_SUFFIX) or len(name) != 16 + len(_SUFFIX):
        return None
    try:
        return int(name[:16], 16)
    except ValueError:
        return None


@dataclass(slots=True)
class ScanReport:
    """What a start-up scan found: objects served, files ignored (with the first reasons)."""

    num_objects: int = 0
    num_bytes: int = 0
    num_adopted: int = 0
    num_ignored: int = 0
    num_temp_removed: int = 0
    reasons: list[str] = field(default_factory=list)

    def ignore(self, path: Path, why: str) -> None:
        self.num_ignored += 1
        log.warning("shared tier: ignoring %s: %s", path, why)
        if len(self.reasons) < 32:
            self.reasons.append(f"{path.name}: {why}")


def read_record(path: Path, namespace: str) -> tuple[bytes, int, int, int, int]:
    """Check one object file whole: ``(key, size, checksum, stamp, header_bytes)``.

    Raises:
        ChecksumMismatchError: torn (its length is not what its header says), foreign (no
            magic, a bad header check) or its bytes fail their checksum; the message says which.
        OSError: it cannot be read.
    """
    with open(path, "rb") as f:
        fd = f.fileno()
        total = os.fstat(fd).st_size
        head = os.pread(fd, _HEADER.size, 0)
        if len(head) < _HEADER.size:
            raise ChecksumMismatchError("torn: shorter than a header")
        magic, key_len, _, size, checksum, stamp, check = _HEADER.unpack(head)
        if magic != _MAGIC:
            raise ChecksumMismatchError("foreign: no kvstore magic")
        if key_len > MAX_KEY_BYTES:
            raise ChecksumMismatchError("foreign: key length out of bounds")
        key = os.pread(fd, key_len, _HEADER.size)
        if len(key) < key_len:
            raise ChecksumMismatchError("torn: shorter than its key")
        want = xxhash.xxh3_64_intdigest(head[:-8] + key, seed=_seed(namespace))
        if want != check:
            raise ChecksumMismatchError("foreign: header check fails (another namespace?)")
        header_bytes = _HEADER.size + key_len
        if total != header_bytes + size:
            how = "shorter" if total < header_bytes + size else "longer"
            raise ChecksumMismatchError(f"torn: {total} bytes, {how} than its header says")
        if size:
            with mmap.mmap(fd, total, access=mmap.ACCESS_READ) as mm:
                view = memoryview(mm)
                try:
                    got = xxhash.xxh3_64_intdigest(view[header_bytes:])
                finally:
                    view.release()
        else:
            got = xxhash.xxh3_64_intdigest(b"")
        if got != checksum:
            raise ChecksumMismatchError("its bytes do not match their checksum")
    return key, size, checksum, stamp, header_bytes


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:  # (some file systems cannot fsync a folder: the rename still holds)
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _try_lock(path: Path) -> int | None:
    """An open fd of ``path`` holding its exclusive lock, or None when another holder has it.

    NOTE: ``flock``, not ``lockf``: its lock belongs to the open file, so two tiers in one
    process (tests) exclude each other as two processes do. Linux NFS clients carry it as a
    whole-file POSIX lock to the server (NFSv4: dropped when the client's lease runs out);
    Lustre needs its ``flock`` mount option."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EACCES, errno.EAGAIN, errno.EWOULDBLOCK):
            return None
        raise
    return fd


class SharedTier(Tier):
    """Objects as files in this node's folder of a shared path (see the module docstring).

    Args:
        root: the shared path (created if missing).
        namespace: the folder under ``root`` that clusters meeting there share.
        owner: this node's id (its folder's name).
        capacity: bytes of objects the master may place here (> 0).
        segment: the segment name the master knows this tier by.
        adopt: take over the folders of nodes that are gone (see Ownership).

    Raises:
        InvalidRequestError: a bad size, namespace or owner.
        TierError: the path cannot be used, or another live process serves this owner's folder.
    """

    tier = TIER_SHARED
    durable = True

    def __init__(
        self,
        root: Path,
        namespace: str,
        owner: str,
        capacity: int,
        segment: str = TIER_SHARED,
        adopt: bool = True,
    ) -> None:
        if capacity <= 0:
            raise InvalidRequestError(f"shared tier size must be > 0, got {capacity}")
        self.namespace = check_name("the shared namespace", namespace)
        self.owner = check_name("the node id", owner)
        self.segment = segment
        self.capacity = capacity
        self.root = Path(root)
        self.space = self.root / namespace / "owners"
        self.path = self.space / owner
        self._lock = threading.Lock()
        #: id -> (key, size, checksum, stamp, header bytes): what this node serves.
        self._objects: dict[int, tuple[bytes, int, int, int, int]] = {}
        self._lock_fd: int | None = None
        self.num_writes_full = 0
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock_fd = _try_lock(self.path / _LOCK)
        except OSError as exc:
            raise TierError(f"cannot use the shared tier at {self.path}: {exc}") from None
        if self._lock_fd is None:
            raise TierError(
                f"another live process serves {self.path} (two nodes with one node id?)"
            )
        try:
            self.report = self._scan_own()
            if adopt:
                self._adopt_orphans(self.report)
        except OSError as exc:
            self.close()
            raise TierError(f"cannot scan the shared tier at {self.path}: {exc}") from None
        log.info(
            "shared tier %s: %d objects (%d bytes, %d adopted), %d files ignored",
            self.path,
            self.report.num_objects,
            self.report.num_bytes,
            self.report.num_adopted,
            self.report.num_ignored,
        )

    # ------------------------------------------------------------------ start-up
    def _scan_own(self) -> ScanReport:
        report = ScanReport()
        for entry in sorted(os.scandir(self.path), key=lambda e: e.name):
            path = Path(entry.path)
            if entry.name.startswith(_TMP_PREFIX):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                report.num_temp_removed += 1
                continue
            if entry.name == _LOCK:
                continue
            offset = _offset_of(entry.name)
            if offset is None or not entry.is_file(follow_symlinks=False):
                report.ignore(path, "foreign: not an object file's name")
                continue
            try:
                record = read_record(path, self.namespace)
            except ChecksumMismatchError as err:
                report.ignore(path, err.message)
                continue
            self._objects[offset] = record
            report.num_objects += 1
            report.num_bytes += record[1]
        return report

    def _adopt_orphans(self, report: ScanReport) -> None:
        """Take over the folders whose lock no live process holds (see Ownership)."""
        next_id = max([*self._objects, int(time.time() * 1e6)]) + 1
        for entry in sorted(os.scandir(self.space), key=lambda e: e.name):
            if entry.name == self.owner or not entry.is_dir(follow_symlinks=False):
                continue
            folder = Path(entry.path)
            try:
                fd = _try_lock(folder / _LOCK)
            except OSError as exc:
                log.warning("shared tier: cannot lock %s: %s", folder, exc)
                continue
            if fd is None:
                continue  # a live node serves it
            try:
                next_id = self._adopt(folder, next_id, report)
            finally:
                os.close(fd)
        _fsync_dir(self.path)

    def _adopt(self, folder: Path, next_id: int, report: ScanReport) -> int:
        """Move ``folder``'s good files into ours (call with its lock held); remove it when
        nothing else is left in it. Returns the next fresh id."""
        left = 0
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            path = Path(entry.path)
            if entry.name == _LOCK:
                continue
            if entry.name.startswith(_TMP_PREFIX):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                report.num_temp_removed += 1
                continue
            if _offset_of(entry.name) is None or not entry.is_file(follow_symlinks=False):
                report.ignore(path, "foreign: not an object file's name")
                left += 1
                continue
            try:
                record = read_record(path, self.namespace)
            except ChecksumMismatchError as err:
                report.ignore(path, err.message)
                left += 1
                continue
            os.rename(path, self.path / file_name(next_id))
            self._objects[next_id] = record
            next_id += 1
            report.num_objects += 1
            report.num_adopted += 1
            report.num_bytes += record[1]
        if not left:
            with contextlib.suppress(OSError):
                (folder / _LOCK).unlink()
                folder.rmdir()
        log.info("shared tier: adopted %s", folder)
        return next_id

    # ------------------------------------------------------------------ reads
    def read(self, offset: int, size: int) -> memoryview:
        with self._lock:
            record = self._objects.get(offset)
        if record is None:
            raise KeyNotFoundError(f"no object with id {offset} on the shared tier")
        key, stored_size, checksum, stamp, header_bytes = record
        if stored_size != size:
            raise KeyNotFoundError(f"shared object {offset} holds {stored_size} bytes, not {size}")
        out = bytearray(size)
        try:
            with open(self.path / file_name(offset), "rb") as f:
                fd = f.fileno()
                head = os.pread(fd, header_bytes, 0)
                got = os.preadv(fd, [out], header_bytes) if size else 0
                extra = os.pread(fd, 1, header_bytes + size)
        except FileNotFoundError:
            raise KeyNotFoundError(f"shared object {offset} is gone from {self.path}") from None
        except OSError as exc:
            raise TierError(f"shared tier read failed: {exc}") from None
        if head != encode_header(self.namespace, key, size, checksum, stamp):
            raise ChecksumMismatchError(f"shared object {offset} was replaced under us")
        if got != size or extra:
            raise ChecksumMismatchError(f"shared object {offset} is torn")
        view = memoryview(out)
        verify_checksum(StoredObject(self.segment, offset, key, size, checksum, stamp), view)
        return view

    def stored(self) -> list[StoredObject]:
        with self._lock:
            items = list(self._objects.items())
        return [
            StoredObject(self.segment, off, key, size, checksum, stamp)
            for off, (key, size, checksum, stamp, _) in items
        ]

    def used_bytes(self) -> int:
        """Bytes of objects stored (the payload, not the headers)."""
        with self._lock:
            return sum(r[1] for r in self._objects.values())

    # ------------------------------------------------------------------ writes
    def write(self, items: list[tuple[StoredObject, memoryview]]) -> list[KVStoreError | None]:
        results: list[KVStoreError | None] = [None] * len(items)
        done: list[tuple[int, tuple[bytes, int, int, int, int]]] = []
        for i, (obj, data) in enumerate(items):
            try:
                if len(data) != obj.size:
                    raise InvalidRequestError("shared tier writes carry whole objects")
                verify_checksum(obj, data)
                done.append((obj.offset, self._write_one(obj, data)))
            except KVStoreError as err:
                results[i] = err
        if done:
            try:
                _fsync_dir(self.path)
            except OSError as exc:
                err = self._error(exc, "fsync of the folder")
                for i, (obj, _) in enumerate(items):
                    if results[i] is None:
                        results[i] = err
                        self._unlink(obj.offset)
                return results
            with self._lock:
                self._objects.update(done)
        return results

    def _write_one(self, obj: StoredObject, data: memoryview) -> tuple[bytes, int, int, int, int]:
        """Write, fsync and rename one object file. Returns its record.

        Raises:
            NoSpaceError: the file system is full (nothing left of the write).
            TierError: any other failure (nothing left of the write).
        """
        head = encode_header(self.namespace, obj.key, obj.size, obj.checksum, obj.stamp)
        tmp = self.path / f"{_TMP_PREFIX}{obj.offset:016x}-{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, [head, data])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, self.path / file_name(obj.offset))
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise self._error(exc, f"write of {obj.key[:64]!r}") from None
        return obj.key, obj.size, obj.checksum, obj.stamp, len(head)

    def _error(self, exc: OSError, what: str) -> KVStoreError:
        if exc.errno in _FULL:
            self.num_writes_full += 1
            return NoSpaceError(f"the shared tier's file system is full ({self.path}): {what}")
        return TierError(f"shared tier {what} failed: {exc}")

    def _unlink(self, offset: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.path / file_name(offset)).unlink()

    def forget(self, offsets: list[int]) -> None:
        for off in offsets:
            with self._lock:
                self._objects.pop(off, None)
            try:
                self._unlink(off)
            except OSError as exc:
                log.error("shared tier: cannot delete object %d: %s", off, exc)

    def close(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # (releases the folder's lock)


def _write_all(fd: int, parts: list[bytes | memoryview]) -> None:
    """``os.writev`` until every byte of ``parts`` is written (a short write goes on)."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]

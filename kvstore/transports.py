"""What a storage node offers beyond TCP, as it travels through the master to clients.

A node registers ``transports``: a small map from transport name to its details, opaque to the
master, which hands the whole map out again through the ``node_transports`` verb. Clients cache
it and choose, per node, the fastest transport that works from where they run:

``shm``   same host: the node's DRAM arena file, which a client of the same user maps once and
          copies straight from/into (ranges still granted by the master), see
          :class:`ShmOffer` and ``kvstore.client.shm``;
``rdma``  one-sided READ/WRITE against registered memory regions, see :mod:`kvstore.rdma`;
TCP       always, the fallback.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from kvstore.errors import InvalidRequestError, ProtocolError, TransportUnavailableError

#: Largest encoded ``transports`` map a node may register (they are tiny: paths and ids).
MAX_TRANSPORTS_BYTES = 64 << 10
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


def check_transports(obj: Any) -> dict[str, dict[str, Any]]:
    """Validate the ``transports`` argument of ``register``.

    Returns:
        The map, unchanged.

    Raises:
        InvalidRequestError: not a map of name -> map, or larger than MAX_TRANSPORTS_BYTES.
    """
    if not isinstance(obj, dict) or not all(
        isinstance(k, str) and isinstance(v, dict) for k, v in obj.items()
    ):
        raise InvalidRequestError("transports must be a map of name -> map")
    if len(msgpack.packb(obj, use_bin_type=True)) > MAX_TRANSPORTS_BYTES:
        raise InvalidRequestError(f"transports exceed {MAX_TRANSPORTS_BYTES} bytes")
    return obj


def boot_id() -> str:
    """This kernel's boot id: equal on two processes only if they run on the same host."""
    try:
        return BOOT_ID_PATH.read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True, slots=True)
class ShmSegment:
    """One arena file a node offers for mapping: its path and identity (device, inode, size)."""

    path: str
    dev: int
    ino: int
    size: int


@dataclass(frozen=True, slots=True)
class ShmOffer:
    """A node's shm details: the host it runs on (boot id), its uid, and its arena files."""

    boot_id: str
    uid: int
    segments: dict[str, ShmSegment]

    def to_wire(self) -> dict[str, Any]:
        return {
            "boot_id": self.boot_id,
            "uid": self.uid,
            "segments": {n: [s.path, s.dev, s.ino, s.size] for n, s in self.segments.items()},
        }

    @staticmethod
    def from_wire(obj: Any) -> ShmOffer:
        """Raises ProtocolError when ``obj`` is malformed."""
        try:
            segments = {
                str(name): ShmSegment(str(v[0]), int(v[1]), int(v[2]), int(v[3]))
                for name, v in obj["segments"].items()
            }
            return ShmOffer(str(obj["boot_id"]), int(obj["uid"]), segments)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError):
            raise ProtocolError("malformed shm offer") from None

    @staticmethod
    def of_files(files: dict[str, Path]) -> ShmOffer:
        """Describe arena files of this process (the node side)."""
        segments = {}
        for name, path in files.items():
            st = os.stat(path)
            segments[name] = ShmSegment(str(path), st.st_dev, st.st_ino, st.st_size)
        return ShmOffer(boot_id(), os.getuid(), segments)


def check_same_host_file(seg: ShmSegment, st: os.stat_result, offer: ShmOffer) -> None:
    """Whether a client may map ``seg``: same host, same user, and the very file advertised.

    Args:
        seg: the advertised segment.
        st: ``os.stat``/``os.fstat`` of the file the client found at ``seg.path``.
        offer: the node's offer (boot id and uid).

    Raises:
        TransportUnavailableError: another host, another user, a file that is not the one the
            node advertised (inode, device or size differ), or one readable by others.
    """
    mine = boot_id()
    if not mine or offer.boot_id != mine:
        raise TransportUnavailableError("node runs on another host (boot id differs)")
    uid = os.getuid()
    if offer.uid != uid or st.st_uid != uid:
        raise TransportUnavailableError("arena file belongs to another user")
    if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
        raise TransportUnavailableError("arena file is not a private (0600) regular file")
    if (st.st_dev, st.st_ino) != (seg.dev, seg.ino):
        raise TransportUnavailableError("arena file was replaced (inode differs)")
    if st.st_size != seg.size:
        raise TransportUnavailableError(
            f"arena file is {st.st_size} bytes, the node advertised {seg.size}"
        )

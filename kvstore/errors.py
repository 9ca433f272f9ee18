"""One error type for the whole system, with a code that travels on the wire and in REST bodies.

Codes come in ranges, one per subsystem (Mooncake's ``types.h`` does the same):

=========  ==========================================
range      subsystem
=========  ==========================================
1xx        request: malformed, unknown verb, bad args
2xx        objects: missing, busy, corrupt
3xx        space: allocation, tiers
4xx        nodes and the data plane
5xx        time: deadlines
6xx        control plane: leadership, epochs
7xx        security
9xx        internal invariants
=========  ==========================================

Every code is raised somewhere (``tests/kvstore/test_errors.py`` checks): a code nothing raises is
removed and its number retired, never reused, since an older peer may still send it.
"""

from __future__ import annotations

import builtins
import enum
from typing import Any


class ErrorCode(enum.IntEnum):
    OK = 0

    INVALID_REQUEST = 100
    UNKNOWN_VERB = 101
    FRAME_TOO_LARGE = 102
    VERSION_MISMATCH = 103
    MALFORMED_FRAME = 104

    KEY_NOT_FOUND = 200
    OBJECT_BUSY = 201
    CHECKSUM_MISMATCH = 202
    PUT_NOT_FOUND = 203
    OBJECT_EXISTS = 204
    BLANK_TOO_OLD = 205

    NO_SPACE = 300
    TIER_FAILED = 301

    NODE_UNAVAILABLE = 400
    NODE_NOT_FOUND = 401
    GRANT_INVALID = 402
    OUT_OF_RANGE = 403
    TRANSPORT_UNAVAILABLE = 404

    TIMEOUT = 500
    # NOTE: 501 was LEASE_EXPIRED, never raised and removed: do not reuse the number.
    OVERLOADED = 502

    NOT_LEADER = 600
    STALE_EPOCH = 601
    MASTER_UNAVAILABLE = 602
    ETCD_UNAVAILABLE = 603

    UNAUTHENTICATED = 700
    FORBIDDEN = 701

    INTERNAL = 900


class KVStoreError(Exception):
    """Base of every error kvstore raises on purpose.

    Attributes:
        code: the :class:`ErrorCode`; the same number goes on the wire and into REST bodies.
        message: a human-readable explanation. Never contains secrets.
    """

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str = "", *, code: ErrorCode | None = None) -> None:
        if code is not None:
            self.code = code
        self.message = message or self.code.name.lower().replace("_", " ")
        super().__init__(self.message)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code.name}: {self.message})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, KVStoreError)
            and type(other) is type(self)
            and other.code == self.code
            and other.message == self.message
        )

    def __hash__(self) -> int:
        return hash((type(self), self.code, self.message))

    def to_wire(self) -> list[Any]:
        return [int(self.code), self.message]

    @staticmethod
    def from_wire(payload: Any) -> KVStoreError:
        """Rebuild the most specific error class for a ``[code, message]`` pair."""
        try:
            code = ErrorCode(int(payload[0]))
            message = str(payload[1])
        except (TypeError, ValueError, IndexError, KeyError):
            return ProtocolError(f"undecodable error payload: {payload!r:.200}")
        cls = _BY_CODE.get(code, KVStoreError)
        err = cls(message, code=code)
        return err


class InvalidRequestError(KVStoreError, ValueError):
    """Misuse: bad arguments, bad keys, bad sizes. Nothing was changed."""

    code = ErrorCode.INVALID_REQUEST


class ProtocolError(InvalidRequestError):
    """A frame that cannot be decoded, is too large, or speaks another version."""

    code = ErrorCode.MALFORMED_FRAME


class UnknownVerbError(InvalidRequestError):
    code = ErrorCode.UNKNOWN_VERB


class WrongEndpointError(InvalidRequestError):
    """A client was pointed at a port that is not a master's control port (a storage node's
    data port, an admin API, an ``http://`` URL); the message says which one to use. Raised by
    the client at connect, never sent on the wire (its code is INVALID_REQUEST)."""


class KeyNotFoundError(KVStoreError, KeyError):
    """The key is not stored (or not yet committed). A miss is always a correct answer."""

    code = ErrorCode.KEY_NOT_FOUND

    def __str__(self) -> str:  # KeyError quotes its argument; we want the plain message
        return self.message


class ObjectBusyError(KVStoreError):
    """Another put of the same key is in flight."""

    code = ErrorCode.OBJECT_BUSY


class ObjectExistsError(KVStoreError):
    """A KV block that is already stored: blocks are immutable (equal keys mean equal tokens)."""

    code = ErrorCode.OBJECT_EXISTS


class BlankTooOldError(KVStoreError):
    """A blank (a put started before its key was known) committed under a key whose stored
    version was started after it: the blank would be the older version by its stamp, which is
    what orders versions after a failover. The client puts such a key the usual way."""

    code = ErrorCode.BLANK_TOO_OLD


class ChecksumMismatchError(KVStoreError, RuntimeError):
    """The bytes read do not match the checksum recorded at put time."""

    code = ErrorCode.CHECKSUM_MISMATCH


class PutNotFoundError(KVStoreError):
    """``put_end``/``put_revoke`` for a put that does not exist (reclaimed or never started)."""

    code = ErrorCode.PUT_NOT_FOUND


class NoSpaceError(KVStoreError):
    code = ErrorCode.NO_SPACE


class TierError(KVStoreError, RuntimeError):
    """A tier's storage failed: an lmdb file that is corrupt or unusable, a GPU that went away."""

    code = ErrorCode.TIER_FAILED


class NodeUnavailableError(KVStoreError, ConnectionError):
    """A storage node could not be reached, or died while serving."""

    code = ErrorCode.NODE_UNAVAILABLE


class GrantInvalidError(KVStoreError):
    """A data-plane request without a valid grant from the master."""

    code = ErrorCode.GRANT_INVALID


class OutOfRangeError(InvalidRequestError):
    """A byte range outside the object it names."""

    code = ErrorCode.OUT_OF_RANGE


class TransportUnavailableError(KVStoreError):
    """A transport (shm, RDMA) is not usable here; callers fall back to TCP."""

    code = ErrorCode.TRANSPORT_UNAVAILABLE


class KVTimeoutError(KVStoreError, builtins.TimeoutError):
    code = ErrorCode.TIMEOUT


class OverloadedError(KVStoreError):
    """A server is at a limit it sets itself (e.g. its event streams): try again later."""

    code = ErrorCode.OVERLOADED


class NotLeaderError(KVStoreError):
    code = ErrorCode.NOT_LEADER


class StaleEpochError(KVStoreError):
    code = ErrorCode.STALE_EPOCH


class MasterUnavailableError(KVStoreError, ConnectionError):
    code = ErrorCode.MASTER_UNAVAILABLE


class EtcdUnavailableError(KVStoreError, ConnectionError):
    """etcd (leader election, membership, discovery) cannot be reached or refused the call."""

    code = ErrorCode.ETCD_UNAVAILABLE


class UnauthenticatedError(KVStoreError):
    code = ErrorCode.UNAUTHENTICATED


class ForbiddenError(KVStoreError):
    code = ErrorCode.FORBIDDEN


class InternalError(KVStoreError, RuntimeError):
    code = ErrorCode.INTERNAL


# Most specific class per code; a code listed twice maps to its first (most general) class.
_BY_CODE: dict[ErrorCode, type[KVStoreError]] = {}
for _cls in (
    KVStoreError,
    InvalidRequestError,
    ProtocolError,
    UnknownVerbError,
    KeyNotFoundError,
    ObjectBusyError,
    ObjectExistsError,
    BlankTooOldError,
    ChecksumMismatchError,
    PutNotFoundError,
    NoSpaceError,
    TierError,
    NodeUnavailableError,
    GrantInvalidError,
    OutOfRangeError,
    TransportUnavailableError,
    KVTimeoutError,
    OverloadedError,
    NotLeaderError,
    StaleEpochError,
    MasterUnavailableError,
    EtcdUnavailableError,
    UnauthenticatedError,
    ForbiddenError,
    InternalError,
):
    _BY_CODE.setdefault(_cls.code, _cls)
_BY_CODE[ErrorCode.FRAME_TOO_LARGE] = ProtocolError
_BY_CODE[ErrorCode.VERSION_MISMATCH] = ProtocolError

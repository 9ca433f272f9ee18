"""Mooncake Store's Python API (``mooncake.store``, the 0.3.x wheel) on a kvstore cluster.

A program written for Mooncake switches by changing one import::

    from kvstore.client.compat.mooncake import MooncakeDistributedStore, ReplicateConfig

or runs unmodified after ``python -m kvstore.client.compat.mooncake --install-alias``, which
writes a small ``mooncake`` package (``mooncake.store`` re-exporting this module) into the
interpreter's site-packages; ``--uninstall-alias`` removes it again.

Return conventions are Mooncake's, measured against the real wheel
(``mooncake-transfer-engine-non-cuda==0.3.13.post1``, tests/client/compat/mooncake_contract.py
runs the same script against both): ``0`` or a negative Mooncake error code for writes; the
byte count or a negative code for reads into buffers; ``b""`` for a missed ``get``; ``1`` / ``0``
/ ``-1`` for existence; counts for ``remove_by_regex`` / ``remove_all``. A ``put`` of a key that
is already stored returns 0 and keeps the stored value (Mooncake's rule; ``upsert`` replaces).

Where kvstore differs (documented, the contract script accepts both):

- Leases: Mooncake grants a read lease (5 s by default) during which ``remove`` answers
  ``OBJECT_HAS_LEASE`` (-706) unless ``force=True``. kvstore removes at once: a read in flight
  still finishes safely (its own lease holds the bytes), so ``remove`` never answers -706.
- Memory: ``global_segment_size`` is not contributed by this process; kvstore's storage nodes
  hold the objects (``kvstore node`` / ``kvstore up``). ``local_buffer_size``, ``protocol`` and
  ``rdma_devices`` are accepted and not needed (kvstore picks shared memory, TCP or RDMA itself).
- Buffers: as with Mooncake over TCP, ``put_from`` / ``get_into`` take any valid address;
  ``register_buffer`` is bookkeeping (a second registration of an address or an unknown
  ``unregister_buffer`` answers -600, like Mooncake's).
- A duplicate ``put`` checks existence first (one more master call); two clients racing to put
  the same new key may both write, and the last one wins.
- ``put_tensor`` stores kvstore's own small header + the raw bytes: tensors written through
  real Mooncake are not readable here, and the other way round.

Not covered: the transfer-engine API (``mooncake.engine``), segment mounting and SSD offload
(``mount_segment``, ``allocate_and_mount_segment``), copy/move tasks, tensor-parallel and
"parallelism" tensor variants, get/put sessions, ``ReplicateConfig`` placement fields (accepted,
ignored except ``replica_num``), and CUDA tensors in ``get_tensor_into_cuda``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import struct
import sys
import sysconfig
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore.client.client import Client
from kvstore.env import Env
from kvstore.errors import (
    ErrorCode,
    InvalidRequestError,
    KVStoreError,
)

__all__ = ["BufferHandle", "MooncakeDistributedStore", "ReplicateConfig", "ErrorCodes"]


class ErrorCodes:
    """Mooncake's error codes (mooncake-store ``types.h``) that this layer answers with."""

    OK = 0
    INTERNAL_ERROR = -1
    NO_AVAILABLE_HANDLE = -200
    INVALID_PARAMS = -600
    INVALID_READ = -701
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    TRANSFER_FAIL = -800
    RPC_FAIL = -900


_CODE_FOR = {
    ErrorCode.KEY_NOT_FOUND: ErrorCodes.OBJECT_NOT_FOUND,
    ErrorCode.INVALID_REQUEST: ErrorCodes.INVALID_PARAMS,
    ErrorCode.OUT_OF_RANGE: ErrorCodes.INVALID_PARAMS,
    ErrorCode.NO_SPACE: ErrorCodes.NO_AVAILABLE_HANDLE,
    ErrorCode.OBJECT_BUSY: ErrorCodes.REPLICA_IS_NOT_READY,
    ErrorCode.OBJECT_EXISTS: ErrorCodes.OBJECT_ALREADY_EXISTS,
    ErrorCode.CHECKSUM_MISMATCH: ErrorCodes.INVALID_READ,
    ErrorCode.NODE_UNAVAILABLE: ErrorCodes.TRANSFER_FAIL,
    ErrorCode.NODE_NOT_FOUND: ErrorCodes.TRANSFER_FAIL,
    ErrorCode.GRANT_INVALID: ErrorCodes.TRANSFER_FAIL,
    ErrorCode.TRANSPORT_UNAVAILABLE: ErrorCodes.TRANSFER_FAIL,
    ErrorCode.TIMEOUT: ErrorCodes.RPC_FAIL,
    ErrorCode.MASTER_UNAVAILABLE: ErrorCodes.RPC_FAIL,
    ErrorCode.NOT_LEADER: ErrorCodes.RPC_FAIL,
    ErrorCode.ETCD_UNAVAILABLE: ErrorCodes.RPC_FAIL,
}


def _code(err: BaseException) -> int:
    """The Mooncake code for a kvstore error (anything unexpected is INTERNAL_ERROR)."""
    if isinstance(err, KVStoreError):
        return _CODE_FOR.get(err.code, ErrorCodes.INTERNAL_ERROR)
    return ErrorCodes.INTERNAL_ERROR


class ReplicateConfig:
    """Mooncake's per-put replication settings. kvstore honours ``replica_num`` (copies on
    distinct nodes); the placement and pin fields are kept for programs that set them."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.with_soft_pin = False
        self.with_hard_pin = False
        self.soft_pin_ttl_ms = 0
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []
        self.preferred_nof_segments: list[str] = []
        self.prefer_alloc_in_same_node = False
        self.group_ids: list[str] = []

    def __repr__(self) -> str:
        return f"ReplicateConfig: {{ replica_num: {self.replica_num} }}"


class BufferHandle(bytearray):
    """What ``get_buffer`` returns: the object's bytes, with Mooncake's ``ptr()`` / ``size()``.

    A bytearray, so ``memoryview(handle)`` and ``bytes(handle)`` work as with Mooncake's."""

    def ptr(self) -> int:
        """Address of the first byte (valid while the handle lives and is not resized)."""
        if not self:
            return 0
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))

    def size(self) -> int:
        """Bytes held."""
        return len(self)


def _at(ptr: int, size: int) -> memoryview:
    """A writable byte view of ``size`` bytes at address ``ptr`` (the caller's memory).

    Raises:
        InvalidRequestError: a null or negative address, or a size that is not positive.
    """
    if not isinstance(ptr, int) or not isinstance(size, int) or ptr <= 0 or size <= 0:
        raise InvalidRequestError(f"bad buffer: address {ptr!r}, size {size!r}")
    return memoryview((ctypes.c_ubyte * size).from_address(ptr)).cast("B")


_TENSOR_MAGIC = b"KVT1"


def _tensor_bytes(tensor: Any) -> bytes:
    """kvstore's tensor format: magic, u32 header length, JSON {dtype, shape}, raw bytes."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise InvalidRequestError(f"put_tensor needs a torch.Tensor, got {type(tensor).__name__}")
    t = tensor.detach().to("cpu").contiguous()
    header = json.dumps({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)})
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    head = header.encode()
    return _TENSOR_MAGIC + struct.pack("<I", len(head)) + head + raw


def _tensor_from(data: bytes | bytearray) -> Any:
    import torch

    if data[:4] != _TENSOR_MAGIC:
        raise InvalidRequestError("object was not written by put_tensor")
    (n,) = struct.unpack_from("<I", data, 4)
    header = json.loads(bytes(data[8 : 8 + n]))
    dtype = getattr(torch, header["dtype"])
    body = bytearray(data[8 + n :])
    if not body:
        return torch.empty(header["shape"], dtype=dtype)
    return torch.frombuffer(body, dtype=torch.uint8).view(dtype).reshape(header["shape"])


class MooncakeDistributedStore:
    """Mooncake's client class, backed by a :class:`kvstore.client.Client`.

    Thread-safe as far as the kvstore client is (it is); buffer registrations take a lock.
    """

    def __init__(self) -> None:
        self._client: Client | None = None
        self._hostname = ""
        self._buffers: dict[int, int] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------ setup
    def setup(
        self,
        local_hostname: Any,
        metadata_server: str = "",
        global_segment_size: int = 16 << 20,
        local_buffer_size: int = 16 << 20,
        protocol: str = "tcp",
        rdma_devices: str = "",
        master_server_addr: str = "",
        *args: Any,
        **kwargs: Any,
    ) -> int:
        """Connect to the kvstore cluster; Mooncake's arguments, or one config dict.

        The master is ``master_server_addr`` (kvstore's ``HOST:PORT`` or ``etcd://...``),
        overridden by ``$KVSTORE_MASTER`` when set (so an unmodified Mooncake program, whose
        address names Mooncake's master, can be pointed at kvstore). ``metadata_server`` is used
        when it is an ``etcd://`` URL and no master address is given. The other arguments are
        accepted for compatibility (see the module docstring).

        Returns:
            0, or a negative Mooncake code: -600 for bad arguments, -900 when no master answers.
        """
        if isinstance(local_hostname, dict):
            cfg = local_hostname
            local_hostname = cfg.get("local_hostname", "")
            metadata_server = cfg.get("metadata_server", "")
            master_server_addr = cfg.get("master_server_addr", "")
        if not isinstance(master_server_addr, str) or not isinstance(metadata_server, str):
            return ErrorCodes.INVALID_PARAMS
        address = Env.read().master or master_server_addr
        if not address and metadata_server.startswith("etcd://"):
            address = metadata_server
        if not address:
            return ErrorCodes.INVALID_PARAMS
        try:
            client = Client.connect(address, lease_reads=True)
        except KVStoreError as err:
            return _code(err) if _code(err) != ErrorCodes.INTERNAL_ERROR else ErrorCodes.RPC_FAIL
        old, self._client = self._client, client
        if old is not None:
            old.close()
        self._hostname = str(local_hostname)
        return 0

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int = 16 << 20) -> int:
        """Mooncake's all-defaults setup: the master from ``$KVSTORE_MASTER`` (else
        ``127.0.0.1:50051``, Mooncake's default master port)."""
        return self.setup(
            "localhost", "", mount_segment_size, 16 << 20, protocol, device_name, "127.0.0.1:50051"
        )

    def close(self) -> int:
        """Disconnect; idempotent. Returns 0."""
        client, self._client = self._client, None
        if client is not None:
            client.close()
        return 0

    def health_check(self) -> int:
        """0 when the master answers, 1 when not set up or closed, 2 when unreachable."""
        if self._client is None:
            return 1
        try:
            self._client.stats()
        except KVStoreError:
            return 2
        return 0

    def get_hostname(self) -> str:
        return self._hostname

    @property
    def client(self) -> Client:
        """The kvstore client underneath (for programs that move on to kvstore's own API).

        Raises:
            InvalidRequestError: before ``setup`` or after ``close``.
        """
        if self._client is None:
            raise InvalidRequestError("MooncakeDistributedStore is not set up")
        return self._client

    # ------------------------------------------------------------ buffers
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Note a buffer for ``put_from`` / ``get_into``; -600 if that address is registered."""
        if not isinstance(buffer_ptr, int) or not isinstance(size, int) or buffer_ptr <= 0:
            return ErrorCodes.INVALID_PARAMS
        if size <= 0:
            return ErrorCodes.INVALID_PARAMS
        with self._lock:
            if buffer_ptr in self._buffers:
                return ErrorCodes.INVALID_PARAMS
            self._buffers[buffer_ptr] = size
        return 0

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """Forget a registered buffer; -600 if it was not registered."""
        with self._lock:
            if self._buffers.pop(buffer_ptr, None) is None:
                return ErrorCodes.INVALID_PARAMS
        return 0

    # ------------------------------------------------------------ writes
    def _put_many(
        self, keys: Sequence[str], views: Sequence[Any], config: Any, overwrite: bool
    ) -> list[int]:
        """Store each key whose value is valid; per key 0 or a Mooncake code."""
        client = self._client
        if client is None:
            return [ErrorCodes.INTERNAL_ERROR] * len(keys)
        out = [0] * len(keys)
        todo: list[int] = []
        for i, (k, v) in enumerate(zip(keys, views, strict=True)):
            if not isinstance(k, str) or not k or v is None or len(v) == 0:
                out[i] = ErrorCodes.INVALID_PARAMS
            else:
                todo.append(i)
        if not todo:
            return out
        try:
            if not overwrite:  # Mooncake keeps the first value of a key: skip stored ones
                stored = client.batch_exists([keys[i] for i in todo])
                todo = [i for i, s in zip(todo, stored, strict=True) if not s]
            if not todo:
                return out
            replicas = max(1, int(getattr(config, "replica_num", 1) or 1))
            errs = client.batch_put(
                [keys[i] for i in todo], [views[i] for i in todo], replicas=replicas
            )
        except KVStoreError as err:
            for i in todo:
                out[i] = _code(err)
            return out
        for i, err in zip(todo, errs, strict=True):
            out[i] = 0 if err is None else _code(err)
        return out

    @staticmethod
    def _view(value: Any) -> memoryview | None:
        try:
            return memoryview(value).cast("B")
        except (TypeError, ValueError):
            return None

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store ``value`` (bytes-like); 0, or -600 for an empty value or key."""
        return self._put_many([key], [self._view(value)], config, False)[0]

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store ``value``, replacing a stored one; 0 or a negative code."""
        return self._put_many([key], [self._view(value)], config, True)[0]

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """Store the concatenation of ``parts`` (bytes-like) as one object."""
        views = [self._view(p) for p in parts]
        if any(v is None for v in views):
            return ErrorCodes.INVALID_PARAMS
        return self._put_many([key], [b"".join(views)], config, False)[0]  # type: ignore[arg-type]

    def upsert_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        views = [self._view(p) for p in parts]
        if any(v is None for v in views):
            return ErrorCodes.INVALID_PARAMS
        return self._put_many([key], [b"".join(views)], config, True)[0]  # type: ignore[arg-type]

    def put_batch(
        self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None
    ) -> int:
        """Store many bytes-like values; 0 when all were stored, else the first failure's code."""
        if len(keys) != len(values):
            return ErrorCodes.INVALID_PARAMS
        rcs = self._put_many(keys, [self._view(v) for v in values], config, False)
        return next((rc for rc in rcs if rc != 0), 0)

    def upsert_batch(
        self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None
    ) -> int:
        if len(keys) != len(values):
            return ErrorCodes.INVALID_PARAMS
        rcs = self._put_many(keys, [self._view(v) for v in values], config, True)
        return next((rc for rc in rcs if rc != 0), 0)

    def _ptr_views(self, ptrs: Sequence[int], sizes: Sequence[int]) -> list[memoryview | None]:
        out: list[memoryview | None] = []
        for p, n in zip(ptrs, sizes, strict=True):
            try:
                out.append(_at(p, n))
            except InvalidRequestError:
                out.append(None)
        return out

    def put_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None
    ) -> int:
        """Store ``size`` bytes read straight from address ``buffer_ptr``; 0 or a code."""
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def upsert_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None
    ) -> int:
        return self.batch_upsert_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """Store many objects from caller memory; per key 0 or a negative code."""
        return self._put_from(keys, buffer_ptrs, sizes, config, upsert=False)

    def batch_upsert_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        return self._put_from(keys, buffer_ptrs, sizes, config, upsert=True)

    def _put_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        config: ReplicateConfig | None,
        *,
        upsert: bool,
    ) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [ErrorCodes.INVALID_PARAMS] * len(keys)
        return self._put_many(keys, self._ptr_views(buffer_ptrs, sizes), config, upsert)

    def batch_put_from_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """Store each key as the concatenation of its buffers (one gather copy per object)."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
            return [ErrorCodes.INVALID_PARAMS] * len(keys)
        values: list[Any] = []
        for ptrs, sizes in zip(all_buffer_ptrs, all_sizes, strict=True):
            if len(ptrs) != len(sizes):
                values.append(None)
                continue
            views = self._ptr_views(ptrs, sizes)
            values.append(None if any(v is None for v in views) else b"".join(views))  # type: ignore[misc]
        return self._put_many(keys, values, config, False)

    # ------------------------------------------------------------ reads
    def get(self, key: str) -> bytes:
        """The object's bytes; ``b""`` when it is missing or cannot be read (Mooncake's rule)."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: list[str]) -> list[bytes]:
        """Per key its bytes, ``b""`` for a miss."""
        client = self._client
        if client is None:
            return [b""] * len(keys)
        try:
            got = client.batch_get(list(keys))
        except KVStoreError:
            return [b""] * len(keys)
        return [b"" if isinstance(g, KVStoreError) else g for g in got]

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The object in a :class:`BufferHandle`; None when it is missing."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
        client = self._client
        if client is None:
            return [None] * len(keys)
        try:
            got = client.batch_get(list(keys))
        except KVStoreError:
            return [None] * len(keys)
        return [None if isinstance(g, KVStoreError) else BufferHandle(g) for g in got]

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Read the object into ``size`` bytes at ``buffer_ptr``.

        Returns:
            Bytes read; -704 when missing, -600 when the buffer is smaller than the object.
        """
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        """Per key the bytes read into its buffer, or a negative code."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [ErrorCodes.INVALID_PARAMS] * len(keys)
        client = self._client
        if client is None:
            return [ErrorCodes.INTERNAL_ERROR] * len(keys)
        views = self._ptr_views(buffer_ptrs, sizes)
        out = [ErrorCodes.INVALID_PARAMS] * len(keys)
        todo = [i for i, v in enumerate(views) if v is not None and isinstance(keys[i], str)]
        if not todo:
            return out
        try:
            got = client.batch_get_into([keys[i] for i in todo], [views[i] for i in todo])
        except KVStoreError as err:
            return [_code(err) if i in set(todo) else out[i] for i in range(len(keys))]
        for i, g in zip(todo, got, strict=True):
            out[i] = g if isinstance(g, int) else _code(g)
        return out

    def batch_get_into_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> list[int]:
        """Read each object and scatter it over its buffers in order; per key bytes or a code."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
            return [ErrorCodes.INVALID_PARAMS] * len(keys)
        client = self._client
        if client is None:
            return [ErrorCodes.INTERNAL_ERROR] * len(keys)
        totals = [sum(s) if all(n > 0 for n in s) else 0 for s in all_sizes]
        scratch = [bytearray(t) for t in totals]
        out = self._raw_get_into(client, keys, scratch)
        for i, n in enumerate(out):
            if n <= 0:
                continue
            pos = 0
            views = self._ptr_views(all_buffer_ptrs[i], all_sizes[i])
            if any(v is None for v in views):
                out[i] = ErrorCodes.INVALID_PARAMS
                continue
            for v in views:
                take = min(len(v), n - pos)  # type: ignore[arg-type]
                if take <= 0:
                    break
                v[:take] = scratch[i][pos : pos + take]  # type: ignore[index]
                pos += take
        return out

    @staticmethod
    def _raw_get_into(client: Client, keys: Sequence[str], bufs: Sequence[Any]) -> list[int]:
        out = [ErrorCodes.INVALID_PARAMS] * len(keys)
        todo = [i for i, b in enumerate(bufs) if len(b) > 0]
        if not todo:
            return out
        try:
            got = client.batch_get_into([keys[i] for i in todo], [bufs[i] for i in todo])
        except KVStoreError as err:
            return [_code(err)] * len(keys)
        for i, g in zip(todo, got, strict=True):
            out[i] = g if isinstance(g, int) else _code(g)
        return out

    # ------------------------------------------------------------ tensors
    def put_tensor(self, key: str, tensor: Any) -> int:
        """Store a CPU (or CUDA, copied to the host) tensor with its dtype and shape."""
        try:
            data = _tensor_bytes(tensor)
        except InvalidRequestError:
            return ErrorCodes.INVALID_PARAMS
        return self._put_many([key], [data], None, False)[0]

    def batch_put_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        if len(keys) != len(tensors_list):
            return [ErrorCodes.INVALID_PARAMS] * len(keys)
        values: list[Any] = []
        for t in tensors_list:
            try:
                values.append(_tensor_bytes(t))
            except InvalidRequestError:
                values.append(None)
        return self._put_many(keys, values, None, False)

    def get_tensor(self, key: str) -> Any:
        """The tensor stored by ``put_tensor``; None when missing or not a tensor object."""
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys: list[str]) -> list[Any]:
        out: list[Any] = []
        for data in self.get_batch(keys):
            try:
                out.append(_tensor_from(data) if data else None)
            except (InvalidRequestError, ValueError, KeyError, AttributeError, struct.error):
                out.append(None)
        return out

    # ------------------------------------------------------------ queries and removal
    def is_exist(self, key: str) -> int:
        """1 when stored, 0 when not, -1 on error."""
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        client = self._client
        if client is None:
            return [-1] * len(keys)
        try:
            return [1 if e else 0 for e in client.batch_exists(list(keys))]
        except KVStoreError:
            return [-1] * len(keys)

    def get_size(self, key: str) -> int:
        """The object's size in bytes; -704 when missing."""
        client = self._client
        if client is None:
            return ErrorCodes.INTERNAL_ERROR
        try:
            info = client.locate(key)
            client.release_lease(info)  # only its size was wanted
            return info.size
        except KVStoreError as err:
            return _code(err)

    def remove(self, key: str, force: bool = False) -> int:
        """0, or -704 when the key is not stored. (Never -706: see the module docstring.)"""
        client = self._client
        if client is None:
            return ErrorCodes.INTERNAL_ERROR
        try:
            err = client.batch_remove([key])[0]
        except KVStoreError as e:
            return _code(e)
        return 0 if err is None else _code(err)

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        client = self._client
        if client is None:
            return [ErrorCodes.INTERNAL_ERROR] * len(keys)
        try:
            return [0 if e is None else _code(e) for e in client.batch_remove(list(keys))]
        except KVStoreError as e:
            return [_code(e)] * len(keys)

    def _remove_matching(self, pattern: re.Pattern[str] | None) -> int:
        client = self._client
        if client is None:
            return ErrorCodes.INTERNAL_ERROR
        try:
            keys = client.list_keys()
            texts = [k.decode("utf-8", "surrogateescape") for k in keys]
            chosen = [
                k for k, t in zip(keys, texts, strict=True) if pattern is None or pattern.search(t)
            ]
            removed = 0
            for start in range(0, len(chosen), 1000):
                errs = client.batch_remove(chosen[start : start + 1000])
                removed += sum(1 for e in errs if e is None)
        except KVStoreError as err:
            return _code(err)
        return removed

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Remove every key the pattern matches anywhere in (``re.search``); the count, or -600
        for a pattern that does not compile."""
        try:
            pattern = re.compile(regex_pattern)
        except (re.error, TypeError):
            return ErrorCodes.INVALID_PARAMS
        return self._remove_matching(pattern)

    def remove_all(self, force: bool = False) -> int:
        """Remove every object in the cluster; the count removed."""
        return self._remove_matching(None)


# ---------------------------------------------------------------- the `mooncake` import alias
_MARKER = "kvstore-mooncake-alias"
_ALIAS_STORE = f'''"""{_MARKER}: ``mooncake.store`` served by kvstore (python -m kvstore.client.compat.mooncake
--uninstall-alias removes this package)."""
from kvstore.client.compat.mooncake import *  # noqa: F401,F403
from kvstore.client.compat.mooncake import __all__  # noqa: F401
'''


def install_alias(target: str | os.PathLike[str] | None = None, force: bool = False) -> Path:
    """Write a ``mooncake`` package whose ``mooncake.store`` is this module.

    Args:
        target: the folder to write it in (default: this interpreter's site-packages).
        force: replace a ``mooncake`` package that is not ours (e.g. the real wheel's).

    Returns:
        The package folder written.

    Raises:
        InvalidRequestError: a real ``mooncake`` package is there and ``force`` is not set.
    """
    base = Path(target) if target is not None else Path(sysconfig.get_paths()["purelib"])
    pkg = base / "mooncake"
    init = pkg / "__init__.py"
    ours = init.exists() and _MARKER in init.read_text(errors="replace")
    if pkg.exists() and not ours and not force:
        raise InvalidRequestError(f"{pkg} holds another mooncake package; pass --force")
    pkg.mkdir(parents=True, exist_ok=True)
    init.write_text(f'"""{_MARKER}: Mooncake Store\'s API on kvstore."""\n')
    (pkg / "store.py").write_text(_ALIAS_STORE)
    return pkg


def uninstall_alias(target: str | os.PathLike[str] | None = None) -> bool:
    """Remove the package :func:`install_alias` wrote; False when there is none of ours."""
    base = Path(target) if target is not None else Path(sysconfig.get_paths()["purelib"])
    pkg = base / "mooncake"
    init = pkg / "__init__.py"
    if not (init.exists() and _MARKER in init.read_text(errors="replace")):
        return False
    for name in ("store.py", "__init__.py"):
        (pkg / name).unlink(missing_ok=True)
    cache = pkg / "__pycache__"
    if cache.is_dir():
        for f in cache.iterdir():
            f.unlink()
        cache.rmdir()
    pkg.rmdir()
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvstore.client.compat.mooncake",
        description="Let programs that import mooncake.store run on kvstore.",
    )
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--install-alias", action="store_true")
    group.add_argument("--uninstall-alias", action="store_true")
    ap.add_argument("--target", help="folder to write into (default: site-packages)")
    ap.add_argument("--force", action="store_true", help="replace a real mooncake package")
    args = ap.parse_args(argv)
    try:
        if args.install_alias:
            pkg = install_alias(args.target, args.force)
            print(f"installed {pkg}: `import mooncake.store` now uses kvstore")
            print("point it at a cluster with KVSTORE_MASTER=HOST:PORT (or etcd://...)")
        elif uninstall_alias(args.target):
            print("removed the mooncake alias")
        else:
            print("no kvstore mooncake alias there")
    except KVStoreError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

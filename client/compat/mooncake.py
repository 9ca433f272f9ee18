"""Mooncake Store's Python API (``mooncake.store``, the 0.3.x wheel) on a kvstore cluster.

A program written for Mooncake switches by changing one import::

    from kvstore.client.compat.mooncake import MooncakeDistributedStore, ReplicateConfig

or runs unmodified after ``python -m kvstore.client.compat.mooncake --install-alias``, which
writes a small ``mooncake`` package (``mooncake.store`` re-exporting this module) into the
interpreter's site-packages; ``--uninstall-alias`` removes it again.

Return conventions are Mooncake's, measured against the real wheel
(``mooncake-transfer-engine-non-cuda==0.3.13.post1``, tests/client/compat/mooncake_contract.py
runs the same script against both and names every public method of the wheel): ``0`` or a
negative Mooncake error code for writes; the byte count or a negative code for reads into
buffers; ``b""`` for a missed ``get``; ``None`` for what ``get_buffer`` / ``get_tensor`` cannot
return (per key in batches); ``1`` / ``0`` / ``-1`` for existence; counts for
``remove_by_regex`` / ``remove_all``; nested lists of byte counts or codes for
``get_into_ranges``. A ``put`` of a key that is already stored returns 0 and keeps the stored
value (Mooncake's rule; ``upsert`` replaces). As in the wheel, the copying verbs (``put*``,
``upsert``, ``get``, ``get_batch``, ``get_buffer``, the tensor puts and gets) stage their bytes
in the ``local_buffer_size`` set up (a put or batch larger than it is refused, a get that does
not fit is a miss); the verbs on caller buffers (``*_from``, ``*_into``, ranges) need none.

The deliberate differences, and what is not covered, are listed in docs/engines/mooncake.md
("Deliberate differences"); the contract script skips exactly those, by name, with the reason.
The binding's error codes, value classes and argument conversions, and the steps of
``get_into_ranges`` that need no cluster, live in ``mooncake_binding.py``; the public ones are
re-exported here.
"""

from __future__ import annotations

import argparse
import re
import sys
import threading
from collections.abc import Sequence
from typing import Any

from kvstore.client.client import Client
from kvstore.client.compat.mooncake_alias import install_alias, uninstall_alias
from kvstore.client.compat.mooncake_binding import (
    BufferHandle,
    ErrorCodes,
    ReplicateConfig,
    bytes_like,
    copy_range,
    error_code,
    key_text,
    plan_ranges,
    range_arguments,
    u64,
)
from kvstore.client.compat.mooncake_values import (
    MAX_LOCAL_BUFFER,
    MIN_CONFIG_SIZE,
    MIN_GLOBAL_SEGMENT,
    PROTOCOLS,
    NotATensor,
    config_size,
    error_shape,
    memory_at,
    named_port,
    tensor_bytes,
    tensor_from,
    tensor_in_place,
    tensor_layout,
)
from kvstore.env import Env
from kvstore.errors import (
    InvalidRequestError,
    KVStoreError,
)

__all__ = ["BufferHandle", "MooncakeDistributedStore", "ReplicateConfig", "ErrorCodes"]


class MooncakeDistributedStore:
    """Mooncake's client class, backed by a :class:`kvstore.client.Client`.

    Thread-safe as far as the kvstore client is (it is); buffer registrations take a lock.
    """

    def __init__(self) -> None:
        self._client: Client | None = None
        self._hostname = ""
        self._local_buffer = 0
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
        when it is an ``etcd://`` URL and no master address is given. Sizes, the hostname and
        the protocol are checked as the wheel checks them; ``global_segment_size`` is not
        allocated (kvstore's storage nodes hold the objects) and ``local_buffer_size`` bounds
        what one copying verb stages, as in the wheel.

        Returns:
            0, or a negative Mooncake code: -600 for bad arguments (a size the wheel refuses,
            an empty hostname, a config dict without ``metadata_server``), -1 for a protocol
            the wheel does not set up, -900 when no master answers.

        Raises:
            TypeError: a positional size that is not an unsigned 64-bit integer (the wheel's
                binding raises the same).
        """
        if isinstance(local_hostname, dict):
            cfg = local_hostname
            local_hostname = str(cfg.get("local_hostname", ""))
            metadata_server = str(cfg.get("metadata_server", ""))
            master_server_addr = cfg.get("master_server_addr", "")
            protocol = cfg.get("protocol", "tcp")
            global_size = config_size(cfg.get("global_segment_size", 16 << 20))
            local_size = config_size(cfg.get("local_buffer_size", 16 << 20))
            if global_size is None or local_size is None or not metadata_server:
                return ErrorCodes.INVALID_PARAMS
            if 0 < global_size < MIN_CONFIG_SIZE or local_size > MAX_LOCAL_BUFFER:
                return ErrorCodes.INVALID_PARAMS
            if 0 < local_size < MIN_CONFIG_SIZE:
                return ErrorCodes.INVALID_PARAMS
        else:
            global_size = u64(global_segment_size, "setup(): global_segment_size")
            local_size = u64(local_buffer_size, "setup(): local_buffer_size")
        if not isinstance(local_hostname, str) or not local_hostname:
            return ErrorCodes.INVALID_PARAMS
        if protocol not in PROTOCOLS:
            return ErrorCodes.INTERNAL_ERROR
        if 0 < global_size < MIN_GLOBAL_SEGMENT:
            return ErrorCodes.INVALID_PARAMS
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
            return (
                error_code(err)
                if error_code(err) != ErrorCodes.INTERNAL_ERROR
                else ErrorCodes.RPC_FAIL
            )
        old, self._client = self._client, client
        if old is not None:
            old.close()
        self._hostname = named_port(local_hostname)
        self._local_buffer = local_size
        return 0

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int = 16 << 20) -> int:
        """Mooncake's all-defaults setup: the master from ``$KVSTORE_MASTER`` (else
        ``127.0.0.1:50051``, Mooncake's default master port); -600 on a store already set up,
        as the wheel answers."""
        if self._client is not None:
            return ErrorCodes.INVALID_PARAMS
        return self.setup(
            "localhost", "", mount_segment_size, 16 << 20, protocol, device_name, "127.0.0.1:50051"
        )

    def close(self) -> int:
        """Disconnect; idempotent. Returns 0.

        What this client stored stays readable by the others: kvstore's storage nodes hold the
        objects, not the client (Mooncake drops the objects in a closing client's own segment).
        """
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
        """This client's name, ``host:port`` as the wheel gives it ("" before setup)."""
        return self._hostname

    def get_offload_rpc_read_count(self) -> int:
        """Reads served by the wheel's SSD-offload RPC: kvstore has none, so 0 (the wheel's
        answer without offload)."""
        return 0

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
        """Note a buffer for ``put_from`` / ``get_into`` / ``get_into_ranges``; -600 if that
        address is registered."""
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

    def _registered_end(self, ptr: int) -> int | None:
        """The end address of the registered buffer holding ``ptr``; None when none does."""
        with self._lock:
            # NOTE: a scan: programs register a handful of large buffers, not many small ones.
            for start, size in self._buffers.items():
                if start <= ptr < start + size:
                    return start + size
        return None

    # ------------------------------------------------------------ writes
    def _put_many(
        self, keys: Sequence[Any], views: Sequence[Any], config: Any, overwrite: bool
    ) -> list[int]:
        """Store each key whose value is valid; per key 0 or a Mooncake code."""
        client = self._client
        if client is None:
            return [ErrorCodes.INTERNAL_ERROR] * len(keys)
        keys = [key_text(k) for k in keys]
        out = [0] * len(keys)
        todo: list[int] = []
        for i, (k, v) in enumerate(zip(keys, views, strict=True)):
            if not isinstance(k, str) or not k or v is None or len(v) == 0:
                out[i] = ErrorCodes.INVALID_PARAMS
            else:
                todo.append(i)
        # A key named twice in one batch is written once, as if the batch ran in order: a put
        # keeps its first value (the wheel's answer), an upsert its last; the other is 0.
        chosen = {keys[i]: i for i in (todo if overwrite else reversed(todo))}
        todo = sorted(chosen.values())
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
                out[i] = error_code(err)
            return out
        for i, err in zip(todo, errs, strict=True):
            out[i] = 0 if err is None else error_code(err)
        return out

    def _staged_puts(
        self, keys: Sequence[Any], views: Sequence[memoryview], config: Any, overwrite: bool
    ) -> list[int]:
        """A copying put: the batch goes through the local buffer whole, as in the wheel, so a
        batch larger than it is refused (-600 for every key) and nothing is stored."""
        if self._client is not None and sum(len(v) for v in views) > self._local_buffer:
            return [ErrorCodes.INVALID_PARAMS] * len(keys)
        return self._put_many(keys, views, config, overwrite)

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store ``value`` (bytes-like); 0, or -600 for an empty value or key.

        Raises:
            TypeError: ``value`` is not bytes-like (as the wheel's binding).
        """
        return self._staged_puts([key], [bytes_like(value, "put()")], config, False)[0]

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store ``value``, replacing a stored one; 0 or a negative code.

        Raises:
            TypeError: ``value`` is not bytes-like.
        """
        return self._staged_puts([key], [bytes_like(value, "upsert()")], config, True)[0]

    def _put_parts(self, key: str, parts: Sequence[Any], config: Any, overwrite: bool) -> int:
        views = [bytes_like(p, "put_parts()") for p in parts]
        if sum(len(v) for v in views) == 0:
            return 0  # the wheel answers 0 and stores nothing
        return self._staged_puts([key], [memoryview(b"".join(views))], config, overwrite)[0]

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """Store the concatenation of ``parts`` (bytes-like) as one object; 0 without storing
        anything when they hold no bytes, as the wheel.

        Raises:
            TypeError: a part is not bytes-like.
        """
        return self._put_parts(key, parts, config, False)

    def upsert_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """:meth:`put_parts`, replacing a stored value."""
        return self._put_parts(key, parts, config, True)

    def put_batch(
        self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None
    ) -> int:
        """Store many bytes-like values; 0 when all were stored, else the first failure's code."""
        if len(keys) != len(values):
            return ErrorCodes.INVALID_PARAMS
        views = [bytes_like(v, "put_batch()") for v in values]
        rcs = self._staged_puts(keys, views, config, False)
        return next((rc for rc in rcs if rc != 0), 0)

    def upsert_batch(
        self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None
    ) -> int:
        """:meth:`put_batch`, replacing stored values."""
        if len(keys) != len(values):
            return ErrorCodes.INVALID_PARAMS
        views = [bytes_like(v, "upsert_batch()") for v in values]
        rcs = self._staged_puts(keys, views, config, True)
        return next((rc for rc in rcs if rc != 0), 0)

    def _ptr_views(self, ptrs: Sequence[int], sizes: Sequence[int]) -> list[memoryview | None]:
        out: list[memoryview | None] = []
        for p, n in zip(ptrs, sizes, strict=True):
            try:
                out.append(memory_at(p, n))
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
        """:meth:`put_from`, replacing a stored value."""
        return self.batch_upsert_from([key], [buffer_ptr], [size], config)[0]

    def put_from_with_metadata(
        self,
        key: str,
        buffer_ptr: int,
        metadata_buffer_ptr: int,
        size: int,
        metadata_size: int,
        config: ReplicateConfig | None = None,
    ) -> int:
        """Store ``metadata_size`` bytes at ``metadata_buffer_ptr`` followed by ``size`` bytes
        at ``buffer_ptr`` as one object (the wheel's order); 0 without storing anything when
        ``size`` is 0, as the wheel."""
        u64(size, "put_from_with_metadata(): size")
        u64(metadata_size, "put_from_with_metadata(): metadata_size")
        if size == 0:
            return 0
        data = self._ptr_views([buffer_ptr], [size])[0]
        meta = self._ptr_views([metadata_buffer_ptr], [metadata_size])[0] if metadata_size else b""
        if data is None or meta is None:
            return ErrorCodes.INVALID_PARAMS
        return self._put_many([key], [memoryview(bytes(meta) + bytes(data))], config, False)[0]

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
        """:meth:`batch_put_from`, replacing stored values."""
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
        sizes = [u64(n, "put_from(): size") for n in sizes]
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
    def _staged_gets(self, keys: Sequence[Any]) -> list[bytearray | None]:
        """A copying read: per key its bytes, or None for a miss or an object that does not fit
        in what is left of the local buffer (keys taken in order, as the wheel stages them)."""
        client = self._client
        if client is None or not keys:
            return [None] * len(keys)
        if self._local_buffer == 0:
            return [None] * len(keys)  # nothing can be staged: the wheel reads nothing either
        keys = [key_text(k) for k in keys]
        try:
            got = client.batch_get(keys)
        except KVStoreError:
            return [None] * len(keys)
        out: list[bytearray | None] = []
        room = self._local_buffer
        for g in got:
            if isinstance(g, KVStoreError) or len(g) > room:
                out.append(None)
            else:
                room -= len(g)
                out.append(bytearray(g))
        return out

    def get(self, key: str) -> bytes:
        """The object's bytes; ``b""`` when it is missing or cannot be read (Mooncake's rule)."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: list[str]) -> list[bytes]:
        """Per key its bytes, ``b""`` for a miss; ``[b""]`` for no keys, as the wheel."""
        if not keys:
            return [b""]
        return [b"" if g is None else bytes(g) for g in self._staged_gets(keys)]

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The object in a :class:`BufferHandle`; None when it is missing."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
        """Per key a :class:`BufferHandle`, or None for a miss."""
        return [None if g is None else BufferHandle(g) for g in self._staged_gets(keys)]

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
        keys = [key_text(k) for k in keys]
        views = self._ptr_views(buffer_ptrs, sizes)
        out = [ErrorCodes.INVALID_PARAMS] * len(keys)
        todo = [i for i, v in enumerate(views) if v is not None and isinstance(keys[i], str)]
        if not todo:
            return out
        try:
            got = client.batch_get_into([keys[i] for i in todo], [views[i] for i in todo])
        except KVStoreError as err:
            return [error_code(err) if i in set(todo) else out[i] for i in range(len(keys))]
        for i, g in zip(todo, got, strict=True):
            out[i] = g if isinstance(g, int) else error_code(g)
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
    def _raw_get_into(client: Client, keys: Sequence[Any], bufs: Sequence[Any]) -> list[int]:
        out = [ErrorCodes.INVALID_PARAMS] * len(keys)
        keys = [key_text(k) for k in keys]
        todo = [i for i, b in enumerate(bufs) if len(b) > 0]
        if not todo:
            return out
        try:
            got = client.batch_get_into([keys[i] for i in todo], [bufs[i] for i in todo])
        except KVStoreError as err:
            return [error_code(err)] * len(keys)
        for i, g in zip(todo, got, strict=True):
            out[i] = g if isinstance(g, int) else error_code(g)
        return out

    def get_into_ranges(
        self,
        buffer_ptrs: list[int],
        all_keys: list[list[str]],
        all_dst_offsets: list[list[list[int]]],
        all_src_offsets: list[list[list[int]]],
        all_sizes: list[list[list[int]]],
    ) -> list[list[list[int]]]:
        """Copy byte ranges of objects into registered buffers.

        Buffer ``i`` gets, for its ``j``-th key ``all_keys[i][j]`` and that key's ``r``-th
        range, ``all_sizes[i][j][r]`` bytes from offset ``all_src_offsets[i][j][r]`` of the
        object, written at ``buffer_ptrs[i] + all_dst_offsets[i][j][r]``. Each object is read
        whole (checked against its checksum) and the ranges are copied from it.

        Returns:
            The same nesting as the offsets: per range the bytes copied, or -600 (buffer not
            inside a registered one, a range past the registered buffer or past the object,
            lists that disagree in length), -704 (object missing) or another negative code.

        Raises:
            TypeError: an offset, size or address that is not an unsigned 64-bit integer, or a
                key that is not text (as the wheel's binding).
        """
        ptrs, keys, dst, src, sizes = range_arguments(
            buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes
        )
        if not len(ptrs) == len(keys) == len(dst) == len(src) == len(sizes):
            return error_shape(len(ptrs), keys, dst, ErrorCodes.INVALID_PARAMS)
        out, wanted = plan_ranges(ptrs, keys, dst, src, sizes, self._registered_end)
        if not wanted:
            return out
        client = self._client
        if client is None:
            for i, j, r in wanted:
                out[i][j][r] = ErrorCodes.INTERNAL_ERROR
            return out
        got = self._read_whole(client, sorted({keys[i][j] for i, j, _ in wanted}))
        for i, j, r in wanted:
            data = got[keys[i][j]]
            if isinstance(data, KVStoreError):
                out[i][j][r] = error_code(data)
            else:
                out[i][j][r] = copy_range(
                    data, ptrs[i], dst[i][j][r], src[i][j][r], sizes[i][j][r], self._registered_end
                )
        return out

    @staticmethod
    def _read_whole(client: Client, names: list[str]) -> dict[str, Any]:
        """Each named object whole (checked against its checksum), or the error that stopped
        it; a failed batch gives every name its error, as no object of it was read."""
        try:
            return dict(zip(names, client.batch_get(names), strict=True))
        except KVStoreError as err:
            return dict.fromkeys(names, err)

    # ------------------------------------------------------------ tensors
    def _put_tensors(
        self, keys: Sequence[Any], tensors: Sequence[Any], config: Any, overwrite: bool
    ) -> list[int]:
        """Store tensors in kvstore's format; per key 0 or a code. A batch larger than the local
        buffer is refused with -200, as the wheel's tensor puts answer."""
        if len(keys) != len(tensors):
            return [ErrorCodes.INVALID_PARAMS] * len(keys)
        values: list[Any] = []
        for t in tensors:
            try:
                values.append(memoryview(tensor_bytes(t)))
            except InvalidRequestError:
                values.append(None)
        staged = sum(len(v) for v in values if v is not None)
        if self._client is not None and staged > self._local_buffer:
            return [
                ErrorCodes.INVALID_PARAMS if v is None else ErrorCodes.NO_AVAILABLE_HANDLE
                for v in values
            ]
        return self._put_many(keys, values, config, overwrite)

    def put_tensor(self, key: str, tensor: Any) -> int:
        """Store a CPU (or CUDA, copied to the host) tensor with its dtype and shape; -600 for
        what is not a tensor or a dtype the wheel does not store (complex, sub-byte, ...)."""
        return self._put_tensors([key], [tensor], None, False)[0]

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        """:meth:`put_tensor`, replacing a stored value."""
        return self._put_tensors([key], [tensor], None, True)[0]

    def pub_tensor(self, key: str, tensor: Any, config: ReplicateConfig | None = None) -> int:
        """:meth:`put_tensor` with replication settings."""
        return self._put_tensors([key], [tensor], config, False)[0]

    def upsert_pub_tensor(
        self, key: str, tensor: Any, config: ReplicateConfig | None = None
    ) -> int:
        """:meth:`pub_tensor`, replacing a stored value."""
        return self._put_tensors([key], [tensor], config, True)[0]

    def batch_put_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        """Per key :meth:`put_tensor`'s answer; -600 for every key when the lists differ."""
        return self._put_tensors(keys, tensors_list, None, False)

    def batch_upsert_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        """Per key :meth:`upsert_tensor`'s answer."""
        return self._put_tensors(keys, tensors_list, None, True)

    def batch_pub_tensor(
        self, keys: list[str], tensors_list: list[Any], config: ReplicateConfig | None = None
    ) -> list[int]:
        """Per key :meth:`pub_tensor`'s answer."""
        return self._put_tensors(keys, tensors_list, config, False)

    def batch_upsert_pub_tensor(
        self, keys: list[str], tensors_list: list[Any], config: ReplicateConfig | None = None
    ) -> list[int]:
        """Per key :meth:`upsert_pub_tensor`'s answer."""
        return self._put_tensors(keys, tensors_list, config, True)

    def _put_tensors_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], overwrite: bool
    ) -> list[int]:
        """Store buffers that hold a tensor object as :meth:`get_tensor_into` leaves it."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [ErrorCodes.INVALID_PARAMS] * len(keys)
        views = self._ptr_views(buffer_ptrs, [u64(n, "put_tensor_from(): size") for n in sizes])
        values: list[memoryview | None] = []
        for v in views:
            try:
                if v is not None:
                    tensor_layout(v)  # refuse what get_tensor could not return
                values.append(v)
            except NotATensor:
                values.append(None)
        return self._put_many(keys, values, None, overwrite)

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """Store ``size`` bytes at ``buffer_ptr`` holding a tensor object (header and body, as
        :meth:`get_tensor_into` leaves them); -600 when they are not one."""
        return self._put_tensors_from([key], [buffer_ptr], [size], False)[0]

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """:meth:`put_tensor_from`, replacing a stored value."""
        return self._put_tensors_from([key], [buffer_ptr], [size], True)[0]

    def batch_put_tensor_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        """Per key :meth:`put_tensor_from`'s answer."""
        return self._put_tensors_from(keys, buffer_ptrs, sizes, False)

    def batch_upsert_tensor_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        """Per key :meth:`upsert_tensor_from`'s answer."""
        return self._put_tensors_from(keys, buffer_ptrs, sizes, True)

    def get_tensor(self, key: str) -> Any:
        """The tensor stored by ``put_tensor``; None when it is missing, not a tensor object,
        or a tensor object whose header does not describe its body."""
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys: list[str]) -> list[Any]:
        """Per key :meth:`get_tensor`'s answer: one object that cannot be returned is None and
        leaves the others' tensors."""
        out: list[Any] = []
        for data in self._staged_gets(keys):
            try:
                out.append(None if data is None else tensor_from(data))
            except NotATensor:
                out.append(None)
        return out

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        """Read a tensor object into ``size`` bytes at ``buffer_ptr``; the tensor, viewing that
        memory, or None (missing, buffer too small, not a tensor object)."""
        return self.batch_get_tensor_into([key], [buffer_ptr], [size])[0]

    def batch_get_tensor_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[Any]:
        """Per key :meth:`get_tensor_into`'s answer."""
        read = self.batch_get_into(keys, buffer_ptrs, sizes)
        out: list[Any] = []
        for n, ptr in zip(read, buffer_ptrs, strict=True):
            try:
                out.append(tensor_in_place(ptr, n) if n > 0 else None)
            except NotATensor:
                out.append(None)
        return out

    # ------------------------------------------------------------ queries and removal
    def is_exist(self, key: str) -> int:
        """1 when stored, 0 when not, -1 on error."""
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """Per key 1 (stored), 0 (not) or -1 (error)."""
        client = self._client
        if client is None:
            return [-1] * len(keys)
        keys = [key_text(k) for k in keys]
        named = [i for i, k in enumerate(keys) if isinstance(k, str) and k]
        out = [0] * len(keys)  # an empty key is never stored
        try:
            found = client.batch_exists([keys[i] for i in named]) if named else []
        except KVStoreError:
            return [-1] * len(keys)
        for i, f in zip(named, found, strict=True):
            out[i] = 1 if f else 0
        return out

    def get_size(self, key: str) -> int:
        """The object's size in bytes; -704 when missing."""
        client = self._client
        if client is None:
            return ErrorCodes.INTERNAL_ERROR
        key = key_text(key)
        if key == "":
            return ErrorCodes.OBJECT_NOT_FOUND
        try:
            info = client.locate(key)
            client.release_lease(info)  # only its size was wanted
            return info.size
        except KVStoreError as err:
            return error_code(err)

    def remove(self, key: str, force: bool = False) -> int:
        """0, or -704 when the key is not stored. (Never -706: see docs/engines/mooncake.md.)"""
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        """Per key 0 or a negative code (-704 when not stored)."""
        client = self._client
        if client is None:
            return [ErrorCodes.INTERNAL_ERROR] * len(keys)
        keys = [key_text(k) for k in keys]
        named = [i for i, k in enumerate(keys) if isinstance(k, str) and k]
        out = [ErrorCodes.OBJECT_NOT_FOUND] * len(keys)  # an empty key is never stored
        try:
            errs = client.batch_remove([keys[i] for i in named]) if named else []
        except KVStoreError as e:
            return [error_code(e)] * len(keys)
        for i, e in zip(named, errs, strict=True):
            out[i] = 0 if e is None else error_code(e)
        return out

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
            return error_code(err)
        return removed

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Remove every key the pattern matches anywhere in (``re.search``); the count, or -600
        for a pattern that does not compile.

        Raises:
            TypeError: the pattern is not text (as the wheel's binding).
        """
        if not isinstance(regex_pattern, str):
            raise TypeError("remove_by_regex(): incompatible function arguments")
        try:
            pattern = re.compile(regex_pattern)
        except re.error:
            return ErrorCodes.INVALID_PARAMS
        return self._remove_matching(pattern)

    def remove_all(self, force: bool = False) -> int:
        """Remove every object in the cluster; the count removed."""
        return self._remove_matching(None)


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

"""CUDA tensors through the byte-level client: pinned host staging, one copy each way.

The data path (TCP ``recv_into``/``sendmsg``, shm copies) moves bytes between sockets or the
node's arena and host memory. A CUDA tensor therefore crosses the PCIe bus exactly once:

- **put**: one device-to-host copy of the tensor into a pinned (page-locked) host buffer, then the
  normal write path sends (or shm-copies) straight from that buffer;
- **get_into**: the data path reads straight into a pinned buffer, then one host-to-device copy
  fills the tensor. Keys whose read failed (missing, checksum mismatch, ...) leave their tensor
  untouched: nothing is copied to the device for them.

Copies are queued ``non_blocking`` on one side stream per device, after that stream waited for
the caller's current stream (so a put sees the kernels that produced the tensor, and a get does
not overwrite a tensor still in use); a batch synchronises each stream once, not once per key.

Pinned buffers come from :class:`PinnedPool`: power-of-two size classes, a bound on the bytes it
keeps, reused across calls (pinning memory costs far more than copying into it). An object larger
than the largest class, or one that does not fit under the bound while every pooled buffer is
lent, gets a one-off buffer of its exact size, freed when the call ends (not chunked: the data
path needs one contiguous buffer per object, to checksum it and to ``recv_into`` it whole).

NOTE: torch's own caching host allocator keeps pinned blocks that were freed (a one-off buffer
included) for later ``pin_memory`` allocations; the bound here is on what this pool holds, not on
what torch caches (``torch.accelerator.empty_host_cache()`` returns that to the OS).

torch is imported only here, and only once a caller has passed a CUDA tensor.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvstore.errors import InvalidRequestError

log = logging.getLogger(__name__)

#: Bytes of pinned host memory a client keeps for staging (free and lent buffers together).
DEFAULT_CAPACITY_BYTES = 256 << 20
#: The smallest size class: smaller objects share one class (pinned pages are costly to make).
MIN_CLASS_BYTES = 64 << 10
#: The largest size class; a larger object gets a one-off buffer.
MAX_CLASS_BYTES = 64 << 20


def is_cuda_tensor(obj: Any) -> bool:
    """Whether ``obj`` is a torch tensor on a CUDA device (never imports torch)."""
    return type(obj).__module__.startswith("torch") and bool(getattr(obj, "is_cuda", False))


def allocate_pinned(num_bytes: int) -> Any:
    """A page-locked ``uint8`` host tensor of ``num_bytes`` (the production allocator).

    Falls back, with one log line, to pageable memory where pinning fails (no driver, a container
    limit): still one copy, only slower.
    """
    import torch

    try:
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as exc:
        if not _warned.is_set():
            _warned.set()
            log.warning("pinned host memory unavailable (%s); staging in pageable memory", exc)
        return torch.empty(num_bytes, dtype=torch.uint8)


_warned = threading.Event()


@dataclass(slots=True, eq=False)
class Lease:
    """A host buffer lent by :class:`PinnedPool`; give it back with :meth:`PinnedPool.release`.

    Attributes:
        buffer: the whole buffer (a 1-D ``uint8`` tensor of the size class, or exact if one-off).
        num_bytes: the bytes asked for.
        pooled: whether it goes back to the pool on release (False: one-off, freed).
    """

    buffer: Any
    num_bytes: int
    pooled: bool
    released: bool = False

    @property
    def data(self) -> Any:
        """The first ``num_bytes`` of the buffer (a tensor view, no copy)."""
        return self.buffer[: self.num_bytes]


class PinnedPool:
    """Reusable pinned host buffers in power-of-two size classes, at most ``capacity_bytes`` kept.

    Thread-safe. Never blocks on the bound: when a new buffer would pass it, free buffers of other
    classes are dropped first, and if that is not enough the caller gets a one-off buffer.

    Args:
        capacity_bytes: the most bytes of pooled buffers (free and lent) held at once.
        allocate: makes a 1-D ``uint8`` host tensor of the given size (pinned in production; tests
            pass a plain CPU allocator).
        min_class_bytes: the smallest size class.
        max_class_bytes: the largest size class; larger requests are one-off.

    Raises:
        InvalidRequestError: classes that are not powers of two or out of order, a negative bound.
    """

    # NOTE: lock order: only ``_lock``, never held while allocating (pinning takes milliseconds).
    def __init__(
        self,
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
        *,
        allocate: Callable[[int], Any] = allocate_pinned,
        min_class_bytes: int = MIN_CLASS_BYTES,
        max_class_bytes: int = MAX_CLASS_BYTES,
    ) -> None:
        for name, n in (("min_class_bytes", min_class_bytes), ("max_class_bytes", max_class_bytes)):
            if n <= 0 or n & (n - 1):
                raise InvalidRequestError(f"{name} must be a power of two, got {n}")
        if min_class_bytes > max_class_bytes or capacity_bytes < 0:
            raise InvalidRequestError("need min_class_bytes <= max_class_bytes, capacity >= 0")
        self.capacity_bytes = capacity_bytes
        self.min_class_bytes = min_class_bytes
        self.max_class_bytes = max_class_bytes
        self._allocate = allocate
        self._lock = threading.Lock()
        # Per class a LIFO stack of free buffers: the most recently used stays warm in cache/TLB.
        self._free: dict[int, list[Any]] = {}
        self._held_bytes = 0  # pooled buffers, free or lent
        self.num_allocations = 0  # buffers made (pooled and one-off), for tests and metrics
        self.num_one_off = 0

    @property
    def held_bytes(self) -> int:
        """Bytes of pooled buffers, free or lent (never above ``capacity_bytes``)."""
        return self._held_bytes

    @property
    def free_bytes(self) -> int:
        """Bytes of pooled buffers waiting to be lent."""
        with self._lock:
            return sum(cls * len(bufs) for cls, bufs in self._free.items())

    def size_class(self, num_bytes: int) -> int | None:
        """The class serving ``num_bytes``: the next power of two (at least the minimum), or
        None beyond the largest class (a one-off buffer)."""
        if num_bytes > self.max_class_bytes:
            return None
        return max(self.min_class_bytes, 1 << max(0, num_bytes - 1).bit_length())

    def acquire(self, num_bytes: int) -> Lease:
        """Lend a buffer of at least ``num_bytes``.

        Args:
            num_bytes: bytes needed.

        Returns:
            The lease; its ``data`` is exactly ``num_bytes`` long.

        Raises:
            InvalidRequestError: a negative size.
            Whatever the allocator raises (nothing is kept or counted then).
        """
        if num_bytes < 0:
            raise InvalidRequestError(f"cannot stage {num_bytes} bytes")
        cls = self.size_class(num_bytes)
        if cls is None:
            return self._one_off(num_bytes)
        dropped: list[Any] = []
        with self._lock:
            free = self._free.get(cls)
            if free:
                return Lease(free.pop(), num_bytes, pooled=True)
            # Make room under the bound from free buffers of other classes, largest first.
            for other in sorted(self._free, reverse=True):
                bufs = self._free[other]
                while bufs and self._held_bytes + cls > self.capacity_bytes:
                    dropped.append(bufs.pop())
                    self._held_bytes -= other
            if self._held_bytes + cls > self.capacity_bytes:
                pooled = False
            else:
                self._held_bytes += cls  # reserved: allocated below, outside the lock
                pooled = True
        del dropped  # freed outside the lock
        if not pooled:
            return self._one_off(num_bytes)
        try:
            buf = self._allocate(cls)
        except BaseException:
            with self._lock:
                self._held_bytes -= cls
            raise
        with self._lock:
            self.num_allocations += 1
        return Lease(buf, num_bytes, pooled=True)

    def _one_off(self, num_bytes: int) -> Lease:
        buf = self._allocate(num_bytes)
        with self._lock:
            self.num_allocations += 1
            self.num_one_off += 1
        return Lease(buf, num_bytes, pooled=False)

    def release(self, lease: Lease) -> None:
        """Give a buffer back (a pooled one is kept for reuse, a one-off one is freed).

        Raises:
            InvalidRequestError: the lease was released already.
        """
        with self._lock:
            if lease.released:
                raise InvalidRequestError("staging buffer released twice")
            lease.released = True
            if lease.pooled:
                self._free.setdefault(len(lease.buffer), []).append(lease.buffer)
        lease.buffer = None  # the caller's reference can no longer reach a reused buffer

    def clear(self) -> None:
        """Free every buffer not lent right now."""
        with self._lock:
            for cls, bufs in self._free.items():
                self._held_bytes -= cls * len(bufs)
            self._free.clear()


class Copier(Protocol):
    """Queues copies between host and device for one batch and waits for them once."""

    def copy(self, dst: Any, src: Any) -> None:
        """Queue ``dst.copy_(src)``; one side of it is a device tensor."""

    def synchronize(self) -> None:
        """Wait until every copy queued so far is done."""


class CudaCopier:
    """Copies on one side stream per device, ordered after the caller's current stream.

    Args:
        streams: the side stream per device, shared across batches (made on first use).
        lock: guards ``streams``.
    """

    def __init__(self, streams: dict[Any, Any], lock: threading.Lock) -> None:
        self._streams = streams
        self._lock = lock
        self._used: dict[Any, Any] = {}

    def _stream(self, device: Any) -> Any:
        stream = self._used.get(device)
        if stream is None:
            import torch

            with self._lock:
                stream = self._streams.get(device)
                if stream is None:
                    stream = self._streams[device] = torch.cuda.Stream(device=device)
            stream.wait_stream(torch.cuda.current_stream(device))
            self._used[device] = stream
        return stream

    def copy(self, dst: Any, src: Any) -> None:
        import torch

        stream = self._stream(src.device if src.is_cuda else dst.device)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def synchronize(self) -> None:
        for stream in self._used.values():
            stream.synchronize()


def _flat_bytes(tensor: Any) -> Any:
    """A contiguous tensor as a flat ``uint8`` view of its bytes (no copy)."""
    import torch

    return tensor.detach().reshape(-1).view(torch.uint8)


class _Pending:
    """A copier and whether copies were queued since its last wait (so a batch waits once)."""

    __slots__ = ("copier", "pending")

    def __init__(self, copier: Copier) -> None:
        self.copier = copier
        self.pending = False

    def copy(self, dst: Any, src: Any) -> None:
        self.pending = True
        self.copier.copy(dst, src)

    def wait(self) -> None:
        if self.pending:
            self.copier.synchronize()
            self.pending = False


@dataclass(slots=True)
class StagedGets:
    """Buffers to read into in place of the caller's CUDA tensors (see :meth:`CudaStaging.gets`).

    Attributes:
        buffers: the caller's buffers, each contiguous CUDA tensor replaced by a pinned buffer
            of the same byte size.
    """

    buffers: list[Any]
    _targets: list[tuple[int, Any, Lease]] = field(default_factory=list)
    _copies: _Pending | None = None

    def finish(self, results: Sequence[Any]) -> None:
        """Copy what was read into the CUDA tensors (one H2D copy each), then wait once.

        Args:
            results: per buffer, the bytes read (an int) or an error; only ints are copied.
        """
        if self._copies is None:
            return  # nothing was staged
        for i, flat, lease in self._targets:
            n = results[i]
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                self._copies.copy(flat[:n], lease.data[:n])
        self._copies.wait()


class CudaStaging:
    """Stages the CUDA tensors of a batch through a :class:`PinnedPool`. Thread-safe.

    Args:
        pool: where the pinned buffers come from.
        is_device: which objects to stage (CUDA tensors; tests stage marked CPU tensors).
        copier: makes the per-batch copier (CUDA streams; tests copy on the CPU).
    """

    def __init__(
        self,
        pool: PinnedPool,
        *,
        is_device: Callable[[Any], bool] = is_cuda_tensor,
        copier: Callable[[], Copier] | None = None,
    ) -> None:
        self.pool = pool
        self.is_device = is_device
        self._streams: dict[Any, Any] = {}
        self._lock = threading.Lock()
        self._new_copier = copier or (lambda: CudaCopier(self._streams, self._lock))

    def any_device(self, objs: Sequence[Any]) -> bool:
        """Whether any of ``objs`` needs staging."""
        return any(self.is_device(o) for o in objs)

    def _stageable(self, obj: Any) -> bool:
        # A non-contiguous device tensor is passed through untouched: as_bytes_view rejects it
        # with InvalidRequestError for its key alone, and nothing is copied or stored.
        return self.is_device(obj) and obj.is_contiguous()

    @contextmanager
    def puts(self, values: Sequence[Any]) -> Iterator[list[Any]]:
        """Copy the CUDA tensors among ``values`` to pinned buffers (one D2H each, one wait).

        Yields:
            ``values`` with each contiguous CUDA tensor replaced by a pinned host tensor holding
            its bytes; valid until the block ends, when the buffers go back to the pool.
        """
        out = list(values)
        leases: list[Lease] = []
        copies: _Pending | None = None
        try:
            for i, v in enumerate(values):
                if not self._stageable(v):
                    continue
                flat = _flat_bytes(v)
                lease = self.pool.acquire(flat.numel())
                leases.append(lease)
                copies = copies or _Pending(self._new_copier())
                copies.copy(lease.data, flat)
                out[i] = lease.data
            if copies is not None:
                copies.wait()
            yield out
        finally:
            self._release(leases, copies)

    @contextmanager
    def gets(self, buffers: Sequence[Any]) -> Iterator[StagedGets]:
        """Pinned buffers to read into in place of the CUDA tensors among ``buffers``.

        Call :meth:`StagedGets.finish` with the per-key results inside the block to copy what
        was read to the devices; the pinned buffers go back to the pool when the block ends.

        Yields:
            The staged batch.
        """
        staged = StagedGets(list(buffers))
        leases: list[Lease] = []
        try:
            for i, b in enumerate(buffers):
                if not self._stageable(b):
                    continue
                flat = _flat_bytes(b)
                lease = self.pool.acquire(flat.numel())
                leases.append(lease)
                staged._targets.append((i, flat, lease))
                staged.buffers[i] = lease.data
            if leases:
                staged._copies = _Pending(self._new_copier())
            yield staged
        finally:
            self._release(leases, staged._copies)

    def _release(self, leases: list[Lease], copies: _Pending | None) -> None:
        try:
            if copies is not None:
                copies.wait()  # an error path may leave copies queued: reuse only idle buffers
        finally:
            for lease in leases:
                self.pool.release(lease)

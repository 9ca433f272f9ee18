"""Turn the buffers users hand us (bytes, bytearray, memoryview, numpy arrays, CPU torch
tensors) into flat byte memoryviews without copying; :class:`Segments`, an object given as
consecutive pieces."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import InvalidRequestError


def _torch_view(obj: Any, writable: bool) -> memoryview:
    if not obj.is_contiguous():  # first: a strided CUDA tensor gets this error, not the next
        raise InvalidRequestError("tensor must be contiguous")
    if obj.device.type != "cpu":
        raise InvalidRequestError(
            f"tensor on {obj.device} is not supported here; move it to the CPU "
            "(Client put/get/batch_* stage CUDA tensors themselves)"
        )
    import torch  # only reached when the caller already uses torch

    flat = obj.detach().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def as_bytes_view(obj: Any, *, writable: bool = False) -> memoryview:
    """A flat ``'B'`` memoryview over ``obj``'s bytes.

    Raises:
        InvalidRequestError: not a buffer, not contiguous, or read-only when ``writable``.
    """
    if type(obj).__module__.startswith("torch"):
        view = _torch_view(obj, writable)
    else:
        try:
            view = memoryview(obj)
        except TypeError:
            raise InvalidRequestError(
                f"value must be a buffer (bytes, numpy, torch), got {type(obj).__name__}"
            ) from None
    if not view.c_contiguous:
        raise InvalidRequestError("buffer must be C-contiguous")
    if writable and view.readonly:
        raise InvalidRequestError("destination buffer is read-only")
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


@dataclass(frozen=True, slots=True)
class Segments:
    """One object's bytes given as consecutive pieces (a gather list): the object is their
    concatenation, which the client never builds. A put sends the pieces with one ``sendmsg``
    (TCP) or copies each to its place (shared memory); e.g. a KV block, whose planes are slices
    of the engine's per-layer tensors.

    Attributes:
        parts: flat ``'B'`` views, in order.
        nbytes: their total size.
        seal: for a put whose bytes are finished late (a KV block's checksum table, see
            :meth:`kvstore.client.KVCache.store`): called once, before any byte is sent, it
            completes the pieces and returns the xxh3_64 of their concatenation, which the
            client would otherwise compute itself. The client calls it while the master
            answers ``put_start``. None: the pieces are complete (the client hashes them).
    """

    parts: tuple[memoryview, ...]
    nbytes: int
    seal: Callable[[], int] | None = field(default=None, compare=False, repr=False)

    @staticmethod
    def of(buffers: Iterable[Any]) -> Segments:
        """The pieces ``buffers`` (each any contiguous buffer, as :func:`as_bytes_view`).

        Raises:
            InvalidRequestError: a piece that is not a contiguous buffer.
        """
        parts = tuple(as_bytes_view(b) for b in buffers)
        return Segments(parts, sum(p.nbytes for p in parts))

    def __len__(self) -> int:
        return self.nbytes

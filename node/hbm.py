"""The HBM tier: one block of GPU memory, addressed by offset like the DRAM arena.

Uses torch where it is installed and sees a CUDA device. Where none exists, :func:`open_hbm`
logs that once and returns None: the node runs without the tier. Reads and writes stage through
host memory (the data plane is TCP); an RDMA/GPUDirect transport would read it in place.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from kvstore.errors import InvalidRequestError, KVStoreError, OutOfRangeError, TierError
from kvstore.node.tiers import StoredObject, Tier
from kvstore.types import TIER_HBM

log = logging.getLogger(__name__)


def gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class HbmTier(Tier):
    """``capacity`` bytes of GPU memory on ``device``.

    Raises:
        InvalidRequestError: a non-positive size.
        TierError: the GPU cannot hold ``capacity`` bytes.
    """

    tier = TIER_HBM

    def __init__(self, capacity: int, device: str = "cuda:0", segment: str = TIER_HBM) -> None:
        if capacity <= 0:
            raise InvalidRequestError(f"HBM tier size must be > 0, got {capacity}")
        import torch

        self._torch = torch
        self.segment = segment
        self.capacity = capacity
        try:
            self.block: Any = torch.empty(capacity, dtype=torch.uint8, device=device)
        except RuntimeError as exc:  # CUDA out of memory and friends
            raise TierError(f"cannot reserve {capacity} bytes of HBM on {device}: {exc}") from None

    def _check(self, offset: int, size: int) -> None:
        if offset < 0 or size < 0 or offset + size > self.capacity:
            raise OutOfRangeError("range lies outside the HBM segment")

    def read(self, offset: int, size: int) -> memoryview:
        self._check(offset, size)
        host = self.block[offset : offset + size].cpu().numpy()
        return memoryview(host).cast("B")

    def write(self, items: list[tuple[StoredObject, memoryview]]) -> list[KVStoreError | None]:
        results: list[KVStoreError | None] = []
        for obj, data in items:
            try:
                self._check(obj.offset, len(data))
                if len(data):
                    src = self._torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
                    self.block[obj.offset : obj.offset + len(data)].copy_(src)
                results.append(None)
            except KVStoreError as err:
                results.append(err)
        self._torch.cuda.synchronize()
        return results

    def close(self) -> None:
        self.block = None


def open_hbm(capacity: int) -> HbmTier | None:
    """The HBM tier, or None (logged once) where no GPU exists or no size was asked for."""
    if capacity <= 0:
        return None
    if not gpu_available():
        log.warning("--hbm asked for but no CUDA GPU is visible: running without an HBM tier")
        return None
    return HbmTier(capacity)

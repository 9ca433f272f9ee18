"""The master's timeouts and limits: one frozen record, validated on creation.

A module of its own, below every owner of the master's state, because each of them reads it:
membership (the node TTL), two-phase puts (the put timeout, the object and batch limits),
recovery (the object limit), tiering and replication (write claims last a put timeout).
Tier policy settings are the tier manager's own (``tiering.TierConfig``).
"""

from __future__ import annotations

from collections.abc import Sized
from dataclasses import dataclass

from kvstore.errors import InvalidRequestError
from kvstore.limits import MAX_BATCH_KEYS, MAX_OBJECT_BYTES
from kvstore.master.event_ring import DEFAULT_RING_BLOCKS, DEFAULT_RING_EVENTS


@dataclass(frozen=True, slots=True)
class MasterConfig:
    """Timeouts and limits of the control plane. Validated on creation."""

    put_timeout_s: float = 30.0
    node_ttl_s: float = 5.0
    heartbeat_interval_s: float = 1.0
    max_batch: int = MAX_BATCH_KEYS
    max_object_bytes: int = MAX_OBJECT_BYTES
    #: The KV event ring (``events.py``): most events, and most block keys they name together.
    event_ring_events: int = DEFAULT_RING_EVENTS
    event_ring_blocks: int = DEFAULT_RING_BLOCKS

    def __post_init__(self) -> None:
        for name in ("put_timeout_s", "node_ttl_s", "heartbeat_interval_s"):
            if not getattr(self, name) > 0:
                raise InvalidRequestError(f"{name} must be > 0")
        if self.heartbeat_interval_s >= self.node_ttl_s:
            raise InvalidRequestError("heartbeat_interval_s must be shorter than node_ttl_s")
        if self.max_batch <= 0 or self.max_object_bytes <= 0:
            raise InvalidRequestError("max_batch and max_object_bytes must be > 0")
        if self.event_ring_events < 1 or self.event_ring_blocks < 1:
            raise InvalidRequestError("event_ring_events and event_ring_blocks must be > 0")

    def check_batch(self, items: Sized) -> None:
        """Refuse a batch over :attr:`max_batch` items.

        Raises:
            InvalidRequestError: too many items.
        """
        n = len(items)
        if n > self.max_batch:
            raise InvalidRequestError(f"batch of {n} exceeds the limit of {self.max_batch}")

"""Each engine's own prefix cache, from vLLM's KV events (``--kv-events-config``).

vLLM 0.32 publishes what its prefix cache does on a ZMQ PUB socket
(``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``): multipart messages ``(topic,
seq as 8 bytes big-endian, payload)``, the payload a msgpack ``KVEventBatch`` encoded by
msgspec: an array ``[ts, events, data_parallel_rank?]`` whose events are maps tagged by
``type``:

* ``BlockStored``: ``block_hashes`` (vLLM's own hashes: bytes, or ints with
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), ``parent_block_hash`` (the block before the first
  one, None at the start of a prompt), ``token_ids`` (the tokens of all the blocks, in order),
  ``block_size``, ``medium``, ``extra_keys`` (per block: LoRA name, multimodal ids, cache salt;
  absent or None when the block hash has none) and more fields ignored here;
* ``BlockRemoved``: ``block_hashes``, ``medium``;
* ``AllBlocksCleared``.

What is matched: the router never reproduces vLLM's hash. It keys each stored block by its own
chain over the token ids the event carries, ``key[i] = xxh3_128(key[i-1] || tokens of block i
as little-endian uint32)`` from a zero seed, and remembers vLLM's hash -> that key, so a
``BlockStored`` whose parent is a known block continues that block's chain and a
``BlockRemoved`` names the key to drop. A prompt's local hit is then the leading whole blocks
of its tokens whose chain keys are held. Not matched (never counted as hits): blocks with
extra keys (LoRA, multimodal, a cache salt), blocks whose parent the router never saw (stored
before it subscribed, or lost in a gap), and media other than the engine's own (``GPU``, or
none given: the CPU platform's cache too). A gap in the sequence numbers (a dropped message or
an engine restart) clears the engine's view: an unknown cache counts as empty, which is a
miss, never a wrong hit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import xxhash
import zmq

from .metrics import RouterMetrics

log = logging.getLogger("kvstore.router")

#: Media whose blocks are the engine's own prefix cache (vLLM's ``MEDIUM_GPU``; None: not said).
LOCAL_MEDIA = (None, "GPU")
_SEED = bytes(16)


@dataclass(frozen=True, slots=True)
class EngineCacheEvent:
    """One event of vLLM's ``KVEventBatch``.

    Attributes:
        kind: ``stored``, ``removed`` or ``cleared``.
        block_hashes: vLLM's hashes of the blocks (bytes or int).
        parent_hash: for ``stored``, the hash of the block before the first one (None: none).
        token_ids: for ``stored``, the tokens of all the blocks.
        block_size: for ``stored``, tokens per block.
        medium: where the blocks are (``GPU``, ``CPU``, ... or None).
        has_extra_keys: for ``stored``, whether any block's hash has extra keys.
    """

    kind: str
    block_hashes: tuple[bytes | int, ...] = ()
    parent_hash: bytes | int | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    medium: str | None = None
    has_extra_keys: bool = False


def _hash(value: Any) -> bytes | int:
    if isinstance(value, bytes | int) and not isinstance(value, bool):
        return value
    raise ValueError(f"a block hash must be bytes or int, not {type(value).__name__}")


def _event(raw: Any) -> EngineCacheEvent | None:
    if not isinstance(raw, dict):
        raise ValueError("an event must be a map")
    kind = raw.get("type")
    medium = raw.get("medium")
    if medium is not None and not isinstance(medium, str):
        raise ValueError("medium must be a string")
    if kind == "BlockStored":
        hashes = tuple(_hash(h) for h in raw["block_hashes"])
        parent = raw.get("parent_block_hash")
        tokens = tuple(int(t) for t in raw["token_ids"])
        block_size = int(raw["block_size"])
        if block_size <= 0 or len(tokens) != block_size * len(hashes):
            raise ValueError(
                f"{len(tokens)} token ids for {len(hashes)} blocks of {block_size} tokens"
            )
        extra = raw.get("extra_keys")
        return EngineCacheEvent(
            "stored",
            hashes,
            None if parent is None else _hash(parent),
            tokens,
            block_size,
            medium,
            bool(extra) and any(k for k in extra),
        )
    if kind == "BlockRemoved":
        return EngineCacheEvent(
            "removed", tuple(_hash(h) for h in raw["block_hashes"]), None, (), 0, medium
        )
    if kind == "AllBlocksCleared":
        return EngineCacheEvent("cleared")
    return None  # a kind this router does not know: ignored


def parse_batch(payload: bytes) -> list[EngineCacheEvent]:
    """Decode one ``KVEventBatch`` payload.

    Args:
        payload: the message's last frame.

    Returns:
        Its events, in order (kinds this router does not know are left out).

    Raises:
        ValueError: not a ``KVEventBatch``.
    """
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError) as err:
        raise ValueError(f"not msgpack: {err}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("a KVEventBatch is an array [ts, events, ...]")
    try:
        events = [_event(e) for e in batch[1]]
    except (KeyError, TypeError) as err:
        raise ValueError(f"malformed event: {err!r}") from None
    return [e for e in events if e is not None]


def chain_keys(
    tokens: Sequence[int] | np.ndarray, block_size: int, parent: bytes = _SEED
) -> list[bytes]:
    """The router's content keys of the full blocks of ``tokens``.

    Args:
        tokens: token ids.
        block_size: tokens per block.
        parent: the key of the block before the first one (the seed at a prompt's start).

    Returns:
        One 16-byte key per full block.
    """
    arr = np.asarray(tokens, dtype="<u4")
    keys = []
    for i in range(len(arr) // block_size):
        parent = xxhash.xxh3_128_digest(
            parent + arr[i * block_size : (i + 1) * block_size].tobytes()
        )
        keys.append(parent)
    return keys


class LocalCache:
    """One engine's prefix cache as its events tell it.

    NOTE: ``_lock`` guards every field: the subscriber thread applies, request handlers count.
    Blocks are reference-counted per vLLM hash because vLLM may cache the same content twice
    (two requests computing one prefix at once) and then remove one copy.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_hash: dict[bytes | int, bytes] = {}
        self._refs: dict[bytes, int] = {}
        self.block_size: int | None = None

    def apply(self, events: Sequence[EngineCacheEvent]) -> None:
        """Fold events into the view, in order."""
        with self._lock:
            for e in events:
                if e.kind == "cleared":
                    self._by_hash.clear()
                    self._refs.clear()
                elif e.medium not in LOCAL_MEDIA:
                    continue
                elif e.kind == "stored":
                    self._stored(e)
                else:
                    for h in e.block_hashes:
                        key = self._by_hash.pop(h, None)
                        if key is not None:
                            left = self._refs.get(key, 0) - 1
                            if left > 0:
                                self._refs[key] = left
                            else:
                                self._refs.pop(key, None)

    def _stored(self, e: EngineCacheEvent) -> None:
        if e.has_extra_keys:
            return
        if e.parent_hash is None:
            parent = _SEED
        else:
            known = self._by_hash.get(e.parent_hash)
            if known is None:
                return  # its prefix is unknown here: it could never be matched
            parent = known
        self.block_size = e.block_size
        for h, key in zip(
            e.block_hashes, chain_keys(e.token_ids, e.block_size, parent), strict=True
        ):
            if h in self._by_hash:
                continue
            self._by_hash[h] = key
            self._refs[key] = self._refs.get(key, 0) + 1

    def clear(self) -> None:
        """Forget everything (the cache is unknown)."""
        with self._lock:
            self._by_hash.clear()
            self._refs.clear()

    def count_blocks(self, tokens: Sequence[int] | np.ndarray, block_size: int) -> int:
        """Leading whole blocks of ``tokens`` the engine holds.

        Args:
            tokens: the prompt.
            block_size: the engine's block size.

        Returns:
            The count (0 when the events were of another block size).
        """
        return self.count_keys(chain_keys(tokens, block_size), block_size)

    def count_keys(self, keys: Sequence[bytes], block_size: int) -> int:
        """Leading ``keys`` (from :func:`chain_keys` at ``block_size``) the engine holds.

        Returns:
            The count (0 when the events were of another block size).
        """
        with self._lock:
            if self.block_size is not None and self.block_size != block_size:
                return 0
            n = 0
            for key in keys:
                if key not in self._refs:
                    break
                n += 1
            return n

    def num_blocks(self) -> int:
        """Distinct blocks held."""
        with self._lock:
            return len(self._refs)


class EngineEvents:
    """A subscriber to one engine's ZMQ KV-event publisher, in a daemon thread.

    Args:
        engine: the engine's URL (its name in metrics).
        endpoint: the publisher, ``tcp://HOST:PORT``.
        metrics: where events, gaps and blocks are counted (None: nowhere).
        topic: the publisher's topic (vLLM's default: empty).
    """

    def __init__(
        self,
        engine: str,
        endpoint: str,
        metrics: RouterMetrics | None = None,
        topic: str = "",
    ) -> None:
        self.engine = engine
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.cache = LocalCache()
        self.last_seq: int | None = None
        self.num_batches = 0
        self._metrics = metrics
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def receive(self, frames: Sequence[bytes]) -> None:
        """Take one message ``(topic, seq, payload)``: check the sequence, apply the batch.

        A gap (or a sequence that went back: the engine restarted) clears the view first.
        """
        if len(frames) != 3 or len(frames[1]) != 8:
            self._count("malformed")
            return
        seq = int.from_bytes(frames[1], "big")
        if self.last_seq is not None and seq != self.last_seq + 1:
            log.warning(
                "router: engine %s KV events: seq %d after %d; its cache counts as empty",
                self.engine,
                seq,
                self.last_seq,
            )
            self.cache.clear()
            if self._metrics is not None:
                self._metrics.engine_event_gaps.labels(self.engine).inc()
        self.last_seq = seq
        try:
            events = parse_batch(frames[2])
        except ValueError as err:
            log.warning("router: engine %s sent a bad KV event batch (%s)", self.engine, err)
            self._count("malformed")
            return
        self.cache.apply(events)
        self.num_batches += 1
        if self._metrics is not None:
            for e in events:
                self._metrics.engine_events.labels(self.engine, e.kind).inc()
            self._metrics.engine_cached_blocks.labels(self.engine).set(self.cache.num_blocks())

    def _count(self, kind: str) -> None:
        if self._metrics is not None:
            self._metrics.engine_events.labels(self.engine, kind).inc()

    def start(self) -> None:
        """Subscribe in a daemon thread until :meth:`close`."""
        assert self._thread is None, "started twice"
        self._thread = threading.Thread(
            target=self._run, name=f"kvstore-engine-events {self.engine}", daemon=True
        )
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the subscriber (it notices within its poll period)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, self.topic)
            sock.connect(self.endpoint)  # zmq reconnects by itself if the engine restarts
            while not self._stop.is_set():
                if sock.poll(200):  # the stop check's period, not a synchronisation
                    self.receive(sock.recv_multipart())
        finally:
            sock.close()

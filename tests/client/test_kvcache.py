"""KVCache on its own (kvstore.client.kvcache), over a fake of the public Client API it uses
(locate_prefix, lookup_prefix, release_leases, batch_put with a PromptCommit,
batch_read_located): store and load, whole and partial blocks, a lookup takes no read lease,
every lease a load takes is given back once, and a vanished or corrupt block cuts the match."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import pytest
import xxhash

from kvstore.client.buffers import Segments
from kvstore.client.client import PrefixBlock
from kvstore.client.kvcache import KVCache
from kvstore.client.puts import PromptCommit
from kvstore.client.reads import LocatedRead
from kvstore.client.transport import ReadItem
from kvstore.errors import ChecksumMismatchError, InvalidRequestError, KeyNotFoundError
from kvstore.grants import Grant
from kvstore.keys import Namespace, block_keys
from kvstore.kvblocks import kv_object_key
from kvstore.types import Location, ObjectInfo

L, H, D, BS = 2, 2, 8, 16


class FakeClient:
    """The public Client API KVCache uses, over a dict of objects and a list of prompts."""

    def __init__(self) -> None:
        self.objects: dict[bytes, bytes] = {}
        self.checksums: dict[bytes, int] = {}  # taken at put: a later change is corruption
        self.prompts: list[tuple[Namespace, np.ndarray]] = []
        self.leases_out: set[int] = set()
        self.next_lease = 1
        self.ranged_reads = 0
        self.lookups = 0

    # -------------------------------------------------------------- the prefix index
    def _match(self, namespace: Namespace, tokens: np.ndarray) -> tuple[np.ndarray, int]:
        best, best_len = np.empty(0, np.int64), 0
        for ns, prompt in self.prompts:
            if ns != namespace:
                continue
            n = min(len(prompt), len(tokens))
            same = np.flatnonzero(prompt[:n] != tokens[:n])
            common = int(same[0]) if len(same) else n
            if common > best_len:
                best, best_len = prompt, common
        return best, best_len

    def lookup_prefix(
        self, namespace: Namespace, tokens: np.ndarray, *, work: Callable[[], None] | None = None
    ) -> int:
        self.lookups += 1
        answer = self._match(namespace, tokens)[1]
        if work is not None:  # (the real client runs it while the master answers)
            work()
        return answer

    def locate_prefix(self, namespace: Namespace, tokens: np.ndarray) -> list[PrefixBlock]:
        prompt, n = self._match(namespace, tokens)
        keys = block_keys(namespace, prompt)
        out = []
        for i in range(-(-n // BS)):
            key = kv_object_key(namespace.digest, keys[i])
            num = min(BS, n - i * BS)
            value = self.objects.get(key)
            if value is None:
                out.append(PrefixBlock(key, num, KeyNotFoundError("vanished")))
                continue
            lease, self.next_lease = self.next_lease, self.next_lease + 1
            self.leases_out.add(lease)
            grant = Grant("r", key, "dram", 0, len(value), 0, b"")
            info = ObjectInfo(
                len(value), self.checksums[key], [Location("n1", "h", 1, grant)], lease
            )
            out.append(PrefixBlock(key, num, info))
        return out

    def release_leases(self, infos: Iterable[ObjectInfo]) -> None:
        for info in infos:
            assert info.lease in self.leases_out, "a lease given back twice"
            self.leases_out.remove(info.lease)

    # -------------------------------------------------------------- puts and reads
    def batch_put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Any],
        *,
        replicas: int = 1,
        prompt: PromptCommit | None = None,
    ) -> list[None]:
        for k, v in zip(keys, values, strict=True):
            if isinstance(v, Segments):  # a block: its planes, and the table its seal fills
                sealed = v.seal() if v.seal is not None else None  # as Client runs it: first
                self.objects[k] = b"".join(bytes(p) for p in v.parts)
                assert sealed in (None, xxhash.xxh3_64_intdigest(self.objects[k]))
            else:
                self.objects[k] = bytes(memoryview(v).cast("B"))
            self.checksums[k] = xxhash.xxh3_64_intdigest(self.objects[k])
        assert prompt is not None
        self.prompts.append((prompt.namespace, np.asarray(prompt.tokens)))
        return [None] * len(keys)

    def batch_read_located(self, reads: Sequence[LocatedRead]) -> None:
        for rd in reads:
            loc = rd.info.locations[0]
            value = self.objects[loc.grant.key]
            if isinstance(rd.dest, Segments):  # a whole block, read in place
                assert rd.ranges is None and len(rd.dest) == len(value)
                pos = 0
                for part in rd.dest.parts:
                    part[:] = value[pos : pos + len(part)]
                    pos += len(part)
                item = ReadItem(loc, rd.dest)
                intact = xxhash.xxh3_64_intdigest(value) == rd.info.checksum
            elif rd.ranges is None:
                rd.dest[: len(value)] = value
                item = ReadItem(loc, rd.dest[: len(value)])
                intact = xxhash.xxh3_64_intdigest(value) == rd.info.checksum
            else:
                self.ranged_reads += 1
                pos = 0
                for off, n in rd.ranges:
                    rd.dest[pos : pos + n] = value[off : off + n]
                    pos += n
                item = ReadItem(loc, rd.dest, rd.ranges)
                assert rd.verify is not None
                intact = rd.verify(item)
            rd.item = item
            rd.result = rd.info.size if intact else ChecksumMismatchError("corrupt")


def ns() -> Namespace:
    return Namespace("tiny", "float16", L, H, D, block_size=BS)


def make_kv(n: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    base = np.random.default_rng(seed).standard_normal((L, 2, n, H, D)).astype(np.float16)
    return [(base[layer, 0], base[layer, 1]) for layer in range(L)]


def empty_kv(n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.zeros((n, H, D), np.float16), np.zeros((n, H, D), np.float16)) for _ in range(L)]


@pytest.fixture
def fake() -> FakeClient:
    return FakeClient()


@pytest.fixture
def kv(fake: FakeClient) -> KVCache:
    cache = KVCache(fake, ns())  # type: ignore[arg-type]
    yield cache
    cache.close()


def test_store_then_load_whole_blocks(fake: FakeClient, kv: KVCache) -> None:
    tokens = np.arange(3 * BS + 5)
    layers = make_kv(len(tokens))
    assert kv.store(tokens, layers) == 3 * BS
    assert kv.store(tokens, layers) == 0  # cached already
    out = empty_kv(len(tokens))
    assert kv.load(tokens, out) == 3 * BS
    for (k, v), (ko, vo) in zip(layers, out, strict=True):
        assert np.array_equal(ko[: 3 * BS], k[: 3 * BS]) and np.array_equal(
            vo[: 3 * BS], v[: 3 * BS]
        )
    assert fake.ranged_reads == 0 and fake.leases_out == set()


def test_bad_layers_store_nothing_even_with_no_full_block(fake: FakeClient, kv: KVCache) -> None:
    short = [(k[:, :, :-1], v[:, :, :-1]) for k, v in make_kv(2 * BS)]  # wrong head size
    with pytest.raises(InvalidRequestError, match="shape"):
        kv.store(np.arange(2 * BS), short)  # (checked while the master answers the lookup)
    assert fake.objects == {} and fake.prompts == []
    with pytest.raises(InvalidRequestError, match="shape"):
        kv.store(np.arange(BS - 1), short)  # no full block: no call, the same check
    assert fake.lookups == 1


def test_arrays_are_checked_as_strictly_on_every_call(fake: FakeClient, kv: KVCache) -> None:
    tokens = np.arange(2 * BS)
    layers = make_kv(len(tokens))
    for k, v in layers:  # a store reads read-only arrays
        k.flags.writeable = v.flags.writeable = False
    assert kv.store(tokens, layers) == 2 * BS
    out = empty_kv(len(tokens))
    assert kv.load(tokens, out) == 2 * BS  # (the checks' fast path now knows float16)
    with pytest.raises(InvalidRequestError, match="read-only"):
        kv.load(tokens, layers)
    for bad, match in (
        ([(k.astype(np.float32), v) for k, v in out], "float32"),
        ([(k[:, ::-1], v) for k, v in out], "contiguous"),
        ([(k[: BS + 1], v) for k, v in out], "tokens"),
    ):
        with pytest.raises(InvalidRequestError, match=match):
            kv.load(tokens, bad)
    assert fake.leases_out == set()


def test_a_partial_last_block_is_a_range_read(fake: FakeClient, kv: KVCache) -> None:
    tokens = np.arange(2 * BS)
    layers = make_kv(len(tokens))
    kv.store(tokens, layers)
    other = np.concatenate([tokens[: BS + 5], np.arange(900, 900 + BS)])  # shares 1 block + 5
    out = empty_kv(len(other))
    assert kv.load(other, out) == BS + 5
    assert fake.ranged_reads == 1
    assert np.array_equal(out[0][0][: BS + 5], layers[0][0][: BS + 5])
    assert fake.leases_out == set()


def test_a_lookup_takes_no_read_lease(fake: FakeClient, kv: KVCache) -> None:
    tokens = np.arange(2 * BS)
    kv.store(tokens, make_kv(len(tokens)))
    assert kv.lookup(tokens) == 2 * BS
    assert fake.next_lease == 1  # no lease was ever taken


def test_a_vanished_block_cuts_the_match(fake: FakeClient, kv: KVCache) -> None:
    tokens = np.arange(4 * BS)
    kv.store(tokens, make_kv(len(tokens)))
    keys = block_keys(ns(), tokens)
    del fake.objects[kv_object_key(ns().digest, keys[1])]
    assert kv.load(tokens, empty_kv(len(tokens))) == BS  # blocks 2, 3 are past the gap
    assert fake.leases_out == set()  # theirs were given back unread


def test_a_corrupt_block_ends_the_load_before_it(fake: FakeClient, kv: KVCache) -> None:
    tokens = np.arange(3 * BS)
    kv.store(tokens, make_kv(len(tokens)))
    key = kv_object_key(ns().digest, block_keys(ns(), tokens)[2])
    bad = bytearray(fake.objects[key])
    bad[7] ^= 0xFF
    fake.objects[key] = bytes(bad)
    assert kv.load(tokens, empty_kv(len(tokens))) == 2 * BS
    with pytest.raises(ChecksumMismatchError):
        list(kv.load_layers(tokens, empty_kv(len(tokens))))
    assert fake.leases_out == set()

"""Objects given as pieces (``Segments``): stored as their concatenation, never joined by the
client, over TCP (gathered by sendmsg) and through shared memory (each piece copied to its
place); the node checks the checksum of the whole either way. And read into pieces: a whole
object lands piece after piece (scattered by recvmsg_into, or copied each to its place), checked
against the object checksum."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvstore.client import Client, Segments
from kvstore.client.reads import LocatedRead
from kvstore.errors import InvalidRequestError

CALL_TIMEOUT_S = 10.0


def pieces(seed: int) -> list[np.ndarray]:
    """Pieces of many sizes: empty, tiny, and large enough that a batch is not joined."""
    rng = np.random.default_rng(seed)
    sizes = [0, 1, 4096, 300_000, 7, 65_536]
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_an_object_put_as_pieces_reads_back_as_their_concatenation(
    cluster_factory, shm: bool
) -> None:
    cluster = cluster_factory(node_args=("--shm",) if shm else ())
    with Client.connect(cluster.address, shm=shm, timeout=CALL_TIMEOUT_S) as c:
        a, b = pieces(1), pieces(2)
        whole_a = b"".join(p.tobytes() for p in a)
        whole_b = b"".join(p.tobytes() for p in b)
        # 2-D pieces count by their bytes, as any buffer does.
        b2 = [p.reshape(1, -1) if p.size else p for p in b]
        results = c.batch_put(["a", "plain", "b"], [Segments.of(a), b"plain", Segments.of(b2)])
        assert results == [None, None, None]
        assert c.get("a") == whole_a and c.get("b") == whole_b and c.get("plain") == b"plain"
        assert c.locate("a").size == len(whole_a)
        # A single put and a small object (its pieces joined into one send) as well.
        c.put("small", Segments.of([b"ab", b"", b"cde"]))
        assert c.get("small") == b"abcde"


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_a_sealed_object_is_completed_by_its_seal_before_it_is_sent(
    cluster_factory, shm: bool
) -> None:
    # KVCache.store's blocks: the checksum table (the last piece) is filled by the seal, which
    # the client runs once while the master answers put_start, and whose checksum it sends.
    cluster = cluster_factory(node_args=("--shm",) if shm else ())
    with Client.connect(cluster.address, shm=shm, timeout=CALL_TIMEOUT_S) as c:
        body = pieces(3)
        tail = np.zeros(16, dtype=np.uint8)  # filled only by the seal
        calls = []

        def seal() -> int:
            calls.append(1)
            tail[:] = np.arange(16, dtype=np.uint8)
            return xxhash.xxh3_64_intdigest(b"".join(p.tobytes() for p in [*body, tail]))

        parts = Segments.of([*body, tail])
        sealed = Segments(parts.parts, parts.nbytes, seal)
        assert c.batch_put(["sealed", "plain"], [sealed, b"plain"]) == [None, None]
        assert calls == [1]
        expected = b"".join(p.tobytes() for p in body) + bytes(range(16))
        assert c.get("sealed") == expected
        assert c.locate("sealed").checksum == xxhash.xxh3_64_intdigest(expected)


def test_a_piece_that_is_not_a_buffer_is_refused() -> None:
    with pytest.raises(InvalidRequestError):
        Segments.of([b"ok", 42])


def _landing(sizes: list[int]) -> list[np.ndarray]:
    return [np.zeros(n, dtype=np.uint8) for n in sizes]


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_a_whole_object_is_read_into_pieces(cluster_factory, shm: bool) -> None:
    # What KVCache.load does with a whole block: its planes land straight in the engine's
    # per-layer tensors. Small objects in one batch (one scatter receive), and one large enough
    # to be hashed while it moves (chunk by chunk, across the pieces).
    cluster = cluster_factory(node_args=("--shm",) if shm else ())
    with Client.connect(cluster.address, shm=shm, timeout=CALL_TIMEOUT_S) as c:
        rng = np.random.default_rng(3)
        values = {
            "a": rng.integers(0, 256, 70_000, dtype=np.uint8).tobytes(),
            "b": rng.integers(0, 256, 5, dtype=np.uint8).tobytes(),
            "big": rng.integers(0, 256, (3 << 20) + 11, dtype=np.uint8).tobytes(),
        }
        assert c.batch_put(list(values), list(values.values())) == [None] * 3
        infos = c.batch_locate(list(values))
        cuts = {"a": [0, 1, 4096, 65_903], "b": [2, 0, 3], "big": [1 << 20, 7, (2 << 20) + 4]}
        landings = {k: _landing(cuts[k]) for k in values}
        reads = [
            LocatedRead(info, Segments.of(landings[k]))
            for k, info in zip(values, infos, strict=True)
        ]
        c.batch_read_located(reads)
        c.release_leases(infos)
        for (k, v), rd in zip(values.items(), reads, strict=True):
            assert rd.result == len(v), rd.result
            assert b"".join(p.tobytes() for p in landings[k]) == v


def test_pieces_must_hold_exactly_the_whole_object(cluster_factory) -> None:
    cluster = cluster_factory()
    with Client.connect(cluster.address, timeout=CALL_TIMEOUT_S) as c:
        c.put("k", b"0123456789")
        info = c.locate("k")
        short = _landing([4, 5])
        long = _landing([4, 7])
        ranged = _landing([4])
        reads = [
            LocatedRead(info, Segments.of(short)),
            LocatedRead(info, Segments.of(long)),
            LocatedRead(info, Segments.of(ranged), [[0, 4]], lambda _item: True),
        ]
        c.batch_read_located(reads)
        c.release_lease(info)
        assert all(isinstance(rd.result, InvalidRequestError) for rd in reads)
        assert not any(p.any() for p in [*short, *long, *ranged])  # nothing written

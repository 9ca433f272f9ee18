"""Objects given as pieces (``Segments``): stored as their concatenation, never joined by the
client, over TCP (gathered by sendmsg) and through shared memory (each piece copied to its
place); the node checks the checksum of the whole either way."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client import Client, Segments
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


def test_a_piece_that_is_not_a_buffer_is_refused() -> None:
    with pytest.raises(InvalidRequestError):
        Segments.of([b"ok", 42])

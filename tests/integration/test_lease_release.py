"""Finished reads give their read leases back: space that removed or overwritten data held
is freed at once, and a working set written afterwards is not evicted for it.

The master's leases last 30 s here: any space still held by a finished read would outlive the
test, so each assertion fails if a release goes missing (they all failed before reads gave
their leases back).
"""

from __future__ import annotations

import pytest

from kvstore.client import Client
from kvstore.client.reads import LOCATE_CHUNK
from kvstore.errors import KeyNotFoundError
from tests.support import wait_until

MIB = 1 << 20
POOL = 64 * MIB
LEASE_S = 30.0
NUM_OLD = 40  # 40 MiB read, then half removed and half overwritten
NUM_WORKING = 24  # then a 24 MiB working set: with the 20 MiB rewritten, 69 % of the pool


@pytest.fixture
def cluster(cluster_factory):
    return cluster_factory(dram="64MiB", master_args=("--lease", str(LEASE_S)))


def value(tag: str, i: int) -> bytes:
    return f"{tag}{i:07d}".encode() * (MIB // 8)


def evictions(c: Client) -> int:
    ev = c.stats()["eviction"]
    return ev["num_evictions"] + ev["num_sync_evictions"] + ev["num_demotions"]


@pytest.mark.parametrize("lease_reads", [False, True], ids=["strict", "lease-reads"])
def test_space_freed_under_finished_reads_is_reused_at_once(cluster, lease_reads: bool) -> None:
    with Client.connect(cluster.address, lease_reads=lease_reads) as c:
        # Only the piggyback carries leases back here (no flush of their own would come in
        # time): each request carries the leases of the reads before it.
        c._returns.delay_s = 60.0
        old = [f"old/{i}" for i in range(NUM_OLD)]
        assert c.batch_put(old, [value("o", i) for i in range(NUM_OLD)]) == [None] * NUM_OLD
        for i, k in enumerate(old):  # read one by one, as a decode engine does
            assert c.get(k) == value("o", i)
        removed, rewritten = old[: NUM_OLD // 2], old[NUM_OLD // 2 :]
        assert c.batch_remove(removed) == [None] * len(removed)
        assert c.batch_put(rewritten, [value("n", i) for i in range(len(rewritten))]) == [
            None
        ] * len(rewritten)
        working = [f"work/{i}" for i in range(NUM_WORKING)]
        assert (
            c.batch_put(working, [value("w", i) for i in range(NUM_WORKING)])
            == [None] * NUM_WORKING
        )
        got = c.batch_get(working + rewritten)
        want = [value("w", i) for i in range(NUM_WORKING)]
        want += [value("n", i) for i in range(len(rewritten))]
        lost = [k for k, g, w in zip(working + rewritten, got, want, strict=True) if g != w]
        assert not lost, f"evicted although the pool is only 69 % full: {lost}"
        assert evictions(c) == 0
        stats = c.stats()
        assert stats["held_bytes"] == 0, "no space waits for a finished read"
        assert stats["used_bytes"] <= (NUM_WORKING + len(rewritten)) * MIB * 1.05


def test_an_idle_reader_gives_its_leases_back_on_its_own(cluster) -> None:
    """The reader sends nothing else: its leases go back in a ``release_leases`` of their own,
    and the space another client's remove freed is free long before the leases would end."""
    with Client.connect(cluster.address) as reader, Client.connect(cluster.address) as writer:
        keys = [f"k/{i}" for i in range(NUM_OLD)]
        assert writer.batch_put(keys, [value("k", i) for i in range(NUM_OLD)]) == [None] * NUM_OLD
        assert reader.batch_get(keys) == [value("k", i) for i in range(NUM_OLD)]
        assert writer.batch_remove(keys) == [None] * NUM_OLD
        # Polls the master's state, bounded far below the 30 s lease.
        wait_until(
            lambda: writer.stats()["used_bytes"] == 0,
            timeout=5.0,
            what="the reader's leases to come back and the removed space to be freed",
        )
        leases = writer.stats()["leases"]
        assert leases["num_outstanding"] == 0 and leases["num_expired"] == 0
        assert leases["num_released"] == NUM_OLD
        working = [f"w/{i}" for i in range(48)]  # 75 % of the pool, under the watermark
        assert writer.batch_put(working, [value("w", i) for i in range(48)]) == [None] * 48
        assert evictions(writer) == 0


def test_a_batch_read_in_chunks_reads_every_key_and_gives_every_lease_back(cluster) -> None:
    # More keys than one get_locations chunk: the chunks are located one ahead of their reads,
    # on one connection; every key's result is its own, in order, and every lease comes back.
    n = 2 * LOCATE_CHUNK + 7
    keys = [f"c/{i}" for i in range(n)]
    vals = [b"%d" % i * 3 for i in range(n)]
    with Client.connect(cluster.address) as c:
        assert c.batch_put(keys, vals) == [None] * n
        gone = {5, LOCATE_CHUNK, n - 2}
        assert c.batch_remove([keys[i] for i in gone]) == [None] * len(gone)
        got = c.batch_get(keys)
        bufs = [bytearray(16) for _ in keys]
        into = c.batch_get_into(keys, bufs)
        for i in range(n):
            if i in gone:
                assert isinstance(got[i], KeyNotFoundError) and isinstance(
                    into[i], KeyNotFoundError
                )
            else:
                assert got[i] == vals[i] and into[i] == len(vals[i])
                assert bytes(bufs[i][: len(vals[i])]) == vals[i]
        wait_until(
            lambda: c.stats()["leases"]["num_outstanding"] == 0,
            timeout=5.0,
            what="the leases of both reads to come back",
        )
        assert c.stats()["leases"]["num_released"] == 2 * (n - len(gone))

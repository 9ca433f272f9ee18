"""The node's manifest: versions named by stamps, so a late forget never drops a newer write."""

from __future__ import annotations

import gc

from kvstore.node.manifest import Manifest
from kvstore.stored_object import StoredObject


def test_a_forget_drops_only_the_version_it_names() -> None:
    m = Manifest()
    m.record(StoredObject("dram", 0, b"v1", 10, 1, stamp=100))
    m.forget([("dram", 0, 100)])
    assert len(m) == 0
    # The extent was freed (v1) and reused by a newer write (v3) before the forget arrived.
    m.record(StoredObject("dram", 0, b"v3", 10, 3, stamp=300))
    m.forget([("dram", 0, 100)])
    assert m.snapshot() == [["dram", 0, b"v3", 10, 3, 300]]
    m.forget([("dram", 0)])  # no stamp: whatever is there
    assert len(m) == 0


def test_one_record_per_place_and_what_survives_a_restart() -> None:
    m = Manifest()
    m.record_many(
        [
            StoredObject("dram", 0, b"a", 1, 1, 1),
            StoredObject("dram", 0, b"b", 1, 2, 2),  # the same place: replaces
            StoredObject("nvme", 0, b"c", 1, 3, 3),
        ]
    )
    assert sorted(o.key for o in m.objects()) == [b"b", b"c"]
    assert sorted(m.snapshot()) == [["dram", 0, b"b", 1, 2, 2], ["nvme", 0, b"c", 1, 3, 3]]
    m.clear_volatile({"nvme"})
    assert m.objects() == [StoredObject("nvme", 0, b"c", 1, 3, 3)]
    m.clear()
    assert len(m) == 0


def test_records_leave_the_collectors_work_once_it_has_seen_them() -> None:
    """A node holds a record per object (millions): the collector must not walk them at every
    full collection (1M record objects held the data threads ~120 ms each time)."""
    m = Manifest()
    gc.collect()
    before = len(gc.get_objects())
    m.record_many(
        StoredObject("dram", i * 64, b"key/%d" % i, 64, i, 1000 + i) for i in range(20_000)
    )
    gc.collect()  # the first pass sees each record once, then stops tracking it
    assert len(gc.get_objects()) - before < 100
    assert m.objects()[123] == StoredObject("dram", 123 * 64, b"key/123", 64, 123, 1123)


def test_a_key_is_found_at_its_newest_whole_record_and_never_at_a_place_reused() -> None:
    """What a one-hop read asks (``Manifest.find``): the newest version of a key, by stamp; a
    place another key's write reused no longer answers for the old key; a forget or a restart
    drops the key as it drops its record."""
    m = Manifest()
    m.record(StoredObject("dram", 0, b"k", 10, 1, stamp=100))
    m.record(StoredObject("dram", 64, b"k", 20, 2, stamp=200))  # a newer put of k
    m.record(StoredObject("nvme", 7, b"k", 10, 1, stamp=100))  # an older copy, demoted
    assert m.find(b"k") == StoredObject("dram", 64, b"k", 20, 2, 200)
    m.record(StoredObject("dram", 64, b"other", 20, 9, stamp=300))  # k's place, reused
    assert m.find(b"k") is None and m.find(b"other") is not None
    m.record(StoredObject("dram", 128, b"j", 5, 5, stamp=50))
    m.forget([("dram", 128, 50)])
    assert m.find(b"j") is None
    m.record(StoredObject("nvme", 8, b"n", 5, 5, stamp=60))
    m.record(StoredObject("dram", 256, b"d", 5, 6, stamp=70))
    m.clear_volatile({"nvme"})
    assert m.find(b"n") is not None and m.find(b"d") is None and m.find(b"other") is None
    m.clear()
    assert m.find(b"n") is None

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

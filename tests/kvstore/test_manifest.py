"""The node's manifest: versions named by stamps, so a late forget never drops a newer write."""

from __future__ import annotations

from kvstore.node.server import Manifest, ManifestEntry


def test_a_forget_drops_only_the_version_it_names() -> None:
    m = Manifest()
    m.record("dram", 0, ManifestEntry(b"v1", 10, 1, stamp=100))
    m.forget([("dram", 0, 100)])
    assert len(m) == 0
    # The extent was freed (v1) and reused by a newer write (v3) before the forget arrived.
    m.record("dram", 0, ManifestEntry(b"v3", 10, 3, stamp=300))
    m.forget([("dram", 0, 100)])
    assert m.snapshot() == [["dram", 0, b"v3", 10, 3, 300]]
    m.forget([("dram", 0)])  # no stamp: whatever is there
    assert len(m) == 0

"""Where a key lives first: its home node, which the master and every client compute alike.

A key's **home** is the live node that wins rendezvous hashing (highest random weight) for it:
each node's weight is the xxh3_64 of the key seeded by the node's id, and the largest wins (ties,
never seen in practice, go to the smaller id). The master places a new object's first replica on
its home when the home's fastest tier has room, no writer's site asks for another place, and the
home takes new data (not draining); otherwise it places as before. A client that knows the live
nodes (``live_nodes``, asked of the master now and then) therefore reads most keys from their home
in **one hop**, without asking the master where they are: the ``read_keys`` verb asks the node
for the key itself (:mod:`kvstore.node.verbs`). A miss there (not placed at home, evicted,
demoted, a node that joined or left since) costs one small round trip, and the read goes the
usual way through the master. Adding or removing a node moves only the keys it wins or won.

One-hop reads are part of lease reads (``Client.connect(..., lease_reads=True)``), the setting
for content-addressed keys (KV blocks: a key's bytes never change). Why a one-hop read is safe:

- **Never freed-and-reused or half-written bytes.** A node answers only objects its manifest
  holds whole (an object enters it once all its bytes arrived), each with the checksum stored at
  write time (xxh3_64), and the client checks the bytes it received against it. Bytes the master
  freed and granted to a new write may be overwritten while, or before, they are sent; the bytes
  that arrive then fail the checksum and the client treats the read as a miss. A write that
  completes at an object's place replaces that place's record, and the node drops a freed
  object's record at its next heartbeat. Of a key's records the newest is read, by stamp (the
  order the master started their puts in; a blank, a put started before its key was known, is
  committed only under a key whose stored version it is newer than: :mod:`kvstore.master.puts`).
- **A read that races an eviction or a removal** returns the object's bytes as written (intact,
  checked) until the node's next heartbeat drops the record (one heartbeat interval, 1 s by
  default), or misses and goes to the master, which answers as of now. This is the promise lease
  reads already make: a key whose bytes never change reads the same either way.
- **A demotion** (DRAM to NVMe, or to another node) moves the record: only objects in memory are
  served by key, so the read misses and the master answers where the object went.
- **A dead node** fails the connection: the read goes to the master, which never lists it again.
- **A fenced node is never read.** A node serves reads by key only while its last acknowledged
  heartbeat (or registration) was sent less than half of the master's ``node_ttl_s`` ago. The
  master declares a node dead, and fences it, only after ``node_ttl_s`` without a heartbeat, so a
  node the master may have fenced stopped serving by key well before; until it registers again
  it answers every one-hop read ``NODE_UNAVAILABLE`` and the client asks the master.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash


class Homes:
    """The home node of each key among ``node_ids`` (rendezvous hashing, see the module)."""

    __slots__ = ("node_ids", "_seeds")

    def __init__(self, node_ids: Sequence[str]) -> None:
        self.node_ids = tuple(sorted(set(node_ids)))
        self._seeds = [xxhash.xxh3_64_intdigest(n.encode()) for n in self.node_ids]

    def __len__(self) -> int:
        return len(self.node_ids)

    def home(self, key: bytes) -> str | None:
        """The node that wins ``key``; None when there is no node."""
        best, best_weight = None, -1
        for node_id, seed in zip(self.node_ids, self._seeds, strict=True):
            weight = xxhash.xxh3_64_intdigest(key, seed)
            if weight > best_weight:
                best, best_weight = node_id, weight
        return best

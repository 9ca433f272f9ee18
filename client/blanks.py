"""A client's blanks: puts the master started before the client knew their keys.

A small put usually costs three round trips: ``put_start`` at the master, the write at the node,
``put_end`` at the master. A **blank** (:mod:`kvstore.master.puts`) is the first of them done
ahead: room for one object of a given size on a given node, with a write grant for no key in
particular (:meth:`kvstore.grants.Grant.for_key`). With one in hand, a put of that size writes
its bytes, with its key, straight to the node and names the key in its ``put_end``: two round
trips. The put promises what any put promises (acknowledged once committed; no reader sees half
an object): the commit is the same ``put_end``, only its ``put_start`` came earlier.

:class:`Blanks` keeps them, per object size and node: the second single-key put of a size (at
most :data:`MAX_BLANK_BYTES`, put again while one of the last :data:`SEEN_SIZES` sizes) asks for
:data:`DEPTH` blanks on every node with its ``put_end``, and every commit after that asks again
for the nodes whose blanks run low, in the same call (no round trip of its own). A put takes a
blank on its key's home node (``kvstore.placement``), so the object lies where a one-hop read
looks for it; where there is none, or the blank is past half its life, the put goes the usual
way. Blanks are bounded: :data:`DEPTH` or so per node for each of :data:`MAX_SIZES` sizes; the
client gives them back when it closes or stops keeping their size, and the master takes back the
ones nobody commits at its put timeout. A writer the master places near its site
(``kvstore.topology``) takes none: where its object goes depends on the room near it when it is
put.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.errors import ForbiddenError
from kvstore.grants import GrantReader, open_batch_unverified
from kvstore.placement import Homes
from kvstore.types import Location, result_from_wire

#: The largest object put through a blank: above it a put is bound by its bytes, not its round
#: trips, and a blank would hold more room for less.
MAX_BLANK_BYTES = 64 * 1024
#: Blanks kept per node for a size; asked for again when a node has fewer than LOW.
DEPTH = 4
LOW = 2
#: Sizes blanks are kept for (the least recently put size's go first, given back).
MAX_SIZES = 4
#: Sizes remembered as put once: blanks are asked for a size put again while remembered, so a
#: workload of ever new sizes asks for none (nobody would take them).
SEEN_SIZES = 16
#: How often blanks are asked for on every node (so a node that joined gets some).
ALL_NODES_EVERY_MS = 10_000


@dataclass(frozen=True, slots=True)
class Blank:
    """One blank: its put id, where it lies (its grant for no key), the master's epoch, and
    until when it is written into (half its life on the master's clock: the write and the commit
    must land before the master takes it back, at the grant's expiry)."""

    put_id: int
    location: Location
    epoch: int | None
    use_by_ms: float


class _Size:
    """The blanks of one size: per node, oldest first; and when every node was last asked."""

    __slots__ = ("by_node", "asked_all_ms")

    def __init__(self) -> None:
        self.by_node: dict[str, deque[Blank]] = {}
        self.asked_all_ms = float("-inf")


class Blanks:
    """The blanks of one client, by size and node. Thread-safe.

    Args:
        clock_ms: the master's wall clock in milliseconds (blanks' grants expire on it).
    """

    def __init__(self, clock_ms: Callable[[], float]) -> None:
        self._clock_ms = clock_ms
        self._lock = threading.Lock()
        self._sizes: OrderedDict[int, _Size] = OrderedDict()
        self._homes: Homes | None = None
        self._epoch: int | None = None  # the master term the blanks held are of
        self._seen: OrderedDict[int, None] = OrderedDict()  # sizes put once (SEEN_SIZES)
        self._dropped: list[Blank] = []  # blanks of sizes no longer kept, to give back
        #: False once the master refused blanks (a tenant's connection): none are asked for.
        self.enabled = True

    def take(self, size: int, key: bytes, home: str | None) -> Blank | None:
        """A blank for an object of ``size`` bytes under ``key``, on ``home`` (None: the key's
        home among the nodes this client holds blanks on); None where there is none."""
        if not self.enabled or size > MAX_BLANK_BYTES:
            return None
        with self._lock:
            held = self._sizes.get(size)
            if held is None:
                return None
            if home is None:
                home = self._home(held, key)
            queue = held.by_node.get(home) if home is not None else None
            now = self._clock_ms()
            while queue:
                blank = queue.popleft()
                if now < blank.use_by_ms:
                    return blank
            return None

    def _home(self, held: _Size, key: bytes) -> str | None:
        """``key``'s home among the nodes ``held`` has blanks on (``self._lock`` held)."""
        nodes = tuple(sorted(n for n, q in held.by_node.items() if q))
        if not nodes:
            return None
        homes = self._homes
        if homes is None or homes.node_ids != nodes:
            homes = self._homes = Homes(nodes)
        return homes.home(key)

    def wanted(self, size: int) -> dict[str, Any] | None:
        """What a ``put_end`` of an object of ``size`` bytes asks for (its ``blanks``
        argument), or None: nothing is missing (or no blanks for such objects)."""
        if not self.enabled or not 0 < size <= MAX_BLANK_BYTES:
            return None
        now = self._clock_ms()
        with self._lock:
            held = self._sizes.get(size)
            if held is None:
                if size in self._seen:  # (put before, while remembered)
                    del self._seen[size]
                    return {"size": size, "count": DEPTH}
                self._seen[size] = None
                while len(self._seen) > SEEN_SIZES:
                    self._seen.popitem(last=False)
                return None
            if now - held.asked_all_ms >= ALL_NODES_EVERY_MS:
                return {"size": size, "count": DEPTH}
            low = [[n, DEPTH - len(q)] for n, q in held.by_node.items() if len(q) < LOW]
        return {"size": size, "nodes": low} if low else None

    def add(self, size: int, asked: dict[str, Any], answer: Any, epoch: int | None) -> None:
        """Keep the blanks ``answer`` gives (``put_end``'s ``blanks``, asked as ``asked``, from
        the master of ``epoch``); an error there turns blanks off where it says they are
        refused."""
        if type(answer) is list and answer and type(answer[0]) is int:  # an error's wire form
            err, _ = result_from_wire(answer)
            if isinstance(err, ForbiddenError):
                self.enabled = False
            return
        reader = GrantReader(open_batch_unverified, check=True)
        now = self._clock_ms()
        got = []
        for put_id, wire in answer:
            loc = Location.from_wire(wire, reader)
            got.append(Blank(put_id, loc, epoch, (now + loc.grant.expires_ms) / 2))
        with self._lock:
            if epoch != self._epoch:  # (a put id means nothing to another leader)
                self._sizes.clear()
                self._epoch = epoch
            held = self._sizes.get(size)
            if held is None:
                held = self._sizes[size] = _Size()
                while len(self._sizes) > MAX_SIZES:
                    _, gone = self._sizes.popitem(last=False)
                    self._dropped += [b for q in gone.by_node.values() for b in q]
            self._sizes.move_to_end(size)
            if "count" in asked:
                held.asked_all_ms = now
            for blank in got:
                held.by_node.setdefault(blank.location.node_id, deque()).append(blank)

    def forget_node(self, node_id: str) -> None:
        """Drop the blanks on ``node_id`` (it failed a write: the master reclaims them)."""
        with self._lock:
            for held in self._sizes.values():
                held.by_node.pop(node_id, None)

    def held(self) -> dict[int, dict[str, int]]:
        """How many blanks are held, by size and node."""
        with self._lock:
            return {s: {n: len(q) for n, q in h.by_node.items()} for s, h in self._sizes.items()}

    def take_dropped(self) -> list[Blank]:
        """The blanks of sizes no longer kept (to give back)."""
        with self._lock:
            out, self._dropped = self._dropped, []
        return out

    def take_all(self) -> list[Blank]:
        """Every blank held, now no longer held (to give back)."""
        with self._lock:
            out = [b for held in self._sizes.values() for q in held.by_node.values() for b in q]
            out += self._dropped
            self._sizes.clear()
            self._dropped = []
        return out

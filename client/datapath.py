"""The client's data path: picks, per node, the fastest transport that works from here.

Order of preference: shared memory (same host, node started with ``--shm``), RDMA (both sides
have a device: one-sided READ/WRITE, see :mod:`kvstore.client.rdma`; untested on real hardware),
TCP. What each node offers comes from the master's ``node_transports`` verb: asked once when the
client connects, and again (at most once a second) when a data call is about to reach a node
unknown here or one whose mapping failed. A transport that fails its checks falls back to TCP,
with one log line: shm for that batch, RDMA for that node from then on. Writes placed in node
memory by shm or RDMA are committed by the node (``shm_commit``/``rdma_commit``: grant and
checksum) before they count as written, exactly like a TCP write.

NOTE: :meth:`DataPath.read` and :meth:`DataPath.write` never call the master. The offers are
refreshed by :meth:`DataPath.refresh_offers`, which the read and put pipelines call *before* a
data call, holding no lock: a read that runs while the master answers another request (a
speculative read, see :mod:`kvstore.client.reads`) makes no nested master call, and no lock is
ever held across the round trip (the shm hang of the faults issue was a nested call under a lock).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvstore import auth, grants, rdma
from kvstore.client.buffers import Segments
from kvstore.client.rdma import RdmaTransport
from kvstore.client.shm import ShmTransport
from kvstore.client.transport import InFlight, ReadItem, TcpTransport, WriteItem
from kvstore.errors import KVStoreError
from kvstore.types import Location

#: How often (seconds) an unknown node id may trigger a fresh ``node_transports`` call.
REFRESH_INTERVAL_S = 1.0


class DataPath:
    """Reads and writes object bytes through shm, RDMA or TCP.

    Args:
        timeout: socket timeout for TCP.
        fetch_transports: returns the master's ``node_transports`` map (called only by
            :meth:`refresh_offers`).
        shm: whether to use shared memory where a node offers it.
        token: the cluster token for TCP connections to nodes.
    """

    def __init__(
        self,
        timeout: float,
        fetch_transports: Callable[[], dict[str, Any]],
        shm: bool = True,
        token: auth.Token | None = None,
    ) -> None:
        self.tcp = TcpTransport(timeout, token)
        self.shm = ShmTransport() if shm else None
        self._fetch = fetch_transports
        self._known: set[str] = set()
        self._fetched_at = float("-inf")
        self._lock = threading.Lock()
        self._rdma_local: rdma.RdmaDevice | None | bool = False  # False: not looked yet
        self._rdma_settings = rdma.RdmaConfig.from_env()
        self.rdma: RdmaTransport | None = None  # made when a node offers RDMA and we have it

    def close(self) -> None:
        if self.rdma is not None:
            self.rdma.close()
        self.tcp.close()
        if self.shm is not None:
            self.shm.close()

    # ---------------------------------------------------------------- offers
    def refresh_offers(self, node_ids: Iterable[str] = (), *, force: bool = False) -> None:
        """Ask the master for the nodes' transport offers if one of ``node_ids`` is new here or
        its mapping (or RDMA session) failed since (rate-limited: at most once per
        ``REFRESH_INTERVAL_S``); with ``force``, ask now (the client does at connect; that ask
        leaves the rate limit alone, so a node that registers just after is learned at once).

        Call it before a data call, never inside one. NOTE: the master is asked holding no
        lock; the lock is taken only to look at and to update what is known. A failed ask
        changes nothing (TCP still works; a later data call asks again).
        """
        if not self._offers_wanted:
            return
        wanted = set(node_ids)
        with self._lock:
            # A mapping or an RDMA session that failed: ask the master again (a restarted node
            # publishes new offers).
            for transport in (self.shm, self.rdma):
                if transport is not None and transport.dropped:
                    self._known -= transport.dropped
                    transport.dropped.clear()
            if not force:
                now = time.monotonic()
                if wanted <= self._known or now - self._fetched_at < REFRESH_INTERVAL_S:
                    return
                self._fetched_at = now
        try:
            offers = self._fetch()
        except KVStoreError:
            return  # TCP still works; try again later
        self.learn_offers(offers, wanted)

    def learn_offers(self, offers: dict[str, Any], node_ids: Iterable[str] = ()) -> None:
        """Take the master's ``node_transports`` answer (``node_ids``: nodes asked about, known
        from now on even if they offer nothing but TCP)."""
        with self._lock:
            self._known = set(node_ids) | set(offers)
            for node_id, transports in offers.items():
                if not isinstance(transports, dict):
                    continue
                if "shm" in transports and self.shm is not None:
                    self.shm.learn(node_id, transports["shm"])
                if "rdma" in transports and self._rdma_settings.enabled:
                    self._learn_rdma(node_id, transports["rdma"])

    def _learn_rdma(self, node_id: str, offer_wire: Any) -> None:
        if self._rdma_local is False:
            self._rdma_local = rdma.first_device("client", self._rdma_settings)
        local = self._rdma_local or None
        offer = rdma.choose(offer_wire, local)  # None: logged once why not
        if offer is None or local is None:
            return
        if self.rdma is None:
            self.rdma = RdmaTransport(local, self.tcp.pool, self._rdma_settings)
        self.rdma.learn(node_id, offer)

    @property
    def tcp_only(self) -> bool:
        """Whether every node is read over TCP (no shared memory, no RDMA here)."""
        return self.shm is None and self.rdma is None

    @property
    def _offers_wanted(self) -> bool:
        return self.shm is not None or self._rdma_settings.enabled

    # ---------------------------------------------------------------- bytes
    def read(self, items: Sequence[ReadItem]) -> None:
        """Fill each item's ``dest``; sets ``item.result`` on failure."""
        self.read_end(self.read_begin(items))

    def read_begin(self, items: Sequence[ReadItem]) -> InFlight:
        """The first half of :meth:`read`: shared memory and RDMA read now, TCP requests are
        sent without waiting for the replies. Must be followed by :meth:`read_end` of what it
        returns, errors or not: only then are all the items filled."""
        rest: Sequence[ReadItem] = items
        if items and self.shm is not None:
            with self._lock:  # memory copies only: no round trip under it
                rest = self.shm.read(items)
        if rest and self.rdma is not None:
            # NOTE: RDMA reads into registered contiguous memory: a destination given as
            # pieces goes by TCP (scattered by recvmsg_into), as a put given as pieces does.
            pieces = [i for i in rest if type(i.dest) is Segments]
            rest = [*self.rdma.read([i for i in rest if type(i.dest) is not Segments]), *pieces]
        return self.tcp.read_begin(rest) if rest else []

    def read_end(self, in_flight: InFlight) -> None:
        """The second half of :meth:`read`: wait for the TCP replies and fill their items."""
        if in_flight:
            self.tcp.read_end(in_flight)

    def views(self, locations: Sequence[Location]) -> list[memoryview | None]:
        """Read-only views, in this process's mappings of same-host arenas, of the granted
        bytes at each location; None where shared memory does not serve it (see
        :meth:`ShmTransport.view`). No copy and no call: what makes them safe to read is the
        caller's (:class:`kvstore.client.inplace.InPlaceReads`)."""
        if self.shm is None or not locations:
            return [None] * len(locations)
        checked: set[tuple[str, str]] = set()
        with self._lock:  # the mapping table only: no round trip under it
            return [self.shm.view(loc, checked) for loc in locations]

    def write(self, items: Sequence[WriteItem]) -> None:
        """Write each item's bytes to its location; sets ``item.result`` on failure.

        Writes through shm or RDMA are committed by the node (``shm_commit``/``rdma_commit``:
        grant and checksum checked there) before this returns, as a TCP write is acknowledged.
        """
        self.write_end(self.write_begin(items))

    def write_begin(self, items: Sequence[WriteItem]) -> InFlight:
        """The first half of :meth:`write`: shared memory and RDMA writes are done (and
        committed) now, TCP writes are sent without waiting for their acknowledgements. Must
        be followed by :meth:`write_end` of what it returns, errors or not."""
        rest: Sequence[WriteItem] = items
        written: list[WriteItem] = []
        if items and self.shm is not None:
            with self._lock:  # memory copies only: no round trip under it
                written, rest = self.shm.write(items)
        if written:
            self.tcp.call_per_node("shm_commit", written, _commit_args)
        if rest and self.rdma is not None:
            # NOTE: RDMA writes from registered contiguous memory: an object given as pieces
            # goes by TCP (gathered by sendmsg) rather than be joined here.
            pieces = [i for i in rest if type(i.data) is Segments]
            placed, rest = self.rdma.write([i for i in rest if type(i.data) is not Segments])
            rest = [*rest, *pieces]
            if placed:
                self.tcp.call_per_node("rdma_commit", placed, _commit_args)
        return self.tcp.write_begin(rest) if rest else []

    def write_end(self, in_flight: InFlight) -> None:
        """The second half of :meth:`write`: wait for the TCP acknowledgements."""
        if in_flight:
            self.tcp.write_end(in_flight)


def _commit_args(item: WriteItem, refs: grants.GrantRefs) -> list[Any]:
    return [refs.wire(item.location.grant), item.checksum]

"""The client's one read pipeline: lease → speculate → locate → read, with replica fallback.

Every read of object bytes goes through :class:`ReadPipeline`, whoever asks: ``Client.get`` and
``batch_get`` (into new ``bytes``), ``get_into`` and ``batch_get_into`` (into caller buffers),
``read_located`` (an answer located earlier) and the KV-cache layer (block objects, whole or by
byte ranges, checked against their checksum table). One place knows the order of the steps and
the rules of each, so a fix to one (a replica that fails its checksum, a lease that ran out) holds
for every caller. The steps, each skipped where it has nothing to do:

1. **lease**: with lease reads, a key whose cached answer is still under its read lease is read
   straight from its node, without the master (:mod:`kvstore.client.locations` says why that is
   safe); a failure sends the key on to the next steps.
2. **speculate**: reads into caller buffers of keys with a cached answer read that replica while
   the master answers ``get_locations`` (a small batch only, ``SPECULATE_MAX_BYTES``); the fresh
   answer confirms the guess or the key is read again from it.
3. **locate**: ``get_locations`` for the rest; each answer carries a read lease, given back to
   the master as soon as the read is done (:mod:`kvstore.client.releases`). A large batch asks
   in chunks of ``LOCATE_CHUNK`` keys, one ahead: the master locates a chunk while the one
   before it is decoded and read, and the nodes read a chunk while the next one is decoded
   (steps 3 and 4 overlap across processes).
4. **read** (:meth:`ReadPipeline.read`): one data call per round; a replica that is gone or fails
   its checksum falls back to the next one, a corrupt one (found here, or by the node, which
   answers CHECKSUM_MISMATCH) is reported to the master (which drops it and copies a good one
   back). Whole objects are verified against the object checksum; a
   read of byte ranges brings its own check (the KV-cache layer's checksum table).

NOTE: no step holds a lock across a round trip. The data path never calls the master from inside
a read: node transports are refreshed before a data call (:meth:`DataPath.refresh_offers`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvstore import grants
from kvstore.client.buffers import Segments
from kvstore.client.control import ControlChannel
from kvstore.client.datapath import DataPath
from kvstore.client.homes import HomeView
from kvstore.client.locations import LocationCache, same_replica
from kvstore.client.pipeline import PIPELINE_MAX_ITEMS, one_chunk_ahead
from kvstore.client.releases import LeaseReturns
from kvstore.client.transport import InFlight, KeyRead, ReadItem, digest
from kvstore.errors import (
    ChecksumMismatchError,
    InvalidRequestError,
    KVStoreError,
    KVTimeoutError,
    NodeUnavailableError,
)
from kvstore.gc_policy import PausedCollector
from kvstore.types import Location, ObjectInfo, result_from_wire

log = logging.getLogger(__name__)

#: A batch of more keys than this is located a chunk at a time, the next chunk's request in
#: flight while a chunk is read (each chunk stays on the shared control pipeline).
LOCATE_CHUNK = PIPELINE_MAX_ITEMS
#: Reads of cached locations overlap the master's answer only up to this many bytes per call.
SPECULATE_MAX_BYTES = 2 << 20
#: Lease reads stop trusting a cached answer this long (or a quarter of the lease, if less) before
#: its lease ends as seen from here: room for the request still to reach the node in time.
LEASE_MARGIN_S = 0.5


@dataclass(slots=True)
class LocatedRead:
    """One read of an object whose replicas are known (an :class:`ObjectInfo` with grants).

    Attributes:
        info: where the object lives (replicas in order of preference).
        dest: the bytes to fill: the object's first ``info.size`` bytes, or, with ``ranges``,
            the ranges one after another; or the whole object's bytes given as pieces
            (:class:`Segments`, exactly ``info.size`` bytes, no ``ranges``), filled in order.
        ranges: ``[[offset, length], ...]`` of the object to read (None: the whole object).
        verify: whether the bytes a read brought are intact (given the transport's item, whose
            ``digest`` is set where the transport hashed the bytes on the way). None: the whole
            object against ``info.checksum`` (required for whole reads only; a range read must
            bring its own check).
        result: after the read, the object's size on success or the error.
        item: the transport item of the last replica tried.
    """

    info: ObjectInfo
    dest: memoryview | Segments
    ranges: list[list[int]] | None = None
    verify: Callable[[ReadItem], bool] | None = None
    result: int | KVStoreError | None = None
    item: ReadItem | None = None


@dataclass(slots=True)
class _Round:
    """A round of reads sent (:meth:`ReadPipeline._send_round`): per read its replica number,
    the transport items and what the data path has in flight for them."""

    pending: list[tuple[LocatedRead, int]]
    items: list[ReadItem]
    in_flight: InFlight


def _nothing() -> None:
    pass


def corrupt_report(location: Location, checksum: int) -> list[Any]:
    """The master's ``report_corrupt`` item for a replica whose bytes failed ``checksum``."""
    g = location.grant
    return [g.key, location.node_id, g.segment, g.offset, checksum]


def decode_locations(reply: Any) -> list[ObjectInfo | KVStoreError]:
    """A ``get_locations`` answer: per key its :class:`ObjectInfo` or error (its grants one-key
    or references to the answer's batch grants, read in order)."""
    out: list[ObjectInfo | KVStoreError] = []
    reader = grants.GrantReader(grants.open_batch_unverified, check=True)
    from_wire = ObjectInfo.from_wire
    for r in reply:
        if type(r) is list and len(r) == 2 and type(r[0]) is int and r[0] == 0:
            out.append(from_wire(r[1], reader))  # (the common case: result_from_wire's first test)
            continue
        err, payload = result_from_wire(r)
        out.append(err if err is not None else from_wire(payload, reader))
    return out


class Scratch:
    """Per-thread receive buffers for reads into new ``bytes``, grown on demand and kept (up to
    ``MAX_SCRATCH`` bytes) so their pages stay mapped between calls: a fresh bytearray per
    object would cost zeroing and page faults on top of the one copy out. Two per thread
    (``slot`` 0 and 1): a chunked batch reads one chunk while the one before is still read."""

    MAX_SCRATCH = 64 << 20

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, size: int, slot: int = 0) -> memoryview:
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = [None, None]
        buf = bufs[slot]
        if buf is None or len(buf) < size:
            buf = bytearray(size)
            if size <= self.MAX_SCRATCH:
                bufs[slot] = buf
        return memoryview(buf)


class _Target(Protocol):
    """Where the bytes of a batch go: caller buffers, or new ``bytes``."""

    #: Whether reads of guessed (cached, unconfirmed) answers may overlap the master's answer.
    speculative: bool
    #: Whether :meth:`rooms` are only room, larger than most objects (not their size).
    room_only: bool

    def fits(self, j: int, info: ObjectInfo) -> bool:
        """Whether key ``j``'s object fits its destination."""
        ...

    def places(self, js: list[int], infos: list[ObjectInfo]) -> list[memoryview]:
        """Destinations for keys ``js``, whose answers are ``infos``."""
        ...

    def finish(self, js: list[int], results: list[Any]) -> None:
        """Keys ``js`` are read (their results set): turn successes into what the caller gets."""
        ...

    def rooms(self, js: list[int]) -> list[memoryview | None]:
        """Destinations for a one-hop read of keys ``js`` (size not yet known): room for the
        object, or None where that key is not read that way."""
        ...

    def found(self, j: int, view: memoryview) -> None:
        """Key ``j``'s one-hop read brought exactly ``view`` (within its room)."""
        ...


class _IntoBuffers:
    """Caller buffers (``batch_get_into``): each result is the object's size."""

    speculative = True
    room_only = False

    def __init__(self, dests: Sequence[memoryview]) -> None:
        self.dests = dests

    def fits(self, j: int, info: ObjectInfo) -> bool:
        return len(self.dests[j]) >= info.size

    def places(self, js: list[int], infos: list[ObjectInfo]) -> list[memoryview]:
        return [self.dests[j] for j in js]

    def finish(self, js: list[int], results: list[Any]) -> None:
        pass

    def rooms(self, js: list[int]) -> list[memoryview | None]:
        dests = self.dests
        return [dests[j] if type(dests[j]) is memoryview else None for j in js]

    def found(self, j: int, view: memoryview) -> None:
        pass


class _NewBytes:
    """New ``bytes`` (``batch_get``): each round reads into one of the thread's two scratch
    buffers, in turn, and copies every object out once (a round's views are released before
    the round after next takes the same buffer). Not speculative: the destination is sized
    from the answer."""

    speculative = False
    room_only = True
    #: A one-hop read (the size not known yet) gives each key ``room`` bytes of the scratch
    #: buffer (at least ``HOME_ROOM``: see ``ReadPipeline._home_room``), and a batch at most
    #: ``HOME_BATCH_BYTES`` in all, or one key's room if more (the node sends only the object;
    #: one larger than its room is a miss, read the usual way). Keys that would get less than
    #: ``HOME_MIN_ROOM`` each are all read the usual way.
    HOME_ROOM = 1 << 20
    HOME_BATCH_BYTES = 4 << 20
    HOME_MIN_ROOM = 4 << 10

    def __init__(self, scratch: Scratch, room: int) -> None:
        self._scratch = scratch
        self._room = room
        self._views: dict[int, memoryview] = {}
        self._slot = 0

    def fits(self, j: int, info: ObjectInfo) -> bool:
        return True

    def places(self, js: list[int], infos: list[ObjectInfo]) -> list[memoryview]:
        buf = self._scratch.get(sum(info.size for info in infos), self._slot)
        self._slot ^= 1
        out: list[memoryview] = []
        pos = 0
        for j, info in zip(js, infos, strict=True):
            view = self._views[j] = buf[pos : pos + info.size]
            out.append(view)
            pos += info.size
        return out

    def finish(self, js: list[int], results: list[Any]) -> None:
        for j in js:
            view = self._views.pop(j, None)
            if view is None:
                continue
            if not isinstance(results[j], KVStoreError):
                results[j] = bytes(view)
            view.release()

    def rooms(self, js: list[int]) -> list[memoryview | None]:
        room = min(self._room, max(self.HOME_BATCH_BYTES, self._room) // len(js))
        if room < self.HOME_MIN_ROOM:
            return [None] * len(js)
        buf = self._scratch.get(room * len(js), self._slot)
        self._slot ^= 1  # (the usual way's rounds, if any, read into the other buffer)
        out: list[memoryview | None] = []
        for i, j in enumerate(js):
            view = self._views[j] = buf[i * room : (i + 1) * room]
            out.append(view)
        return out

    def found(self, j: int, view: memoryview) -> None:
        self._views.pop(j).release()
        self._views[j] = view


class ReadPipeline:
    """Locates and reads objects for one client. Thread-safe (it holds no lock of its own: the
    location cache and the lease queue guard themselves).

    Args:
        control: the channel to the master.
        data: the data path to the nodes.
        cache: the client's location cache (also forgotten by its puts and removes).
        returns: where finished reads' leases go.
    """

    def __init__(
        self,
        control: ControlChannel,
        data: DataPath,
        cache: LocationCache,
        returns: LeaseReturns,
    ) -> None:
        self._control = control
        self._data = data
        self._cache = cache
        self._returns = returns
        self._scratch = Scratch()
        #: Room a one-hop read into new bytes gives each key: 1 MiB, or the next power of two
        #: above the largest object read into new bytes so far (at most the scratch's bound).
        self._home_room = _NewBytes.HOME_ROOM
        #: Seconds a get_locations answer may be reused without the master (0: never); see
        #: :meth:`use_lease_reads`.
        self.lease_window = 0.0
        #: ``{"at": this client's site}`` (``kvstore.topology``), sent with every
        #: get_locations: the master orders each object's replicas nearest this client first.
        self.site_args: dict[str, Any] = {}
        #: The live nodes, for one-hop reads (lease reads over TCP only; see :mod:`kvstore.placement`).
        self.homes: HomeView | None = None
        #: Objects read in one hop, from their home node.
        self.num_one_hop = 0

    def use_lease_reads(self, lease_s: float) -> None:
        """Reuse answers within the master's read lease of ``lease_s`` seconds (less a margin
        for the request still to reach the node in time)."""
        if lease_s > 0:
            self.lease_window = lease_s - min(LEASE_MARGIN_S, lease_s / 4)
            if self.homes is None:
                self.homes = HomeView(
                    lambda: self._control.call("live_nodes", {}), hold_s=self.lease_window
                )

    def home_of(self, key: bytes) -> str | None:
        """``key``'s home node as one-hop reads see it; None: they are off."""
        homes = self.homes
        view = homes.current() if homes is not None else None
        return view[0].home(key) if view is not None else None

    def changed(self, keys: list[bytes], landed: list[str | None] | None = None) -> None:
        """This client removed ``keys`` (``landed`` None) or put them, the first replica of
        each on node ``landed[i]``: a key not at its home is held from one-hop reads (see
        :mod:`kvstore.client.homes`)."""
        if self.homes is None:
            return
        if landed is None:
            self.homes.hold(keys)
            return
        view = self.homes.current()
        if view is None:
            return
        home = view[0].home
        away = [k for k, n in zip(keys, landed, strict=True) if n != home(k)]
        if away:
            self.homes.hold(away)

    # ---------------------------------------------------------------- locate
    def locate(self, keys: list[bytes]) -> list[ObjectInfo | KVStoreError]:
        """Where the objects live, each answer with a read lease: the caller gives it back
        (``LeaseReturns.give_back``) once its read is done."""
        return decode_locations(
            self._control.call(
                "get_locations", {"keys": keys, "batch_grants": True, **self.site_args}
            )
        )

    def _stamp(self) -> tuple[float, int]:
        """Taken just before asking the master where keys are: until when its read lease on
        the answers holds as seen from here (0 without lease reads), and the cache generation
        (see :meth:`LocationCache.put_many`)."""
        lease_until = time.monotonic() + self.lease_window if self.lease_window else 0.0
        return lease_until, self._cache.generation

    # ---------------------------------------------------------------- whole batches
    def get_into(self, keys: list[bytes], dests: list[memoryview]) -> list[int | KVStoreError]:
        """Read each object into its buffer. Returns per key its size or its error."""
        results: list[Any] = [None] * len(keys)
        with PausedCollector():
            self._run(keys, _IntoBuffers(dests), results)
        return results

    def get(self, keys: list[bytes]) -> list[bytes | KVStoreError]:
        """Read each object into new ``bytes``. Returns per key its bytes or its error."""
        results: list[Any] = [None] * len(keys)
        with PausedCollector():
            self._run(keys, _NewBytes(self._scratch, self._home_room), results)
        largest = max((len(r) for r in results if type(r) is bytes), default=0)
        if largest > self._home_room:  # (then a read of that size again takes one hop)
            self._home_room = min(1 << (largest - 1).bit_length(), Scratch.MAX_SCRATCH)
        return results

    def _run(self, keys: list[bytes], target: _Target, results: list[Any]) -> None:
        """The pipeline: the steps of the module docstring, in order, each taking the keys
        the steps before it left; sets ``results`` (aligned with ``keys``)."""
        todo = list(range(len(keys)))
        if self.lease_window:
            todo = self._read_leased(keys, todo, target, results)
            if not todo:
                return
            if self.homes is not None:
                todo = self._read_at_home(keys, todo, target, results)
                if not todo:
                    return
        if len(todo) < len(keys):
            keys = [keys[j] for j in todo]  # (from here on, the keys of ``todo``)
        cached = self._cache.get_many(keys) if target.speculative else []
        guessed = [
            (j, info)
            for j, info in zip(todo, cached, strict=False)
            if info is not None and target.fits(j, info)
        ]
        lease_until, generation = self._stamp()
        # NOTE: large reads (where one round trip matters little) do not overlap.
        if not guessed or sum(info.size for _, info in guessed) > SPECULATE_MAX_BYTES:
            if len(keys) > LOCATE_CHUNK:
                self._read_in_chunks(keys, todo, target, results)
                return
            infos = self.locate(keys)
            self._begin_located(keys, todo, infos, (lease_until, generation), target, results)()
            return
        guesses = self._guess_items(guessed, target)
        self._data.refresh_offers({item.location.node_id for item in guesses.values()})
        reply, _ = self._control.call_overlapped(
            "get_locations",
            {"keys": keys, "batch_grants": True, **self.site_args},
            lambda: self._data.read(list(guesses.values())),
        )
        infos = decode_locations(reply)
        done_with = self._cache.put_many(keys, infos, lease_until, generation)
        try:
            self._confirm(todo, infos, dict(guessed), guesses, target, results)
        finally:
            self._returns.give_back(done_with)

    def _begin_located(
        self,
        keys: list[bytes],
        js: list[int],
        infos: list[ObjectInfo | KVStoreError],
        stamp: tuple[float, int],
        target: _Target,
        results: list[Any],
        *,
        keep: bool = True,
    ) -> Callable[[], None]:
        """Steps 3 and 4 for keys ``js`` (``keys``: theirs) once the master answered ``infos``,
        up to the nodes' replies: cache the answers (unless not ``keep``) and send their reads.
        Returns the rest (to call exactly once, whatever happens meanwhile), which takes the
        replies and gives the leases back. ``stamp``: taken before asking (see
        :meth:`_stamp`)."""
        if keep:
            done_with = self._cache.put_many(keys, infos, *stamp)
        else:
            done_with = [i.lease for i in infos if type(i) is ObjectInfo and i.lease]
        try:
            end_answers = self._begin_answers(js, infos, target, results)
        except BaseException:
            self._returns.give_back(done_with)
            raise

        def end() -> None:
            try:
                end_answers()
            finally:
                self._returns.give_back(done_with)

        return end

    def _read_in_chunks(
        self, keys: list[bytes], todo: list[int], target: _Target, results: list[Any]
    ) -> None:
        """Steps 3 and 4 of a large batch, ``LOCATE_CHUNK`` keys at a time: each chunk's
        ``get_locations`` is sent before the chunk ahead of it is decoded and read, so the
        master works on the next answer while this process and the nodes work on this one.
        The nodes' replies to a chunk are taken after the next chunk's reads are sent, so the
        nodes read a chunk while this process decodes the next one.

        Without lease reads a bulk read's answers are not kept as guesses for later speculative
        reads (a guess only saves a small reread's latency, and keeping thousands of answers a
        batch costs a client reading distinct keys CPU on every key, as ``.venv/bin/python
        bench/bench_small.py`` shows in the client's CPU a key; a cached guess of one of
        these keys may be older, which is harmless: every guess is checked against the
        master's fresh answer). With lease reads they are kept: that is what lease reads are.
        """
        keep = bool(self.lease_window)

        def start(chunk: slice, work: Callable[[], None] | None) -> tuple[tuple[float, int], Any]:
            stamp = self._stamp()
            args = {"keys": keys[chunk], "batch_grants": True, **self.site_args}
            if work is None:
                return stamp, self._control.call("get_locations", args)
            return stamp, self._control.call_overlapped("get_locations", args, work)[0]

        reading: Callable[[], None] | None = None  # the rest of the chunk being read

        def finish(chunk: slice, answer: tuple[tuple[float, int], Any]) -> None:
            nonlocal reading
            before, reading = reading, None
            try:
                stamp, reply = answer
                infos = decode_locations(reply)
                reading = self._begin_located(
                    keys[chunk], todo[chunk], infos, stamp, target, results, keep=keep
                )
            finally:
                if before is not None:
                    before()

        try:
            one_chunk_ahead(len(keys), LOCATE_CHUNK, start, finish)
        finally:
            if reading is not None:
                reading()

    def _read_leased(
        self, keys: list[bytes], todo: list[int], target: _Target, results: list[Any]
    ) -> list[int]:
        """Step 1: read the keys whose cached answer is still under lease, without the master.

        Returns:
            The keys (positions) still to read the usual way: no leased answer, or its read
            failed (node gone, grant refused, bytes changed: that answer is forgotten).
        """
        leased = self._cache.leased_many(keys, time.monotonic())
        js: list[int] = []
        infos: list[ObjectInfo] = []
        rest: list[int] = []
        for j in todo:
            info = leased[j]
            if info is not None and info.locations and target.fits(j, info):
                js.append(j)
                infos.append(info)
            else:
                rest.append(j)
        if not js:
            return rest
        # The first replica only, and no replica fallback here: any failure sends the key on
        # to the master's fresh answer (step 3), whose read (step 4) falls back and reports.
        # (Step 4's machinery on this path is a large share of a leased 4 KiB read:
        # ``.venv/bin/python bench/bench_store.py --small``, the lease-read client.)
        items = list(self._guess_items(list(zip(js, infos, strict=True)), target).values())
        self._data.read(items)
        ok: list[int] = []
        stale: list[int] = []
        for j, info, item in zip(js, infos, items, strict=True):
            if item.result is None and digest(item) == info.checksum:
                results[j] = info.size
                ok.append(j)
            else:
                stale.append(j)
        target.finish(ok, results)
        if stale:
            self._cache.forget([keys[j] for j in stale])
            rest = sorted(rest + stale)
        return rest

    def _read_at_home(
        self, keys: list[bytes], todo: list[int], target: _Target, results: list[Any]
    ) -> list[int]:
        """Step 1b: read the keys from their home nodes by key, without the master (one hop,
        :mod:`kvstore.placement`): the bytes over TCP, or, from a node whose arenas this client
        maps, where they lie, then copied from the mapping. Returns the keys (positions) still
        to read the usual way: a miss, a failure, or bytes that fail their checksum."""
        assert self.homes is not None
        view = self.homes.current()
        if view is None:
            return todo
        homes, endpoints = view
        shm = self._data.shm
        sent: list[KeyRead] = []  # bytes over TCP
        mapped: list[KeyRead] = []  # places, copied from shared memory
        asked: list[tuple[int, KeyRead]] = []
        rest: list[int] = []
        held = self.homes.held if self.homes.holding else None
        now = time.monotonic()
        room_only = target.room_only
        by_shm: dict[str, bool] = {}  # node -> whether this client copies from its arenas
        for j, dest in zip(todo, target.rooms(todo), strict=True):
            node = homes.home(keys[j]) or ""
            endpoint = endpoints.get(node)
            if endpoint is None or dest is None or held and held(keys[j], now):
                rest.append(j)
                continue
            item = KeyRead(keys[j], endpoint, dest, node_id=node, room_only=room_only)
            copies = by_shm.get(node)
            if copies is None:
                copies = by_shm[node] = shm is not None and shm.serves(node)
            (mapped if copies else sent).append(item)
            asked.append((j, item))
        if not asked:
            return todo
        if sent:
            self._data.tcp.read_keys(sent)
        if mapped:
            assert shm is not None
            self._data.tcp.read_keys(mapped, where=True)
            checked: set[tuple[str, str]] = set()
            for item in mapped:
                if item.result is None:
                    item.dest = item.dest[: item.size]
                    item.digest = shm.copy_at(
                        item.node_id, item.segment, item.offset, item.dest, checked
                    )
                    if item.digest is None:
                        item.result = NodeUnavailableError("no shared memory for this node")
        ok: list[int] = []
        for j, item in asked:
            if item.result is None and digest(item) == item.checksum:  # type: ignore[arg-type]
                results[j] = item.size
                target.found(j, item.dest)
                ok.append(j)
            else:
                if isinstance(item.result, NodeUnavailableError | KVTimeoutError):
                    self.homes.stale()
                rest.append(j)
        self.num_one_hop += len(ok)
        target.finish(ok, results)
        return sorted(rest) if len(rest) < len(todo) else todo

    @staticmethod
    def _guess_items(guessed: list[tuple[int, ObjectInfo]], target: _Target) -> dict[int, ReadItem]:
        js = [j for j, _ in guessed]
        infos = [info for _, info in guessed]
        dests = target.places(js, infos)
        return {
            j: ReadItem(info.locations[0], dest[: info.size])
            for j, info, dest in zip(js, infos, dests, strict=True)
        }

    def _confirm(
        self,
        js: list[int],
        infos: list[ObjectInfo | KVStoreError],
        cached: dict[int, ObjectInfo],
        guesses: dict[int, ReadItem],
        target: _Target,
        results: list[Any],
    ) -> None:
        """Step 2's end: accept the speculative reads the master's fresh answers confirm (same
        object, same replica, intact bytes); read the others from the fresh answers."""
        redo: list[int] = []
        redo_infos: list[ObjectInfo | KVStoreError] = []
        confirmed: list[int] = []
        for j, info in zip(js, infos, strict=True):
            item = guesses.get(j)
            if (
                item is not None
                and isinstance(info, ObjectInfo)
                and item.result is None
                and same_replica(info, cached[j], item.location)
                and digest(item) == info.checksum
            ):
                results[j] = info.size
                confirmed.append(j)
            else:
                redo.append(j)
                redo_infos.append(info)
        target.finish(confirmed, results)
        if redo:
            self._read_answers(redo, redo_infos, target, results)

    def _read_answers(
        self,
        js: list[int],
        infos: Sequence[ObjectInfo | KVStoreError],
        target: _Target,
        results: list[Any],
    ) -> None:
        """Step 4 for keys ``js`` whose answers are ``infos``: read each into its destination."""
        self._begin_answers(js, infos, target, results)()

    def _begin_answers(
        self,
        js: list[int],
        infos: Sequence[ObjectInfo | KVStoreError],
        target: _Target,
        results: list[Any],
    ) -> Callable[[], None]:
        """:meth:`_read_answers` up to the nodes' replies: returns the rest (to call exactly
        once), which takes the replies and sets the results."""
        ok: list[int] = []
        found: list[ObjectInfo] = []
        for j, info in zip(js, infos, strict=True):
            if isinstance(info, KVStoreError):
                results[j] = info
            else:
                ok.append(j)
                found.append(info)
        if not ok:
            return _nothing
        reads = [
            LocatedRead(info, dest)
            for info, dest in zip(found, target.places(ok, found), strict=True)
        ]
        sent = self._read_begin(reads)

        def end() -> None:
            self._read_end(sent)
            for j, rd in zip(ok, reads, strict=True):
                results[j] = rd.result
            target.finish(ok, results)

        return end

    # ---------------------------------------------------------------- step 4: the read
    def read(self, reads: Sequence[LocatedRead]) -> None:
        """Fill each read's ``dest`` from the first replica that serves it intact; sets each
        ``result`` (the object's size, or the error).

        A replica that is gone (NodeUnavailableError) or fails its check (ChecksumMismatchError)
        falls back to the next one; a replica whose bytes fail the check, here or on its node,
        is reported to the master once the batch is done (best effort).
        """
        with PausedCollector():
            self._read(reads)

    def _read(self, reads: Sequence[LocatedRead]) -> None:
        self._read_end(self._read_begin(reads))

    def _read_begin(self, reads: Sequence[LocatedRead]) -> _Round:
        """:meth:`read`'s first round sent (see :meth:`DataPath.read_begin`): for
        :meth:`_read_end`, which must follow whatever happens meanwhile."""
        pending: list[tuple[LocatedRead, int]] = []  # (read, replica number)
        for rd in reads:
            if not rd.info.locations:
                rd.result = NodeUnavailableError("no live replica")
            elif rd.ranges is None and len(rd.dest) < rd.info.size:
                rd.result = InvalidRequestError(
                    f"buffer of {len(rd.dest)} bytes is too small for an object of {rd.info.size}"
                )
            elif type(rd.dest) is Segments and (
                rd.ranges is not None or len(rd.dest) != rd.info.size
            ):
                rd.result = InvalidRequestError(
                    f"pieces of {len(rd.dest)} bytes must hold the whole object ({rd.info.size})"
                )
            else:
                assert rd.ranges is None or rd.verify is not None, "a range read needs a check"
                pending.append((rd, 0))
        return self._send_round(pending)

    def _send_round(self, pending: list[tuple[LocatedRead, int]]) -> _Round:
        """Send a round of reads: each ``(read, r)`` from its ``r``-th replica."""
        items = [
            ReadItem(
                rd.info.locations[r],
                rd.dest
                if rd.ranges is not None or type(rd.dest) is Segments
                else rd.dest[: rd.info.size],
                rd.ranges,
            )
            for rd, r in pending
        ]
        if not items:
            return _Round(pending, items, [])
        self._data.refresh_offers({item.location.node_id for item in items})
        return _Round(pending, items, self._data.read_begin(items))

    def _read_end(self, sent: _Round) -> None:
        """Take a round's replies and check them; replicas that fail fall back to the next
        one, round after round (see :meth:`read`)."""
        corrupt: list[list[Any]] = []
        while sent.pending:
            pending, items = sent.pending, sent.items
            self._data.read_end(sent.in_flight)
            retry: list[tuple[LocatedRead, int]] = []
            for (rd, r), item in zip(pending, items, strict=True):
                rd.item = item
                err = item.result
                if err is None:
                    if (
                        rd.verify(item)
                        if rd.verify is not None
                        else digest(item) == rd.info.checksum
                    ):
                        rd.result = rd.info.size
                        continue
                    # A corrupt replica: report it (the master drops it and copies a good one
                    # back) and read the next replica instead.
                    corrupt.append(corrupt_report(item.location, rd.info.checksum))
                    err = ChecksumMismatchError(
                        "object bytes do not match their checksum (overwritten or corrupt)"
                    )
                elif isinstance(err, ChecksumMismatchError):
                    # The node found the replica damaged itself (an NVMe record truncated or
                    # missing a chunk): reported alike, or every read would meet it again.
                    corrupt.append(corrupt_report(item.location, rd.info.checksum))
                if isinstance(err, NodeUnavailableError | ChecksumMismatchError) and (
                    r + 1 < len(rd.info.locations)
                ):
                    retry.append((rd, r + 1))
                else:
                    rd.result = err
            sent = self._send_round(retry)
        if corrupt:
            self.report_corrupt(corrupt)

    def report_corrupt(self, reports: list[list[Any]]) -> None:
        """Tell the master which replicas failed their checksum (best effort: a lost report
        only delays the repair; the next reader reports again). Each report is ``[key,
        node_id, segment, offset, checksum]`` (see :func:`corrupt_report`)."""
        self._cache.forget([r[0] for r in reports])
        try:
            self._control.call("report_corrupt", {"items": reports})
        except KVStoreError as err:
            log.warning("could not report %d corrupt replica(s): %s", len(reports), err.message)

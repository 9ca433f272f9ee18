"""The collector policy of a kvstore daemon (master or node), and a record of its pauses.

A collection of CPython's cyclic garbage collector runs in the middle of whatever allocated the
object that triggered it: on the master's event loop thread the master serves no one while it
lasts; on a node's thread the read or write that allocated waits. A young collection walks the
objects allocated since the last one (bounded by the threshold); a full collection walks every
object the collector tracks. So the master keeps its big tables out of the collector's sight
(committed objects: ``table.py``; pending puts: ``puts.py``), and a process that runs a master
or a node (``kvstore master``, ``kvstore node``, ``kvstore up``) sets the policy below once,
after start-up: :func:`tune_collector`. Not the client: it lives in an engine's process, whose
collector is the engine's to set.

:class:`CollectorPauses` (installed by :func:`tune_collector`) counts the collections of each
generation and how long they held the thread; the master's and the node's metrics export them
(``kvstore_gc_*``, :func:`metric_families`), and with ``--log-level debug`` each collection
longer than :data:`LONG_PAUSE_S` is logged with its generation and duration, to tell a
collection pause apart from a long turn of the daemon's own work.

A client (:class:`~kvstore.client.Client`) sets no policy: it lives in an engine's process. It
pauses the collector for the length of each of its data calls instead (:class:`PausedCollector`).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

#: The collector's young-generation threshold in a daemon (CPython's default is 700). A
#: ``put_start`` batch keeps ~1,000 pending puts alive until its ``put_end``: at 700, young
#: collections catch them alive and promote them, and the old generation's 25% growth rule then
#: runs a full collection every few batches; at 10,000 they die young, and the puts take about as
#: long as with the collector off (``.venv/bin/python bench/bench_master_memory.py``, with and
#: without ``--daemon-gc``, and with ``--gc-off``). A node's write request keeps its items'
#: claims and manifest records alive the same way, and CPython's defaults run full collections on
#: its data threads where this policy runs none (``.venv/bin/python bench/bench_small.py --keys
#: 1000 --size 16 --rounds 40`` prints the node's collections).
YOUNG_GC_THRESHOLD = 10_000

#: A collection that holds the loop longer than this is logged (at debug level).
LONG_PAUSE_S = 0.005

NUM_GENERATIONS = 3


class CollectorPauses:
    """Per generation: how many collections ran, the seconds they held the thread, the longest.

    A ``gc.callbacks`` hook: CPython calls it at the start and the end of every collection.
    Process-wide (the collector is), so one instance serves every master or node of a process.
    """

    def __init__(self) -> None:
        self.num_collections = [0] * NUM_GENERATIONS
        self.seconds = [0.0] * NUM_GENERATIONS
        self.longest_s = [0.0] * NUM_GENERATIONS
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        gen = info["generation"]
        self.num_collections[gen] += 1
        self.seconds[gen] += took
        if took > self.longest_s[gen]:
            self.longest_s[gen] = took
        if took > LONG_PAUSE_S and log.isEnabledFor(logging.DEBUG):
            log.debug(
                "collector: generation %d held the loop %.1f ms (%d collected, %d uncollectable)",
                gen,
                took * 1e3,
                info["collected"],
                info["uncollectable"],
            )

    def install(self) -> None:
        """Start recording (once: a second call changes nothing)."""
        if self not in gc.callbacks:
            gc.callbacks.append(self)


#: The pauses of this process's collector (recorded once :func:`tune_collector` ran).
PAUSES = CollectorPauses()


def tune_collector() -> int:
    """Set a daemon's collector policy: a larger young threshold, start-up frozen, pauses
    recorded (:data:`PAUSES`).

    Why freeze (``gc.freeze``): a full collection walks every object the collector tracks.
    The master's object table tracks almost nothing (``table.py``), so the modules, classes and
    functions loaded at start-up are most of each full collection's work, for objects that live
    as long as the process (``.venv/bin/python bench/bench_master_memory.py --daemon-gc`` against
    the same without it times a full collection either way). ``gc.collect()`` runs first, so
    nothing that is already garbage is frozen (frozen cyclic garbage is never collected); what
    start-up created and a later term's fresh ``MasterService`` drops is freed by reference
    counting, so at worst a cycle among those stays, once, never growing. Call it once, after
    start-up, in every process that runs a master or a node.

    Returns:
        How many objects were frozen.
    """
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(YOUNG_GC_THRESHOLD, gen1, gen2)
    gc.collect()
    gc.freeze()
    PAUSES.install()
    return gc.get_freeze_count()


def metric_families() -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The process's garbage collector as metrics: what :data:`PAUSES` recorded, and how many
    objects :func:`tune_collector` froze."""
    families = (
        CounterMetricFamily(
            "kvstore_gc_collections", "Garbage collections, by generation", labels=["generation"]
        ),
        CounterMetricFamily(
            "kvstore_gc_pause_seconds",
            "Seconds garbage collections held their thread, by generation",
            labels=["generation"],
        ),
        GaugeMetricFamily(
            "kvstore_gc_longest_pause_seconds",
            "The longest garbage collection so far, by generation",
            labels=["generation"],
        ),
    )
    figures = (PAUSES.num_collections, PAUSES.seconds, PAUSES.longest_s)
    for family, values in zip(families, figures, strict=True):
        for gen in range(NUM_GENERATIONS):
            family.add_metric([str(gen)], values[gen])
        yield family
    yield GaugeMetricFamily(
        "kvstore_gc_frozen_objects",
        "Objects frozen at start-up, out of the collector's sight",
        value=float(gc.get_freeze_count()),
    )


class PausedCollector:
    """``with PausedCollector():`` runs a client's data call (a get, a put, a batch of either)
    with the cyclic collector off, and turns it back on at the end, if it was on.

    Why: a batch call allocates a dozen small records a key (the master's answer as lists, an
    answer, its replicas and grants, the read items), all freed by reference counting when
    the call is done and none in a cycle. Collections in the middle of the call find them alive
    and promote them, and the promotions then start full collections of the engine's whole
    heap, a cost in client CPU per key that the pause removes (``.venv/bin/python
    bench/bench_small.py --keys 1000 --size 16 --rounds 40 --heap 2000000``: a client holding
    2M objects, as an engine does, with its collections in the calls). The collections due
    meanwhile run at the next allocation after the call: deferred by one call, not skipped.

    Thread-safe: a call that finds the collector off (another call's pause, or the engine's own
    ``gc.disable()``) leaves it as it is. A call turns it back on at its end even while calls of
    other threads still run (they run the rest of the way with it on), so in an engine whose
    threads keep calls in flight the collector is never off for longer than one call. A call that
    waits out its timeouts (a master or node that does not answer) keeps it off that long: the
    collections are late, no garbage is lost. An engine that turns its collector off
    (``gc.disable()``) while a call of another thread is in flight may find it on again when
    that call returns.
    """

    __slots__ = ("_mine",)

    def __enter__(self) -> None:
        self._mine = gc.isenabled()
        if self._mine:
            gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self._mine:
            gc.enable()

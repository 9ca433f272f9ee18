"""The router's engine set from the etcd engine registry (:mod:`kvstore.client.engine_registry`).

Why a watch and not a poll: an engine that registers is routable on the next event (well under
a second) instead of on the next poll period, and an engine that dies leaves with its lease's
expiry event, while etcd does the work (one stream, no listing every period). Correctness
across outages comes from the revision: the watcher lists the prefix once (a snapshot at
revision R) and watches from R + 1; after the stream breaks (etcd restarted, a network cut) it
resumes from the last revision it applied + 1, so it gets exactly the changes it missed,
deletions of expired leases included. Only when etcd has compacted that history away
(:class:`~kvstore.etcd.WatchCompactedError`) does it list again and apply the difference.
While etcd is unreachable the set stays as it was: the engines are still health-polled, so a
dead one stops receiving requests whatever etcd says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from kvstore.address import Address
from kvstore.client.engine_registry import (
    DEFAULT_ENGINES_PREFIX,
    RegisteredEngine,
    check_prefix,
    list_engines,
)
from kvstore.errors import EtcdUnavailableError, InvalidRequestError
from kvstore.etcd import EtcdStore, WatchCompactedError, WatchEvent

from .metrics import RouterMetrics

log = logging.getLogger("kvstore.router")

#: Seconds before re-watching after etcd failed (then doubling up to the max).
RETRY_FIRST_S = 0.2
RETRY_MAX_S = 5.0


class EngineDiscovery:
    """Follows the registry and reports each key as it appears and goes.

    NOTE: runs on the router's event loop; ``on_add`` / ``on_remove`` are called from it, one
    at a time, in revision order.

    Args:
        endpoints: etcd addresses.
        on_add: called with a key's registration when it appears or changes.
        on_remove: called with a key's last registration when it goes.
        prefix: the registry prefix.
        metrics: where the changes are counted (None: nowhere).
        refuse: why a registration that decodes is still not to be used (None: it is to be).
    """

    def __init__(
        self,
        endpoints: Sequence[Address],
        on_add: Callable[[RegisteredEngine], None],
        on_remove: Callable[[RegisteredEngine], None],
        *,
        prefix: str = DEFAULT_ENGINES_PREFIX,
        metrics: RouterMetrics | None = None,
        refuse: Callable[[RegisteredEngine], str | None] = lambda reg: None,
    ) -> None:
        self.endpoints = list(endpoints)
        self.prefix = check_prefix(prefix)
        self.on_add = on_add
        self.on_remove = on_remove
        self.metrics = metrics
        self.refuse = refuse
        #: Live registrations by key.
        self.current: dict[str, RegisteredEngine] = {}
        #: Why each refused key was refused, so that a key written again unchanged is not
        #: logged again.
        self.refused: dict[str, str] = {}
        #: The last revision applied (None: never listed).
        self.revision: int | None = None
        #: Set once the first listing is applied.
        self.listed = asyncio.Event()
        #: Whether a watch stream is open now.
        self.watching = False
        self.num_listings = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Follow the registry in a task until :meth:`close`."""
        assert self._task is None, "started twice"
        self._task = asyncio.create_task(self.run())

    async def close(self) -> None:
        """Stop following (the engine set stays as it is)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def _count(self, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.discovery_changes.labels(kind).inc()

    def _up(self, up: bool) -> None:
        self.watching = up
        if self.metrics is not None:
            self.metrics.discovery_up.set(1 if up else 0)

    def _put(self, reg: RegisteredEngine) -> None:
        if self.current.get(reg.key) == reg:
            return
        why = self.refuse(reg)
        if why is not None:
            self._refuse(reg.key, f"{reg.key!r} ({reg.record.url!r}): {why}")
            return
        self.refused.pop(reg.key, None)
        old = self.current.get(reg.key)
        if old is not None and old.record != reg.record:
            self._remove(reg.key)  # a changed record: the old engine goes, the new one comes
        self.current[reg.key] = reg
        if old is None or old.record != reg.record:
            self._count("added")
            self.on_add(reg)

    def _refuse(self, key: str, why: str) -> None:
        """Refuse a key's registration: log it (once while the reason holds), count it, and
        drop what the key held before."""
        if self.refused.get(key) != why:
            log.warning("router: engine registry: ignoring %s", why)
            self.refused[key] = why
        self._count("ignored")
        self._remove(key)

    def _remove(self, key: str) -> None:
        reg = self.current.pop(key, None)
        if reg is not None:
            self._count("removed")
            self.on_remove(reg)

    async def _list(self, store: EtcdStore) -> None:
        """Take a snapshot and apply its difference from what we hold."""
        snapshot, revision = await list_engines(store, self.prefix)
        for key in [k for k in self.current if k not in snapshot]:
            self._remove(key)
        for reg in snapshot.values():
            self._put(reg)
        self.revision = revision
        self.num_listings += 1
        if self.num_listings > 1:
            self._count("resynced")
        self.listed.set()

    def apply(self, event: WatchEvent) -> None:
        """Apply one watch event (a put that does not decode removes what the key held)."""
        key = event.kv.key.decode("utf-8", "replace")
        if event.kind == "delete":
            self.refused.pop(key, None)
            self._remove(key)
        else:
            try:
                reg = RegisteredEngine.from_kv(self.prefix, event.kv)
            except InvalidRequestError as err:  # its message shows the values with repr
                self._refuse(key, err.message)
            else:
                self._put(reg)
        self.revision = max(self.revision or 0, event.kv.mod_revision)

    async def run(self) -> None:
        """List, then watch from the listing's revision, resuming after failures, forever."""
        store = EtcdStore(self.endpoints)
        retry_s = RETRY_FIRST_S
        down_logged = False
        try:
            while True:
                try:
                    if self.revision is None:
                        await self._list(store)
                    assert self.revision is not None
                    watch = await store.watch(
                        self.prefix.encode() + b"/", prefix=True, start_revision=self.revision + 1
                    )
                    try:
                        self._up(True)
                        if down_logged:
                            log.info("router: engine registry watched again from %d", self.revision)
                        down_logged, retry_s = False, RETRY_FIRST_S
                        async for event in watch.events():
                            self.apply(event)
                    finally:
                        self._up(False)
                        await watch.cancel()
                    raise EtcdUnavailableError("the watch ended")
                except WatchCompactedError as err:
                    log.warning("router: engine registry: %s; listing again", err.message)
                    self.revision = None
                except EtcdUnavailableError as err:
                    if not down_logged:
                        log.warning(
                            "router: engine registry at %s unavailable (%s); keeping the %d "
                            "engines it listed, retrying",
                            ",".join(str(e) for e in self.endpoints),
                            err.message,
                            len(self.current),
                        )
                        down_logged = True
                    await asyncio.sleep(retry_s)  # a backoff, not a synchronisation
                    retry_s = min(retry_s * 2, RETRY_MAX_S)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(store.close())

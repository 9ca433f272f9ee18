"""Our small interface to etcd v3: key/values, leases, compare-and-swap, watches.

Everything kvstore asks of etcd goes through :class:`EtcdStore`, so the client library behind it
(``aetcd``, an asyncio gRPC client) can be swapped without touching the master, the nodes or
the SDK. Every call is bounded by ``op_timeout`` and every failure of etcd itself becomes an
:class:`~kvstore.errors.EtcdUnavailableError`; after a failure the store moves to the next
endpoint, so ``HOST:PORT,HOST:PORT`` lists survive the loss of one etcd member.

Leases are kept alive *explicitly* by the caller (:meth:`EtcdStore.keep_alive`): the caller
knows when it last proved its lease and can fence itself with its own monotonic clock.

For threaded callers (the storage node's agent, the client SDK) :class:`EtcdThread` runs a store
on a private event loop in a daemon thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvstore.address import Address
from kvstore.errors import EtcdUnavailableError, InvalidRequestError

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_OP_TIMEOUT_S = 2.0
CLOSE_TIMEOUT_S = 1.0
ETCD_SCHEME = "etcd://"


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One etcd key with its metadata (``lease`` is 0 for a key without a lease)."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """``kind`` is ``"put"`` or ``"delete"``."""

    kind: str
    kv: KeyValue


class WatchCompactedError(EtcdUnavailableError):
    """A watch asked to resume from a revision etcd has compacted away: the events in between
    are lost, so the watcher must list the keys again (a snapshot) and watch from there.

    Attributes:
        compacted_revision: the oldest revision etcd still holds.
    """

    def __init__(self, compacted_revision: int) -> None:
        super().__init__(f"etcd compacted the watched history up to {compacted_revision}")
        self.compacted_revision = compacted_revision


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: int
    ttl: int


def parse_endpoints(text: str) -> list[Address]:
    """Parse ``HOST:PORT[,HOST:PORT...]``, with or without a leading ``etcd://``.

    Raises:
        InvalidRequestError: an empty list or a malformed address.
    """
    if not isinstance(text, str):
        raise InvalidRequestError("etcd endpoints must be a string like HOST:PORT[,HOST:PORT]")
    body = text[len(ETCD_SCHEME) :] if text.startswith(ETCD_SCHEME) else text
    parts = [p.strip() for p in body.split(",") if p.strip()]
    if not parts:
        raise InvalidRequestError(f"no etcd endpoint in {text!r}")
    endpoints = [Address.parse(p) for p in parts]
    if any(e.port == 0 for e in endpoints):
        raise InvalidRequestError(f"etcd endpoint without a port in {text!r}")
    return endpoints


def is_etcd_url(text: str) -> bool:
    return isinstance(text, str) and text.startswith(ETCD_SCHEME)


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range_end)."""
    b = bytearray(prefix)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b"\0"


def self_cancelled() -> bool:
    """Whether the running task is being cancelled by someone (not by grpc under a call).

    grpc.aio raises ``asyncio.CancelledError`` into a call whose channel closed; a task that
    treated that as its own cancellation would end quietly (``Task.cancelling()`` tells apart).
    """
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def _close_client(client: Any) -> None:
    """Close an aetcd client, bounded: a channel to a paused etcd must not hold the caller."""
    if client is None:
        return
    try:
        await asyncio.wait_for(client.close(), CLOSE_TIMEOUT_S)
    except asyncio.CancelledError:
        if self_cancelled():
            raise
    except Exception:  # noqa: BLE001 - a broken channel is what we are discarding
        log.debug("closing an etcd client failed", exc_info=True)


def _kv(raw: Any) -> KeyValue:
    return KeyValue(
        bytes(raw.key), bytes(raw.value), raw.create_revision, raw.mod_revision, raw.lease
    )


class EtcdWatch:
    """Events under a key or prefix, in revision order. Stop with :meth:`cancel`."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    async def events(self) -> AsyncIterator[WatchEvent]:
        """Yield events until cancelled.

        Raises:
            EtcdUnavailableError: the watch stream broke (etcd went away).
        """
        import aetcd

        try:
            async for ev in self._raw:
                kind = "delete" if ev.kind == aetcd.EventKind.DELETE else "put"
                yield WatchEvent(kind, _kv(ev.kv))
        except asyncio.CancelledError:
            if self_cancelled():
                raise
            raise EtcdUnavailableError("etcd watch broke: its channel closed") from None
        except aetcd.exceptions.RevisionCompactedError as exc:
            raise WatchCompactedError(int(exc.compacted_revision)) from None
        except (aetcd.ClientError, OSError, RuntimeError, ValueError) as exc:
            raise EtcdUnavailableError(f"etcd watch broke: {type(exc).__name__}") from None

    async def cancel(self) -> None:
        """Stop the watch, bounded: the stream may already be gone with etcd."""
        try:
            await asyncio.wait_for(self._raw.cancel(), CLOSE_TIMEOUT_S)
        except asyncio.CancelledError:
            if self_cancelled():
                raise
        except Exception:  # noqa: BLE001 - the stream may already be gone with etcd
            log.debug("cancelling an etcd watch failed", exc_info=True)


class EtcdStore:
    """An asyncio etcd v3 client bound to a list of endpoints. Use :meth:`connect`.

    Args:
        endpoints: etcd client addresses; the store talks to one at a time, moving on after
            a failure.
        op_timeout: seconds each call may take.

    Raises (every call):
        EtcdUnavailableError: etcd failed, refused or did not answer within ``op_timeout``.
    """

    def __init__(
        self, endpoints: Sequence[Address], *, op_timeout: float = DEFAULT_OP_TIMEOUT_S
    ) -> None:
        if not endpoints:
            raise InvalidRequestError("at least one etcd endpoint is needed")
        self.endpoints = list(endpoints)
        self.op_timeout = op_timeout
        self._index = 0
        self._client: Any = None

    @property
    def endpoint(self) -> Address:
        return self.endpoints[self._index]

    @classmethod
    async def connect(
        cls,
        endpoints: Sequence[Address],
        *,
        attempts: int = 5,
        backoff_s: float = 0.2,
        op_timeout: float = DEFAULT_OP_TIMEOUT_S,
    ) -> EtcdStore:
        """Connect and check that etcd answers, with bounded retries over the endpoints.

        Raises:
            EtcdUnavailableError: no endpoint answered within ``attempts`` tries.
        """
        store = cls(endpoints, op_timeout=op_timeout)
        last = ""
        for attempt in range(max(1, attempts)):
            try:
                await store.status()
                return store
            except EtcdUnavailableError as err:
                last = err.message
                if attempt + 1 < attempts:
                    await asyncio.sleep(min(backoff_s * (2**attempt), 2.0))
        await store.close()
        names = ",".join(str(e) for e in endpoints)
        raise EtcdUnavailableError(f"etcd at {names} unreachable after {attempts} tries: {last}")

    async def close(self) -> None:
        client, self._client = self._client, None
        await _close_client(client)

    async def _drop(self, client: Any) -> None:
        """Forget ``client`` after a failure and move to the next endpoint.

        NOTE: only the client that failed is closed (a call that raced in on a newer one keeps
        it), and a fresh connection starts with no reconnect backoff left from the outage.
        """
        if self._client is client:
            self._client = None
            self._index = (self._index + 1) % len(self.endpoints)
        await _close_client(client)

    async def _call(self, what: str, fn: Callable[[Any], Awaitable[T]]) -> T:
        import aetcd

        if self._client is None:
            ep = self.endpoint
            self._client = aetcd.Client(ep.host, ep.port, timeout=max(1, round(self.op_timeout)))
        client, ep = self._client, self.endpoint
        try:
            return await asyncio.wait_for(fn(client), self.op_timeout)
        except asyncio.CancelledError:
            if self_cancelled():
                # Our caller cancelled us (shutdown, its own deadline): the call's state is
                # unknown, so the connection goes too; the cancellation goes on.
                await asyncio.shield(self._drop(client))
                raise
            # grpc cancelled the call under us (its channel closed): a failure of etcd's link.
            await self._drop(client)
            raise EtcdUnavailableError(f"etcd {ep} failed during {what}: call cancelled") from None
        except aetcd.exceptions.RevisionCompactedError as exc:
            # etcd answered: the link is fine, only the history asked for is gone.
            raise WatchCompactedError(int(exc.compacted_revision)) from None
        except (aetcd.ClientError, TimeoutError, OSError) as exc:
            await self._drop(client)
            raise EtcdUnavailableError(
                f"etcd {ep} failed during {what}: {type(exc).__name__}"
            ) from None
        except Exception as exc:
            # grpc's own errors on a closing channel (UsageError, InvalidStateError, ...): no
            # caller of ours can act on them but as on any other failure of etcd.
            log.warning("etcd %s: unexpected %s during %s", ep, type(exc).__name__, what)
            await self._drop(client)
            raise EtcdUnavailableError(
                f"etcd {ep} failed during {what}: {type(exc).__name__}"
            ) from None

    # ------------------------------------------------------------------ key/values
    async def status(self) -> None:
        await self._call("status", lambda c: c.status())

    async def get(self, key: bytes) -> KeyValue | None:
        got = await self._call("get", lambda c: c.get(key))
        return None if got is None else _kv(got)

    async def get_prefix(self, prefix: bytes) -> list[KeyValue]:
        got = await self._call("get_prefix", lambda c: c.get_prefix(prefix))
        return [_kv(kv) for kv in got]

    async def get_prefix_at(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` and the revision they were read at.

        Why the revision: a watch started at ``revision + 1`` sees exactly the changes after
        this listing, none missed and none twice.
        """
        got = await self._call("get_prefix", lambda c: c.get_prefix(prefix))
        return [_kv(kv) for kv in got], int(got.header.revision)

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        await self._call("put", lambda c: c.put(key, value, lease=lease or None))

    async def delete(self, key: bytes) -> bool:
        got = await self._call("delete", lambda c: c.delete(key))
        return got is not None

    async def delete_prefix(self, prefix: bytes) -> None:
        await self._call("delete_prefix", lambda c: c.delete_prefix(prefix))

    async def create_if_absent(
        self, key: bytes, value: bytes, lease: int = 0
    ) -> tuple[bool, KeyValue | None]:
        """Compare-and-swap: put ``key`` only if it does not exist.

        Returns:
            (created, the key as it stands now: ours when created, the holder's otherwise;
            None when it vanished in between).
        """

        async def txn(c: Any) -> tuple[bool, Any]:
            tx = c.transactions
            ok, _ = await c.transaction(
                compare=[tx.create(key) == 0],
                success=[tx.put(key, value, lease=lease or None)],
                failure=[],
            )
            return ok, await c.get(key)

        ok, got = await self._call("create_if_absent", txn)
        return ok, None if got is None else _kv(got)

    async def delete_if_created_at(self, key: bytes, create_revision: int) -> bool:
        """Delete ``key`` only if it is still the incarnation created at ``create_revision``."""

        async def txn(c: Any) -> bool:
            tx = c.transactions
            ok, _ = await c.transaction(
                compare=[tx.create(key) == create_revision], success=[tx.delete(key)], failure=[]
            )
            return ok

        return await self._call("delete_if_created_at", txn)

    # ------------------------------------------------------------------ leases
    async def grant_lease(self, ttl: int) -> Lease:
        """A new lease of ``ttl`` seconds (etcd may raise it to its minimum TTL)."""
        if ttl <= 0:
            raise InvalidRequestError("lease TTL must be > 0")
        got = await self._call("grant_lease", lambda c: c.lease(ttl))
        return Lease(got.id, got.ttl)

    async def keep_alive(self, lease_id: int) -> int:
        """Refresh a lease once. Returns its TTL from now, 0 when the lease is gone."""
        reply = await self._call("keep_alive", lambda c: c.refresh_lease(lease_id))
        return 0 if reply is None else int(reply.TTL)

    async def revoke_lease(self, lease_id: int) -> None:
        """Best effort: a lease that is already gone, or an etcd that is down, is not an error."""
        with contextlib.suppress(EtcdUnavailableError):
            await self._call("revoke_lease", lambda c: c.revoke_lease(lease_id))

    # ------------------------------------------------------------------ watches
    async def watch(
        self, key: bytes, *, prefix: bool = False, start_revision: int | None = None
    ) -> EtcdWatch:
        """Start watching ``key`` (or every key under it when ``prefix``)."""
        end = prefix_end(key) if prefix else None
        raw = await self._call(
            "watch", lambda c: c.watch(key, range_end=end, start_revision=start_revision)
        )
        return EtcdWatch(raw)


class EtcdThread:
    """An :class:`EtcdStore` on a private event loop in a daemon thread, for threaded callers.

    Args:
        endpoints: etcd client addresses.
        op_timeout: seconds each call may take.
    """

    def __init__(
        self, endpoints: Sequence[Address], *, op_timeout: float = DEFAULT_OP_TIMEOUT_S
    ) -> None:
        self.store = EtcdStore(endpoints, op_timeout=op_timeout)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="etcd-client", daemon=True
        )
        self._thread.start()

    def run(self, make: Callable[[EtcdStore], Awaitable[T]]) -> T:
        """Run ``make(store)`` on the etcd loop and wait for it (bounded by the store's timeout).

        Raises:
            EtcdUnavailableError: etcd failed or did not answer in time.
        """
        fut = asyncio.run_coroutine_threadsafe(make(self.store), self._loop)  # type: ignore[arg-type]
        try:
            return fut.result(self.store.op_timeout * 2 + 1)
        except TimeoutError:
            fut.cancel()
            raise EtcdUnavailableError("etcd did not answer in time") from None
        except concurrent.futures.CancelledError:
            # The call was cancelled on the etcd loop (a closing channel): never let that reach
            # a caller's thread as anything but "etcd failed" (it ended the node's master link).
            raise EtcdUnavailableError("etcd call cancelled") from None

    def close(self) -> None:
        if not self._loop.is_running():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.store.close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

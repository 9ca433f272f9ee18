"""Inference engines announce themselves in etcd, so a router finds them without a static list.

Keys, under one prefix (default ``/kvstore/engines``, kept apart from a cluster's
``/kvstore/<cluster>`` keys because a router may front engines of several pools)::

    <prefix>/<role>/<instance>   {"url": "http://h:p", "role": "prefill", "model": "smollm2",
                                  "block_size": 32, "kv_events": "tcp://h:p"}   under a lease

``role`` is ``prefill``, ``decode`` or ``both`` (vLLM's kv_producer, kv_consumer, kv_both);
``instance`` is the registration's own name (default: its lease id in hex, unique per
registration, as Dynamo names its instances). ``model``, ``block_size`` and ``kv_events`` (the
engine's vLLM KV-event publisher) may be null.

Why a lease and not a delete on exit: an engine that is SIGKILLed, OOM-killed or cut off deletes
nothing; its key must still go. The announcer keeps the lease alive every ``ttl / 3`` seconds;
when the engine dies the key goes within one TTL (etcd expires the lease), and a clean stop
revokes the lease so the key goes at once. When etcd is unreachable the announcer logs one line
and keeps trying; the engine itself keeps serving (a registry is a convenience for routers, not
a dependency of inference). A lease that expired meanwhile is replaced by a new one and the key
written again.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import re
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

from kvstore.address import Address
from kvstore.errors import EtcdUnavailableError, InvalidRequestError
from kvstore.etcd import EtcdStore, KeyValue
from kvstore.topology import Site

log = logging.getLogger(__name__)

DEFAULT_ENGINES_PREFIX = "/kvstore/engines"
#: Seconds an engine's key outlives the engine. Short enough that a router stops listing a
#: dead engine within seconds (its own health poll already stops sending to it sooner), long
#: enough that one missed keep-alive (every ttl / 3) or a short etcd hiccup drops nothing.
DEFAULT_ENGINE_TTL_S = 5
ENGINE_ROLES = ("prefill", "decode", "both")
#: vLLM's ``kv_role`` -> the registry's role.
KV_ROLE_TO_ROLE = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
#: Longest value we accept (a record is ~150 bytes; anything far larger is not ours).
MAX_VALUE_BYTES = 4096
#: Seconds between two registration attempts while etcd is unreachable (then doubling).
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 5.0
#: Seconds a clean stop waits for the lease's revocation before giving up on etcd.
STOP_TIMEOUT_S = 3.0


#: A host name or IPv4 address as ``urlsplit`` lowercases it (underscores too: container
#: runtimes name services with them; a trailing dot: an absolute name).
_HOST_NAME = re.compile(r"[a-z0-9](?:[a-z0-9._-]*[a-z0-9])?\.?")


def check_engine_url(url: object) -> str:
    """Validate an engine's base URL: ``http(s)://HOST[:PORT][/PATH]`` in printable ASCII, a
    host name or an IP address, no user info, query or fragment (routers log it and append
    API paths to it).

    Raises:
        InvalidRequestError: anything else (the message shows the URL escaped, with repr).
    """
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise InvalidRequestError(f"engine url must be http(s)://HOST:PORT, got {url!r}")
    if len(url) > 512 or not url.isascii() or not url.isprintable() or " " in url:
        raise InvalidRequestError(f"engine url {url!r} holds whitespace or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # an unclosed IPv6 bracket, a port that is no number in 0..65535
        raise InvalidRequestError(f"engine url {url!r} names no reachable host and port") from None
    if "@" in parts.netloc or "?" in url or "#" in url:
        raise InvalidRequestError(f"engine url {url!r} has user info, a query or a fragment")
    host = parts.hostname or ""
    if parts.netloc.startswith("["):
        try:
            ipaddress.IPv6Address(host)
            named = True
        except ValueError:
            named = False
    else:
        named = _HOST_NAME.fullmatch(host) is not None
    if port == 0 or not named:
        raise InvalidRequestError(f"engine url {url!r} names no reachable host and port")
    return url


def check_prefix(prefix: str) -> str:
    """Validate a registry prefix (``/...``, no trailing slash).

    Raises:
        InvalidRequestError: anything else.
    """
    if (
        not isinstance(prefix, str)
        or not prefix.startswith("/")
        or prefix.endswith("/")
        or len(prefix) > 200
    ):
        raise InvalidRequestError(
            f"engine registry prefix must start with '/' and not end with one, got {prefix!r}"
        )
    return prefix


def engine_key(prefix: str, role: str, instance: str) -> bytes:
    """The key an engine's record lives under.

    Raises:
        InvalidRequestError: a bad prefix, role or instance name.
    """
    if role not in ENGINE_ROLES:
        raise InvalidRequestError(f"engine role must be one of {ENGINE_ROLES}, got {role!r}")
    if not instance or "/" in instance or len(instance) > 128 or not instance.isprintable():
        raise InvalidRequestError(f"bad engine instance name {instance!r}")
    return f"{check_prefix(prefix)}/{role}/{instance}".encode()


@dataclass(frozen=True, slots=True)
class EngineRecord:
    """What an engine says about itself in etcd.

    Attributes:
        url: its OpenAI-compatible base URL, as a router reaches it (``http(s)://HOST:PORT``).
        role: ``prefill``, ``decode`` or ``both``.
        model: its served model name, or None.
        block_size: its KV block size in tokens, or None.
        kv_events: its vLLM KV-event publisher (``tcp://HOST:PORT``), or None.
        site: where it runs, ``(host_id, rack, zone)`` (``kvstore.topology``), or None: the
            router counts the distance of a P/D handoff by it.

    Raises:
        InvalidRequestError: a value a router could not use (checked on creation).
    """

    url: str
    role: str
    model: str | None = None
    block_size: int | None = None
    kv_events: str | None = None
    site: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        check_engine_url(self.url)
        if self.site is not None:
            Site.from_wire(self.site)  # (its checks: three names, typed errors)
        if urlsplit(self.url).hostname in ("0.0.0.0", "::"):
            raise InvalidRequestError(
                f"engine url {self.url!r} is a bind-all address: advertise one a router can reach"
            )
        if self.role not in ENGINE_ROLES:
            raise InvalidRequestError(
                f"engine role must be one of {ENGINE_ROLES}, got {self.role!r}"
            )
        if self.model is not None and not (isinstance(self.model, str) and self.model):
            raise InvalidRequestError("engine model must be a non-empty string or null")
        if self.block_size is not None and (
            not isinstance(self.block_size, int)
            or isinstance(self.block_size, bool)
            or self.block_size <= 0
        ):
            raise InvalidRequestError(
                f"engine block_size must be a positive integer, got {self.block_size!r}"
            )
        if self.kv_events is not None and not (
            isinstance(self.kv_events, str)
            and self.kv_events.startswith(("tcp://", "ipc://"))
            and self.kv_events.isascii()
            and self.kv_events.isprintable()
            and " " not in self.kv_events
        ):
            raise InvalidRequestError(
                f"engine kv_events must be tcp://HOST:PORT, got {self.kv_events!r}"
            )

    @property
    def where(self) -> Site | None:
        """Its site, or None where it declared none."""
        return Site.from_wire(self.site) if self.site is not None else None

    def encode(self) -> bytes:
        """The JSON value stored in etcd (no ``site`` where none was declared: a router that
        predates sites reads the record as before)."""
        fields = asdict(self)
        if fields["site"] is None:
            del fields["site"]
        return json.dumps(fields, separators=(",", ":")).encode()

    @staticmethod
    def decode(value: bytes) -> EngineRecord:
        """Parse a stored value.

        Raises:
            InvalidRequestError: not JSON, not an object, missing or unknown fields, bad values.
        """
        if len(value) > MAX_VALUE_BYTES:
            raise InvalidRequestError(f"engine record of {len(value)} bytes: too large")
        try:
            obj = json.loads(value)
        except ValueError:
            raise InvalidRequestError(f"engine record is not JSON: {value[:80]!r}") from None
        if not isinstance(obj, dict):
            raise InvalidRequestError("engine record must be a JSON object")
        unknown = set(obj) - set(EngineRecord.__dataclass_fields__)
        if unknown:
            raise InvalidRequestError(f"engine record has unknown fields {sorted(unknown)}")
        if isinstance(obj.get("site"), list):
            obj["site"] = tuple(obj["site"])
        try:
            return EngineRecord(**obj)
        except TypeError:
            raise InvalidRequestError("engine record lacks url or role") from None


@dataclass(frozen=True, slots=True)
class RegisteredEngine:
    """One live key of the registry.

    Attributes:
        key: the etcd key (its name in the registry).
        record: what it says.
        lease: the etcd lease it lives under.
    """

    key: str
    record: EngineRecord
    lease: int

    @staticmethod
    def from_kv(prefix: str, kv: KeyValue) -> RegisteredEngine:
        """Decode one key under ``prefix``.

        Raises:
            InvalidRequestError: a key that is not ``<prefix>/<role>/<instance>``, a key without
                a lease (it would never go away), a role in the key that the value contradicts,
                or a bad value.
        """
        key = kv.key.decode("utf-8", "replace")
        rest = key[len(prefix) + 1 :] if key.startswith(prefix + "/") else ""
        role, _, instance = rest.partition("/")
        if (
            role not in ENGINE_ROLES
            or not instance
            or "/" in instance
            or not instance.isprintable()
        ):
            raise InvalidRequestError(f"{key[:160]!r} is not <prefix>/<role>/<instance>")
        if kv.lease == 0:
            raise InvalidRequestError(f"{key[:160]!r} has no lease: not an engine registration")
        record = EngineRecord.decode(kv.value)
        if record.role != role:
            raise InvalidRequestError(f"{key[:160]!r} says role {record.role!r}")
        return RegisteredEngine(key, record, kv.lease)


async def list_engines(
    store: EtcdStore, prefix: str = DEFAULT_ENGINES_PREFIX
) -> tuple[dict[str, RegisteredEngine], int]:
    """Every valid registration under ``prefix`` and the revision of the listing; invalid keys
    are logged and skipped (someone else's, never trusted).

    Raises:
        EtcdUnavailableError: etcd did not answer.
    """
    kvs, revision = await store.get_prefix_at(check_prefix(prefix).encode() + b"/")
    out: dict[str, RegisteredEngine] = {}
    for kv in kvs:
        try:
            reg = RegisteredEngine.from_kv(prefix, kv)
        except InvalidRequestError as err:
            log.warning("engine registry: ignoring %s", err.message)
            continue
        out[reg.key] = reg
    return out, revision


class EngineAnnouncer:
    """Holds one engine's registration in etcd from a daemon thread until :meth:`stop`.

    A thread of its own (with its own event loop) because its callers are threaded or
    synchronous: vLLM's scheduler process and the ``kvstore engine register`` sidecar. Every
    etcd call is bounded by the store's ``op_timeout``; the engine never waits on etcd.

    Args:
        endpoints: etcd addresses.
        record: what to announce.
        prefix: the registry prefix.
        instance: the registration's name (None: its lease id in hex).
        ttl_s: the lease's TTL in seconds.
    """

    def __init__(
        self,
        endpoints: Sequence[Address],
        record: EngineRecord,
        *,
        prefix: str = DEFAULT_ENGINES_PREFIX,
        instance: str | None = None,
        ttl_s: int = DEFAULT_ENGINE_TTL_S,
    ) -> None:
        if not endpoints:
            raise InvalidRequestError("at least one etcd endpoint is needed")
        if not isinstance(ttl_s, int) or isinstance(ttl_s, bool) or ttl_s < 1:
            raise InvalidRequestError(f"engine lease TTL must be >= 1 second, got {ttl_s!r}")
        if instance is not None:
            engine_key(prefix, record.role, instance)  # validates
        self.endpoints = list(endpoints)
        self.record = record
        self.prefix = check_prefix(prefix)
        self.instance = instance
        self.ttl_s = ttl_s
        #: Set while the key is known to be in etcd (cleared when a keep-alive fails).
        self.registered = threading.Event()
        #: The key of the current (or last) registration; None before the first.
        self.key: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(
            target=self._thread_main, name="engine-announcer", daemon=True
        )

    def start(self) -> EngineAnnouncer:
        """Start announcing in the background; returns at once (etcd may still be down)."""
        self._thread.start()
        self._started.wait(5)
        return self

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Revoke the lease (the key goes at once) and end the thread, bounded by ``timeout``."""
        if self._loop is None or not self._thread.is_alive():
            return
        with contextlib.suppress(RuntimeError):  # the loop already closed
            self._loop.call_soon_threadsafe(self._request_stop)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("engine registry: etcd did not answer the revocation; the key expires")

    def _request_stop(self) -> None:
        assert self._stopping is not None
        self._stopping.set()

    def _thread_main(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self._started.set()
        # A keep-alive must fail fast enough to be retried twice within one TTL.
        store = EtcdStore(self.endpoints, op_timeout=max(0.5, min(2.0, self.ttl_s / 3)))
        lease_id = 0
        retry_s = RETRY_FIRST_S
        unreachable = False
        try:
            while not self._stopping.is_set():
                try:
                    if lease_id == 0:
                        lease_id = await self._register(store)
                        if unreachable:
                            log.info(
                                "engine registry: etcd reachable again; %s registered", self.key
                            )
                        unreachable, retry_s = False, RETRY_FIRST_S
                    elif await store.keep_alive(lease_id) == 0:
                        log.warning(
                            "engine registry: lease of %s expired; registering again", self.key
                        )
                        self.registered.clear()
                        lease_id = 0
                        continue
                    wait_s = self.ttl_s / 3
                except EtcdUnavailableError as err:
                    self.registered.clear()
                    if not unreachable:  # one line per outage, not one per retry
                        log.warning(
                            "engine registry: etcd unreachable (%s); the engine keeps serving, "
                            "registration retried in the background",
                            err.message,
                        )
                    unreachable = True
                    wait_s, retry_s = retry_s, min(retry_s * 2, RETRY_MAX_S)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), wait_s)
        finally:
            self.registered.clear()
            if lease_id:
                await store.revoke_lease(lease_id)  # best effort, bounded by op_timeout
            await store.close()

    async def _register(self, store: EtcdStore) -> int:
        lease = await store.grant_lease(self.ttl_s)
        try:
            instance = self.instance or f"{lease.lease_id:x}"
            key = engine_key(self.prefix, self.record.role, instance)
            await store.put(key, self.record.encode(), lease=lease.lease_id)
        except BaseException:
            await store.revoke_lease(lease.lease_id)
            raise
        self.key = key.decode()
        self.registered.set()
        log.info("engine registry: %s -> %s (lease TTL %ds)", self.key, self.record.url, lease.ttl)
        return lease.lease_id

"""Run a master: the control server, the admin API and the housekeeping loop on one event loop.

What a master runs with is one frozen, validated :class:`MasterDaemonConfig` (like the node's
``NodeDaemonConfig``): the ``kvstore master`` flags, the environment's defaults and, with etcd, its
:class:`~kvstore.master.ha.HAConfig`. One :func:`serve_master` runs a plain master and a member
of an HA group alike: the HA part only adds a leadership fence and an elector around the same
:class:`Master`. This module sits above ``ha.py`` (it imports it, never the reverse). A process
that runs a master sets the collector's policy once it has started (:func:`apply_collector_policy`,
``kvstore/gc_policy.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
from dataclasses import dataclass, field

from aiohttp import web

from kvstore.auth import Token
from kvstore.errors import InvalidRequestError
from kvstore.etcd import EtcdStore
from kvstore.gc_policy import tune_collector
from kvstore.master.admin import AdminConfig, AdminRunner, init_app
from kvstore.master.ha import Elector, HAConfig, Leadership
from kvstore.master.metrics import MasterMetrics
from kvstore.master.prefix_restore import fetch_objects
from kvstore.master.rest.fence import AdminFence
from kvstore.master.server import CHUNK_ITEMS, ControlServer
from kvstore.master.service import MasterConfig, MasterService, ServiceSlot
from kvstore.master.tenant_book import EtcdTenantStore, FileTenantStore, TenantBook
from kvstore.master.tiering import TierConfig
from kvstore.processes import ready_line
from kvstore.serving import WireDeadlines
from kvstore.types import ObjectInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MasterDaemonConfig:
    """How a master runs: the ``kvstore master`` flags. Validated on creation.

    Attributes:
        host: the address to bind (and to publish, unless ``ha.advertise_host`` says otherwise).
        port: the control port (0: any free one).
        admin_port: the admin REST port (0: any free one).
        config: the control plane's timeouts and limits.
        tiers: the tier policy (watermarks, eviction, leases, promotion).
        token: the cluster token (None: no authentication).
        public_reads: serve read-only REST endpoints without the token.
        ssl_context: serve the admin REST over HTTPS.
        chunk_items: items of a batch served per turn of the event loop
            (``KVSTORE_CHUNK_ITEMS``; see ``server.py``).
        deadlines: how long the control server waits for a frame and for a hello
            (``--frame-timeout``, ``--hello-timeout``).
        ha: join an HA group of masters through etcd (None: a plain, embedded master).
        tenants_file: where a plain master keeps its tenants across restarts (None: in memory;
            with ``ha`` they are kept in etcd).
    """

    host: str = "127.0.0.1"
    port: int = 0
    admin_port: int = 0
    config: MasterConfig = field(default_factory=MasterConfig)
    tiers: TierConfig = field(default_factory=TierConfig)
    token: Token | None = None
    public_reads: bool = True
    ssl_context: ssl.SSLContext | None = None
    chunk_items: int = CHUNK_ITEMS
    deadlines: WireDeadlines = field(default_factory=WireDeadlines)
    ha: HAConfig | None = None
    tenants_file: str | None = None

    def __post_init__(self) -> None:
        if not self.host:
            raise InvalidRequestError("--host must not be empty")
        for name in ("port", "admin_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise InvalidRequestError(f"--{name.replace('_', '-')} must be 0..65535")
        if self.chunk_items < 1:
            raise InvalidRequestError("chunk_items must be >= 1")
        if self.tenants_file is not None:
            if self.ha is not None:
                raise InvalidRequestError("--tenants-file: with --etcd the tenants are in etcd")
            if self.token is None:
                raise InvalidRequestError("tenants need a cluster token (--token-file)")


#: How often a master samples its event loop's lag (``Master._watch_loop_lag``).
LOOP_LAG_INTERVAL_S = 0.01


@dataclass(frozen=True, slots=True)
class MasterEndpoints:
    control: str
    admin: str


class Master:
    """A running master. ``start()`` binds, ``stop()`` releases everything it started."""

    def __init__(self, options: MasterDaemonConfig | None = None) -> None:
        options = options or MasterDaemonConfig()
        self.options = options
        #: The current term's service (an HA master swaps in a fresh one each term).
        self.slot = ServiceSlot(MasterService(options.config, tiers=options.tiers))
        #: The tenants (master/tenant_book.py): kept across terms, as their directory is.
        self.tenants = TenantBook(
            has_cluster_token=options.token is not None,
            store=FileTenantStore(options.tenants_file) if options.tenants_file else None,
            on_change=self._tenant_changed,
        )
        self.slot.service.tenants = self.tenants.directory
        self.metrics = MasterMetrics(self.slot)
        self.control = ControlServer(
            self.slot,
            options.host,
            options.port,
            observer=self.metrics,
            token=options.token,
            chunk_items=options.chunk_items,
            deadlines=options.deadlines,
            tenants=self.tenants.directory,
        )
        self.admin_settings = AdminConfig(token=options.token, public_reads=options.public_reads)
        self.ssl_context = options.ssl_context
        #: With HA: the leadership fence the admin API obeys too (set before ``start``).
        self.admin_fence: AdminFence | None = None
        self.host = options.host
        self.admin_port = options.admin_port
        self._runner: web.AppRunner | None = None
        self._housekeeping: asyncio.Task[None] | None = None
        self._lag_watch: asyncio.Task[None] | None = None
        self._restoring: asyncio.Task[None] | None = None

    def _tenant_changed(self, name: str, quotas: dict[str, int] | None) -> None:
        """Pass a tenant's quotas to the current term (None: it was deleted)."""
        book = getattr(self.slot.service, "quotas", None)
        if book is None:
            return
        if quotas is None:
            book.drop_tenant(name)
        else:
            book.set_tenant(name, quotas)

    async def start(self) -> MasterEndpoints:
        await self.tenants.load()  # (a plain master's file; with HA, etcd's at each term)
        await self.control.start()
        app = init_app(
            self.slot, self.metrics, self.admin_settings, self.admin_fence, tenants=self.tenants
        )
        self._runner = AdminRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.admin_port, ssl_context=self.ssl_context)
        await site.start()
        self.admin_port = self._runner.addresses[0][1]
        self._housekeeping = asyncio.create_task(self._housekeep())
        self._lag_watch = asyncio.create_task(self._watch_loop_lag())
        scheme = "https" if self.ssl_context is not None else "http"
        return MasterEndpoints(
            f"{self.host}:{self.control.port}", f"{scheme}://{self.host}:{self.admin_port}"
        )

    @property
    def service(self) -> MasterService:
        """The service of the current term."""
        return self.slot.service

    async def _housekeep(self) -> None:
        period = min(0.25, self.service.config.heartbeat_interval_s / 2)
        while True:
            await asyncio.sleep(period)
            if self.admin_fence is not None and self.admin_fence.admin_check() is not None:
                continue  # a master that may not lead changes nothing, not even by the clock
            try:
                self.service.expire_nodes()
                self.service.reclaim_expired_puts()
                self.service.tick()
                # What a big read batch left hot: a cooling step a turn, others served between.
                for _ in range(self.service.num_cool_steps_due()):
                    await asyncio.sleep(0)
                    self.service.cool_step()
                if self.service.prompt_metas_dirty and self._restoring is None:
                    self._restoring = asyncio.create_task(self._restore_prefix_index())
            except Exception:  # a bug here must not stop the master from serving
                log.exception("housekeeping failed")

    async def _watch_loop_lag(self) -> None:
        """Sample the loop's lag every :data:`LOOP_LAG_INTERVAL_S`: how late a timer ran is
        how long the turns before it held the loop (``kvstore_loop_lag_seconds``)."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + LOOP_LAG_INTERVAL_S
            await asyncio.sleep(LOOP_LAG_INTERVAL_S)
            self.metrics.observe_loop_lag(max(0.0, loop.time() - due))

    async def _restore_prefix_index(self) -> None:
        """After manifests were admitted: fetch prompt metas off the loop, then index them."""
        svc = self.service
        svc.prompt_metas_dirty = False  # admissions from now on trigger another round
        try:
            keys = sorted(svc.prompt_metas.to_fetch)
            infos = [
                (k, i)
                for k, i in zip(keys, svc.get_locations(keys), strict=True)
                if isinstance(i, ObjectInfo)
            ]
            svc.prompt_metas.to_fetch.difference_update(keys)
            try:
                fetched = await asyncio.to_thread(fetch_objects, infos, self.control.token)
            finally:  # the reads are done: their leases go back at once
                svc.release_leases([i.lease for _, i in infos if i.lease])
            svc.prompt_metas.add_fetched(fetched)
            done = svc.restore_prefix_index()
            if done:
                log.info("prefix index: %d prompt(s) restored from the nodes' manifests", done)
        except Exception:
            log.exception("prefix index restore failed")
        finally:
            self._restoring = None

    async def stop(self) -> None:
        for task in (self._housekeeping, self._lag_watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.control.stop()
        if self._runner is not None:
            await self._runner.cleanup()


def apply_collector_policy() -> None:
    """Set the collector's policy for a process that runs a master, once it has started
    (``kvstore/gc_policy.py`` says why; ``kvstore master`` and ``kvstore up`` both call it)."""
    log.debug("froze %d start-up objects", tune_collector())


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


async def serve_master(options: MasterDaemonConfig) -> None:
    """Run a master until SIGINT/SIGTERM. Prints one ready line (:func:`ready_line`) with both
    endpoints.

    With ``options.ha``, the master is one of an HA group: standby until elected, it prints
    ``kvstore master leading: epoch=N`` each time it wins and ``kvstore master standby: ...``
    each time it steps down, and refuses what only a leader may do in between.

    Raises:
        EtcdUnavailableError: with HA, etcd did not answer at start (after bounded retries).
    """
    ha = options.ha
    store = (
        None if ha is None else await EtcdStore.connect(ha.endpoints, attempts=ha.connect_attempts)
    )
    master = Master(options)
    fence: Leadership | None = None
    if store is not None and ha is not None:
        fence = Leadership(master.slot)
        master.control.fence = fence
        master.admin_fence = fence
        # Its own client: a failed call cancels every other call on a client's channel.
        master.tenants.store = EtcdTenantStore(
            EtcdStore(ha.endpoints, op_timeout=store.op_timeout), ha.prefix
        )
    endpoints = await master.start()
    apply_collector_policy()
    elector: Elector | None = None
    role: dict[str, str] = {}
    if ha is not None and store is not None and fence is not None:
        advertise = ha.advertise_host or options.host
        control = f"{advertise}:{master.control.port}"
        admin = f"http://{advertise}:{master.admin_port}"
        elector = Elector(store, ha, fence, control, admin, on_lead=master.tenants.load)
        role = {"state": "standby", "etcd": ",".join(str(e) for e in ha.endpoints)}
    stop = asyncio.Event()
    install_stop_signals(stop)
    print(
        ready_line("master", control=endpoints.control, admin=endpoints.admin, **role), flush=True
    )
    campaign = asyncio.create_task(elector.run()) if elector is not None else None
    try:
        await stop.wait()
    finally:
        if campaign is not None:
            campaign.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await campaign
        await master.stop()
        if isinstance(master.tenants.store, EtcdTenantStore):
            await master.tenants.store.close()
        if elector is not None and store is not None:
            await elector.close()
            await store.close()
        print("kvstore master stopped", flush=True)

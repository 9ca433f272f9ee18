"""Run a master: the control server, the admin API and the housekeeping loop on one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass

from aiohttp import web
from kvstore.master.admin import init_app
from kvstore.master.server import ControlServer
from kvstore.master.service import MasterConfig, MasterService
from kvstore.master.tiering import TierConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MasterEndpoints:
    control: str
    admin: str


class Master:
    """A running master. ``start()`` binds, ``stop()`` releases everything it started."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        admin_port: int = 0,
        config: MasterConfig | None = None,
        tiers: TierConfig | None = None,
    ) -> None:
        self.service = MasterService(config, tiers=tiers)
        self.control = ControlServer(self.service, host, port)
        self.host = host
        self.admin_port = admin_port
        self._runner: web.AppRunner | None = None
        self._housekeeping: asyncio.Task[None] | None = None

    async def start(self) -> MasterEndpoints:
        await self.control.start()
        self._runner = web.AppRunner(init_app(self.service), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.admin_port)
        await site.start()
        self.admin_port = self._runner.addresses[0][1]
        self._housekeeping = asyncio.create_task(self._housekeep())
        return MasterEndpoints(
            f"{self.host}:{self.control.port}", f"http://{self.host}:{self.admin_port}"
        )

    async def _housekeep(self) -> None:
        period = min(0.25, self.service.config.heartbeat_interval_s / 2)
        while True:
            await asyncio.sleep(period)
            try:
                self.service.expire_nodes()
                self.service.reclaim_expired_puts()
                self.service.tick()
            except Exception:  # a bug here must not stop the master from serving
                log.exception("housekeeping failed")

    async def stop(self) -> None:
        if self._housekeeping is not None:
            self._housekeeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._housekeeping
        await self.control.stop()
        if self._runner is not None:
            await self._runner.cleanup()


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


async def serve_master(
    host: str, port: int, admin_port: int, config: MasterConfig, tiers: TierConfig | None = None
) -> None:
    """Run a master until SIGINT/SIGTERM. Prints one ``ready`` line with both endpoints."""
    master = Master(host, port, admin_port, config, tiers)
    endpoints = await master.start()
    stop = asyncio.Event()
    install_stop_signals(stop)
    print(f"kvstore master ready: control={endpoints.control} admin={endpoints.admin}", flush=True)
    try:
        await stop.wait()
    finally:
        await master.stop()
        print("kvstore master stopped", flush=True)

"""A ring of recent samples of the cluster's counters, for the status page's charts.

Sampled on the master's loop by a background task (``cleanup_ctx``); the page turns successive
samples into rates, so it shows the last minutes the moment it loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

log = logging.getLogger(__name__)


class History:
    """The last ``window_s`` seconds of samples, one every ``interval_s``.

    Args:
        sample: returns one sample (a dict of numbers, perhaps nested); called on the loop.
        interval_s: seconds between samples.
        window_s: how much history to keep.
        wall: wall-clock seconds, stamped on each sample.
    """

    def __init__(
        self,
        sample: Callable[[], dict[str, Any]],
        interval_s: float,
        window_s: float,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.sample = sample
        self.interval_s = interval_s
        self.samples: deque[dict[str, Any]] = deque(maxlen=max(2, int(window_s / interval_s)))
        self.wall = wall

    def take(self) -> None:
        """Append one sample now."""
        self.samples.append({"t": round(self.wall(), 3), **self.sample()})

    def to_json(self) -> dict[str, Any]:
        return {"interval_s": self.interval_s, "samples": list(self.samples)}

    async def run(self) -> None:
        while True:
            try:
                self.take()
            except Exception:  # a bug here must not stop the admin API
                log.exception("history sample failed")
            await asyncio.sleep(self.interval_s)


def history_ctx(key: Any) -> Callable[[Any], AsyncIterator[None]]:
    """A ``cleanup_ctx`` entry that runs the app's :class:`History` while the app lives."""

    async def ctx(app: Any) -> AsyncIterator[None]:
        task = asyncio.create_task(app[key].run())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return ctx

"""Each engine's live state: vLLM's ``/metrics`` gauges polled in the background, what the
router itself has sent there, and the fits of its timings.

Metric names are those the vLLM 0.32 OpenAI server exports: ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (a fraction, 0..1), the info gauge
``vllm:cache_config_info`` (labels ``block_size``, ``num_gpu_blocks``, ``cache_dtype``) and the
``vllm:inter_token_latency_seconds`` histogram (its ``_sum`` and ``_count``); and the kvstore
connector's counters ``vllm:kvstore_loaded_bytes_total`` and ``vllm:kvstore_load_seconds_total``
(absent on an engine without it).

An answer the router cannot read (a gauge that is not a finite, non-negative number, a model
list that is not one) is :class:`EngineAnswerError`: the engine that sent it is unhealthy until
it answers well, and no other engine is affected.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore.routing.policy import EngineView, watermark_state
from kvstore.topology import Site

from .admission import EngineSlots
from .live_fit import EngineFit

ROLES = ("prefill", "decode", "both")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition -> name -> [(labels, value)].

    Args:
        text: a ``/metrics`` body.

    Returns:
        Samples by name (comments and malformed lines skipped).
    """
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.setdefault(m.group(1), []).append((labels, value))
    return out


class EngineAnswerError(ValueError):
    """An engine answered its poll with something the router cannot use."""


def _total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    """The sum of a gauge's samples (0 when absent).

    Raises:
        EngineAnswerError: a sum that is not a finite, non-negative number (NaN and infinities
            parse as floats, and would poison every prediction made from them).
    """
    values = samples.get(name)
    total = 0.0 if not values else sum(v for _, v in values)
    if not math.isfinite(total) or total < 0:
        raise EngineAnswerError(f"{name} is {total!r}")
    return total


def _positive_int(labels: dict[str, str], name: str, ignored: list[str]) -> int | None:
    """A label's positive decimal integer, or None: absent, or not one (then said in
    ``ignored``: a block size of 0 would divide by zero, and a routable engine does not need
    it, so it reads as unknown)."""
    value = labels.get(name)
    if value is None:
        return None
    if value.isascii() and value.isdigit() and int(value) > 0:
        return int(value)
    ignored.append(f"vllm:cache_config_info {name}={value[:40]!r} is not a positive integer")
    return None


@dataclass(slots=True)
class EngineLoad:
    """What one poll of ``/metrics`` said.

    Attributes:
        num_running: requests in the running batch.
        num_waiting: requests queued in the engine.
        kv_usage: KV cache use, 0..1.
        block_size: vLLM's block size (None: not exported, or not a positive integer).
        num_blocks: KV blocks (None: not exported, or not a positive integer).
        cache_dtype: ``--kv-cache-dtype`` (None: not exported).
        itl_sum_s: the inter-token latency histogram's sum.
        itl_count: its count.
        loaded_bytes: bytes the kvstore connector loaded from the pool (a counter).
        load_seconds: seconds it spent loading them (a counter).
        ignored: values of the answer read as unknown, and why.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_blocks: int | None = None
    cache_dtype: str | None = None
    itl_sum_s: float = 0.0
    itl_count: float = 0.0
    loaded_bytes: float = 0.0
    load_seconds: float = 0.0
    ignored: tuple[str, ...] = ()

    @staticmethod
    def from_metrics(text: str) -> EngineLoad:
        """Read a vLLM ``/metrics`` body.

        Args:
            text: the body.

        Returns:
            The load (gauges that are absent read as zero; a block size or block count that
            is not a positive integer as unknown).

        Raises:
            EngineAnswerError: a gauge that is not a finite, non-negative number.
        """
        samples = parse_metrics(text)
        load = EngineLoad(
            num_running=int(_total(samples, "vllm:num_requests_running")),
            num_waiting=int(_total(samples, "vllm:num_requests_waiting")),
            kv_usage=_total(samples, "vllm:kv_cache_usage_perc"),
            itl_sum_s=_total(samples, "vllm:inter_token_latency_seconds_sum"),
            itl_count=_total(samples, "vllm:inter_token_latency_seconds_count"),
            loaded_bytes=_total(samples, "vllm:kvstore_loaded_bytes_total"),
            load_seconds=_total(samples, "vllm:kvstore_load_seconds_total"),
        )
        info = samples.get("vllm:cache_config_info")
        if info:
            labels = info[0][0]
            ignored: list[str] = []
            load.block_size = _positive_int(labels, "block_size", ignored)
            load.num_blocks = _positive_int(labels, "num_gpu_blocks", ignored)
            load.cache_dtype = labels.get("cache_dtype")
            load.ignored = tuple(ignored)
        return load


@dataclass(slots=True)
class Engine:
    """One vLLM instance behind the router.

    Attributes:
        url: its base URL (its name everywhere).
        role: ``prefill``, ``decode`` or ``both`` (kv_both).
        slots: its admission queue.
        fit: its cost-model fits.
        healthy: its last poll answered and no request has failed on it since.
        load: the last poll's gauges.
        models: its ``/v1/models`` entries.
        above_high: the watermark state (see :func:`.policy.watermark_state`).
        inflight: requests the router has on it now.
        prefill_s: predicted prefill seconds of the router's requests there without a first
            token yet.
        reserved_tokens: KV tokens those requests will hold.
        poll_problems: what is wrong with its polls now, each logged once (empty: nothing).
        site: where it runs, as it registered (``kvstore.topology``; None: not declared).
    """

    url: str
    role: str
    slots: EngineSlots
    fit: EngineFit
    healthy: bool = False
    load: EngineLoad = field(default_factory=EngineLoad)
    models: list[dict[str, Any]] = field(default_factory=list)
    above_high: bool = False
    inflight: int = 0
    prefill_s: float = 0.0
    reserved_tokens: int = 0
    poll_problems: frozenset[str] = frozenset()
    site: Site | None = None

    def observe(
        self, load: EngineLoad, models: list[dict[str, Any]], high: float, low: float
    ) -> None:
        """Take a successful poll: gauges, models, watermark state, one decode-fit sample from
        the inter-token latency seen since the last poll, and the pool loads made since then.

        Args:
            load: the poll's gauges.
            models: the poll's ``/v1/models`` entries.
            high: the high watermark.
            low: the low watermark.
        """
        tokens = load.itl_count - self.load.itl_count
        if self.healthy and tokens >= 1 and load.itl_sum_s >= self.load.itl_sum_s:
            batch = max(1.0, (load.num_running + self.load.num_running) / 2)
            self.fit.decode.add(batch, (load.itl_sum_s - self.load.itl_sum_s) / tokens)
        if self.healthy and load.loaded_bytes >= self.load.loaded_bytes:  # not restarted
            self.fit.transfer.add(
                load.loaded_bytes - self.load.loaded_bytes,
                load.load_seconds - self.load.load_seconds,
            )
        self.load = load
        self.models = models
        self.healthy = True
        self.above_high = watermark_state(self.above_high, load.kv_usage, high, low)

    def view(self, local_cached_tokens: int = 0) -> EngineView:
        """A snapshot for :func:`.policy.choose`.

        Args:
            local_cached_tokens: the request's tokens in this engine's own prefix cache.

        Returns:
            The view.
        """
        load = self.load
        capacity = (load.num_blocks or 0) * (load.block_size or 0)
        return EngineView(
            name=self.url,
            healthy=self.healthy,
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            kv_usage=load.kv_usage,
            kv_capacity_tokens=capacity,
            router_inflight=self.inflight,
            router_prefill_s=self.prefill_s,
            router_reserved_tokens=self.reserved_tokens,
            above_high=self.above_high,
            cost=self.fit.cost(),
            decode_fitted=self.fit.decode.solve() is not None,
            local_cached_tokens=local_cached_tokens,
            slots=self.slots.limit,
            router_queued=len(self.slots.queue),
            site=self.site,
        )


def make_engines(
    urls: list[tuple[str, str]], fit: Callable[[], EngineFit], slots: Callable[[], EngineSlots]
) -> list[Engine]:
    """Build the engines.

    Args:
        urls: (role, URL) pairs.
        fit: makes a fresh fit (with the prior cost model).
        slots: makes a fresh admission queue.

    Returns:
        The engines, in the order given.

    Raises:
        ValueError: an unknown role or a URL given twice.
    """
    seen = set()
    out = []
    for role, url in urls:
        if role not in ROLES:
            raise ValueError(f"unknown engine role {role!r}")
        url = url.rstrip("/")
        if url in seen:
            raise ValueError(f"engine {url} given twice")
        seen.add(url)
        out.append(Engine(url, role, slots(), fit()))
    return out

"""The router's configuration: what it fronts and how it decides, checked on creation."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.client.engine_registry import (
    DEFAULT_ENGINES_PREFIX,
    check_engine_url,
    check_prefix,
)
from kvstore.errors import InvalidRequestError
from kvstore.etcd import parse_endpoints
from kvstore.routing.cost import CostModel
from kvstore.routing.policy import (
    DEFAULT_HIGH_WATERMARK,
    DEFAULT_LOW_WATERMARK,
    DEFAULT_POLICY,
    POLICIES,
)

from .requests import DEFAULT_MAX_CHARS_PER_TOKEN
from .slo_classes import SLOPolicy

#: Largest request body read: room for a million-token context as JSON token ids (or as
#: ASCII-escaped text), and a bound on what one request makes the router hold.
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
#: Prior cost model for a small model on a CPU engine: measurements replace its prefill and
#: decode terms (:mod:`.fit`), and its transfer bandwidth once the engine's connector reports
#: loads; ``kv_bytes_per_token`` is SmolLM2-135M's in bf16 (30 layers x 3 KV heads x 64 x 2 x 2).
CPU_PRIOR = CostModel(
    block_size_tokens=32,
    prefill_base_s=0.05,
    prefill_s_per_token=1e-3,
    prefill_s_per_token_pair=0.0,
    decode_base_s=0.04,
    decode_s_per_seq=0.005,
    decode_s_per_kv_token=0.0,
    kv_bytes_per_token=23_040,
    transfer_bytes_per_s=1e9,
    transfer_latency_s=0.002,
)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """What the router fronts and how it decides.

    Attributes:
        prefill: prefill engine URLs (P/D mode).
        decode: decode engine URLs (P/D mode).
        engines: kv_both engine URLs (no P/D split).
        master: the pool's master (``HOST:PORT`` / ``etcd://``), or None: nothing is cached.
        slo: SLO classes and their mapping.
        prior: the cost model before measurements.
        model_dir: the model folder (tokenizer, config) when the engines' ``root`` is not
            readable here.
        dtype: the engines' ``--dtype`` when it differs from the model config's.
        salt: the connector's namespace salt.
        max_inflight: concurrent requests per engine.
        poll_s: seconds between polls of each engine's ``/metrics``.
        timeout_s: one whole request.
        high_watermark: decode KV use over which an engine takes nothing new.
        low_watermark: KV use under which it takes requests again.
        early_rejection: reject requests whose SLO the prediction says cannot be met.
        engine_priority: the engines run vLLM's ``--scheduling-policy priority``: each request
            is sent with its SLO class's priority (0 first), so that when an engine runs out
            of KV room vLLM preempts the lowest class first (a request's own ``priority``
            stays).
        pool_events: follow the master's KV events for the pool's view (else: one prefix-index
            lookup per request).
        engine_events: (engine URL, ZMQ endpoint) of engines that publish vLLM's own KV events
            (``--kv-events-config``): the router tracks their local prefix caches.
        discover: etcd endpoints (``etcd://HOST:PORT[,HOST:PORT]``) whose engine registry adds
            and removes engines live (:mod:`.discovery`), or None: the static engines only.
        discover_prefix: the registry's prefix in etcd.
        max_body_bytes: the largest request body read (beyond it: 413, unread).
        max_chars_per_token: a prompt with more characters than the model's context length
            times this is refused (400) before it is tokenized.
    """

    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    engines: tuple[str, ...] = ()
    master: str | None = None
    slo: SLOPolicy = field(default_factory=SLOPolicy)
    prior: CostModel = CPU_PRIOR
    model_dir: str | None = None
    dtype: str | None = None
    salt: str | None = None
    max_inflight: int = 4
    poll_s: float = 0.5
    timeout_s: float = 600.0
    high_watermark: float = DEFAULT_HIGH_WATERMARK
    low_watermark: float = DEFAULT_LOW_WATERMARK
    early_rejection: bool = True
    pool_events: bool = True
    engine_events: tuple[tuple[str, str], ...] = ()
    policy: str = DEFAULT_POLICY
    discover: str | None = None
    discover_prefix: str = DEFAULT_ENGINES_PREFIX
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_chars_per_token: int = DEFAULT_MAX_CHARS_PER_TOKEN
    engine_priority: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise InvalidRequestError(
                f"unknown policy {self.policy!r}: one of {', '.join(sorted(POLICIES))}"
            )
        if self.engines and (self.prefill or self.decode):
            raise InvalidRequestError("give --engine, or --prefill and --decode, not both")
        if self.discover is not None:
            parse_endpoints(self.discover)  # raises on a malformed list
            check_prefix(self.discover_prefix)
        elif not self.engines and not (self.prefill and self.decode):
            raise InvalidRequestError(
                "give --engine URL, or --prefill URL and --decode URL, or --discover etcd://..."
            )
        for url in (*self.prefill, *self.decode, *self.engines):
            check_engine_url(url)
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise InvalidRequestError("watermarks must satisfy 0 < low <= high <= 1")
        if self.max_inflight < 1 or self.poll_s <= 0 or self.timeout_s <= 0:
            raise InvalidRequestError("max_inflight, poll_s and timeout_s must be positive")
        if self.max_body_bytes < 1 or self.max_chars_per_token < 1:
            raise InvalidRequestError("max_body_bytes and max_chars_per_token must be positive")
        urls = {*self.prefill, *self.engines}
        seen = set()
        for url, endpoint in self.engine_events:
            if url not in urls:
                raise InvalidRequestError(
                    f"--engine-events {url}: not a --prefill or --engine URL of this router"
                )
            if url in seen:
                raise InvalidRequestError(f"--engine-events {url} given twice")
            seen.add(url)
            if not endpoint.startswith(("tcp://", "ipc://")):
                raise InvalidRequestError(
                    f"--engine-events {url}={endpoint}: the endpoint must be tcp://HOST:PORT"
                )

    @property
    def disaggregated(self) -> bool:
        """P/D mode (two steps) rather than kv_both engines, for the static engines (with
        ``discover`` the engine set decides: ``RouterState.disaggregated``)."""
        return not self.engines

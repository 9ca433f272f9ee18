"""The scheduler as the admin API sees it: a JSON body in, the chosen instances out.

The REST route is a thin wrapper: decode the body, call :func:`schedule_request`, map
``KVStoreError`` to a 4xx. Nothing here knows about HTTP.

Request body::

    {"block_keys": ["9f86d081...", ...] or [0, 1, 2],   # chained prefix-index keys
     "input_length": 6758, "output_length": 500,         # output_length is optional (default 1)
     "slo_class": "interactive",                           # optional: the first class
     "now_s": 12.5}                                        # optional: the state's clock

Response: :meth:`Decision.to_dict` (``accepted``, ``prefill_instance``, ``decode_instance``,
predictions, ``reject_reason``). A rejection under overload is an answer, not an error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import InvalidRequestError

from .cluster import ClusterState
from .scheduler import Router, ScheduleRequest, make_router
from .trace import num_blocks_for

#: Most block keys one request may name (a 4M-token prompt at 16 tokens a block).
MAX_BLOCK_KEYS = 262_144
_MAX_KEY_CHARS = 256
_ALLOWED_FIELDS = frozenset({"block_keys", "input_length", "output_length", "slo_class", "now_s"})


@dataclass(slots=True)
class SchedulerState:
    """What the master hands the route: the cluster it sees and the router to ask.

    Attributes:
        cluster: prefill and decode instances and the pool's prefix index.
        router: the router (``conductor`` unless built otherwise).
        now_s: the clock used when a request gives no ``now_s``.
    """

    cluster: ClusterState
    router: Router = field(default_factory=lambda: make_router("conductor"))
    now_s: float = 0.0


def _int(body: Mapping[str, Any], name: str, default: int | None, minimum: int) -> int:
    if name not in body:
        if default is None:
            raise InvalidRequestError(f"missing field {name!r}")
        return default
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name!r} must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise InvalidRequestError(f"{name!r} must be >= {minimum}, got {value}")
    return value


def parse_request(body: object, block_size: int) -> tuple[ScheduleRequest, float | None]:
    """Validate a JSON body into a :class:`ScheduleRequest` and an optional clock.

    Args:
        body: the decoded JSON.
        block_size: tokens per block of the cluster.

    Returns:
        The request and ``now_s`` (None when the body has none).

    Raises:
        InvalidRequestError: naming the field that is missing, mistyped or inconsistent.
    """
    if not isinstance(body, Mapping):
        raise InvalidRequestError(f"request must be a JSON object, got {type(body).__name__}")
    unknown = sorted(str(k) for k in body if k not in _ALLOWED_FIELDS)
    if unknown:
        raise InvalidRequestError(f"unknown field(s) {', '.join(unknown)}")
    input_length = _int(body, "input_length", None, 1)
    output_length = _int(body, "output_length", 1, 1)
    if "block_keys" not in body:
        raise InvalidRequestError("missing field 'block_keys'")
    raw_keys = body["block_keys"]
    if not isinstance(raw_keys, list):
        raise InvalidRequestError(f"'block_keys' must be a list, got {type(raw_keys).__name__}")
    if len(raw_keys) > MAX_BLOCK_KEYS:
        raise InvalidRequestError(
            f"'block_keys' has {len(raw_keys)} keys; at most {MAX_BLOCK_KEYS}"
        )
    for position, key in enumerate(raw_keys):
        if isinstance(key, bool) or not isinstance(key, int | str):
            raise InvalidRequestError(f"block_keys[{position}] must be an integer or a string")
        if isinstance(key, int) and key < 0:
            raise InvalidRequestError(f"block_keys[{position}] must be >= 0, got {key}")
        if isinstance(key, str) and not 0 < len(key) <= _MAX_KEY_CHARS:
            raise InvalidRequestError(f"block_keys[{position}] must have 1..{_MAX_KEY_CHARS} chars")
    expected = num_blocks_for(input_length, block_size)
    if len(raw_keys) != expected:
        raise InvalidRequestError(
            f"'block_keys' has {len(raw_keys)} keys but input_length {input_length} needs "
            f"{expected} blocks of {block_size} tokens"
        )
    slo_class = body.get("slo_class")
    if slo_class is not None and not isinstance(slo_class, str):
        raise InvalidRequestError("'slo_class' must be a string")
    now_s = body.get("now_s")
    if now_s is not None and (
        isinstance(now_s, bool) or not isinstance(now_s, int | float) or not math.isfinite(now_s)
    ):
        raise InvalidRequestError("'now_s' must be a finite number")
    request = ScheduleRequest(tuple(raw_keys), input_length, output_length, slo_class or "")
    return request, None if now_s is None else float(now_s)


def schedule_request(scheduler_state: SchedulerState, request_dict: object) -> dict[str, Any]:
    """Choose the prefill and decode instances for one request.

    Changes no cluster state (the master commits what it then does); only a round-robin
    router advances its position.

    Args:
        scheduler_state: the cluster view and router.
        request_dict: the JSON body (see the module docstring).

    Returns:
        ``Decision.to_dict()``: ``accepted``, ``prefill_instance``, ``decode_instance``,
        ``predicted_ttft_s``, ``predicted_tbt_s``, cache hits, ``reject_reason``.

    Raises:
        InvalidRequestError: for a malformed body or an unknown SLO class.
    """
    request, now_s = parse_request(request_dict, scheduler_state.cluster.block_size_tokens)
    router = scheduler_state.router
    if not request.slo_class:
        request = ScheduleRequest(
            request.block_keys,
            request.input_length,
            request.output_length,
            router.config.slo_classes[0].name,
        )
    decision = router.decide(
        scheduler_state.cluster, request, scheduler_state.now_s if now_s is None else now_s
    )
    return decision.to_dict()

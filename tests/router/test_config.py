"""The router's configuration: what it refuses on creation, and the mode it describes."""

from __future__ import annotations

from typing import Any

import pytest

from kvstore.errors import InvalidRequestError
from kvstore.router.config import RouterConfig


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="unknown policy"):
        RouterConfig(engines=("http://a",), policy="random")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"engines": ("http://a",), "prefill": ("http://p",)}, "not both"),
        ({"prefill": ("http://p",)}, "give --engine URL"),
        ({}, "give --engine URL"),
        ({"engines": ("http://a",), "low_watermark": 0.95, "high_watermark": 0.9}, "watermarks"),
        ({"engines": ("http://a",), "max_inflight": 0}, "must be positive"),
        ({"engines": ("http://a",), "poll_s": 0}, "must be positive"),
        ({"engines": ("http://a",), "max_body_bytes": 0}, "must be positive"),
        (
            {"engines": ("http://a",), "engine_events": (("http://b", "tcp://b:1"),)},
            "not a --prefill or --engine URL",
        ),
        (
            {"engines": ("http://a",), "engine_events": (("http://a", "udp://a:1"),)},
            "tcp://HOST:PORT",
        ),
        (
            {
                "engines": ("http://a",),
                "engine_events": (("http://a", "tcp://a:1"), ("http://a", "tcp://a:2")),
            },
            "given twice",
        ),
    ],
    ids=[
        "both-modes",
        "prefill-without-decode",
        "no-engine",
        "low-over-high",
        "no-slot",
        "no-poll-period",
        "no-body",
        "events-of-a-stranger",
        "events-not-tcp",
        "events-twice",
    ],
)
def test_a_config_that_cannot_route_is_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        RouterConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "disaggregated"),
    [
        ({"engines": ("http://a", "http://b")}, False),
        ({"prefill": ("http://p",), "decode": ("http://d",)}, True),
    ],
)
def test_the_static_engines_set_the_mode(kwargs: dict[str, Any], disaggregated: bool) -> None:
    assert RouterConfig(**kwargs).disaggregated is disaggregated


def test_discovery_alone_is_enough_but_its_endpoints_must_parse() -> None:
    assert RouterConfig(discover="etcd://127.0.0.1:2379").engines == ()
    with pytest.raises(InvalidRequestError):
        RouterConfig(discover="etcd://")

"""The vLLM connector's extra config: what it accepts and what it refuses (no vLLM needed)."""

from __future__ import annotations

import pytest

from kvstore.client.adapters.vllm_config import DEFAULT_LOAD_MODE, ConnectorConfig
from kvstore.errors import InvalidRequestError


def test_inline_token_is_refused_without_echoing_it() -> None:
    with pytest.raises(InvalidRequestError) as err:
        ConnectorConfig.from_extra({"master": "h:1", "token": "s3cret-token"})
    assert "token_file" in str(err.value) and "KVSTORE_TOKEN" in str(err.value)
    assert "s3cret" not in str(err.value)


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({}, "master"),
        ({"master": ""}, "master"),
        ({"master": "h:1", "slat": "x"}, "slat"),
        ({"master": "h:1", "load_mode": "sometimes"}, "load_mode"),
        ({"master": "h:1", "timeout_s": 0}, "timeout_s"),
        ({"master": "h:1", "retry_s": True}, "retry_s"),
        ({"master": "h:1", "salt": ""}, "salt"),
    ],
)
def test_bad_extra_config_is_a_clear_error(extra: dict, needle: str) -> None:
    with pytest.raises(InvalidRequestError, match=needle):
        ConnectorConfig.from_extra(extra)


def test_defaults_and_etcd_master() -> None:
    cfg = ConnectorConfig.from_extra({"master": "etcd://h:2379", "salt": "tenant-1"})
    assert (cfg.master, cfg.salt, cfg.token_file) == ("etcd://h:2379", "tenant-1", None)
    assert cfg.load_mode == DEFAULT_LOAD_MODE == "layer"
    assert (cfg.timeout_s, cfg.retry_s) == (5.0, 10.0)
    assert ConnectorConfig.from_extra({"master": "h:1", "load_mode": "async"}).load_mode == "async"

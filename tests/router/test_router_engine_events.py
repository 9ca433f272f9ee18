"""``kvstore router --engine-events`` with real vLLM servers publishing their own KV events.

Two kv_both servers (prefix caching on, ``--kv-events-config`` with a ZMQ publisher each,
``--enable-prompt-tokens-details`` so their answers say how many prompt tokens they took from
a cache) on one pool, and a kv_both router subscribed to both. A second prompt sharing a long
prefix goes to the engine that holds it in its own cache, and the router's count of those
tokens is what vLLM itself reports. Select with ``-m engine``; skipped without the vLLM
virtualenv or the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.demo.vllm_server import free_port
from tests.adapters.vllm_servers import VLLMServer, missing_engine
from tests.router.rig import PoolRig, metric, post
from tests.support import wait_until

pytestmark = [
    pytest.mark.engine,
    pytest.mark.timeout(900),
    pytest.mark.skipif(missing_engine() is not None, reason=str(missing_engine())),
]

BS = 32
SYSTEM = (
    "You answer questions about a lighthouse. It stands on a granite rock, was built in 1868, "
    "and its lamp turns every ten seconds. Visitors may climb the 217 steps from April to "
    "October; tickets cost eight euros and children under six go free. The keeper's house is "
    "now a small museum about shipwrecks along this coast. "
)


class Rig(PoolRig):
    """A pool, two engines publishing KV events, a router subscribed to both."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp)
        self.ports = [free_port(), free_port()]
        for i, port in enumerate(self.ports):
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{port}",
            }
            self.servers.append(
                VLLMServer(
                    tmp / f"e{i}.log",
                    self.kv,
                    cpu=i,
                    prefix_caching=True,
                    extra_args=[
                        "--kv-events-config",
                        json.dumps(events),
                        "--enable-prompt-tokens-details",
                    ],
                )
            )
        self.wait_ready()
        args: list[str] = []
        for server, port in zip(self.servers, self.ports, strict=True):
            args += [
                "--engine",
                server.url,
                "--engine-events",
                f"{server.url}=tcp://127.0.0.1:{port}",
            ]
        self.router = self.start_router(*args)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    with Rig(Path(tmp_path_factory.mktemp("router_events"))) as r:
        yield r


def test_a_shared_prefix_goes_to_the_engine_that_holds_it_locally(rig: Rig) -> None:
    def messages(question: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM * 2}, {"role": "user", "content": question}]

    def ask(question: str) -> tuple[Any, dict[str, Any]]:
        body = {"model": "smollm2", "temperature": 0, "max_tokens": 4}
        status, headers, answer = post(
            rig.router + "/v1/chat/completions", {**body, "messages": messages(question)}
        )
        assert status == 200, answer
        return headers, answer

    def tokens(question: str) -> list[int]:
        return rig.servers[0].post(
            "/tokenize", {"model": "smollm2", "messages": messages(question)}
        )["tokens"]

    a, b = "How many steps are there?", "What does a ticket cost?"
    tok_a, tok_b = tokens(a), tokens(b)
    common = next(i for i, (x, y) in enumerate(zip(tok_a, tok_b, strict=False)) if x != y)
    assert common > 4 * BS
    headers, _ = ask(a)
    assert headers["x-kvstore-local-cached-tokens"] == "0"
    holder = headers["x-kvstore-engine"]
    # The holder's events reached the router (A's whole blocks), and the router's poll of
    # the holder shows it idle again (a running request would weigh on its prediction) and
    # answering (a poll that timed out on a busy host leaves it out of the choice).
    wait_until(
        lambda: (
            metric(rig.router, "kvstore_router_engine_cached_blocks", f'"{holder}"')
            >= len(tok_a) // BS
            and metric(rig.router, "kvstore_router_engine_running", f'"{holder}"') == 0
            and metric(rig.router, "kvstore_router_engine_waiting", f'"{holder}"') == 0
            and metric(rig.router, "kvstore_router_engine_healthy", f'"{holder}"') == 1
        ),
        timeout=60,
        interval=0.1,
        what="the holder's KV events reach the router",
    )
    headers, answer = ask(b)
    assert headers["x-kvstore-engine"] == holder
    local = int(headers["x-kvstore-local-cached-tokens"])
    assert local == common // BS * BS
    # What vLLM itself took from its cache for B: the same whole blocks.
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == local
    assert metric(rig.router, "kvstore_router_local_cached_tokens_total", f'"{holder}"') == local
    # B's own blocks past the shared prefix are a second stored event; the engine publishes it
    # as it answers, so it may reach the router just after the answer does.
    wait_until(
        lambda: metric(rig.router, "kvstore_router_engine_events_total", 'kind="stored"') >= 2,
        timeout=30,
        interval=0.1,
        what="the router to receive B's stored blocks",
    )

"""``kvstore router`` in front of real vLLM servers (the real model, temperature 0, the CPU).

Two kv_both servers with the kvstore connector on one pool serve every test of the module
(each start costs tens of seconds here): as prefill and decode of a P/D router, and as the
two engines of a kv_both router. The last test SIGKILLs one of them. Select with ``-m engine``;
skipped where the vLLM virtualenv or the model is missing.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvstore.client.events import EventStream
from kvstore.demo.vllm_server import free_port
from kvstore.router.engines import EngineLoad
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
    "You answer questions about a mountain hut. The hut opens in June and closes in "
    "September. Beds cost thirty francs a night, breakfast is included, and dinner is served "
    "at seven. Blankets are provided; bring your own sleeping bag liner. Dogs are not allowed "
    "inside. The path from the valley takes three hours and is marked in red and white. "
)
CHAT = [
    {"role": "system", "content": "You are a terse geography assistant."},
    {"role": "user", "content": "Name the largest city in Italy and one sight there."},
]
SLO_CONFIG = {
    "default_class": "standard",
    "classes": [
        {"name": "impossible", "ttft_s": 0.0001, "tbt_s": 10.0},
        {"name": "standard", "ttft_s": 600.0, "tbt_s": 60.0},
    ],
    "api_keys": {"sk-impossible": "impossible"},
}


class Rig(PoolRig):
    """The module's pool, two engines and routers in front of them."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp)
        # Prefix caching off: every call computes (or loads) its prompt the same way.
        for name, cpu in (("p", 0), ("d", 1)):
            self.servers.append(
                VLLMServer(tmp / f"{name}.log", self.kv, cpu=cpu, prefix_caching=False)
            )
        self.wait_ready()
        self.p, self.d = self.servers
        (tmp / "slo.json").write_text(json.dumps(SLO_CONFIG))

    def router(self, *engine_args: str) -> str:
        """Start a router; returns its URL (stopped with the rig)."""
        return self.start_router("--slo-config", str(self.tmp / "slo.json"), *engine_args)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    with Rig(Path(tmp_path_factory.mktemp("router"))) as r:
        yield r


@pytest.fixture(scope="module")
def pd(rig: Rig) -> str:
    return rig.router("--prefill", rig.p.url, "--decode", rig.d.url)


def _client(base: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=300)


def _ask(client: openai.OpenAI, kind: str, stream: bool, **extra: Any) -> str:
    common: dict[str, Any] = {"model": "smollm2", "temperature": 0, "max_tokens": 16, **extra}
    if kind == "completions":
        if stream:
            return "".join(
                c.choices[0].text
                for c in client.completions.create(
                    prompt="The capital of France is", stream=True, **common
                )
                if c.choices
            )
        return (
            client.completions.create(prompt="The capital of France is", **common).choices[0].text
        )
    if stream:
        return "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(messages=CHAT, stream=True, **common)
            if c.choices
        )
    return client.chat.completions.create(messages=CHAT, **common).choices[0].message.content or ""


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_openai_client_through_the_router_equals_a_direct_call(
    rig: Rig, pd: str, kind: str, stream: bool
) -> None:
    # The router first, then the engine: both then read the prompt's full blocks from the pool
    # and compute the rest (a prompt computed whole rounds differently in bf16).
    routed = _ask(_client(pd), kind, stream)
    direct = _ask(_client(rig.d.url), kind, False)
    assert routed == direct and direct
    if kind == "completions":
        assert "Paris" in direct


def test_kv_both_router_equals_a_direct_call(rig: Rig) -> None:
    router = rig.router("--engine", rig.p.url, "--engine", rig.d.url)
    for kind, stream in (("chat", True), ("completions", False)):
        routed = _ask(_client(router), kind, stream)
        assert routed == _ask(_client(rig.p.url), kind, False)


def _caught_up(rig: Rig, router: str) -> None:
    """Wait (bounded) until the router's event view reflects every event the master has
    numbered so far, and says it is synced."""
    with EventStream(rig.cluster.address) as stream:
        seq = stream.snapshot().seq
    wait_until(
        lambda: (
            metric(router, "kvstore_router_pool_view_state", 'state="synced"') == 1
            and metric(router, "kvstore_router_pool_view_seq") >= seq
        ),
        timeout=30,
        interval=0.1,
        what="the router's view of the pool catches up with the master",
    )


def test_a_shared_prefix_is_counted_from_the_kv_events_as_the_index_answers(
    rig: Rig, pd: str
) -> None:
    def messages(question: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM * 2}, {"role": "user", "content": question}]

    def ask(router: str, question: str) -> tuple[int, int, int, str, dict[str, Any]]:
        body = {"model": "smollm2", "temperature": 0, "max_tokens": 4}
        status, headers, answer = post(
            router + "/v1/chat/completions", {**body, "messages": messages(question)}
        )
        assert status == 200, answer
        return (
            int(headers["x-kvstore-cached-tokens"]),
            int(headers["x-kvstore-loadable-tokens"]),
            int(headers["x-kvstore-prompt-tokens"]),
            headers["x-kvstore-pool-view"],
            answer,
        )

    def tokens(question: str) -> list[int]:  # as the engine counts them (chat template applied)
        return rig.p.post("/tokenize", {"model": "smollm2", "messages": messages(question)})[
            "tokens"
        ]

    a, b = "When does the hut open?", "What does a bed cost?"
    tok_a, tok_b = tokens(a), tokens(b)
    common = next(i for i, (x, y) in enumerate(zip(tok_a, tok_b, strict=False)) if x != y)
    assert common > 4 * BS
    _caught_up(rig, pd)
    before = metric(pd, "kvstore_router_cached_tokens_total")
    events_before = metric(pd, "kvstore_router_pool_answers_total", 'source="events"')
    cached_a, loadable_a, len_a, source, answer_a = ask(pd, a)
    # Its system prompt is new to the pool: no whole block of it is there.
    assert source == "events" and cached_a == loadable_a == 0
    assert len_a == answer_a["usage"]["prompt_tokens"] == len(tok_a)  # tokenized as the engine
    _caught_up(rig, pd)  # A's blocks, stored by the connector, reached the router as events
    cached_b, loadable_b, len_b, source, answer_b = ask(pd, b)
    # Served once, A's whole blocks are in the pool: B's shared prefix is found in whole
    # blocks (the view holds block keys; the index would add the tokens of a partial block).
    assert source == "events"
    assert cached_b == loadable_b == common // BS * BS
    assert len_b == answer_b["usage"]["prompt_tokens"] == len(tok_b)
    assert metric(pd, "kvstore_router_cached_tokens_total") - before == cached_a + cached_b
    assert metric(pd, "kvstore_router_pool_answers_total", 'source="events"') >= events_before + 2
    # B served: the view and the master's prefix index (a router that asks it per request)
    # count the same whole blocks of it.
    lookup = rig.router("--no-pool-events", "--prefill", rig.p.url, "--decode", rig.d.url)
    cached_idx, loadable_idx, _, source, _ = ask(lookup, b)
    assert source == "lookup" and cached_idx >= len(tok_b) // BS * BS
    _caught_up(rig, pd)
    cached_view, loadable_view, _, source, _ = ask(pd, b)
    assert source == "events"
    assert (cached_view, loadable_view) == (cached_idx // BS * BS, loadable_idx)


def test_the_engines_export_the_metrics_the_router_reads(rig: Rig, pd: str) -> None:
    with urllib.request.urlopen(rig.p.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert f"\n{name}{{" in text
    load = EngineLoad.from_metrics(text)
    assert load.block_size == BS and load.cache_dtype == "auto"
    assert load.num_blocks is not None and load.num_blocks > 100
    assert 0.0 <= load.kv_usage <= 1.0 and "vllm:kv_cache_usage_perc{" in text
    assert load.itl_count > 0  # earlier tests generated tokens here
    # The router's own view: both engines up, cost terms exported per engine.
    assert metric(pd, "kvstore_router_engine_healthy") == 2
    assert metric(pd, "kvstore_router_cost_term", f'instance="{rig.p.url}"') > 0


def test_slo_rejection_and_bad_requests_are_openai_errors(rig: Rig, pd: str) -> None:
    for client, headers in (
        (_client(pd), {"X-SLO-Class": "impossible"}),
        (_client(pd, key="sk-impossible"), {}),
    ):
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(
                model="smollm2", prompt="Hello", max_tokens=4, extra_headers=headers
            )
        assert int(err.value.response.headers["Retry-After"]) >= 1
        assert "impossible" in err.value.message
    assert (
        metric(
            pd, "kvstore_router_rejections_total", 'reason="predicted"', 'slo_class="impossible"'
        )
        >= 2
    )
    with pytest.raises(openai.NotFoundError):
        _client(pd).completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        _client(pd).chat.completions.create(model="smollm2", messages=[{"role": "x"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        _client(pd).completions.create(model="smollm2", prompt="word " * 5000, max_tokens=2)
    assert "maximum context length" in err.value.message
    status, _, answer = post(pd + "/v1/completions", b"{not json")
    assert status == 400 and "not JSON" in answer["error"]["message"]
    status, _, answer = post(
        pd + "/v1/completions", {"prompt": "x"}, headers={"X-SLO-Class": "gold"}
    )
    assert status == 400 and "gold" in answer["error"]["message"]
    models = _client(pd).models.list()
    assert [m.id for m in models.data] == ["smollm2"]


def test_a_dead_decode_or_prefill_engine_falls_back_to_the_other(rig: Rig) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    direct = _ask(_client(rig.p.url), "completions", False)
    for args in (
        ("--prefill", rig.p.url, "--decode", dead),
        ("--prefill", dead, "--decode", rig.d.url),
    ):
        router = rig.router(*args)
        assert _ask(_client(router), "completions", False) == direct


def test_a_client_hanging_up_mid_stream_is_not_an_engine_failure(rig: Rig, pd: str) -> None:
    """The router's write to a client that left fails; that is the client's doing: the engine
    stays healthy and nothing falls back to another engine."""
    fallbacks = metric(pd, "kvstore_router_fallbacks_total")
    host, port = pd.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {
        "model": "smollm2",
        "prompt": "Write a long story about a lighthouse keeper.",
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.fp.readline()  # the answer is streaming
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client hangs up
    conn.close()
    wait_until(
        lambda: metric(pd, "kvstore_router_requests_total", 'outcome="client_gone"') >= 1,
        timeout=120,
        interval=0.2,
        what="the router to see the client leave",
    )
    assert metric(pd, "kvstore_router_fallbacks_total") == fallbacks
    with urllib.request.urlopen(pd + "/health", timeout=10) as r:
        assert json.loads(r.read())["engines"] == {rig.p.url: True, rig.d.url: True}


def test_an_engine_killed_mid_stream_ends_cleanly_and_the_router_keeps_serving(
    rig: Rig, pd: str
) -> None:
    """Last in the module: it kills the decode engine."""
    client = _client(pd)
    stream = client.completions.create(
        model="smollm2",
        prompt="Write a long story about a lighthouse keeper.",
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    parts = []
    killed = False
    with pytest.raises(openai.APIError) as err:  # the stream cannot move: a typed error ends it
        for chunk in stream:
            parts.append(chunk.choices[0].text if chunk.choices else "")
            if len(parts) == 3 and not killed:
                os.kill(rig.d.pid, signal.SIGKILL)  # the API server: its connection drops
                killed = True
    assert killed and "failed mid-answer" in str(err.value)
    # The next request: the decode engine is gone, the prefill engine answers it whole.
    status, headers, answer = post(
        pd + "/v1/completions",
        {
            "model": "smollm2",
            "prompt": "The capital of France is",
            "max_tokens": 8,
            "temperature": 0,
        },
    )
    assert status == 200, answer
    assert headers["x-kvstore-engine"] == rig.p.url
    assert "Paris" in answer["choices"][0]["text"]

    def degraded() -> bool:
        try:
            urllib.request.urlopen(pd + "/health", timeout=10)
        except urllib.error.HTTPError:
            return False
        with urllib.request.urlopen(pd + "/health", timeout=10) as resp:
            return json.loads(resp.read())["engines"] == {rig.p.url: True, rig.d.url: False}

    wait_until(degraded, timeout=30, interval=0.2, what="router sees the decode engine down")
    assert metric(pd, "kvstore_router_requests_total", 'outcome="stream_error"') >= 1

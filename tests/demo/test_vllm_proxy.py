"""``kvstore proxy`` in front of two real vLLM servers (the real model, temperature 0).

No connector is needed to test the proxy itself: with greedy sampling the decode server computes
the same answer whether or not the KV came from the pool, so the proxied answer must equal a
direct call, streaming or not; the prefill server must have been asked for one token.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.demo import realmodel
from kvstore.demo.vllm_proxy import prefill_request
from kvstore.demo.vllm_server import VLLMServer, free_port
from kvstore.processes import parse_ready, terminate

REPO = Path(__file__).resolve().parents[2]
ENGINE_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
MODEL = realmodel.model_dir("smollm2")

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

PROMPT = "The capital of France is"
CHAT = [
    {"role": "system", "content": "You are a terse geography assistant."},
    {"role": "user", "content": "Name the largest city in Italy and one sight there."},
]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VLLMServer, VLLMServer]]:
    if not ENGINE_PYTHON.exists():
        pytest.skip(".venv-vllm is absent (make test builds it)")
    if not realmodel.is_complete(MODEL):
        pytest.skip(f"no model at {MODEL} (make test fetches it)")
    logs = tmp_path_factory.mktemp("vllm-logs")
    # Prefix caching off: every call computes its prompt whole, so two calls of one body are
    # computed alike (a cache hit computes only the rest, and bf16 sums then round differently).
    prefill = VLLMServer(
        MODEL,
        "prefill",
        logs / "prefill.log",
        cpu_core=0,
        python=str(ENGINE_PYTHON),
        prefix_caching=False,
    )
    decode = VLLMServer(
        MODEL,
        "decode",
        logs / "decode.log",
        cpu_core=1,
        python=str(ENGINE_PYTHON),
        prefix_caching=False,
    )
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


def _start_proxy(prefill: str, decode: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "proxy", "--prefill", prefill, "--decode", decode]
        + ["--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the ready line, or EOF if it died
    ready = parse_ready(line, "proxy")
    if ready is None:
        terminate(proc)
        raise AssertionError(f"the proxy did not start: {line!r}")
    return proc, ready["url"]


@pytest.fixture(scope="module")
def proxy(servers: tuple[VLLMServer, VLLMServer]) -> Iterator[str]:
    proc, url = _start_proxy(servers[0].url, servers[1].url)
    try:
        yield url
    finally:
        terminate(proc)


def _post(url: str, body: Any) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _stream(url: str, body: dict[str, Any]) -> tuple[str, list[str]]:
    """The content type and the SSE ``data:`` payloads of a streamed answer."""
    req = urllib.request.Request(
        url,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        kind = resp.headers.get("Content-Type", "")
        payloads = [
            line[len("data: ") :].strip()
            for line in resp.read().decode().splitlines()
            if line.startswith("data: ")
        ]
    return kind, payloads


def _text(kind: str, answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return choice["text"] if kind == "completions" else choice["message"]["content"]


def _streamed_text(kind: str, payloads: list[str]) -> str:
    assert payloads[-1] == "[DONE]", payloads[-3:]
    parts = []
    for p in payloads[:-1]:
        choice = json.loads(p)["choices"]
        if not choice:
            continue
        parts.append(
            choice[0]["text"] if kind == "completions" else choice[0]["delta"].get("content") or ""
        )
    return "".join(parts)


def _generation_tokens(server: VLLMServer) -> float:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:generation_tokens_total")
    )


def _body(kind: str) -> tuple[str, dict[str, Any]]:
    common = {"model": "smollm2", "temperature": 0, "max_tokens": 24}
    if kind == "completions":
        return "/v1/completions", {**common, "prompt": PROMPT}
    return "/v1/chat/completions", {**common, "messages": CHAT}


@pytest.mark.parametrize(
    ("body", "want"),
    [
        ({"prompt": "x", "max_tokens": 50}, {"prompt": "x", "max_tokens": 1, "stream": False}),
        (
            {"messages": [], "stream": True, "stream_options": {"include_usage": True}},
            {"messages": [], "max_tokens": 1, "stream": False},
        ),
        (
            {"messages": [], "max_completion_tokens": 9, "min_tokens": 5, "temperature": 0},
            {"messages": [], "max_completion_tokens": 1, "max_tokens": 1, "stream": False}
            | {"temperature": 0},
        ),
    ],
)
def test_the_prefill_half_asks_for_one_token_without_streaming(
    body: dict[str, Any], want: dict[str, Any]
) -> None:
    before = json.dumps(body)
    assert prefill_request(body) == want
    assert json.dumps(body) == before  # the client's request, sent on to decode, is unchanged


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_proxied_answer_equals_a_direct_call_and_prefill_made_one_token(
    servers: tuple[VLLMServer, VLLMServer], proxy: str, kind: str
) -> None:
    prefill, decode = servers
    path, body = _body(kind)
    status, direct = _post(decode.url + path, body)
    assert status == 200, direct
    before = _generation_tokens(prefill)
    status, proxied = _post(proxy + path, body)
    assert status == 200, proxied
    assert _text(kind, proxied) == _text(kind, direct) and _text(kind, direct)
    assert _generation_tokens(prefill) - before == 1  # the prefill half asked for max_tokens=1
    if kind == "completions":
        assert "Paris" in _text(kind, direct)


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_streaming_passes_the_decode_servers_events_through(
    servers: tuple[VLLMServer, VLLMServer], proxy: str, kind: str
) -> None:
    prefill, decode = servers
    path, body = _body(kind)
    _, direct = _post(decode.url + path, body)
    before = _generation_tokens(prefill)
    content_type, payloads = _stream(proxy + path, body)
    assert content_type.startswith("text/event-stream")
    assert len(payloads) > 3  # token by token, not one block
    assert _streamed_text(kind, payloads) == _text(kind, direct)
    assert _generation_tokens(prefill) - before == 1


def test_models_health_and_bad_requests(servers: tuple[VLLMServer, VLLMServer], proxy: str) -> None:
    with urllib.request.urlopen(proxy + "/v1/models", timeout=30) as resp:
        assert [m["id"] for m in json.loads(resp.read())["data"]] == ["smollm2"]
    with urllib.request.urlopen(proxy + "/health", timeout=30) as resp:
        assert json.loads(resp.read()) == {"status": "ok", "prefill": True, "decode": True}
    status, answer = _post(proxy + "/v1/completions", b"{not json")
    assert status == 400 and "not JSON" in answer["error"]["message"]
    # The prefill server's own refusal comes back as it is, and decode is not asked.
    status, answer = _post(proxy + "/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404 and "nope" in json.dumps(answer)


def test_an_unreachable_decode_server_is_a_502_and_an_unhealthy_proxy(
    servers: tuple[VLLMServer, VLLMServer],
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    proc, url = _start_proxy(servers[0].url, dead)
    try:
        path, body = _body("completions")
        status, answer = _post(url + path, body)
        assert status == 502 and dead in answer["error"]["message"]
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url + "/health", timeout=30)
        assert err.value.code == 503
        assert json.loads(err.value.read()) == {
            "status": "degraded",
            "prefill": True,
            "decode": False,
        }
    finally:
        terminate(proc)

"""``kvstore demo``: disaggregated prefill/decode under real vLLM servers, KV through the pool.

Four processes and the pool: the embedded cluster (``kvstore up``), a prefill vLLM server
(``kv_producer``: computes the prompt, its connector saves the KV into the pool), a decode vLLM
server (``kv_consumer``: loads the prompt's KV from the pool, computes only what is missing, and
generates) and a reference vLLM server without the connector (a single instance). Each
question shares a long system prompt; for each the demo prints the answer, the tokens the decode
server found in the pool, its time to first token against the reference's, the bytes the
connectors moved, and whether the decode answer equals the single reference instance's.

Two references, from the one instance, because in bf16 a prompt computed on top of cached KV
rounds differently from one computed whole (vLLM's own prefix cache does the same: a question
answered from it can differ from a cold one): "local" is the reference serving the prompt from
its own prefix cache after a one-token prefill of it, i.e. the same computation with the KV kept
in-process instead of moved through the pool (equal means the pool's KV is exact); "recompute"
is the reference computing the prompt whole (a fresh ``cache_salt`` bypasses its cache), whose
time to first token is the "without the pool" figure. Prefill and decode run with vLLM's prefix
cache off, so decode's KV comes from the pool. The figures come from the connectors' counters on
each server's ``/metrics`` (``vllm:kvstore_*``).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvstore.demo.vllm_proxy import prefill_request
from kvstore.demo.vllm_server import VLLMServer, kv_transfer_config

SYSTEM_PROMPT = (
    "You are the help desk of the Riverside Public Library. Answer in one or two short "
    "sentences, in plain English, and only with facts from this briefing. "
    "Opening hours: Monday to Friday from 9 in the morning to 8 in the evening, Saturday from 10 "
    "to 5, closed on Sunday and on public holidays. The library is at 12 Mill Street, next to "
    "the old bridge; bus lines 4 and 17 stop in front of it, and there is a bicycle rack by the "
    "main door but no car park. Membership is free for anyone who lives, works or studies in "
    "the city: bring a photo identity card and a letter with your address. Members may borrow "
    "up to twelve items at a time: books for three weeks, films and music for one week, and "
    "magazines for one week. Loans can be renewed twice, online or at the desk, unless another "
    "member has reserved the item. Late returns cost twenty cents per item per day, at most "
    "five euros per item; children's items have no late fee. Lost items are charged at their "
    "replacement price. The children's room is on the ground floor, with story time every "
    "Wednesday at four. The reading room and the quiet study area are on the first floor; the "
    "study area can be booked in two-hour slots. Public computers and printers are on the "
    "second floor: printing costs ten cents per page in black and white and fifty cents in "
    "colour. The free wireless network is called Riverside-Guest and needs no password. "
    "Meeting rooms for up to twenty people can be booked by members, free of charge for "
    "non-profit groups. The book drop outside the main door is open at all hours. "
)
QUESTIONS = (
    "When is the library open on Saturday?",
    "How much is the late fee for a book?",
    "Where can I print, and what does it cost?",
    "What do I need to become a member?",
)
LEGEND = (
    "cached: prompt tokens decode loaded from the pool (whole blocks, never the last token); "
    "TTFT pool: decode's time to first token with that KV; TTFT none: one vLLM instance "
    "computing the prompt whole; moved: KV bytes prefill saved + decode loaded; =local / "
    "=recomp: decode's answer equals that single instance's, serving the prompt from its own "
    "prefix cache / computing it whole (greedy; bf16 rounds the two differently)."
)


@dataclass(slots=True)
class Row:
    question: str
    prompt_tokens: int
    cached_tokens: int
    ttft_pool_s: float
    ttft_none_s: float
    bytes_moved: int
    answer: str
    local: str  # the single instance, prompt from its own prefix cache
    recompute: str  # the single instance, prompt computed whole

    @property
    def equal_local(self) -> bool:
        return self.answer == self.local

    @property
    def equal_recompute(self) -> bool:
        return self.answer == self.recompute


@dataclass(slots=True)
class Streamed:
    text: str
    ttft_s: float
    prompt_tokens: int


def _post_json(url: str, body: dict[str, Any], timeout: float = 300) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def chat_stream(url: str, body: dict[str, Any], timeout: float = 300) -> Streamed:
    """One streamed chat completion: its text, time to the first content token, prompt size."""
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(
            {**body, "stream": True, "stream_options": {"include_usage": True}}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    started = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    prompt_tokens = 0
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if event.get("usage"):
                prompt_tokens = int(event["usage"]["prompt_tokens"])
            for choice in event.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - started
                parts.append(piece)
    return Streamed("".join(parts), ttft if ttft is not None else 0.0, prompt_tokens)


def connector_counters(server: VLLMServer) -> dict[str, float]:
    """The ``vllm:kvstore_*`` counters on a server's ``/metrics``, summed over labels."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:kvstore_"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
        out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _counter_delta(
    server: VLLMServer, before: dict[str, float], name: str, timeout: float = 5.0
) -> float:
    """How far counter ``name`` moved since ``before``. vLLM publishes connector figures with
    the engine's next stats report, so a figure may land a moment after the answer: poll briefly
    (bounded) until it moves, and take it as zero if it does not."""
    deadline = time.monotonic() + timeout
    while True:
        delta = connector_counters(server).get(name, 0.0) - before.get(name, 0.0)
        if delta or time.monotonic() > deadline:
            return delta
        time.sleep(0.1)  # polling a state, bounded by the deadline


#: Seconds the vLLM servers have, all together, to exit after SIGTERM before SIGKILL (a server
#: still starting can take 20 s and more to heed it; the demo has nothing of theirs to keep).
STOP_GRACE_S = 5.0
#: Seconds to reap a server after SIGKILL.
KILL_WAIT_S = 10.0


def stop_all(servers: Sequence[VLLMServer], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to every server's process group at once, wait for them together until one
    shared deadline, then SIGKILL every group still there at once and reap them.

    NOTE: one deadline for all, not a grace per server: waiting for each in turn made Ctrl-C
    while the servers started take 23 s and more, in silence.
    """
    for server in servers:
        server.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for server in servers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for server in servers:
        server.signal_group(signal.SIGKILL)
    for server in servers:
        server.stop(KILL_WAIT_S)  # reaps, kills what is left of the group, closes the log


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def print_table(rows: Sequence[Row], out: IO[str] | None = None) -> None:
    """The demo's table: a line per question, its answer under it, the legend below."""
    head = (
        f"{'question':<42} {'tokens':>6} {'cached':>6} {'TTFT pool':>10} {'TTFT none':>10} "
        f"{'moved':>10} {'=local':>6} {'=recomp':>7}"
    )
    print(head, file=out)
    print("-" * len(head), file=out)
    for i, r in enumerate(rows, 1):
        print(
            f"{f'{i}: {r.question}'[:42]:<42} {r.prompt_tokens:>6} {r.cached_tokens:>6} "
            f"{r.ttft_pool_s * 1e3:>8.0f}ms {r.ttft_none_s * 1e3:>8.0f}ms "
            f"{_fmt_bytes(r.bytes_moved):>10} {_yes(r.equal_local):>6} "
            f"{_yes(r.equal_recompute):>7}",
            file=out,
        )
        print(f"   answer: {' '.join(r.answer.split())}", file=out)
        if not r.equal_local:
            print(f"   local: {' '.join(r.local.split())}", file=out)
        if not r.equal_recompute:
            print(f"   recomputed: {' '.join(r.recompute.split())}", file=out)
    print(LEGEND, file=out)


def run_vllm_demo(
    master: str,
    model: Path,
    *,
    max_tokens: int = 32,
    block_size: int = 32,
    log_dir: Path | None = None,
    questions: Sequence[str] = QUESTIONS,
    say: Callable[[str], None] | None = None,
    out: IO[str] | None = None,
) -> list[Row]:
    """Start the three vLLM servers, ask the questions, print the table; stop the servers.

    Ctrl-C (KeyboardInterrupt) stops the servers within :data:`STOP_GRACE_S` (and a kill),
    says so, prints the rows of the questions already answered, and is raised again.

    Args:
        master: the pool's control address.
        model: the model folder (``kvstore model fetch smollm2``).
        max_tokens: tokens per answer.
        block_size: vLLM's block size (one pool block object per vLLM block).
        log_dir: where the servers' logs go (default: a new ``kvstore-demo-logs-*`` folder
            in the temporary directory); kept after the demo, which says where.
        questions: what to ask, each after the shared system prompt.
        say: where progress lines go (default: stderr).
        out: where the table goes (default: stdout).

    Returns:
        One row per question.

    Raises:
        KVStoreError: a server failed to start (the message has its log's tail).
    """
    say = say or (lambda line: print(f"kvstore demo: {line}", file=sys.stderr, flush=True))
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="kvstore-demo-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    servers: list[VLLMServer] = []
    rows: list[Row] = []
    try:
        for name, role, core in (
            ("prefill", "kv_producer", 0),
            ("decode", "kv_consumer", 1),
            ("reference", None, 0),
        ):
            kv = kv_transfer_config(master, role) if role else None
            server = VLLMServer(
                model,
                name,
                logs / f"{name}.log",
                kv_config=kv,
                cpu_core=core,
                block_size=block_size,
                prefix_caching=role is None,  # the reference's "local" answers use it
            )
            servers.append(server)
            say(
                f"starting vLLM {name:<9} pid {server.pid:<7} {server.url}"
                + (f" ({role})" if role else " (no connector)")
                + f", log {server.log_path}"
            )
        say("waiting for the three vLLM servers (~30-90 s on 2 cores)")
        for server in servers:
            server.wait_ready()
            say(f"vLLM {server.name} ready after {time.monotonic() - started:.0f} s")
        prefill, decode, reference = servers
        _ask(prefill, decode, reference, questions, max_tokens, say, rows)
    except KeyboardInterrupt:
        say(f"interrupted: stopping the vLLM servers (at most {STOP_GRACE_S:g} s)")
        stop_all(servers)
        say(f"stopped; the servers' logs are kept in {logs}")
        if rows:
            print_table(rows, out=out)
            say(f"interrupted after {len(rows)} of {len(questions)} questions: the rows above")
        raise
    except BaseException:
        stop_all(servers)
        say(f"the servers' logs are kept in {logs}")
        raise
    stop_all(servers)
    print_table(rows, out=out)
    say(f"the servers' logs are kept in {logs}")
    return rows


def _ask(
    prefill: VLLMServer,
    decode: VLLMServer,
    reference: VLLMServer,
    questions: Sequence[str],
    max_tokens: int,
    say: Callable[[str], None],
    rows: list[Row],
) -> None:
    """Ask each question; its row goes into ``rows`` as soon as it is complete (an interrupted
    demo prints the rows it has)."""
    # One short unrelated request each first: the first request of a fresh server pays one-off
    # costs (allocations, thread start-up) that are not what the table compares.
    warm = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for server in (prefill, decode, reference):
        _post_json(server.url + "/v1/chat/completions", {**warm, "temperature": 0})
    for i, question in enumerate(questions, 1):
        body = {
            "model": "smollm2",
            "messages": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": question},
            ],
            "temperature": 0,
            "max_tokens": max_tokens,
        }
        say(f"question {i}/{len(questions)}: prefill, decode, then the single instance twice")
        p_before, d_before = connector_counters(prefill), connector_counters(decode)
        _post_json(prefill.url + "/v1/chat/completions", prefill_request(body))
        saved = _counter_delta(prefill, p_before, "vllm:kvstore_saved_bytes")
        got = chat_stream(decode.url, body)
        cached = _counter_delta(decode, d_before, "vllm:kvstore_loaded_tokens")
        loaded = _counter_delta(decode, d_before, "vllm:kvstore_loaded_bytes")
        recomputed = chat_stream(reference.url, {**body, "cache_salt": f"whole-{uuid.uuid4()}"})
        _post_json(reference.url + "/v1/chat/completions", prefill_request(body))
        local = chat_stream(reference.url, body)
        rows.append(
            Row(
                question=question,
                prompt_tokens=got.prompt_tokens,
                cached_tokens=int(cached),
                ttft_pool_s=got.ttft_s,
                ttft_none_s=recomputed.ttft_s,
                bytes_moved=int(saved + loaded),
                answer=got.text,
                local=local.text,
                recompute=recomputed.text,
            )
        )

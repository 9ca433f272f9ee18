"""``kvstore router``: an OpenAI-compatible, cache- and load-aware front door for vLLM engines.

Modules, each owning one thing:

* :mod:`.slo` holds the router's SLO classes (priority order, API keys, the config file).
* :mod:`.fit` fits cost-model terms to timings the router measures (least squares).
* :mod:`.policy` is the choice logic: predicted TTFT, the watermark decode choice, rejection.
* :mod:`.admission` is the priority queue in front of each engine (bounded concurrency,
  promotion).
* :mod:`.engines` reads each engine's live load from its ``/metrics``.
* :mod:`.listen` knows where the router listens, to refuse engine URLs that name it.
* :mod:`.requests` checks OpenAI request bodies and tokenizes them like the engine does.
* :mod:`.app` is the aiohttp daemon (routes, error middleware, Prometheus metrics).
"""

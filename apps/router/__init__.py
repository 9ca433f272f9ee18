"""``kvstore router``: an OpenAI-compatible, cache- and load-aware front door for vLLM engines.

The choice itself (cost terms, SLO classes, the policies, early rejection) is
:mod:`kvstore.routing`, which the simulator runs too. Modules here, each owning one thing:

* :mod:`.config` is what the router fronts and how it decides (checked on creation).
* :mod:`.slo` maps requests onto SLO classes (priority order, API keys, the config file).
* :mod:`.fit` fits cost-model terms to timings the router measures (least squares).
* :mod:`.admission` is the priority queue in front of each engine (bounded concurrency,
  promotion).
* :mod:`.engines` reads each engine's live load from its ``/metrics``.
* :mod:`.discovery` follows the etcd engine registry; :mod:`.engine_cache` each engine's own
  prefix cache through vLLM's KV events; :mod:`.poolview` the pool through the master's.
* :mod:`.poolhits` asks what the pool holds of a prompt (that view, or the prefix index).
* :mod:`.state` holds the engines, their polls, the served models and the choice on them.
* :mod:`.steps` runs a request's prefill and answer steps, with their fallbacks.
* :mod:`.routes` is the HTTP edge: the handlers and the error middleware.
* :mod:`.listen` knows where the router listens, to refuse engine URLs that name it.
* :mod:`.requests` checks OpenAI request bodies and tokenizes them like the engine does.
* :mod:`.metrics` holds the router's Prometheus metrics.
* :mod:`.app` starts the aiohttp daemon (``init_app``, ``start_router``, ``serve_router``).
"""

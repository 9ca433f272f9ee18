"""The vLLM connector's ``kv_connector_extra_config``, checked without importing vLLM.

Kept apart from :mod:`kvstore.client.adapters.vllm` (which imports vLLM) so that the rules can be
tested and reused (e.g. by a launcher) in an environment without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvstore.address import Address
from kvstore.client.engine_registry import (
    DEFAULT_ENGINE_TTL_S,
    DEFAULT_ENGINES_PREFIX,
    KV_ROLE_TO_ROLE,
    EngineRecord,
    check_prefix,
    engine_key,
)
from kvstore.errors import InvalidRequestError
from kvstore.etcd import is_etcd_url, parse_endpoints
from kvstore.keys import Namespace
from kvstore.topology import MAX_NAME, Site

#: Extra-config keys the connector understands (anything else is refused: a typo must not
#: silently run without, say, the salt).
CONFIG_KEYS = frozenset(
    {
        "master",
        "token_file",
        "salt",
        "load_mode",
        "timeout_s",
        "retry_s",
        "advertise_url",
        "etcd",
        "engines_prefix",
        "engine_instance",
        "engine_ttl_s",
        "host_id",
        "rack",
        "zone",
    }
)
LOAD_MODES = ("layer", "async")
#: The default: layer-wise loads are faster than async ones with a long prompt fully cached and
#: within noise elsewhere (``.venv/bin/python bench/bench_vllm.py``, its ``kvstore`` and
#: ``kvstore-async`` rows; docs/benchmarks.md).
DEFAULT_LOAD_MODE = "layer"

#: vLLM's ``--kv-cache-dtype`` values that name an FP8 cache, as namespace dtypes.
FP8_CACHE_DTYPES = {"fp8": "float8_e4m3", "fp8_e4m3": "float8_e4m3"}
#: Appended to the namespace's model for an MLA cache (see :func:`engine_namespace`).
MLA_MARK = "#mla"
#: Model dtypes (``--dtype``, or the model's ``config.json``) the pool's namespaces describe.
MODEL_DTYPES = ("float16", "bfloat16", "float32")


def kv_dtype_from(cache_dtype: str, model_dtype: str) -> str:
    """The namespace dtype of a vLLM KV cache.

    Args:
        cache_dtype: vLLM's ``--kv-cache-dtype`` (``auto``: the model's dtype).
        model_dtype: the model's dtype name (``bfloat16``, ``float16``, ``float32``).

    Returns:
        A :class:`~kvstore.keys.Namespace` dtype.

    Raises:
        InvalidRequestError: a KV dtype the pool's namespaces do not describe.
    """
    if cache_dtype in FP8_CACHE_DTYPES:
        return FP8_CACHE_DTYPES[cache_dtype]
    if cache_dtype != "auto":
        raise InvalidRequestError(f"kvstore connector: unsupported kv cache dtype {cache_dtype!r}")
    if model_dtype not in MODEL_DTYPES:
        raise InvalidRequestError(f"kvstore connector: unsupported model dtype {model_dtype}")
    return model_dtype


#: Between the engine's salt and a request's ``cache_salt`` in a salted namespace: vLLM's API
#: refuses a ``cache_salt`` holding ``/``, so no request salt can pose as another's or as none.
CACHE_SALT_SEPARATOR = "/"


def salted_namespace(namespace: Namespace, cache_salt: str | None) -> Namespace:
    """The namespace of a request's blocks: ``namespace`` itself without a ``cache_salt``
    (keys unchanged), else its salt extended by the request's, so that requests of different
    salts (or none) never share a block while requests of one salt still do.

    The salt becomes ``<engine salt or ''>/<cache_salt>``; the router builds the same one.

    Args:
        namespace: the engine's namespace (its salt is the connector's ``salt``, or None).
        cache_salt: the request's ``cache_salt`` (vLLM's ``Request.cache_salt``), or None.

    Raises:
        InvalidRequestError: an empty salt, or one that makes the salt over 1024 bytes.
    """
    if cache_salt is None:
        return namespace
    if not isinstance(cache_salt, str) or not cache_salt:
        raise InvalidRequestError("cache_salt must be a non-empty string")
    return replace(namespace, salt=f"{namespace.salt or ''}{CACHE_SALT_SEPARATOR}{cache_salt}")


def engine_namespace(
    *,
    served_model: str,
    revision: str | None,
    kv_dtype: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    salt: str | None,
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
) -> Namespace:
    """The pool namespace of a vLLM instance's KV: the connector saves and looks up in it, and
    the router (which has no vLLM) asks the prefix index in it.

    Two instances share KV exactly when all of these agree.

    Args:
        served_model: the served model name (``--served-model-name``, else ``--model``).
        revision: the model revision, or None.
        kv_dtype: from :func:`kv_dtype_from`.
        num_layers: attention layers whose KV a block holds.
        num_kv_heads: KV heads held by this tensor-parallel rank.
        head_dim: elements per head.
        block_size: vLLM's ``--block-size``.
        salt: the connector's namespace salt, or None.
        tp_rank: this rank.
        tp_size: tensor-parallel world size.
        mla: an MLA latent cache (``num_kv_heads`` 1, ``head_dim`` half the latent width);
            marked in the model field, so that it never meets a K/V cache of equal sizes.

    Returns:
        The namespace.

    Raises:
        InvalidRequestError: values the namespace cannot describe.
    """
    model = f"{served_model}@{revision}" if revision else served_model
    if mla:
        model += MLA_MARK
    return Namespace(
        model=model,
        dtype=kv_dtype,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        salt=salt,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


@dataclass(frozen=True)
class ConnectorConfig:
    """What ``kv_connector_extra_config`` may carry (nothing vLLM's own config already says).

    Attributes:
        master: the master's ``HOST:PORT`` or ``etcd://HOST:PORT[,...]``.
        token_file: a file holding the cluster token; else ``$KVSTORE_TOKEN`` or
            ``$KVSTORE_TOKEN_FILE``. The token itself never goes in the config (it would show on
            the command line and in vLLM's config log).
        salt: optional namespace salt (tenant or LoRA isolation).
        load_mode: ``layer`` (load inside the step, before the layers run) or ``async`` (load
            between steps, ``load_async=True``).
        timeout_s: seconds any one pool call may wait.
        retry_s: seconds to serve without the pool after it failed, before trying it again.
        advertise_url: the engine's OpenAI URL as a router reaches it; given, the scheduler
            side registers the engine in etcd (:mod:`kvstore.client.engine_registry`).
        etcd: the registry's etcd ``HOST:PORT[,...]`` (default: the master's, when it is
            ``etcd://``).
        engines_prefix: the registry's prefix in etcd.
        engine_instance: the registration's name (default: its lease id).
        engine_ttl_s: the registration's lease TTL in seconds.
        host_id, rack, zone: where the engine runs (:mod:`kvstore.topology`; None: its
            ``$KVSTORE_*`` variable, else the hostname and the default rack and zone).
    """

    master: str
    token_file: str | None = None
    salt: str | None = None
    load_mode: str = DEFAULT_LOAD_MODE
    timeout_s: float = 5.0
    retry_s: float = 10.0
    advertise_url: str | None = None
    etcd: str | None = None
    engines_prefix: str = DEFAULT_ENGINES_PREFIX
    engine_instance: str | None = None
    engine_ttl_s: int = DEFAULT_ENGINE_TTL_S
    host_id: str | None = None
    rack: str | None = None
    zone: str | None = None

    @property
    def registry_endpoints(self) -> list[Address] | None:
        """Where the engine registers (None: it does not, no ``advertise_url``)."""
        if self.advertise_url is None:
            return None
        return parse_endpoints(self.etcd if self.etcd is not None else self.master)

    def engine_record(
        self,
        kv_role: str,
        served_model: str | None,
        block_size: int | None,
        kv_events_endpoint: str | None = None,
    ) -> EngineRecord | None:
        """What the engine announces (None without ``advertise_url``).

        Args:
            kv_role: vLLM's ``kv_role``.
            served_model: the served model name.
            block_size: vLLM's block size.
            kv_events_endpoint: vLLM's KV-event publisher endpoint when it publishes (its
                bind address: ``*`` becomes the advertised host).

        Raises:
            InvalidRequestError: a kv_role or value the registry cannot describe.
        """
        if self.advertise_url is None:
            return None
        if kv_role not in KV_ROLE_TO_ROLE:
            raise InvalidRequestError(f"kvstore connector: cannot register kv_role {kv_role!r}")
        events = None
        if kv_events_endpoint and kv_events_endpoint.startswith("tcp://"):
            host = self.advertise_url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[0]
            bind, _, port = kv_events_endpoint[len("tcp://") :].rpartition(":")
            if bind in ("*", "0.0.0.0", "[::]", ""):
                bind = host
            events = f"tcp://{bind}:{port}"
        return EngineRecord(
            self.advertise_url.rstrip("/"),
            KV_ROLE_TO_ROLE[kv_role],
            model=served_model or None,
            block_size=block_size,
            kv_events=events,
            site=tuple(Site.declared(self.host_id, self.rack, self.zone).to_wire()),
        )

    @staticmethod
    def from_extra(extra: dict[str, Any] | None) -> ConnectorConfig:
        """Validate ``kv_connector_extra_config``.

        Raises:
            InvalidRequestError: no master, a token given inline, an unknown key or a bad value.
        """
        extra = dict(extra or {})
        _check_keys(extra)
        master, mode = _checked_connection(extra)
        advertise, etcd = _checked_registration(extra, master)
        prefix, instance, ttl = _checked_engine_entry(extra)
        return ConnectorConfig(
            master=master,
            token_file=extra.get("token_file"),
            salt=extra.get("salt"),
            load_mode=mode,
            timeout_s=float(extra.get("timeout_s", 5.0)),
            retry_s=float(extra.get("retry_s", 10.0)),
            advertise_url=advertise,
            etcd=etcd,
            engines_prefix=prefix,
            engine_instance=instance,
            engine_ttl_s=ttl,
            host_id=extra.get("host_id"),
            rack=extra.get("rack"),
            zone=extra.get("zone"),
        )


# The steps of ConnectorConfig.from_extra, in the order it checks: each raises the first error
# of its part, so a config with several errors names the same one as a single pass would.


def _check_keys(extra: dict[str, Any]) -> None:
    """Refuse an inline token and any key the connector does not know."""
    if "token" in extra:
        raise InvalidRequestError(
            "kvstore connector: the cluster token must not be in kv_connector_extra_config "
            "(it would show on the command line and in logs); give token_file, or set "
            "$KVSTORE_TOKEN / $KVSTORE_TOKEN_FILE"
        )
    unknown = sorted(set(extra) - CONFIG_KEYS)
    if unknown:
        raise InvalidRequestError(
            f"kvstore connector: unknown extra config {unknown}; known: {sorted(CONFIG_KEYS)}"
        )


def _checked_connection(extra: dict[str, Any]) -> tuple[str, str]:
    """The master and the load mode, after checking them and the timeouts, token file and salt."""
    master = extra.get("master")
    if not isinstance(master, str) or not master:
        raise InvalidRequestError(
            'kvstore connector: kv_connector_extra_config needs "master": "HOST:PORT" '
            'or "etcd://HOST:PORT"'
        )
    mode = extra.get("load_mode", DEFAULT_LOAD_MODE)
    if mode not in LOAD_MODES:
        raise InvalidRequestError(f"kvstore connector: load_mode must be one of {LOAD_MODES}")
    for name in ("timeout_s", "retry_s"):
        v = extra.get(name, 1.0)
        if not isinstance(v, int | float) or isinstance(v, bool) or v <= 0:
            raise InvalidRequestError(f"kvstore connector: {name} must be a positive number")
    for name in ("token_file", "salt"):
        v = extra.get(name)
        if v is not None and not (isinstance(v, str) and v):
            raise InvalidRequestError(f"kvstore connector: {name} must be a non-empty string")
    for name in ("host_id", "rack", "zone"):  # (an empty rack or zone: the default one)
        v = extra.get(name)
        if v is not None and not (isinstance(v, str) and len(v) <= MAX_NAME):
            raise InvalidRequestError(
                f"kvstore connector: {name} must be a string of at most {MAX_NAME} characters"
            )
    return master, mode


def _checked_registration(extra: dict[str, Any], master: str) -> tuple[Any, Any]:
    """``advertise_url`` and ``etcd``: registering needs an etcd to register in, and the
    registry's keys mean nothing without the URL a router would reach."""
    advertise = extra.get("advertise_url")
    etcd = extra.get("etcd")
    if advertise is not None:
        EngineRecord(advertise, "both")  # the URL's own checks, typed errors
        if etcd is None and not is_etcd_url(master):
            raise InvalidRequestError(
                'kvstore connector: "advertise_url" registers the engine in etcd: give '
                '"etcd": "HOST:PORT", or the master as "etcd://HOST:PORT"'
            )
    elif etcd is not None or "engine_instance" in extra:
        raise InvalidRequestError(
            'kvstore connector: "etcd" / "engine_instance" need "advertise_url" (the URL a '
            "router reaches this engine at)"
        )
    if etcd is not None:
        parse_endpoints(etcd)
    return advertise, etcd


def _checked_engine_entry(extra: dict[str, Any]) -> tuple[str, str | None, int]:
    """The registry prefix, the registration's name and its lease TTL, checked as the registry
    will use them so that a bad one fails at startup rather than at the first registration."""
    prefix = check_prefix(extra.get("engines_prefix", DEFAULT_ENGINES_PREFIX))
    instance = extra.get("engine_instance")
    if instance is not None:
        if not isinstance(instance, str):
            raise InvalidRequestError("kvstore connector: engine_instance must be a string")
        engine_key(prefix, "both", instance)
    ttl = extra.get("engine_ttl_s", DEFAULT_ENGINE_TTL_S)
    if not isinstance(ttl, int) or isinstance(ttl, bool) or ttl < 1:
        raise InvalidRequestError("kvstore connector: engine_ttl_s must be an integer >= 1")
    return prefix, instance, ttl

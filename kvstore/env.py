"""The ``KVSTORE_*`` environment variables: one typed reader for all of them.

Why one module: the variables used to be read in six modules, four different ways (a bare
``os.environ.get`` at import time, a lenient float parse, a strict integer parse, a string
compared with ``"0"``), so a bad value failed in one place, was ignored in another, and the
master's chunk size was frozen the moment ``kvstore.master.rpc_chunks`` was imported. Here every
variable has one name, one type, one default and one error; nothing is read at import time:
:meth:`Env.read` reads the environment when a process starts something (a daemon, a client, a
command), and the code that needs a value takes it as an argument or an option.

Tokens come only from here or from a file, never from a command line (a flag shows in ``ps``);
:func:`kvstore.auth.load_token` checks them (this module imports nothing of ours but the errors,
so that every layer, the wire protocol included, may read its settings here).

=============================  ==============  =========================================
variable                       field           meaning
=============================  ==============  =========================================
``KVSTORE_LOG_LEVEL``          log_level       default of ``kvstore --log-level``
``KVSTORE_TOKEN``              token           the cluster token itself
``KVSTORE_TOKEN_FILE``         token_file      a file holding the cluster token
``KVSTORE_MASTER``             master          the master for the SGLang / Mooncake adapters
``KVSTORE_ADMIN``              admin           admin URL of ``kvstore status|nodes|evict|drain``
``KVSTORE_CA_FILE``            ca_file         CA bundle for an ``https`` admin URL
``KVSTORE_TIMEOUT``            timeout_s       seconds per admin call
``KVSTORE_CONFIG``             config          the operator commands' TOML file
``KVSTORE_MODEL_DIR``          model_dir       the real model's folder (engines, demo)
``KVSTORE_POLL_US``            poll_us         busy-poll window after each request (µs)
``KVSTORE_PREFAULT``           prefault        pre-fault arenas in the background
``KVSTORE_CHUNK_ITEMS``        chunk_items     items a master serves per loop turn
``KVSTORE_RDMA``               rdma            RDMA on (default) or off
``KVSTORE_RDMA_DEVICE``        rdma_device     the RDMA device to use
``KVSTORE_RDMA_PORT``          rdma_port       its port (1..255)
``KVSTORE_RDMA_GID_INDEX``     rdma_gid_index  GID index (0..255; RoCE v2: usually 1 or 3)
``KVSTORE_TEST_RDMA_DEVICE``   test_rdma_dev…  tests only: pretend this RDMA device exists
``KVSTORE_HOST_ID``            host_id         this host's id for topology (default: hostname)
``KVSTORE_RACK``               rack            this host's rack (default: the default rack)
``KVSTORE_ZONE``               zone            this host's zone (default: the default zone)
=============================  ==============  =========================================
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.errors import InvalidRequestError

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
#: Default busy-poll window in microseconds (kvstore.polling says why;
#: ``.venv/bin/python bench/bench_polling.py`` measures each window).
DEFAULT_POLL_US = 200.0
#: The longest window accepted (a longer one would burn a core on every idle connection).
MAX_POLL_US = 10_000.0
#: Default items a master serves per turn of its event loop (kvstore.master.rpc_chunks).
DEFAULT_CHUNK_ITEMS = 256
TOKEN_ENV = "KVSTORE_TOKEN"
TOKEN_FILE_ENV = "KVSTORE_TOKEN_FILE"
_TRUE = ("1", "on", "yes", "true")
_FALSE = ("0", "off", "no", "false")


class EnvError(InvalidRequestError):
    """A ``KVSTORE_*`` variable holds a value we cannot use; the message names it.

    Attributes:
        variable: the variable's name, e.g. ``KVSTORE_RDMA_PORT``.
        value: what it held.
    """

    def __init__(self, variable: str, value: str, expected: str) -> None:
        super().__init__(f"${variable}={value!r}: expected {expected}")
        self.variable = variable
        self.value = value


@dataclass(frozen=True, slots=True)
class Env:
    """Every ``KVSTORE_*`` setting, parsed and validated (see the module docstring's table).

    None means "not set": the reader of each value decides what that means (its own default,
    or another source such as a config file).
    """

    log_level: str = "info"
    #: The secret itself: never shown by ``repr``; :func:`kvstore.auth.load_token` checks it.
    token: str | None = field(default=None, repr=False)
    token_file: Path | None = None
    master: str | None = None
    admin: str | None = None
    ca_file: str | None = None
    timeout_s: float | None = None
    config: Path | None = None
    model_dir: Path | None = None
    poll_us: float = DEFAULT_POLL_US
    prefault: bool = True
    chunk_items: int = DEFAULT_CHUNK_ITEMS
    rdma: bool = True
    rdma_device: str | None = None
    rdma_port: int = 1
    rdma_gid_index: int = 0
    test_rdma_device: str | None = None
    #: Where this process runs (``kvstore.topology.Site.declared`` reads these three alone).
    host_id: str | None = None
    rack: str | None = None
    zone: str | None = None

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> Env:
        """Parse and validate every ``KVSTORE_*`` variable (an empty one counts as unset).

        Args:
            environ: the environment to read (default ``os.environ``).

        Raises:
            EnvError: a variable holds a value of the wrong type or out of range (the token:
                too short, too long, or not printable ASCII).
        """
        env = {k: v for k, v in (os.environ if environ is None else environ).items() if v}
        log_level = env.get("KVSTORE_LOG_LEVEL", "info").lower()
        if log_level not in LOG_LEVELS:
            raise EnvError("KVSTORE_LOG_LEVEL", env["KVSTORE_LOG_LEVEL"], "/".join(LOG_LEVELS))
        return cls(
            log_level=log_level,
            token=env.get(TOKEN_ENV),
            token_file=_path(env, TOKEN_FILE_ENV),
            master=env.get("KVSTORE_MASTER"),
            admin=env.get("KVSTORE_ADMIN"),
            ca_file=env.get("KVSTORE_CA_FILE"),
            timeout_s=_seconds(env, "KVSTORE_TIMEOUT"),
            config=_path(env, "KVSTORE_CONFIG"),
            model_dir=_path(env, "KVSTORE_MODEL_DIR"),
            poll_us=_poll_us(env.get("KVSTORE_POLL_US")),
            prefault=_flag(env, "KVSTORE_PREFAULT", True),
            chunk_items=_integer(env, "KVSTORE_CHUNK_ITEMS", DEFAULT_CHUNK_ITEMS, 1, 1 << 30),
            rdma=_flag(env, "KVSTORE_RDMA", True),
            rdma_device=env.get("KVSTORE_RDMA_DEVICE"),
            rdma_port=_integer(env, "KVSTORE_RDMA_PORT", 1, 1, 255),
            rdma_gid_index=_integer(env, "KVSTORE_RDMA_GID_INDEX", 0, 0, 255),
            test_rdma_device=env.get("KVSTORE_TEST_RDMA_DEVICE"),
            host_id=env.get("KVSTORE_HOST_ID"),
            rack=env.get("KVSTORE_RACK"),
            zone=env.get("KVSTORE_ZONE"),
        )


def _path(env: Mapping[str, str], name: str) -> Path | None:
    return Path(env[name]) if name in env else None


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise EnvError(name, raw, "on/off (1/0, yes/no, true/false)")


def _integer(env: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = env.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise EnvError(name, raw, f"an integer in {lo}..{hi}") from None
    if not lo <= value <= hi:
        raise EnvError(name, raw, f"an integer in {lo}..{hi}")
    return value


def _seconds(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise EnvError(name, raw, "a number of seconds > 0") from None
    if not (value > 0 and math.isfinite(value)):
        raise EnvError(name, raw, "a number of seconds > 0")
    return value


def read_poll_us(environ: Mapping[str, str] | None = None) -> float:
    """``KVSTORE_POLL_US`` alone (µs), by :attr:`Env.poll_us`'s rule: every connection reads it
    when it opens, so it must cost little and must not fail on another variable's bad value."""
    return _poll_us((os.environ if environ is None else environ).get("KVSTORE_POLL_US") or None)


def _poll_us(raw: str | None) -> float:
    """The one lenient variable: a tuning knob that a client library reads must never stop it,
    so a bad window means the default, and the window is clamped to ``0..MAX_POLL_US``."""
    try:
        us = float(raw) if raw is not None else DEFAULT_POLL_US
    except ValueError:
        us = DEFAULT_POLL_US
    if not math.isfinite(us):
        us = DEFAULT_POLL_US
    return min(max(0.0, us), MAX_POLL_US)

"""Settings of the operator commands (``kvstore status|nodes|evict``), from four sources.

Order of precedence, highest first:

1. command-line flags (``--admin``, ``--token-file``, ``--ca-file``, ``--timeout``);
2. environment: ``KVSTORE_ADMIN``, ``KVSTORE_TOKEN`` (the token itself) or
   ``KVSTORE_TOKEN_FILE``, ``KVSTORE_CA_FILE``, ``KVSTORE_TIMEOUT``;
3. the TOML config file: ``--config PATH``, else ``$KVSTORE_CONFIG``, else
   ``~/.config/kvstore/config.toml`` when it exists. Keys: ``admin``, ``token_file``, ``ca_file``,
   ``timeout``, ``master`` (a token itself never goes into the file: only the path of a file
   holding it);
4. defaults: ``admin = "http://127.0.0.1:7701"``, no token, system CAs, ``timeout = 10``.

The data commands (``kvstore get|put|ls|rm``, :mod:`kvstore.cli.objects`) talk to the master's
control port instead: ``--master``, else ``$KVSTORE_MASTER``, else the file's ``master``, else
``127.0.0.1:7700`` (where ``kvstore up`` listens by default); see :func:`resolve_master`.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore import auth
from kvstore.env import Env
from kvstore.errors import InvalidRequestError

DEFAULT_ADMIN = "http://127.0.0.1:7701"
DEFAULT_TIMEOUT_S = 10.0
#: The control address of ``kvstore up``'s master with its default ``--port``.
DEFAULT_MASTER = "127.0.0.1:7700"
_FILE_KEYS = {
    "admin": str,
    "token_file": str,
    "ca_file": str,
    "timeout": (int, float),
    "master": str,
}


@dataclass(frozen=True, slots=True)
class CliConfig:
    """Where the operator commands connect and how.

    Attributes:
        admin: the master's admin URL (``http://`` or ``https://``).
        token: the cluster token, or None.
        ca_file: a CA bundle to verify an ``https`` admin URL with (None: system CAs).
        timeout: seconds per HTTP call.
        sources: for each setting, where its value came from (flag, env, file, default).
    """

    admin: str = DEFAULT_ADMIN
    token: auth.Token | None = None
    ca_file: str | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    sources: dict[str, str] = field(default_factory=dict)


def default_config_path() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "kvstore/config.toml"


def load_config_file(path: str | os.PathLike[str] | None, env: Env) -> dict[str, Any]:
    """Read the TOML config file (``{}`` when none is named and the default does not exist).

    Args:
        path: ``--config``, if given; else ``$KVSTORE_CONFIG`` (``env.config``), else the default.
        env: the environment's settings.

    Raises:
        InvalidRequestError: a named file is missing, is not TOML, or has unknown or mistyped keys.
    """
    named = path if path is not None else env.config
    target = Path(named) if named is not None else default_config_path()
    if named is None and not target.exists():
        return {}
    try:
        data = tomllib.loads(target.read_text())
    except OSError as exc:
        raise InvalidRequestError(f"cannot read config {str(target)!r}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidRequestError(f"config {str(target)!r} is not valid TOML: {exc}") from None
    for key, value in data.items():
        kind = _FILE_KEYS.get(key)
        if kind is None:
            raise InvalidRequestError(
                f"config {str(target)!r}: unknown key {key!r} (known: {', '.join(_FILE_KEYS)})"
            )
        if not isinstance(value, kind) or isinstance(value, bool):
            raise InvalidRequestError(f"config {str(target)!r}: {key!r} has the wrong type")
    return data


def resolve(
    flags: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    config_path: str | None = None,
) -> CliConfig:
    """Merge flags, environment, config file and defaults (in that order of precedence).

    Args:
        flags: values given on the command line (None = not given): ``admin``, ``token_file``,
            ``ca_file``, ``timeout``.
        env: the environment (default ``os.environ``).
        config_path: ``--config``, if given.

    Returns:
        The settings and where each came from.

    Raises:
        InvalidRequestError: a bad config file, token file, timeout or admin URL (EnvError, one
            of them, for a bad ``KVSTORE_*`` variable).
    """
    read = Env.read(env)
    file = load_config_file(config_path, read)
    from_env = {"admin": read.admin, "ca_file": read.ca_file, "timeout": read.timeout_s}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    defaults = {"admin": DEFAULT_ADMIN, "ca_file": None, "timeout": DEFAULT_TIMEOUT_S}
    for name, default in defaults.items():
        if flags.get(name) is not None:
            values[name], sources[name] = flags[name], "flag"
        elif from_env[name] is not None:
            values[name], sources[name] = from_env[name], "env"
        elif name in file:
            values[name], sources[name] = file[name], "file"
        else:
            values[name], sources[name] = default, "default"
    try:
        timeout = float(values["timeout"])
    except (TypeError, ValueError):
        raise InvalidRequestError("timeout must be a number of seconds") from None
    if not timeout > 0:
        raise InvalidRequestError("timeout must be > 0")
    admin = str(values["admin"]).rstrip("/")
    if not admin.startswith(("http://", "https://")):
        raise InvalidRequestError("the admin URL must start with http:// or https://")

    if flags.get("token_file") is not None:
        token, sources["token"] = auth.load_token(flags["token_file"], env={}), "flag"
    elif read.token or read.token_file:
        token, sources["token"] = auth.load_token(None, env), "env"
    elif "token_file" in file:
        token, sources["token"] = auth.load_token(file["token_file"], env={}), "file"
    else:
        token, sources["token"] = None, "default"
    return CliConfig(admin, token, values["ca_file"], timeout, sources)


def resolve_master(
    flag: str | None,
    env: Mapping[str, str] | None = None,
    config_path: str | None = None,
) -> tuple[str, str]:
    """The master's control address for the data commands, and where it came from.

    Args:
        flag: ``--master``, if given.
        env: the environment (default ``os.environ``).
        config_path: ``--config``, if given.

    Returns:
        ``(address, source)``, the source one of flag, env, file, default.

    Raises:
        InvalidRequestError: a bad config file (EnvError for a bad ``KVSTORE_*`` variable).
    """
    read = Env.read(env)
    file = load_config_file(config_path, read)
    if flag is not None:
        return flag, "flag"
    if read.master is not None:
        return read.master, "env"
    if "master" in file:
        return file["master"], "file"
    return DEFAULT_MASTER, "default"

"""The argument checks of the master's RPC verbs.

Every handler checks the types of its arguments with these before the service sees them, so a
wrong type is an ``InvalidRequestError`` for the caller, never an internal error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvstore.errors import InvalidRequestError, KVStoreError
from kvstore.limits import MAX_KEY_BYTES, check_wire_key
from kvstore.topology import Site


def arg(args: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """``args[name]``, which must be of ``kind`` (a bool is not an int here).

    Raises:
        InvalidRequestError: absent or of another type.
    """
    value = args.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise InvalidRequestError(f"argument {name!r} must be {getattr(kind, '__name__', kind)}")
    return value


def optional_arg(
    args: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any
) -> Any:
    """As :func:`arg`, but ``default`` where ``name`` is absent."""
    return arg(args, name, kind) if name in args else default


def site_arg(args: dict[str, Any], name: str) -> Site | None:
    """The site ``args[name]`` names (``[host_id, rack, zone]``), None where it is absent.

    Raises:
        InvalidRequestError: not a site's wire form.
    """
    return Site.from_wire(args[name]) if name in args else None


def list_arg(
    args: dict[str, Any], name: str, item: type | tuple[type, ...] | None = None
) -> list[Any]:
    """``args[name]``, a list whose every item (unless ``item`` is None) is of ``item``.

    Raises:
        InvalidRequestError: not a list, or an item of another type.
    """
    value = arg(args, name, list)
    if item is not None:
        for v in value:
            if not isinstance(v, item) or isinstance(v, bool):
                raise InvalidRequestError(
                    f"every item of {name!r} must be {getattr(item, '__name__', item)}"
                )
    return value


def per_key(raw_keys: list[Any], call: Callable[[list[bytes], list[int]], list[Any]]) -> list[Any]:
    """Run ``call(valid_keys, their_indices)``; invalid keys get their own error in place (a
    key that is already an error, put there by the tenant edge (``rpc_tenants.py``), is that
    error)."""
    out: list[Any] = [None] * len(raw_keys)
    valid_idx: list[int] = []
    valid: list[bytes] = []
    for i, k in enumerate(raw_keys):
        try:
            valid.append(check_wire_key(k))
            valid_idx.append(i)
        except KVStoreError as err:
            out[i] = k if isinstance(k, KVStoreError) else err
    for i, r in zip(valid_idx, call(valid, valid_idx), strict=True):
        out[i] = r
    return out


def list_keys_args(args: dict[str, Any], max_limit: int) -> tuple[bytes, bytes | None, int]:
    """``list_keys``' ``prefix``, ``after`` and ``limit``, checked.

    Raises:
        InvalidRequestError: a prefix that is not bytes or too long, an ``after`` that is not
            bytes, a limit outside ``1..max_limit``.
    """
    prefix = args.get("prefix", b"")
    after = args.get("after")
    limit = args.get("limit", max_limit)
    if not isinstance(prefix, bytes) or len(prefix) > MAX_KEY_BYTES:
        raise InvalidRequestError(f"prefix must be bytes of at most {MAX_KEY_BYTES}")
    if after is not None and not isinstance(after, bytes):
        raise InvalidRequestError("after must be bytes or absent")
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= max_limit:
        raise InvalidRequestError(f"limit must be an int in 1..{max_limit}")
    return prefix, after, limit

"""Tenant commands: ``kvstore tenant create|list|show|set|delete|share|unshare|shared`` and
``share-prefix|unshare-prefix|shared-prefixes``.

A tenant is a part of the pool with its own token and its own part of the key space
(:mod:`kvstore.tenants`), and optionally a quota of bytes per tier. These commands are the
operator's: they call the master's admin REST API (``/api/v1/tenants``) with the cluster token,
with the same settings, TLS and output as ``kvstore status`` (:mod:`kvstore.cli.ops`): a table
by default, JSON with ``--json``.

``create`` prints the tenant's new token once: the master keeps only its digest, so it cannot be
shown again (delete the tenant and create it again for a new one). Give it to the tenant's
clients as their token (``--token-file``, ``KVSTORE_TOKEN``).

Quotas are sizes (``20GiB``, ``512MiB``; :func:`kvstore.limits.parse_size`); ``set``'s
``none`` removes a tier's quota.

``share DIGEST`` marks a KV namespace (its digest, 32 hex characters) shared: every tenant stores
and hits its blocks as one (``/api/v1/shared-namespaces``); ``unshare`` undoes it, ``shared``
lists them.

``share-prefix NAME`` shares a leading token range of one namespace's prompts (a system prompt,
tool definitions; ``/api/v1/shared-prefixes``): its full blocks are stored once and hit by every
tenant, and every block after it stays the writing tenant's. The namespace is given as a file
(``Namespace.to_dict()`` as JSON) or computed from the model folder and the engine's block size,
as the router computes the vLLM connector's; the tokens as a file of token ids (JSON) or a text
file, tokenized with the model folder's tokenizer as vLLM tokenizes a completion prompt.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore.cli.ops import add_admin_flags, admin_client, format_table
from kvstore.errors import InvalidRequestError
from kvstore.keys import Namespace
from kvstore.limits import format_size, parse_size
from kvstore.router.requests import ModelInfo
from kvstore.tenants import check_name, check_namespace_hex
from kvstore.types import TIER_ORDER

#: The tenants' resource in the admin API.
PATH = "/api/v1/tenants"
#: The shared namespaces' resource in the admin API.
SHARED_PATH = "/api/v1/shared-namespaces"
#: The shared prefixes' resource in the admin API.
PREFIXES_PATH = "/api/v1/shared-prefixes"
#: What ``set --TIER-quota`` takes to remove a quota.
NO_QUOTA = "none"
#: The width of the field names of a tenant's printout.
WIDTH = 12


def _path(name: str) -> str:
    return f"{PATH}/{urllib.parse.quote(check_name(name), safe='')}"


def _quota_flags(args: argparse.Namespace, allow_none: bool) -> dict[str, int | None]:
    """The quotas given on the command line, by tier (None: remove that tier's quota).

    Raises:
        InvalidRequestError: a size that does not parse, or ``none`` where it is not allowed.
    """
    quotas: dict[str, int | None] = {}
    for tier in TIER_ORDER:
        text = getattr(args, f"{tier}_quota")
        if text is None:
            continue
        if text.strip().lower() == NO_QUOTA:
            if not allow_none:
                raise InvalidRequestError(
                    f"--{tier}-quota {NO_QUOTA} only removes a quota (kvstore tenant set)"
                )
            quotas[tier] = None
            continue
        try:
            quotas[tier] = parse_size(text)
        except InvalidRequestError as err:
            raise InvalidRequestError(f"--{tier}-quota: {err.message}") from None
    return quotas


def _quota_cells(quotas: dict[str, Any]) -> list[str]:
    """One cell per tier: its quota, or ``-`` for none."""
    return [
        "-" if quotas.get(tier) is None else format_size(int(quotas[tier])) for tier in TIER_ORDER
    ]


def _created(ms: Any) -> str:
    if not isinstance(ms, int | float):
        return "-"
    when = datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC)
    return when.strftime("%Y-%m-%d %H:%M:%SZ")


def _print_tenant(tenant: dict[str, Any]) -> None:
    """A tenant as ``field  value`` lines: its quotas per tier, then whatever else the master
    said of it (usage, counts) as it came."""
    quotas = tenant.get("quotas") or {}
    print(f"{'name':<{WIDTH}}{tenant.get('name')}")
    for tier, cell in zip(TIER_ORDER, _quota_cells(quotas), strict=True):
        print(f"{tier + ' quota':<{WIDTH}}{cell}")
    if "created_ms" in tenant:
        print(f"{'created':<{WIDTH}}{_created(tenant['created_ms'])}")
    for field, value in tenant.items():
        if field not in ("name", "quotas", "created_ms", "token", "nodes_pending"):
            shown = value if isinstance(value, str | int | float) else json.dumps(value)
            print(f"{field:<{WIDTH}}{shown}")


def _warn_pending(reply: dict[str, Any]) -> None:
    """Say which nodes had not taken the change when the master answered (normally none)."""
    if reply.get("nodes_pending"):
        print(
            "warning: these nodes had not confirmed the change yet (slow or gone); they take it "
            f"at their next heartbeat: {', '.join(reply['nodes_pending'])}",
            file=sys.stderr,
        )


def cmd_create(args: argparse.Namespace) -> int:
    body = {"name": check_name(args.name), "quotas": _quota_flags(args, allow_none=False)}
    reply = admin_client(args).call("POST", PATH, body)
    _warn_pending(reply)
    notice = (
        f"The token of tenant {reply['name']!r} is shown only now: the master keeps only its "
        "digest. Give it to the tenant's clients as their token (--token-file, KVSTORE_TOKEN)."
    )
    if args.json:
        print(json.dumps(reply, indent=2))
        print(notice, file=sys.stderr)  # stdout stays JSON alone
        return 0
    _print_tenant(reply)
    print(f"{'token':<{WIDTH}}{reply['token']}")
    print()
    print(notice)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    tenants = admin_client(args).call("GET", PATH)["tenants"]
    if args.json:
        print(json.dumps(tenants, indent=2))
        return 0
    rows = [
        [t["name"], *_quota_cells(t.get("quotas") or {}), _created(t.get("created_ms"))]
        for t in tenants
    ]
    quota_headers = [f"{tier.upper()} QUOTA" for tier in TIER_ORDER]
    print(format_table(["TENANT", *quota_headers, "CREATED"], rows))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    tenant = admin_client(args).call("GET", _path(args.name))
    if args.json:
        print(json.dumps(tenant, indent=2))
    else:
        _print_tenant(tenant)
    return 0


def cmd_set(args: argparse.Namespace) -> int:
    path = _path(args.name)
    quotas = _quota_flags(args, allow_none=True)
    if not quotas:
        raise InvalidRequestError(
            "give at least one of "
            + ", ".join(f"--{tier}-quota" for tier in TIER_ORDER)
            + " (a size, or none)"
        )
    reply = admin_client(args).call("PATCH", path, {"quotas": quotas})
    if args.json:
        print(json.dumps(reply, indent=2))
    else:
        _print_tenant(reply)
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    reply = admin_client(args).call("DELETE", _path(args.name))
    _warn_pending(reply)
    if args.json:
        print(json.dumps(reply))
    else:
        print(
            f"deleted tenant {args.name!r}: {reply.get('objects_removed', 0)} object(s) removed; "
            "its token opens nothing from now on"
        )
    return 0


def _shared_path(digest: str) -> str:
    """The namespace's resource, its digest checked here so a typo never reaches the master."""
    return f"{SHARED_PATH}/{check_namespace_hex(digest).hex()}"


def _change(
    args: argparse.Namespace,
    method: str,
    path: str,
    body: Any,
    say: Callable[[dict[str, Any]], str],
) -> int:
    """One sharing change on the admin API: a warning for nodes that had not taken it, then
    its answer as JSON or the line ``say`` makes of it."""
    reply = admin_client(args).call(method, path, body)
    _warn_pending(reply)
    print(json.dumps(reply) if args.json else say(reply))
    return 0


def cmd_share(args: argparse.Namespace) -> int:
    return _change(
        args,
        "PUT",
        _shared_path(args.digest),
        None,
        lambda r: f"namespace {r['digest']} is shared: every tenant stores and hits its blocks",
    )


def cmd_unshare(args: argparse.Namespace) -> int:
    return _change(
        args,
        "DELETE",
        _shared_path(args.digest),
        None,
        lambda r: f"namespace {r['digest']} is each tenant's own again (new stores and lookups)",
    )


def cmd_shared(args: argparse.Namespace) -> int:
    namespaces = admin_client(args).call("GET", SHARED_PATH)["namespaces"]
    if args.json:
        print(json.dumps(namespaces, indent=2))
    else:
        print(format_table(["SHARED NAMESPACE"], [[d] for d in namespaces]))
    return 0


def _prefix_namespace(args: argparse.Namespace) -> dict[str, Any]:
    """The shared prefix's namespace (its ``to_dict`` form), from ``--namespace-file`` or from
    ``--model-dir`` and ``--block-size`` (the vLLM connector's, as the router computes it)."""
    if args.namespace_file is not None:
        raw = json.loads(Path(args.namespace_file).read_text())
        return Namespace.from_dict(raw).to_dict()
    if args.model_dir is None or args.block_size is None:
        raise InvalidRequestError(
            "give the namespace: --namespace-file, or --model-dir and --block-size"
        )
    model = ModelInfo.load({"id": args.model or Path(args.model_dir).name}, args.model_dir)
    ns = model.namespace(
        args.block_size,
        args.kv_cache_dtype,
        dtype=args.dtype,
        salt=args.salt,
        tp_size=args.tp_size,
    )
    return ns.to_dict()


def _prefix_tokens(args: argparse.Namespace) -> list[int]:
    """The shared prefix's token ids: ``--tokens-file`` (a JSON list), or ``--text-file``
    tokenized with ``--model-dir``'s tokenizer, special tokens added (vLLM's completion
    prompt)."""
    if args.tokens_file is not None:
        tokens = json.loads(Path(args.tokens_file).read_text())
        if not isinstance(tokens, list):
            raise InvalidRequestError(f"{args.tokens_file}: must hold a JSON list of token ids")
        return tokens
    if args.text_file is None or args.model_dir is None:
        raise InvalidRequestError("give the tokens: --tokens-file, or --text-file and --model-dir")
    from transformers import AutoTokenizer  # (heavy; only this command needs it)

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    return list(tokenizer(Path(args.text_file).read_text())["input_ids"])


def _prefix_path(name: str) -> str:
    return f"{PREFIXES_PATH}/{urllib.parse.quote(check_name(name), safe='')}"


def _prefix_line(what: str) -> Callable[[dict[str, Any]], str]:
    return lambda r: (
        f"prefix {r['name']} ({r['num_tokens']} tokens, {r['num_blocks']} blocks of"
        f" namespace {r['namespace']}) {what}"
    )


def cmd_share_prefix(args: argparse.Namespace) -> int:
    body = {"namespace": _prefix_namespace(args), "tokens": _prefix_tokens(args)}
    say = _prefix_line("is shared: every tenant stores and hits its blocks")
    return _change(args, "PUT", _prefix_path(args.name), body, say)


def cmd_unshare_prefix(args: argparse.Namespace) -> int:
    say = _prefix_line("is each tenant's own again (new stores and lookups)")
    return _change(args, "DELETE", _prefix_path(args.name), None, say)


def cmd_shared_prefixes(args: argparse.Namespace) -> int:
    prefixes = admin_client(args).call("GET", PREFIXES_PATH)["prefixes"]
    if args.json:
        print(json.dumps(prefixes, indent=2))
        return 0
    rows = [
        [p["name"], p["namespace"], p["model"], str(p["num_tokens"]), str(p["num_blocks"])]
        for p in prefixes
    ]
    print(format_table(["SHARED PREFIX", "NAMESPACE", "MODEL", "TOKENS", "BLOCKS"], rows))
    return 0


def _prefix_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="NAME", help="a-z, 0-9, '-', '_', starting with a letter")
    p.add_argument(
        "--namespace-file", metavar="FILE", help="the namespace, Namespace.to_dict() as JSON"
    )
    p.add_argument("--model-dir", metavar="DIR", help="the model folder (config and tokenizer)")
    p.add_argument(
        "--model", metavar="NAME", help="the served model name (default: the folder's name)"
    )
    p.add_argument("--block-size", type=int, metavar="N", help="the engines' --block-size")
    p.add_argument("--kv-cache-dtype", default="auto", help="the engines' --kv-cache-dtype")
    p.add_argument("--dtype", default=None, help="the engines' --dtype (default: the config's)")
    p.add_argument("--salt", default=None, help="the connector's namespace salt, if any")
    p.add_argument("--tp-size", type=int, default=1, help="the engines' tensor-parallel size")
    p.add_argument("--tokens-file", metavar="FILE", help="the range's token ids, a JSON list")
    p.add_argument(
        "--text-file", metavar="FILE", help="the range's text (tokenized with --model-dir)"
    )


def _quota_args(p: argparse.ArgumentParser, removable: bool) -> None:
    for tier in TIER_ORDER:
        what = "a size like 20GiB" + (f", or {NO_QUOTA} to remove it" if removable else "")
        p.add_argument(
            f"--{tier}-quota",
            default=None,
            metavar="SIZE",
            help=f"the most bytes the tenant may hold in {tier.upper()} ({what})",
        )


def add_parsers(sub: Any) -> None:
    """Register ``tenant`` and its subcommands on the ``kvstore`` subparsers."""
    epilog = (
        "settings: flags > environment > config file > defaults; the cluster token is "
        "needed (see `kvstore.cli.settings`)"
    )
    group = sub.add_parser(
        "tenant", help="tenants: their tokens, quotas and keys (operator)", epilog=epilog
    )
    verbs = group.add_subparsers(dest="tenant_command", required=True)
    p = verbs.add_parser("create", help="create a tenant and print its token once", epilog=epilog)
    add_admin_flags(p)
    p.add_argument("name", metavar="NAME", help="a-z, 0-9, '-', '_', starting with a letter")
    _quota_args(p, removable=False)
    p.set_defaults(func=cmd_create)
    p = verbs.add_parser("list", help="every tenant and its quotas", epilog=epilog)
    add_admin_flags(p)
    p.set_defaults(func=cmd_list)
    p = verbs.add_parser("show", help="one tenant", epilog=epilog)
    add_admin_flags(p)
    p.add_argument("name", metavar="NAME", help="the tenant")
    p.set_defaults(func=cmd_show)
    p = verbs.add_parser("set", help="change a tenant's quotas", epilog=epilog)
    add_admin_flags(p)
    p.add_argument("name", metavar="NAME", help="the tenant")
    _quota_args(p, removable=True)
    p.set_defaults(func=cmd_set)
    p = verbs.add_parser(
        "delete", help="delete a tenant, its objects, and its token", epilog=epilog
    )
    add_admin_flags(p)
    p.add_argument("name", metavar="NAME", help="the tenant")
    p.set_defaults(func=cmd_delete)
    digest_help = "the namespace's digest, 32 hex characters"
    p = verbs.add_parser(
        "share", help="share a KV namespace's blocks between every tenant", epilog=epilog
    )
    add_admin_flags(p)
    p.add_argument("digest", metavar="DIGEST", help=digest_help)
    p.set_defaults(func=cmd_share)
    p = verbs.add_parser(
        "unshare", help="make a KV namespace each tenant's own again", epilog=epilog
    )
    add_admin_flags(p)
    p.add_argument("digest", metavar="DIGEST", help=digest_help)
    p.set_defaults(func=cmd_unshare)
    p = verbs.add_parser("shared", help="the shared KV namespaces", epilog=epilog)
    add_admin_flags(p)
    p.set_defaults(func=cmd_shared)
    p = verbs.add_parser(
        "share-prefix",
        help="share a leading token range (a system prompt) between every tenant",
        epilog=epilog,
    )
    add_admin_flags(p)
    _prefix_args(p)
    p.set_defaults(func=cmd_share_prefix)
    p = verbs.add_parser(
        "unshare-prefix", help="make a shared prefix each tenant's own again", epilog=epilog
    )
    add_admin_flags(p)
    p.add_argument("name", metavar="NAME", help="the shared prefix")
    p.set_defaults(func=cmd_unshare_prefix)
    p = verbs.add_parser("shared-prefixes", help="the shared prefixes", epilog=epilog)
    add_admin_flags(p)
    p.set_defaults(func=cmd_shared_prefixes)

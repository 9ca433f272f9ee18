"""``--config FILE`` of the daemons (``kvstore up|master|node|router``): their flags in TOML.

Every flag of the command is a key, spelled as the flag without its dashes (``admin_port`` or
``admin-port`` for ``--admin-port``), with a TOML value of the flag's kind: a number for a
number, ``true``/``false`` for a switch (``shm = true``, ``public_reads = false``), a string
for the rest (``dram = "4GiB"``), a list for a flag given several times (``prefill = [...]``).
A table named after a command applies to that command only, so one file can serve a machine::

    token_file = "/etc/kvstore/token"     # every command
    [master]
    port = 7700
    [node]
    master = "10.0.0.1:7700"
    data_dir = "/var/lib/kvstore"
    dram = "64GiB"

A flag given on the command line wins over the file. A key that is no flag of the command, or a
value of the wrong kind, stops the command with one line naming the key and the file. (The
operator commands' ``--config``, :mod:`kvstore.cli.settings`, is another file: where to
connect, not how to serve.)
"""

from __future__ import annotations

import argparse
import difflib
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore.errors import InvalidRequestError, KVStoreError

#: The commands that take ``--config FILE`` (and the tables a file may hold).
DAEMONS = ("up", "master", "node", "router")
#: The flag's destination; the operator commands' ``config`` is another file.
DEST = "daemon_config"
_BOOL_ACTIONS = (
    argparse._StoreTrueAction,
    argparse._StoreFalseAction,
    argparse.BooleanOptionalAction,
)


def add_config_flag(p: argparse.ArgumentParser) -> None:
    """Give a daemon's parser ``--config FILE``."""
    p.add_argument(
        "--config",
        dest=DEST,
        metavar="FILE",
        default=None,
        help="TOML file of this command's flags (key: the flag without --, e.g. "
        'admin_port = 7701 or dram = "4GiB"; a [node] table: kvstore node only); '
        "flags on the command line win",
    )


def find(argv: Sequence[str]) -> tuple[str | None, str | None]:
    """The daemon command in ``argv`` and its ``--config`` value (None, None: neither)."""
    at, command = 0, None
    while at < len(argv):  # the first word that is no global option (--log-level LEVEL)
        if argv[at] == "--log-level":
            at += 2
        elif argv[at].startswith("-"):
            at += 1
        else:
            command = argv[at]
            break
    if command not in DAEMONS:
        return None, None
    rest = list(argv[at + 1 :])
    for i, arg in enumerate(rest):
        if arg == "--config" and i + 1 < len(rest):
            return command, rest[i + 1]
        if arg.startswith("--config="):
            return command, arg.split("=", 1)[1]
    return command, None


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise AssertionError("the kvstore parser has no subcommands")


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each key a file may use (dest and every long flag, ``-`` as ``_``) and its action."""
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        if action.dest in ("help", DEST):
            continue
        out[action.dest] = action
        for flag in action.option_strings:
            if flag.startswith("--") and not flag.startswith("--no-"):
                out[flag[2:].replace("-", "_")] = action
    return out


def _value(action: argparse.Action, value: Any, where: str) -> Any:
    """``value`` as the flag would have parsed it; InvalidRequestError where it cannot be."""
    if isinstance(action, _BOOL_ACTIONS):
        if not isinstance(value, bool):
            raise InvalidRequestError(f"{where} must be true or false, not {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):
        if not isinstance(value, list):
            raise InvalidRequestError(f"{where} must be a list, e.g. [{value!r}]")
        return [_one(action, v, where) for v in value]
    return _one(action, value, where)


def _one(action: argparse.Action, value: Any, where: str) -> Any:
    if isinstance(value, bool | dict | list):
        raise InvalidRequestError(f"{where} must be a single number or string, not {value!r}")
    kind = action.type
    if kind is None:
        if not isinstance(value, str):
            raise InvalidRequestError(f'{where} must be a string, e.g. "{value}"')
    elif kind in (int, float):
        if isinstance(value, str) or (kind is int and isinstance(value, float)):
            raise InvalidRequestError(f"{where} must be a number ({kind.__name__}), not {value!r}")
        value = kind(value)
    else:  # a converter of the flag's own (a size, a lower-cased name): as on the command line
        try:
            value = kind(value)  # type: ignore[operator]
        except KVStoreError as err:
            raise InvalidRequestError(f"{where}: {err.message}") from None
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"{where}: {exc}") from None
    if action.choices is not None and value not in action.choices:
        known = ", ".join(map(str, action.choices))
        raise InvalidRequestError(f"{where} must be one of {known}, not {value!r}")
    return value


def load(path: str, command: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The flags of ``command`` that the file at ``path`` sets, by destination, converted.

    Raises:
        InvalidRequestError: the file is missing or not TOML, a key is no flag of the command,
            or a value is not of the flag's kind (each message names the key and the file).
    """
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise InvalidRequestError(f"cannot read config {path!r}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidRequestError(f"config {path!r} is not valid TOML: {exc}") from None
    items = [(k, v) for k, v in data.items() if k not in DAEMONS]
    table = data.get(command, {})
    if not isinstance(table, dict):
        raise InvalidRequestError(f"config {path!r}: [{command}] must be a table")
    items += list(table.items())  # after the top level: the command's own table wins
    flags = _flags(parser)
    out: dict[str, Any] = {}
    for key, value in items:
        action = flags.get(key.replace("-", "_"))
        if action is None:
            close = difflib.get_close_matches(key.replace("-", "_"), list(flags), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise InvalidRequestError(
                f"config {path!r}: unknown key {key!r}: kvstore {command} has no "
                f"--{key.replace('_', '-')} flag" + hint
            )
        out[action.dest] = _value(action, value, f"config {path!r}: {key!r}")
    return out


def apply(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str | None:
    """Make the ``--config`` file of a daemon command in ``argv`` its parser's defaults, so
    that flags on the command line win; returns the command (None: no daemon command).

    A flag given several times (``--prefill``) takes the file's list only where the command
    line gives none of it: the command line wins there too, it does not add to the file.

    Raises:
        InvalidRequestError: a bad file (see :func:`load`).
    """
    command, path = find(argv)
    if command is None or path is None:
        return command
    sub = _subparser(parser, command)
    values = load(path, command, sub)
    for action in sub._actions:
        if action.dest in values:
            action.required = False  # given by the file (e.g. kvstore node's --master)
    lists = {
        a.dest: values.pop(a.dest)
        for a in sub._actions
        if isinstance(a, argparse._AppendAction) and a.dest in values
    }
    sub.set_defaults(**values)
    if lists:
        sub.set_defaults(**{DEST + "_lists": lists})
    return command


def fill_lists(args: argparse.Namespace) -> None:
    """After parsing: the file's lists where the command line gave none (see :func:`apply`)."""
    for dest, values in (getattr(args, DEST + "_lists", None) or {}).items():
        if not getattr(args, dest, None):
            setattr(args, dest, values)

"""What every command group of the ``kvstore`` command shares: the help formatter, the event
loop, the security and wire-deadline flags and the one-line error text."""

from __future__ import annotations

import argparse
import asyncio
import errno
import re
from collections.abc import Coroutine
from typing import Any

from kvstore import auth, protocol
from kvstore.serving import WireDeadlines

try:  # an optional speed-up: the standard loop serves as well
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency where it builds
    uvloop = None  # type: ignore[assignment]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each flag's default, except where there is none to show (None, a
    switch that is off) or the help already says it in words."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose subcommands (and theirs) all use :class:`HelpFormatter`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def run_loop(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` on uvloop where it is installed, else on asyncio's own loop."""
    if uvloop is not None:
        return uvloop.run(coro)
    return asyncio.run(coro)


def derived_port(base: int, explicit: int | None, offset: int) -> int:
    """``explicit``, else ``base + offset`` (0 when ``base`` is 0: any free port)."""
    if explicit is not None:
        return explicit
    return base + offset if base else 0


def add_security_flags(p: argparse.ArgumentParser, tls: bool) -> None:
    """``--token-file``, ``--public-reads`` and (with ``tls``) ``--tls-cert`` / ``--tls-key``.

    NOTE: a token itself never goes on a command line (it would show in ``ps``): only the path
    of a file holding it, or the environment (``kvstore.env``).
    """
    p.add_argument(
        "--token-file",
        default=None,
        help="file holding the cluster token (else env KVSTORE_TOKEN / KVSTORE_TOKEN_FILE; "
        "none: no authentication)",
    )
    p.add_argument(
        "--public-reads",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve read-only REST endpoints without the token (mutating calls always need it)",
    )
    if tls:
        p.add_argument("--tls-cert", default=None, help="PEM certificate: serve REST over HTTPS")
        p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")


def add_wire_flags(p: argparse.ArgumentParser) -> None:
    """``--frame-timeout`` and ``--hello-timeout``: a server's wire deadlines
    (:class:`~kvstore.serving.WireDeadlines`; read them back with :func:`wire_deadlines`)."""
    p.add_argument(
        "--frame-timeout",
        type=float,
        default=protocol.FRAME_TIMEOUT_S,
        metavar="SECONDS",
        help="seconds a request frame has, once its first byte arrived, to arrive whole (plus "
        f"its body at {protocol.MIN_FRAME_RATE / (1 << 20):g} MiB/s); a half-sent one is dropped",
    )
    p.add_argument(
        "--hello-timeout",
        type=float,
        default=auth.HELLO_TIMEOUT_S,
        metavar="SECONDS",
        help="seconds a new connection has to prove the cluster token (with a token)",
    )


def wire_deadlines(args: argparse.Namespace) -> WireDeadlines:
    """The wire deadlines :func:`add_wire_flags` parsed.

    Raises:
        InvalidRequestError: a value that is not a finite number > 0.
    """
    return WireDeadlines(frame_s=args.frame_timeout, hello_s=args.hello_timeout)


def os_error_text(exc: OSError) -> str:
    """``exc`` as one line, without Python's ``[Errno N]`` prefix."""
    text = str(exc)
    if text.startswith("[Errno"):
        text = text.split("] ", 1)[-1]
    if exc.filename is not None and str(exc.filename) not in text:
        text = f"{text}: {exc.filename}"
    return text


#: The flags that choose a port a daemon binds: (attribute, flag, offset from ``--port`` where
#: the flag is left out and its default is derived, 0: not derived).
PORT_FLAGS = (
    ("port", "--port", 0),
    ("admin_port", "--admin-port", 1),
    ("node_port", "--node-port", 2),
)


def port_in_use_text(exc: OSError, args: argparse.Namespace) -> str | None:
    """One line for a bind that failed because another process holds the port: which port,
    and which flag chooses another; None when ``exc`` is something else.

    The port is the one whose number the error names (asyncio's and ``socket.create_server``'s
    errors do); else every port the command asked for (``http.server``'s error names none).
    """
    if exc.errno != errno.EADDRINUSE:
        return None
    base = getattr(args, "port", None) or 0
    asked: list[tuple[int, str]] = []
    for attr, flag, offset in PORT_FLAGS:
        if not hasattr(args, attr):
            continue
        port = getattr(args, attr)
        if port is None and offset and base:
            port = base + offset
        if port:
            asked.append((port, flag))
    if getattr(args, "parent_pipe", None) is not None:  # the storage node of `kvstore up`
        asked = [(port, "kvstore up --node-port") for port, flag in asked if flag == "--port"]
    named = [(port, flag) for port, flag in asked if re.search(rf"\b{port}\b", str(exc))]
    chosen = named or asked
    if not chosen:
        return None
    fix = "stop it, or choose another port with {} (0 picks a free one)"
    if len(chosen) == 1:
        port, flag = chosen[0]
        where = f"port {port}" + (f" on {args.host}" if getattr(args, "host", None) else "")
        return f"{where} is already in use (another kvstore may be running): " + fix.format(flag)
    ports = ", ".join(f"{port} ({flag})" for port, flag in chosen)
    return f"one of ports {ports} is already in use: " + fix.format("its flag")

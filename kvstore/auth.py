"""The cluster token: one shared secret that every connection proves it knows.

Control plane (client/node → master) and data plane (client → node): when the server has a token,
the first frame of every connection must be a ``hello`` request carrying it. A connection that
skips it, or sends a wrong one, gets one ``UNAUTHENTICATED`` error and is closed. A server without
a token answers ``hello`` and serves everyone, so everything behaves as before when no token is
configured anywhere.

Tenants (:mod:`kvstore.tenants`): a server that knows tenant tokens binds a connection whose
``hello`` carries one to that tenant (:attr:`Gate.tenant`); the cluster token binds none (the
operator). A deleted tenant's connections are refused at their next request.

Admin REST: the token is a bearer token (``Authorization: Bearer <token>``).

NOTE: a token never appears in a log line, an error body, a ``repr`` or a process title: it is
read from a file (``--token-file``) or the environment (``KVSTORE_TOKEN``), never from a flag
value, and :class:`Token` masks itself.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import ssl
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvstore import protocol
from kvstore.env import TOKEN_ENV as TOKEN_ENV  # the variables' names, where they are read
from kvstore.env import TOKEN_FILE_ENV as TOKEN_FILE_ENV
from kvstore.env import Env
from kvstore.errors import InvalidRequestError, UnauthenticatedError
from kvstore.tenants import TenantDirectory

HELLO_VERB = "hello"
MIN_TOKEN_BYTES = 16
MAX_TOKEN_BYTES = 4096
#: Largest body a connection may send before it proved the token: a ``hello`` and its token.
PRE_AUTH_MAX_BODY = MAX_TOKEN_BYTES + 1024
#: Seconds a connection has, from accept, to complete its ``hello`` (token servers only).
#: The default: each server takes its own from ``kvstore.serving.WireDeadlines``.
HELLO_TIMEOUT_S = 5.0
#: Connections per server that have not proved the token yet. A new one over the bound
#: closes the oldest: a flood cannot lock out a client that sends its hello right away.
MAX_UNAUTHENTICATED = 256


class Token:
    """A cluster token. Compares in constant time; prints as ``Token(***)``."""

    __slots__ = ("_secret",)

    def __init__(self, secret: str | bytes) -> None:
        raw = secret.encode() if isinstance(secret, str) else bytes(secret)
        raw = raw.strip()
        if not MIN_TOKEN_BYTES <= len(raw) <= MAX_TOKEN_BYTES:
            raise InvalidRequestError(
                f"a cluster token must be {MIN_TOKEN_BYTES}..{MAX_TOKEN_BYTES} bytes"
            )
        if not (raw.isascii() and raw.decode().isprintable()) or b" " in raw:
            # It travels in HTTP headers: visible ASCII only.
            raise InvalidRequestError("a cluster token must be printable ASCII without spaces")
        self._secret = raw

    def matches(self, offered: object) -> bool:
        """Whether ``offered`` (str or bytes off the wire) is this token, in constant time."""
        if isinstance(offered, str):
            offered = offered.encode("utf-8", "surrogateescape")
        if not isinstance(offered, bytes):
            return False
        return hmac.compare_digest(self._secret, offered)

    def reveal(self) -> bytes:
        """The secret itself, to put on the wire. Never log it."""
        return self._secret

    def __repr__(self) -> str:
        return "Token(***)"

    __str__ = __repr__

    def __reduce__(self) -> Any:  # pickling would copy the secret somewhere unexpected
        raise TypeError("a Token cannot be pickled")


def load_token(
    token_file: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> Token | None:
    """The cluster token from ``token_file``, else ``$KVSTORE_TOKEN``, else
    ``$KVSTORE_TOKEN_FILE``; None when none is configured.

    Args:
        token_file: a file holding the token (surrounding whitespace is ignored).
        env: the environment to read (default ``os.environ``; see :class:`kvstore.env.Env`).

    Returns:
        The token, or None (no authentication).

    Raises:
        InvalidRequestError: the file cannot be read or the token is too short or too long.
    """
    settings = Env.read(env)
    if token_file is None and settings.token:
        return Token(settings.token)
    path = token_file if token_file is not None else settings.token_file
    if path is None:
        return None
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidRequestError(
            f"cannot read token file {str(path)!r}: {exc.strerror or exc}"
        ) from None
    return Token(raw)


# ------------------------------------------------------------------ servers
class Gate:
    """Per-connection state of the handshake on a server.

    ``screen(request)`` runs before a request is dispatched: it returns None to dispatch the
    request, or a reply frame to send instead (and whether to close the connection after it).
    """

    __slots__ = ("_seen", "_tenants", "_token", "open", "tenant")

    def __init__(self, token: Token | None, tenants: TenantDirectory | None = None) -> None:
        self._token = token
        self._tenants = tenants
        self.open = token is None
        #: The tenant this connection is bound to at ``hello`` (None: the operator's).
        self.tenant: str | None = None
        self._seen = -1  # the directory version the binding was last checked against

    def check_header(self, header: protocol.FrameHeader) -> None:
        """Refuse, from its header alone, a frame too large for a connection that has not
        proved the token yet: nothing big is read or decoded before authentication.

        Raises:
            UnauthenticatedError: not authenticated yet and the body is over
                :data:`PRE_AUTH_MAX_BODY` or a payload follows (the caller closes).
        """
        if self.open:
            return
        if header.body_len > PRE_AUTH_MAX_BODY or header.payload_len:
            raise UnauthenticatedError(
                "this server needs a cluster token: send hello first (a small frame)"
            )

    def screen(self, request: protocol.Request) -> tuple[bytes, bool] | None:
        if request.verb == HELLO_VERB:
            offered = request.args.get("token")
            tenant = self._tenants.resolve(offered) if self._tenants is not None else None
            if tenant is None and self._token is not None and not self._token.matches(offered):
                err = UnauthenticatedError("wrong cluster token")
                return protocol.encode_error(request.req_id, err), True
            self.open, self.tenant = True, tenant
            self._seen = self._tenants.version if self._tenants is not None else -1
            reply: dict[str, Any] = {"authenticated": True}
            if tenant is not None:
                reply["tenant"] = tenant
            return protocol.encode_response(request.req_id, reply), False
        if not self.open:
            err = UnauthenticatedError("this server needs a cluster token: send hello first")
            return protocol.encode_error(request.req_id, err), True
        tenants = self._tenants
        if self.tenant is not None and tenants is not None and tenants.version != self._seen:
            if not tenants.has(self.tenant):
                self.open = False  # deleted: its token no longer opens anything
                err = UnauthenticatedError(f"tenant {self.tenant!r} was deleted")
                return protocol.encode_error(request.req_id, err), True
            self._seen = tenants.version
        return None


class PendingConnections:
    """The connections of one server that have not proved the token yet, oldest first.

    :meth:`add` a connection at accept with a callable that closes it; :meth:`discard` it
    once it authenticated or closed. Over ``limit``, adding closes the oldest pending ones.
    Thread-safe (the node serves each connection on its own thread).
    """

    def __init__(self, limit: int = MAX_UNAUTHENTICATED) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._pending: dict[object, Callable[[], None]] = {}  # insertion order: oldest first

    def add(self, conn: object, close: Callable[[], None]) -> None:
        """Track ``conn``; close the oldest pending connections beyond the limit."""
        evicted: list[Callable[[], None]] = []
        with self._lock:
            self._pending[conn] = close
            while len(self._pending) > self.limit:
                oldest = next(iter(self._pending))
                evicted.append(self._pending.pop(oldest))
        for fn in evicted:  # outside the lock: closing may run other code
            with contextlib.suppress(Exception):
                fn()

    def discard(self, conn: object) -> None:
        with self._lock:
            self._pending.pop(conn, None)

    def __len__(self) -> int:
        return len(self._pending)


# ------------------------------------------------------------------ clients
def hello(conn: protocol.FramedSocket, token: Token | None) -> None:
    """Prove the token on a fresh connection (nothing to do without a token).

    Raises:
        UnauthenticatedError: the server refused the token.
    """
    if token is not None:
        conn.call(HELLO_VERB, {"token": token.reveal()})


# ------------------------------------------------------------------ REST
def bearer_ok(authorization: str | None, token: Token | None) -> bool:
    """Whether an ``Authorization`` header carries the token (always true without a token)."""
    if token is None:
        return True
    if not authorization:
        return False
    scheme, _, value = authorization.partition(" ")
    return scheme.lower() == "bearer" and token.matches(value.strip())


# ------------------------------------------------------------------ TLS
def tls_context(cert_file: str | None, key_file: str | None) -> ssl.SSLContext | None:
    """A server TLS context for the admin REST API, or None without a certificate.

    Raises:
        InvalidRequestError: only one of the two files given, or they cannot be loaded.
    """
    if cert_file is None and key_file is None:
        return None
    if cert_file is None or key_file is None:
        raise InvalidRequestError("--tls-cert and --tls-key go together")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidRequestError(f"cannot load the TLS certificate or key: {exc}") from None
    return ctx

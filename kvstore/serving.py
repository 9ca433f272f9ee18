"""The rules of serving request frames, shared by the master's and the nodes' servers.

Two servers speak the wire protocol (``kvstore.protocol``): the master's control server (one
asyncio loop, ``kvstore.master.server``) and a node's data server (one thread per connection on
blocking sockets, ``kvstore.node.server``). Each connection of either runs the same loop: wait
for a frame, read its header and body within their deadlines, check them, dispatch the request,
write the reply. The I/O of that loop differs (an awaited stream reader; a socket with
timeouts), the rules do not, and the rules are what must never drift apart between the two.
So they live here, once, in :class:`FrameSession`, which does no I/O of its own (its
:meth:`~FrameSession.next_header` reads through the blocking socket a node hands it):

* deadlines (:class:`WireDeadlines`, each server's option): once a frame's first byte has
  arrived, its header and body must arrive within ``frame_s`` plus the body at ``min_rate``
  (a half-sent frame holds no server); before the cluster token is proved, the whole hello must
  arrive within ``hello_s`` of the accept;
* what a header alone refuses: a frame that is not a request, anything large (or any payload)
  before the token is proved (``auth.Gate``); over-long bodies and payloads are refused while
  decoding the header, at the limits each server gives its reader;
* what a body refuses: undecodable msgpack, any verb before the hello, and, where the server
  names its verbs (the node), an unknown verb or a payload longer than its verb takes;
* how a refused request is answered (:class:`Refusal`): its payload read and dropped when
  small, so the connection stays usable; never read when large (answer, then hang up).

Why not one loop with two drivers: the node's loop is its data path's hot loop (each request
runs it once) and the master's interleaves long polls and fencing with asyncio; a loop written
once would need an I/O driver per model anyway, for nothing the rules above do not already
share.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

from kvstore import auth, protocol
from kvstore.errors import InvalidRequestError, KVStoreError, ProtocolError, UnknownVerbError
from kvstore.tenants import TenantDirectory

#: A refused request's payload up to this size is read and dropped (the connection stays
#: usable); a larger one is not read at all: the connection is closed after the answer.
MAX_DISCARD = 1 << 20


@dataclass(frozen=True, slots=True)
class WireDeadlines:
    """How long a server waits for a peer's bytes: a server option (``--frame-timeout``,
    ``--hello-timeout``), the defaults those of the protocol (``protocol.FRAME_TIMEOUT_S``,
    ``protocol.MIN_FRAME_RATE``, ``auth.HELLO_TIMEOUT_S``). Validated on creation.

    Why an option and not only the module constants: an operator on a slow or lossy network
    may need longer ones, a hardened edge shorter ones, and tests of the deadlines run the
    servers with short ones instead of waiting out the defaults. Only servers read it: a
    client's own timeouts are its own.

    Attributes:
        frame_s: seconds a frame's header and body have, once its first byte arrived.
        hello_s: seconds a connection has, from accept, to complete its ``hello`` (servers
            with a token only).
        min_rate: bytes per second a large frame body must at least arrive at (it adds
            ``body_len / min_rate`` to ``frame_s``).

    Raises:
        InvalidRequestError: a value that is not a finite number > 0.
    """

    frame_s: float = protocol.FRAME_TIMEOUT_S
    hello_s: float = auth.HELLO_TIMEOUT_S
    min_rate: float = protocol.MIN_FRAME_RATE

    def __post_init__(self) -> None:
        for name, what in (
            ("frame_s", "--frame-timeout"),
            ("hello_s", "--hello-timeout"),
            ("min_rate", "the minimum frame rate"),
        ):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise InvalidRequestError(f"{what} must be a finite number > 0, not {value!r}")

    def frame_deadline_s(self, body_len: int) -> float:
        """Seconds the rest of a frame (header and a body of ``body_len`` bytes) may take."""
        return self.frame_s + body_len / self.min_rate


#: The protocol's deadlines (what a server uses unless told otherwise).
DEFAULT_DEADLINES = WireDeadlines()


@dataclass(frozen=True, slots=True)
class Refusal:
    """The answer to a request that is not dispatched.

    Attributes:
        frame: the response frame to send.
        skip: payload bytes to read and drop before sending it.
        hang_up: close the connection once the frame is sent.
    """

    frame: bytes
    skip: int
    hang_up: bool


def refuse(req_id: int, err: KVStoreError, header: protocol.FrameHeader) -> Refusal:
    """The answer to a request refused with ``err``: its payload skipped when small, never
    read when large (a 1 TiB ``ping`` costs nothing: the connection is closed instead)."""
    frame = protocol.encode_error(req_id, err)
    if header.payload_len > MAX_DISCARD:
        return Refusal(frame, 0, True)
    return Refusal(frame, header.payload_len, False)


class FrameSession:
    """The serving rules for one connection (see the module docstring).

    Args:
        token: the cluster token the connection must prove first (None: no handshake).
        accepted_at: when the connection was accepted, on the clock the caller's deadlines use.
        payload_limits: the most payload bytes each verb takes (0: none), for a server that
            names its verbs; None: the server checks verbs itself and its header limits refuse
            every payload (the master).
        deadlines: the server's wire deadlines.
        tenants: the tenant tokens the server knows (None: the cluster token only).
    """

    __slots__ = ("deadlines", "gate", "hello_by", "payload_limits")

    def __init__(
        self,
        token: auth.Token | None,
        accepted_at: float,
        payload_limits: Mapping[str, int] | None = None,
        deadlines: WireDeadlines = DEFAULT_DEADLINES,
        tenants: TenantDirectory | None = None,
    ) -> None:
        self.gate = auth.Gate(token, tenants)
        self.deadlines = deadlines
        #: The whole hello must have arrived by this time (while not authenticated).
        self.hello_by = accepted_at + deadlines.hello_s
        self.payload_limits = payload_limits

    @property
    def tenant(self) -> str | None:
        """The tenant the connection proved at ``hello`` (None: the operator's)."""
        return self.gate.tenant

    @property
    def authenticated(self) -> bool:
        """Whether the token is proved (or none is needed): frames may take their time to
        start, and once started have :meth:`WireDeadlines.frame_deadline_s`."""
        return self.gate.open

    def header_deadline(self, started: float) -> float:
        """When the header of a frame whose first byte arrived at ``started`` must be in."""
        if self.gate.open:
            return started + self.deadlines.frame_s
        return self.hello_by

    def body_deadline(self, started: float, header: protocol.FrameHeader) -> float:
        """When the body of a frame whose first byte arrived at ``started`` must be in."""
        if self.gate.open:
            return started + self.deadlines.frame_deadline_s(header.body_len)
        return self.hello_by

    def check_header(self, header: protocol.FrameHeader) -> None:
        """Refuse a frame from its header alone; the caller answers (request id 0) and hangs
        up, since the framing cannot be trusted after it.

        Raises:
            ProtocolError: not a request frame.
            UnauthenticatedError: too large for a connection that has not proved the token.
        """
        if header.kind != protocol.KIND_REQUEST:
            raise ProtocolError("expected a request frame")
        self.gate.check_header(header)  # nothing large before the token is proved

    def next_header(self, fs: protocol.FramedSocket) -> tuple[protocol.FrameHeader, float]:
        """A blocking server's next frame header, and when its body must be in.

        The rules of :meth:`header_deadline`, :meth:`check_header` and :meth:`body_deadline`
        in one call: a node serves every small read through here, where four calls a frame
        show in its profile (``.venv/bin/python bench/bench_small.py --profile DIR``).
        Authenticated, the connection idles as long as it likes (``fs.wait_frame``); the frame's
        clock starts at its first byte.

        Raises:
            KVStoreError: the header is refused (answer with request id 0, then hang up).
            TimeoutError, ConnectionError: the peer stalled or went away.
        """
        if self.gate.open:
            fs.wait_frame()
            started = time.monotonic()
            deadlines = self.deadlines
            header = fs.read_header(started + deadlines.frame_s)
            if header.kind != protocol.KIND_REQUEST:
                raise ProtocolError("expected a request frame")
            return header, started + deadlines.frame_deadline_s(header.body_len)
        header = fs.read_header(self.hello_by)
        self.check_header(header)
        return header, self.hello_by

    def open_request(
        self, header: protocol.FrameHeader, body: bytes | memoryview
    ) -> protocol.Request | Refusal:
        """Decode and screen a request: the request to dispatch, or the answer instead.

        The payload (``header.payload_len`` bytes after the body) is still unread either way.
        """
        try:
            request = protocol.decode_request(body)
        except ProtocolError as err:
            return refuse(protocol.request_id_of(body), err, header)
        screened = self.gate.screen(request)
        if screened is not None:
            frame, hang_up = screened
            if header.payload_len > MAX_DISCARD:
                return Refusal(frame, 0, True)  # not worth reading: hang up
            return Refusal(frame, header.payload_len, hang_up)
        if self.payload_limits is not None:
            limit = self.payload_limits.get(request.verb)
            if limit is None:
                err: KVStoreError = UnknownVerbError(f"unknown verb {request.verb[:64]!r}")
                return refuse(request.req_id, err, header)
            if header.payload_len > limit:
                err = ProtocolError(
                    f"{request.verb} takes no payload"
                    if not limit
                    else f"payload too large for {request.verb}"
                )
                return refuse(request.req_id, err, header)
        return request

"""The storage node's small REST endpoint: ``GET /health`` and ``GET /metrics``.

A stdlib threading HTTP server (the node is a threaded process with no event loop) and a
prometheus_client registry of its own. ``/metrics`` needs the cluster token as a bearer token
unless reads are public; ``/health`` is always open. Errors are JSON bodies with our codes.
"""

from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore import auth, gc_policy
from kvstore.errors import ErrorCode

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Connections served at once (a thread each); past it a new connection is closed unanswered.
MAX_CONNECTIONS = 32
#: Seconds a connection may stay silent (before or within its request) before it is closed.
IDLE_TIMEOUT_S = 10.0


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them: idle connections
    (scrapers that never send, a flood of sockets) cannot grow the node's threads without
    bound; ``/health`` needs no token, so anyone who reaches the port could."""

    daemon_threads = True
    #: The listen backlog (socketserver's default is 5): a burst of connections waits in the
    #: kernel's queue to be taken, and past the cap closed at once, not left unanswered.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: Any, max_connections: int) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _NodeCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]], segments: dict[str, tuple[str, int]]):
        self.stats = stats
        self.segments = segments

    def collect(self) -> Iterator[Any]:
        stats = self.stats()
        yield CounterMetricFamily(
            "kvstore_node_reads", "Read items served", value=stats.get("num_reads", 0)
        )
        yield CounterMetricFamily(
            "kvstore_node_writes", "Write items served", value=stats.get("num_writes", 0)
        )
        yield GaugeMetricFamily(
            "kvstore_node_objects", "Objects in this node's manifest", value=stats["num_objects"]
        )
        cap = GaugeMetricFamily(
            "kvstore_node_segment_capacity_bytes",
            "Bytes each segment of this node holds",
            labels=["segment", "tier"],
        )
        for name, (tier, capacity) in sorted(self.segments.items()):
            cap.add_metric([name, tier], capacity)
        yield cap
        yield from gc_policy.metric_families()


class NodeAdmin:
    """Serves ``/health`` and ``/metrics`` for one node in a background thread.

    Args:
        host, port: where to listen (port 0 picks a free one).
        node_id: this node's id (in ``/health``).
        stats: returns the data server's counters.
        segments: segment name → (tier, capacity in bytes).
        token: the cluster token (None: everything open).
        public_reads: whether ``/metrics`` is open without the token.
        ssl_context: serve HTTPS with it (None: plain HTTP).
        max_connections: connections served at once (see :class:`_BoundedServer`).
        idle_timeout_s: seconds a connection may stay silent before it is closed.
    """

    def __init__(
        self,
        host: str,
        port: int,
        node_id: str,
        stats: Callable[[], dict[str, Any]],
        segments: dict[str, tuple[str, int]],
        token: auth.Token | None = None,
        public_reads: bool = True,
        ssl_context: ssl.SSLContext | None = None,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_NodeCollector(stats, segments))
        admin = self

        class Handler(BaseHTTPRequestHandler):
            timeout = idle_timeout_s  # (the socket's: a silent client is dropped)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass  # no access log (and so no headers in any log)

            def _json(self, status: int, body: dict[str, Any], extra: dict[str, str] | None = None):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _error(self, status: int, code: ErrorCode, message: str) -> None:
                extra = {"WWW-Authenticate": "Bearer"} if status == 401 else None
                body = {"error": {"error_code": int(code), "name": code.name, "message": message}}
                self._json(status, body, extra)

            def do_GET(self) -> None:  # noqa: N802
                path = self.path.split("?", 1)[0]
                if path == "/health":
                    self._json(200, {"status": "ok", "node_id": node_id})
                elif path == "/metrics":
                    if not public_reads and not auth.bearer_ok(
                        self.headers.get("Authorization"), token
                    ):
                        self._error(401, ErrorCode.UNAUTHENTICATED, "missing or wrong bearer token")
                        return
                    data = generate_latest(admin.registry)
                    self.send_response(200)
                    self.send_header("Content-Type", CONTENT_TYPE)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                else:
                    self._error(404, ErrorCode.INVALID_REQUEST, f"no route GET {path[:128]}")

            def _refuse(self) -> None:
                self._error(405, ErrorCode.INVALID_REQUEST, "this endpoint is read-only")

            do_POST = do_PUT = do_DELETE = do_PATCH = _refuse  # noqa: N815

        self._server = _BoundedServer((host, port), Handler, max_connections)
        if ssl_context is not None:
            self._server.socket = ssl_context.wrap_socket(self._server.socket, server_side=True)
        self.scheme = "https" if ssl_context is not None else "http"
        self.host = host
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="node-admin", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

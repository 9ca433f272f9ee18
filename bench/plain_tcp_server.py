"""The "plain-tcp" server of bench_peers.py: the limit that the stores are set beside.

Run:  python bench/plain_tcp_server.py PORT   (started and stopped by PID by bench_peers.py)

It holds one object's bytes per (slot, size) and speaks the least a store could over TCP: a
request is a fixed 11-byte header (``b"G"`` or ``b"P"``, a slot number, little-endian u16, and
the size, u64); a get is answered with ``sendall`` of the bytes held for that slot and size; a
put is followed by the size's bytes, received straight into the buffer held for them, and
answered with 4 bytes. (Slots let a batch's 16 objects differ, so the worker can verify them.) No
index, no metadata, no checksums: what is left is the kernel's copies and one round trip.
TCP_NODELAY on every connection, one thread per connection. Only the standard library.
"""

from __future__ import annotations

import signal
import socket
import struct
import sys
import threading

HEADER = struct.Struct("<cHQ")
ACK = b"ok\x00\x00"
_objects: dict[tuple[int, int], bytearray] = {}
_lock = threading.Lock()


def _object(slot: int, size: int) -> bytearray:
    with _lock:
        buf = _objects.get((slot, size))
        if buf is None:
            buf = _objects[(slot, size)] = bytearray(size)
        return buf


def _recv_exact(conn: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``conn``; False when the peer closed first."""
    got = 0
    while got < len(view):
        # MSG_WAITALL: the kernel fills the rest in one call unless a signal cuts it short.
        n = conn.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if n == 0:
            return False
        got += n
    return True


def serve(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    header = bytearray(HEADER.size)
    hview = memoryview(header)
    with conn:
        while _recv_exact(conn, hview):
            op, slot, size = HEADER.unpack(header)
            buf = _object(slot, size)
            if op == b"G":
                conn.sendall(buf)
            elif op == b"P":
                if not _recv_exact(conn, memoryview(buf)):
                    return
                conn.sendall(ACK)
            else:
                return


def main() -> None:
    port = int(sys.argv[1])
    lsock = socket.create_server(("127.0.0.1", port), backlog=128)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"plain-tcp ready on {port}", flush=True)
    while True:
        conn, _ = lsock.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()

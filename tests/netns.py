"""A network path through two namespaces of our own that a test can cut: a real partition.

:class:`CuttableLink` gives one process (say, one master) its own way to a TCP service (say,
etcd) that crosses a veth pair between two network namespaces we create::

    process --> 127.0.0.1:port --[ns A: 10.x.y.2]== veth ==[ns B: 10.x.y.1]--> 127.0.0.1:service

The two relay legs live in this (test) process: a socket belongs to the namespace its creating
thread was in, so each leg's socket is made by a thread that entered its namespace with
``setns``. Every address sits inside the namespaces we create (a private /30); the host's own
namespace only gets a listening socket on loopback. :meth:`cut` takes the far end of the veth
down: the near end keeps its route, so packets vanish (connections stall, new ones time out)
exactly as in a network partition; :meth:`heal` brings it back. Everything is removed in
:meth:`close`. Needs root (``ip netns``); :func:`netns_or_skip` skips with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import subprocess
import threading
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def netns_or_skip(name: str) -> None:
    """Create namespace ``name`` or skip the test with the reason (not root, no ``ip``)."""
    try:
        _ip("netns", "add", name)
    except FileNotFoundError:
        pytest.skip("no `ip` command (iproute2): cannot make a network namespace")
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"`ip netns add` not permitted here: {exc.stderr.decode().strip()}")


def in_netns(name: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on a thread that entered network namespace ``name`` (sockets it makes stay)."""
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            with open(f"/run/netns/{name}") as f:
                if _libc.setns(f.fileno(), CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {name} failed")
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            err.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    if err:
        raise err[0]
    assert out, f"entering {name} did not finish"
    return out[0]


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


class CuttableLink:
    """``127.0.0.1:<port>`` on the host reaches ``127.0.0.1:<target_port>`` through the veth.

    Args:
        target_port: the service on the host's loopback (etcd's client port).
        tag: makes the namespace and interface names unique (a small integer).
    """

    def __init__(self, target_port: int, tag: int) -> None:
        self.target_port = target_port
        self.ns_near, self.ns_far = f"kvha{tag}a", f"kvha{tag}b"
        self.if_near, self.if_far = f"kvha{tag}a", f"kvha{tag}b"
        octet = 4 * (tag % 64)
        subnet = f"10.231.{tag // 64 % 256}"
        self.far_ip, self.near_ip = f"{subnet}.{octet + 1}", f"{subnet}.{octet + 2}"
        self._socks: list[socket.socket] = []
        self._closed = False
        netns_or_skip(self.ns_near)
        try:
            _ip("netns", "add", self.ns_far)
            for ns in (self.ns_near, self.ns_far):
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip(
                "-n",
                self.ns_near,
                "link",
                "add",
                self.if_near,
                "type",
                "veth",
                "peer",
                "name",
                self.if_far,
                "netns",
                self.ns_far,
            )
            _ip("-n", self.ns_near, "addr", "add", f"{self.near_ip}/30", "dev", self.if_near)
            _ip("-n", self.ns_far, "addr", "add", f"{self.far_ip}/30", "dev", self.if_far)
            _ip("-n", self.ns_near, "link", "set", self.if_near, "up")
            _ip("-n", self.ns_far, "link", "set", self.if_far, "up")
            self._far = in_netns(self.ns_far, self._listener)
            self._far.bind((self.far_ip, 0))
            self._far.listen(64)
            self._near = socket.create_server(("127.0.0.1", 0))
            self.port = self._near.getsockname()[1]
            threading.Thread(target=self._accept_near, daemon=True).start()
            threading.Thread(target=self._accept_far, daemon=True).start()
        except subprocess.CalledProcessError as exc:
            self.close()
            pytest.skip(f"cannot build a veth pair here: {exc.stderr.decode().strip()}")
        except OSError as exc:
            self.close()
            pytest.skip(f"cannot enter a network namespace here: {exc}")
        except BaseException:
            self.close()
            raise

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _listener(self) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socks.append(s)
        return s

    def _accept_near(self) -> None:
        """Host side: each connection goes on through a socket made inside the near namespace."""
        far = self._far.getsockname()
        while not self._closed:
            try:
                conn, _ = self._near.accept()
            except OSError:
                return
            try:
                out = in_netns(self.ns_near, self._listener)
                out.settimeout(5)
                out.connect(far)
                out.settimeout(None)
            except OSError:
                conn.close()  # cut: the caller sees its connection fail, as with a dead route
                continue
            self._relay(conn, out)

    def _accept_far(self) -> None:
        """Far side: hand each connection to the service on the host's loopback."""
        while not self._closed:
            try:
                conn, _ = self._far.accept()
            except OSError:
                return
            try:
                out = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                out.settimeout(None)
            except OSError:
                conn.close()
                continue
            self._relay(conn, out)

    def _relay(self, a: socket.socket, b: socket.socket) -> None:
        self._socks += [a, b]
        threading.Thread(target=_pump, args=(a, b), daemon=True).start()
        threading.Thread(target=_pump, args=(b, a), daemon=True).start()

    def cut(self) -> None:
        """Partition: the far end goes down, packets on the link are lost."""
        _ip("-n", self.ns_far, "link", "set", self.if_far, "down")

    def heal(self) -> None:
        _ip("-n", self.ns_far, "link", "set", self.if_far, "up")

    def close(self) -> None:
        """Close every socket and delete both namespaces (the veth pair goes with them)."""
        self._closed = True
        for s in [getattr(self, "_near", None), getattr(self, "_far", None), *self._socks]:
            if s is not None:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept/recv
                with contextlib.suppress(OSError):
                    s.close()
        for ns in (self.ns_near, self.ns_far):
            if os.path.exists(f"/run/netns/{ns}"):
                with contextlib.suppress(subprocess.CalledProcessError):
                    _ip("netns", "del", ns)

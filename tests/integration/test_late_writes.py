"""Writes of an allocation that is no longer current never change another object's bytes:
an old grant replayed after remove or revoke, and a writer stalled past the put timeout whose
space went to the next put (over TCP and through shm). Real master and node processes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading

import numpy as np
import pytest
import xxhash

from kvstore import protocol
from kvstore.client import Client
from kvstore.errors import ErrorCode
from tests.netns import CuttableLink
from tests.support import wait_until

MIB = 1 << 20


def _control(cluster) -> protocol.FramedSocket:
    host, port = cluster.address.split(":")
    return protocol.FramedSocket.connect(host, int(port), timeout=10)


def _put_start(ctl: protocol.FramedSocket, key: bytes, size: int) -> tuple[int, list]:
    """A raw put_start: (put id, the write location's wire form)."""
    code, ticket = ctl.call("put_start", {"keys": [key], "sizes": [size]})[0]
    assert code == 0, ticket
    put_id, locations = ticket
    return put_id, locations[0]


def _write(loc: list, data: bytes) -> int:
    """Write ``data`` with the grant of ``loc``; returns the node's per-item code."""
    conn = protocol.FramedSocket.connect(loc[1], loc[2], timeout=10)
    try:
        frame = protocol.encode_request(
            1,
            "write",
            {"items": [[loc[3], 0, len(data), xxhash.xxh3_64_intdigest(data)]]},
            len(data),
        )
        conn.send_frame(frame, [data])
        response, _ = conn.read_response()
        return response.unwrap()[0][0]
    finally:
        conn.close()


def _value(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("how", ["remove", "revoke"])
def test_an_old_grant_cannot_write_over_the_next_tenant(cluster_factory, how) -> None:
    cluster = cluster_factory(num_nodes=1, dram="16MiB")
    a, b = _value(1, MIB), _value(2, MIB)
    ctl = _control(cluster)
    try:
        with Client.connect(cluster.address, shm=False) as c:
            put_id, loc_a = _put_start(ctl, b"a", MIB)
            if how == "remove":
                assert _write(loc_a, a) == 0
                checksum = xxhash.xxh3_64_intdigest(a)
                assert ctl.call("put_end", {"put_ids": [put_id], "checksums": [checksum]}) == [
                    [0, None]
                ]
                assert c.get("a") == a
                c.remove("a")
            else:
                assert ctl.call("put_revoke", {"put_ids": [put_id]}) == [[0, None]]
            wait_until(lambda: c.stats()["used_bytes"] == 0, what="a's space freed")
            c.put("b", b)
            loc_b = c.locate("b").locations[0]
            assert (loc_b.grant.segment, loc_b.grant.offset) == (loc_a[3][2], loc_a[3][3]), (
                "b got a's bytes (the case under test)"
            )
            # A write carrying a's old grant is refused, and b is intact.
            assert _write(loc_a, _value(3, MIB)) == ErrorCode.GRANT_INVALID
            assert c.get("b") == b
    finally:
        ctl.close()


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_a_writer_stalled_past_the_put_timeout_never_lands_on_the_next_put(
    cluster_factory, shm
) -> None:
    cluster = cluster_factory(
        num_nodes=1,
        dram="16MiB",
        master_args=("--put-timeout", "1.5"),
        node_args=("--shm",) if shm else (),
    )
    size = 2 * MIB
    slow, nxt = _value(4, size), _value(5, size)
    ctl = _control(cluster)
    try:
        with Client.connect(cluster.address, shm=shm) as c:
            put_id, loc = _put_start(ctl, b"slow", size)
            # A writer that sends half its bytes and stalls (a real socket we hold).
            data = protocol.FramedSocket.connect(loc[1], loc[2], timeout=10)
            frame = protocol.encode_request(
                1, "write", {"items": [[loc[3], 0, size, xxhash.xxh3_64_intdigest(slow)]]}, size
            )
            data.send_frame(frame, [slow[: size // 2]])
            wait_until(lambda: c.stats()["num_pending"] == 0, what="the stalled put reclaimed")
            c.put("next", nxt)
            loc_next = c.locate("next").locations[0]
            assert loc_next.grant.offset == loc[3][3], "next got the stalled put's bytes"
            # The stalled writer wakes up and sends the rest: none of it may land.
            with contextlib.suppress(OSError):
                data.sock.sendall(slow[size // 2 :])
                data.read_response()
            data.close()
            assert c.get("next") == nxt
            buf = bytearray(size)
            assert c.get_into("next", buf) == size and bytes(buf) == nxt
            assert ctl.call("put_end", {"put_ids": [put_id], "checksums": [0]})[0][0] != 0
    finally:
        ctl.close()


def test_a_put_over_a_slow_link_reclaimed_at_the_timeout_never_hits_the_next_tenant(
    cluster_factory,
) -> None:
    # A 2 MiB put over a 1 Mbit/s link (a veth pair between network namespaces we create, rate
    # limited with tc) is reclaimed at the put timeout; the next put of that space goes through
    # shm on this host. The slow writer's bytes keep arriving afterwards: none may land.
    cluster = cluster_factory(
        num_nodes=1, dram="16MiB", master_args=("--put-timeout", "3"), node_args=("--shm",)
    )
    data_port = int(cluster.nodes[0].field("data").split(":")[1])
    link = CuttableLink(data_port, tag=(os.getpid() + 2048) % 4096)
    try:
        try:
            subprocess.run(
                ["tc", "-n", link.ns_near, "qdisc", "add", "dev", link.if_near, "root", "tbf",
                 "rate", "1mbit", "burst", "16kb", "latency", "1s"],
                check=True, capture_output=True, timeout=10,
            )  # fmt: skip
        except (FileNotFoundError, subprocess.CalledProcessError) as exc:
            pytest.skip(f"cannot rate-limit the link here (tc): {exc}")
        size = 2 * MIB
        slow, nxt = _value(6, size), _value(7, size)
        ctl = _control(cluster)
        try:
            with Client.connect(cluster.address) as c:
                _, loc = _put_start(ctl, b"slow", size)
                slow_loc = [loc[0], "127.0.0.1", link.port, loc[3]]
                outcome: list[object] = []

                def writer() -> None:
                    try:
                        outcome.append(_write(slow_loc, slow))
                    except (OSError, ConnectionError) as exc:
                        outcome.append(exc)

                t = threading.Thread(target=writer, daemon=True)
                t.start()
                wait_until(lambda: c.stats()["num_pending"] == 0, what="the slow put reclaimed")
                c.put("next", nxt)  # through shm
                assert c.locate("next").locations[0].grant.offset == loc[3][3]
                t.join(30)  # the node stops the slow write (its grant expired) and hangs up
                assert not t.is_alive(), "the node kept reading an expired write"
                assert outcome and outcome[0] != 0, outcome
                assert c.get("next") == nxt
        finally:
            ctl.close()
    finally:
        link.close()

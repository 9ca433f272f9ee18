"""Node tasks (moves between tiers) against a real data server with DRAM and NVMe tiers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore import grants
from kvstore.errors import ErrorCode, KVStoreError
from kvstore.node.arena import ShmArena
from kvstore.node.nvme import NvmeTier
from kvstore.node.server import DataServer
from kvstore.node.tasks import run_tasks
from kvstore.node.tiers import checksum_of


@pytest.fixture
def server(tmp_path: Path) -> Iterator[DataServer]:
    arena = ShmArena(tmp_path / "arena", 1 << 20)
    nvme = NvmeTier(tmp_path / "nvme", 4 << 20, chunk_bytes=1000)
    srv = DataServer({"dram": arena}, grants.new_secret(), tiers={"nvme": nvme})
    yield srv
    arena.close()
    nvme.close()


def move(task_id: int, key: bytes, data: bytes, src: list, dst: list, checksum: int | None = None):
    return {
        "id": task_id,
        "kind": "move",
        "key": key,
        "size": len(data),
        "checksum": checksum_of(data) if checksum is None else checksum,
        "src": src,
        "dst": dst,
    }


def test_demote_then_promote_keeps_exact_bytes(server: DataServer) -> None:
    data = os.urandom(5000)
    server.segments["dram"].view[128 : 128 + len(data)] = data
    assert run_tasks(server, [move(1, b"k", data, ["dram", 128], ["nvme", 7])]) == [[1, 0, None]]
    assert bytes(server.read_object("nvme", 7, len(data))) == data
    assert run_tasks(server, [move(2, b"k", data, ["nvme", 7], ["dram", 8192])]) == [[2, 0, None]]
    assert bytes(server.read_object("dram", 8192, len(data))) == data
    assert {(e[0], e[1]) for e in server.manifest.snapshot()} == {("nvme", 7), ("dram", 8192)}
    server.forget([("nvme", 7)])
    assert [e[0] for e in server.manifest.snapshot()] == ["dram"]
    assert server.tiers["nvme"].stored() == []


def test_bad_tasks_fail_alone(server: DataServer) -> None:
    data = os.urandom(100)
    server.segments["dram"].view[0:100] = data
    results = run_tasks(
        server,
        [
            move(1, b"a", data, ["dram", 0], ["nvme", 1], checksum=123),  # other bytes
            move(2, b"b", data, ["tape", 0], ["nvme", 2]),  # no such segment
            move(3, b"c", data, ["nvme", 99], ["dram", 512]),  # nothing stored there
            {
                "id": 4,
                "kind": "teleport",
                "key": b"d",
                "size": 1,
                "checksum": 0,
                "dst": ["nvme", 4],
            },
            {"kind": "move"},  # no id
            {**move(7, b"g", data, ["dram", 0], ["nvme", 7]), "deadline_ms": 1},  # too late
            move(6, b"f", data, ["dram", 0], ["nvme", 6]),  # fine
        ],
    )
    codes = [r[1] for r in results]
    assert codes[0] == ErrorCode.CHECKSUM_MISMATCH
    assert codes[1] == ErrorCode.GRANT_INVALID
    assert codes[2] == ErrorCode.KEY_NOT_FOUND
    assert codes[3] == ErrorCode.INVALID_REQUEST
    assert codes[4] == ErrorCode.INVALID_REQUEST
    assert codes[5] == ErrorCode.TIMEOUT
    assert codes[6] == 0
    assert [o.offset for o in server.tiers["nvme"].stored()] == [6]


def test_a_new_secret_forgets_grants_verified_under_the_old(server: DataServer) -> None:
    old = server.secret
    g = grants.sign(old, grants.OP_READ, b"k", "dram", 0, 10, 2**62)
    grant, view = server.granted_view(g.to_wire(), grants.OP_READ, owned=None)
    assert grant == g and len(view) == 10
    server.secret = grants.new_secret()  # re-registration with a new master epoch
    with pytest.raises(KVStoreError, match="signature"):
        server.granted_view(g.to_wire(), grants.OP_READ, owned=None)

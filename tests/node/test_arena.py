"""The DRAM arena file: held with a lock while its node lives, removed by the next node to start
on the host when its node was killed (tmpfs would otherwise keep it in memory forever)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.errors import InvalidRequestError, OutOfRangeError
from kvstore.node.arena import DramTier, ShmArena, reclaim_stale_arenas
from kvstore.node.tiers import checksum_of
from kvstore.stored_object import StoredObject
from tests.support import wait_until

HOLD = """
import sys, time
from pathlib import Path
from kvstore.node.arena import ShmArena
a = ShmArena(Path(sys.argv[1]), 1 << 20)
print("ready", flush=True)
time.sleep(600)
"""


def _holder(path: Path) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def test_a_killed_nodes_arena_is_reclaimed_and_a_live_one_kept(tmp_path: Path) -> None:
    dead, alive = tmp_path / "kvstore-dead.arena", tmp_path / "kvstore-alive.arena"
    victim, holder = _holder(dead), _holder(alive)
    try:
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=10)
        assert dead.exists()  # a killed process cannot clean up after itself
        other = tmp_path / "notes.txt"
        other.write_text("not an arena")
        older = tmp_path / "kvstore-older.dram"  # an older node's file: it never locks it
        older.write_bytes(b"\0" * 4096)
        assert reclaim_stale_arenas(tmp_path) == [dead]
        assert not dead.exists() and alive.exists() and other.exists() and older.exists()
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert reclaim_stale_arenas(tmp_path) == [alive]


def test_this_process_arena_is_kept_until_closed(tmp_path: Path) -> None:
    a = ShmArena(tmp_path / "kvstore-mine.arena", 4096)
    assert reclaim_stale_arenas(tmp_path) == []
    a.view[:5] = b"hello"
    assert bytes(a.view[:5]) == b"hello"
    with pytest.raises(InvalidRequestError, match="live node"):
        ShmArena(tmp_path / "kvstore-mine.arena", 4096)  # a second node with the same id
    assert bytes(a.view[:5]) == b"hello"
    a.close()
    assert not (tmp_path / "kvstore-mine.arena").exists()
    assert not list(tmp_path.iterdir())  # nothing left behind (no .creating file either)


def test_next_node_on_the_host_removes_a_killed_nodes_arena(cluster_factory) -> None:
    cluster = cluster_factory()
    node = cluster.nodes[0]
    path = Path("/dev/shm") / f"kvstore-{node.field('id')}.arena"
    if not path.exists():  # /dev/shm not writable here: arenas live in the data dir
        return
    node.kill()
    assert path.exists()
    cluster.add_node()
    wait_until(lambda: not path.exists(), timeout=30)


def _mapped_kib(path: Path) -> int:
    """Resident KiB of this process's mapping of ``path`` (from /proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.endswith(str(path)):
            for field in lines[i + 1 :]:
                if field.startswith("Rss:"):
                    return int(field.split()[1])
    return -1


def test_a_new_arena_is_mapped_in_the_background(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    size = 64 << 20
    a = ShmArena(base / f"kvstore-prefault-{os.getpid()}.arena", size)
    try:
        # Every page ends up in our page tables without being touched: no first-write faults.
        wait_until(lambda: _mapped_kib(a.path) == size // 1024, timeout=30)
        a.view[size - 5 :] = b"tail!"
        assert bytes(a.view[size - 5 :]) == b"tail!"
    finally:
        a.close()
    assert not a.path.exists()
    cold = ShmArena(base / f"kvstore-cold-{os.getpid()}.arena", size, prefault=False)
    try:
        assert _mapped_kib(cold.path) < size // 1024
    finally:
        cold.close()


def test_the_dram_tier_reads_and_writes_the_arena_in_place(tmp_path: Path) -> None:
    arena = ShmArena(tmp_path / "arena", 4096, prefault=False)
    tier = DramTier("dram", arena)
    assert (tier.segment, tier.tier, tier.capacity, tier.durable) == ("dram", "dram", 4096, False)
    obj = StoredObject("dram", 100, b"k", 5, checksum_of(b"hello"))
    bad = StoredObject("dram", 4094, b"k", 5, 0)
    results = tier.write([(obj, memoryview(b"hello")), (bad, memoryview(b"world"))])
    assert results[0] is None and isinstance(results[1], OutOfRangeError)
    assert bytes(tier.read(100, 5)) == b"hello"
    view = tier.in_place(100, 5)
    view[:] = b"HELLO"  # the same bytes: a ranged write lands in the arena
    assert bytes(arena.view[100:105]) == b"HELLO"
    with pytest.raises(OutOfRangeError):
        tier.in_place(4094, 5)
    with pytest.raises(OutOfRangeError):
        tier.read(-1, 5)
    assert tier.stored() == []
    view.release()
    arena.close()

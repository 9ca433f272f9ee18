"""The multi-host test bed for tests: hosts as network namespaces (``kvstore.cli.testbed``).

``testbed_factory`` (module-scoped: process starts are slow, so a test module shares its beds)
builds :class:`~kvstore.cli.testbed.Testbed` objects and removes them all after the module; it
skips with the reason where namespaces, veth pairs or ``tc`` are not permitted (not root).
:func:`client_on` runs one SDK client on a host, in that host's namespace, and returns what it
saw as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvstore.cli.testbed import Host, Testbed, TestbedError

#: The client a test runs on a host: puts, locates, gets, and which nodes it maps by shm.
CLIENT = r"""
import hashlib, json, sys
from kvstore.client import Client

ask = json.loads(sys.argv[1])

def value(key, size):
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]

out = {"got": {}, "locations": {}, "shm": {}}
with Client.connect(ask["master"], timeout=ask.get("timeout", 10.0)) as c:
    for key, size in ask.get("put", []):
        c.put(key, value(key, size), replicas=ask.get("replicas", 1))
    for key in ask.get("locate", []):
        info = c.locate(key)
        out["locations"][key] = [f"{loc.host}:{loc.port}" for loc in info.locations]
        c.release_lease(info)
    for key, size in ask.get("get", []):
        try:
            out["got"][key] = "ok" if bytes(c.get(key)) == value(key, size) else "differs"
        except Exception as exc:
            out["got"][key] = type(exc).__name__
    for node_id in ask.get("shm_nodes", []):
        out["shm"][node_id] = c._data.shm.mapping(node_id, "dram") is not None
print(json.dumps(out))
"""


def client_on(bed: Testbed, host: Host, ask: dict[str, Any], timeout: float = 120.0) -> Any:
    """Run :data:`CLIENT` on ``host`` with ``ask`` (``master``, ``put``: [key, size] pairs,
    ``replicas``, ``locate``: keys, ``get``: [key, size] pairs, ``shm_nodes``: node ids); its
    answer (``got``: key -> "ok" / "differs" / error name, ``locations``: key -> node
    addresses, ``shm``: node id -> mapped)."""
    out = bed.python(host, CLIENT, json.dumps(ask), timeout=timeout)
    return json.loads(out.strip().splitlines()[-1])


def bed_or_skip(num_hosts: int, num_racks: int, **kwargs: Any) -> Testbed:
    """A test bed, or a skip with the reason it cannot be built here."""
    try:
        return Testbed(num_hosts, num_racks, **kwargs)
    except TestbedError as err:
        pytest.skip(f"no multi-host test bed here: {err}")


@pytest.fixture(scope="module")
def testbed_factory() -> Iterator[Callable[..., Testbed]]:
    made: list[Testbed] = []

    def make(num_hosts: int = 4, num_racks: int = 2, **kwargs: Any) -> Testbed:
        bed = bed_or_skip(num_hosts, num_racks, **kwargs)
        made.append(bed)
        return bed

    yield make
    for bed in made:
        bed.close()

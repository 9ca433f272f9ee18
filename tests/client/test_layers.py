"""The client's layers stay layers: the KV-cache API, the event stream, the engine adapters and
the Mooncake drop-in use only the public methods of ``Client`` (never a private member of it),
and the parts below the ``Client`` facade never import it or anything above it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CLIENT = Path(__file__).resolve().parents[2] / "client"

#: Modules built on the Client: public entry points only.
USERS = sorted(
    [
        CLIENT / "kvcache.py",
        CLIENT / "events.py",
        CLIENT / "compat" / "mooncake.py",
        *(CLIENT / "adapters").glob("*.py"),
    ]
)
#: The parts the Client is made of: they know nothing above them.
PARTS = [
    CLIENT / f"{name}.py"
    for name in (
        "control",
        "endpoints",
        "leader",
        "pipeline",
        "reads",
        "puts",
        "datapath",
        "transport",
        "shm",
        "locations",
        "releases",
        "staging",
    )
]
ABOVE_THE_PARTS = (
    "kvstore.client.client",
    "kvstore.client.kvcache",
    "kvstore.client.events",
    "kvstore.client.adapters",
    "kvstore.client.compat",
)


def _names_a_client(node: ast.expr) -> bool:
    """Whether ``node`` is an expression for a Client: ``client``, ``self.client``,
    ``kv.client``, ``self._client``, ..."""
    if isinstance(node, ast.Name):
        return "client" in node.id.lower()
    if isinstance(node, ast.Attribute):
        return node.attr.lstrip("_").lower().endswith("client")
    return False


def private_uses(path: Path) -> list[str]:
    """``line: expression`` of every private member reached through a client in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and _names_a_client(node.value)
        ):
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_the_checks_see_what_they_look_for() -> None:
    code = "def f(kv, self):\n    kv.client._control.call()\n    self._client._data\n"
    tmp = ast.parse(code)
    found = sorted(
        ast.unparse(n)
        for n in ast.walk(tmp)
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and _names_a_client(n.value)
    )
    assert found == ["kv.client._control", "self._client._data"]


@pytest.mark.parametrize("path", USERS, ids=lambda p: str(p.relative_to(CLIENT)))
def test_users_of_the_client_reach_no_private_member(path: Path) -> None:
    assert private_uses(path) == []


@pytest.mark.parametrize("path", PARTS, ids=lambda p: p.name)
def test_the_parts_of_the_client_import_nothing_above_them(path: Path) -> None:
    above = {m for m in imports(path) if m.startswith(ABOVE_THE_PARTS)}
    assert above == set()
    assert not {m for m in imports(path) if m.startswith("kvstore.master")}

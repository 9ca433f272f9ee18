"""The layers of the whole tree, read from the source with ``ast`` (nothing is imported).

    apps     kvstore.cli, .router, .replay, .sim, .demo   (apps/: may import every layer)
    client   kvstore.client (client/)   master   kvstore.master (master/)   node   kvstore.node (node/)
    core     kvstore (kvstore/: types, errors, keys, wire, grants, transports, RDMA's shared half)

The folders are the layers: each source folder holds one layer (pyproject.toml's package-dir maps
them into the one ``kvstore`` namespace). A layer imports only itself and the layers below it: the
core none of the others; the node, the master and the client never each other (they meet only on
the wire). A core module that only one other layer uses belongs in that layer. No module-level
import cycle anywhere, and an import inside a function between our modules only where the list
below says why. (The master's and the client's own finer rules: tests/master/test_layers.py,
tests/client/test_layers.py.)
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Package -> source folder, as pyproject.toml maps them.
PACKAGE_DIRS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
    "setuptools"
]["package-dir"]
#: Each top-level package's layer, and the folder its layer lives in.
LAYERS = {
    "kvstore": ("core", "kvstore"),
    "kvstore.node": ("node", "node"),
    "kvstore.master": ("master", "master"),
    "kvstore.client": ("client", "client"),
    "kvstore.cli": ("apps", "apps/cli"),
    "kvstore.router": ("apps", "apps/router"),
    "kvstore.routing": ("apps", "apps/routing"),
    "kvstore.replay": ("apps", "apps/replay"),
    "kvstore.sim": ("apps", "apps/sim"),
    "kvstore.demo": ("apps", "apps/demo"),
}
FOLDERS = {folder: package for package, folder in PACKAGE_DIRS.items()}
TOP = tuple(p for p, (name, _) in LAYERS.items() if name == "apps")
ALLOWED_BELOW = {
    "core": {"core"},
    "node": {"core", "node"},
    "client": {"core", "client"},
    "master": {"core", "master"},
    "apps": {"core", "node", "client", "master", "apps"},
}
#: Imports inside functions, each with its reason: (importing module, imported module).
LAZY_ALLOWED = {
    # The router loads transformers (seconds); other subcommands should not wait for it.
    ("kvstore.cli.inference", "kvstore.router.app"),
    # The master's modules (aiohttp, prometheus) are two thirds of the CLI's start-up; a
    # ``kvstore node`` process (one per node, many per test run) never loads them.
    ("kvstore.cli.daemons", "kvstore.master.daemon"),
    ("kvstore.cli.daemons", "kvstore.master.ha"),
    ("kvstore.cli.daemons", "kvstore.master.service"),
    ("kvstore.cli.daemons", "kvstore.master.tiering"),
    # ... and for the same reason, the vLLM demo and proxy (aiohttp) where they run.
    ("kvstore.cli.inference", "kvstore.demo.vllm_demo"),
    ("kvstore.cli.inference", "kvstore.demo.vllm_proxy"),
    # These need torch, which the pool itself does not; the demo imports them when it runs.
    ("kvstore.demo.demo", "kvstore.demo.models"),
    ("kvstore.demo.demo", "kvstore.demo.workers"),
    ("kvstore.demo.serve", "kvstore.client"),
    ("kvstore.demo.serve", "kvstore.demo.hf"),
    ("kvstore.demo.serve", "kvstore.client.adapters.fp8"),
    ("kvstore.demo.serve", "kvstore.demo.models"),
    ("kvstore.demo.serve", "kvstore.demo.workers"),
}


def _sources() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


SOURCES = _sources()


def layer(module: str) -> str:
    """The layer of a module: that of the longest package in :data:`LAYERS` it is in."""
    owner = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[owner][0]


def _targets(node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
    """Our modules an import statement loads (``from pkg import mod`` names ``mod``)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            is_package = SOURCES[module].name == "__init__.py"
            package = module if is_package else module.rsplit(".", 1)[0]
            for _ in range(node.level - 1):
                package = package.rsplit(".", 1)[0]
            base = f"{package}.{base}" if base else package
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in SOURCES else base for a in node.names]
    return [n for n in names if n in SOURCES and n != module]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(module: str) -> tuple[set[str], set[str], set[str]]:
    """(imported at module level, only for type checking, inside a function or class)."""
    tree = ast.parse(SOURCES[module].read_text(), filename=str(SOURCES[module]))
    top: set[str] = set()
    typing_only: set[str] = set()
    nested: set[str] = set()

    def visit(node: ast.AST, inside: bool, checking: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                found = _targets(child, module)
                (typing_only if checking else nested if inside else top).update(found)
            scoped = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            guarded = isinstance(child, ast.If) and _is_type_checking(child.test)
            visit(child, inside or scoped, checking or guarded)

    visit(tree, False, False)
    return top, typing_only, nested


GRAPH = {m: _walk(m) for m in SOURCES}


def test_the_tree_is_found() -> None:
    assert {"kvstore.protocol", "kvstore.master.service", "kvstore.client.client"} <= set(SOURCES)
    assert {"kvstore.cli", "kvstore.sim", "kvstore.node.server", "kvstore.demo"} <= set(SOURCES)


def test_the_folders_are_the_layers() -> None:
    """Every package lives in its layer's folder, and no folder holds two layers."""
    assert {p: folder for p, (_, folder) in LAYERS.items()} == PACKAGE_DIRS
    top_folders = {f.split("/")[0] for f in PACKAGE_DIRS.values()}
    assert top_folders == {"kvstore", "node", "master", "client", "apps"}
    for package, folder in PACKAGE_DIRS.items():
        for sub in sorted((ROOT / folder).iterdir()):
            if (sub / "__init__.py").exists():
                name = f"{package}.{sub.name}"
                assert layer(name) == LAYERS[package][0], f"{sub} is in {package}'s folder"


#: File names that may repeat, each the same role in each package it is in: a daemon's
#: ``server``/``daemon``/``admin``/``tasks``/``metrics``/``config``, each side's half of two-phase
#: ``puts`` and of ``rdma``, an HTTP application's ``routes`` and ``state``, a run's ``report``.
SAME_ROLE_NAMES = {
    "__init__",
    "__main__",
    "admin",
    "config",
    "daemon",
    "metrics",
    "puts",
    "rdma",
    "report",
    "routes",
    "server",
    "state",
    "tasks",
}


def test_a_file_name_says_what_is_inside_and_repeats_only_for_one_role() -> None:
    """A name used by two packages for different things (``events``, ``discovery``, ``slo``,
    ``verbs``) makes a newcomer open the wrong file; a repeat is allowed only for one role."""
    by_name: dict[str, list[str]] = {}
    for module, path in SOURCES.items():
        by_name.setdefault(path.stem, []).append(module)
    repeated = {n: ms for n, ms in by_name.items() if len(ms) > 1 and n not in SAME_ROLE_NAMES}
    assert not repeated, repeated


def test_a_core_module_serves_more_than_one_layer() -> None:
    """Code that only one layer uses lives in that layer's folder, not in the core (a core
    subpackage, such as the RDMA transport both ends use, counts as one)."""

    def unit(module: str) -> str:
        return ".".join(module.split(".")[:2])

    users: dict[str, set[str]] = {unit(m): set() for m in SOURCES if layer(m) == "core"}
    for module, (top, typing_only, nested) in GRAPH.items():
        for target in top | typing_only | nested:
            if unit(target) in users and unit(target) != unit(module):
                users[unit(target)].add(layer(module))
    entry_points = {"kvstore", "kvstore.__main__"}
    single = {
        m: sorted(u)
        for m, u in users.items()
        if len(u) == 1 and "core" not in u and m not in entry_points
    }
    assert not single, f"core modules that one other layer alone uses: {single}"


@pytest.mark.parametrize("module", sorted(SOURCES))
def test_a_module_imports_only_its_layer_and_those_below(module: str) -> None:
    if module == "kvstore.__main__":
        return  # ``python -m kvstore``: the entry point is the CLI
    top, typing_only, nested = GRAPH[module]
    upward = sorted(
        t for t in top | typing_only | nested if layer(t) not in ALLOWED_BELOW[layer(module)]
    )
    assert not upward, f"{module} ({layer(module)}) imports above its layer: {upward}"


def test_no_import_inside_a_function_without_a_reason() -> None:
    lazy = {(m, t) for m, (_, _, nested) in GRAPH.items() for t in nested}
    assert not lazy - LAZY_ALLOWED, sorted(lazy - LAZY_ALLOWED)


def test_no_module_level_import_cycle() -> None:
    """Tarjan's strongly connected components over module-level imports (type-checking-only
    imports cannot cycle at run time and are left out)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v][0]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            connect(v)
    assert not cycles, cycles


def test_one_word_for_a_validated_configuration_record() -> None:
    """A component is built from a frozen, validated ``*Config`` (``MasterConfig``,
    ``NodeDaemonConfig``, ``RouterConfig``); no second or third word for the same thing."""
    others = []
    for module, path in SOURCES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith(("Settings", "Options")):
                others.append(f"{module}.{node.name}")
    assert not others, others

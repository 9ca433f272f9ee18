"""The master's import layers: no function-level imports between its modules, no import cycle
(``TYPE_CHECKING`` imports count), and no module reaching into another's private members.

Read from the source with ``ast`` (nothing is imported), so a hidden cycle fails here by name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

MASTER = Path(__file__).resolve().parents[2] / "master"
PACKAGE = "kvstore.master"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(MASTER).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def _sources() -> dict[str, ast.Module]:
    return {
        _module_name(p): ast.parse(p.read_text(), filename=str(p))
        for p in sorted(MASTER.rglob("*.py"))
    }


SOURCES = _sources()


PACKAGES = {m for m in SOURCES if (MASTER / Path(*m.split(".")[2:]) / "__init__.py").exists()}


def _targets(node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
    """The master modules an import statement loads (``from pkg import mod`` names ``mod``)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the module's package, one level up per extra dot
            package = module if module in PACKAGES else module.rsplit(".", 1)[0]
            for _ in range(node.level - 1):
                package = package.rsplit(".", 1)[0]
            base = f"{package}.{base}" if base else package
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in SOURCES else base for a in node.names]
    return [n for n in names if n == PACKAGE or n.startswith(PACKAGE + ".")]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> tuple[list[ast.Import | ast.ImportFrom], list[ast.stmt]]:
    """(imports at module level, including ``if TYPE_CHECKING:`` and try blocks there;
    imports anywhere else)."""
    top: list[ast.Import | ast.ImportFrom] = []

    def walk_top(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, ast.Import | ast.ImportFrom):
                top.append(stmt)
            elif isinstance(stmt, ast.If) and _is_type_checking(stmt.test):
                walk_top(stmt.body)
            elif isinstance(stmt, ast.Try):
                walk_top(stmt.body)
                for handler in stmt.handlers:
                    walk_top(handler.body)

    walk_top(tree.body)
    seen = {id(n) for n in top}
    nested = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in seen
    ]
    return top, nested


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, tree in SOURCES.items():
        top, _ = _imports(tree)
        graph[module] = {t for node in top for t in _targets(node, module) if t != module}
    return graph


def test_the_sources_are_found() -> None:
    assert f"{PACKAGE}.service" in SOURCES and f"{PACKAGE}.membership" in SOURCES


@pytest.mark.parametrize("module", sorted(SOURCES))
def test_no_function_level_imports_between_master_modules(module: str) -> None:
    _, nested = _imports(SOURCES[module])
    hidden = {
        f"line {n.lineno}: {t}"
        for n in nested
        if isinstance(n, ast.Import | ast.ImportFrom)
        for t in _targets(n, module)
    }
    assert not hidden, f"{module} imports master modules inside a function: {hidden}"


def test_the_import_graph_of_the_master_has_no_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_owners_sit_below_the_facade() -> None:
    """The layer order the service's docstring gives: each owner imports only those below it."""
    graph = _graph()
    order = ["config", "table", "membership", "space", "puts", "tiering", "replication"]
    for i, name in enumerate(order):
        above = {f"{PACKAGE}.{n}" for n in order[i + 1 :]} | {f"{PACKAGE}.service"}
        assert not graph[f"{PACKAGE}.{name}"] & above, f"{name} imports a layer above it"
    assert f"{PACKAGE}.service" not in graph[f"{PACKAGE}.recovery"]


def _private_names(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, ``self._x`` attributes, names
    assigned at module or class level, ``__slots__`` entries."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.add(node.value)  # __slots__ entries, among other strings
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


def test_no_module_reaches_into_another_master_modules_private_members() -> None:
    defined = {module: _private_names(tree) for module, tree in SOURCES.items()}
    offences = []
    for module, tree in SOURCES.items():
        others = set().union(*(names for m, names in defined.items() if m != module))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name.startswith("_") and _targets(node, module):
                        offences.append(f"{module}: imports {alias.name}")
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
                continue
            if node.attr.startswith("__") or node.attr in defined[module]:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in others:
                offences.append(f"{module} line {node.lineno}: .{node.attr}")
    assert not offences, offences


def test_no_module_asks_which_allocator_a_segment_has() -> None:
    """Segments' space is a ``SpaceAllocator``: nothing branches on its class."""
    offences = [
        f"{module} line {node.lineno}"
        for module, tree in SOURCES.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "isinstance"
        and any(
            isinstance(n, ast.Name) and n.id in ("OffsetAllocator", "ByteBudget")
            for n in ast.walk(node.args[1])
        )
    ]
    assert not offences, offences

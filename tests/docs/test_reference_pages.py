"""The generated reference pages (docs/reference/) equal what docs/gen_reference.py makes of the
code now: a flag, a variable, an error code, a metric or a route changed without regenerating
the pages fails here, naming the stale page."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvstore.errors import ErrorCode

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = ".venv/bin/python docs/gen_reference.py"


def _load_generator() -> ModuleType:
    # docs/ is no package: the script is loaded from its file, once per test session.
    name = "kvstore_docs_gen_reference"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


@pytest.fixture(scope="module")
def pages() -> dict[Path, str]:
    return gen.render()


@pytest.mark.parametrize("name", sorted(gen.PAGES))
def test_page_is_current(pages: dict[Path, str], name: str) -> None:
    path = gen.REFERENCE_DIR / name
    page = f"docs/reference/{name}"
    assert path.exists(), f"{page} is missing: run {REGENERATE}"
    assert path.read_text(encoding="utf-8") == pages[path], f"{page} is stale: run {REGENERATE}"


def test_check_names_the_stale_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gen, "REFERENCE_DIR", tmp_path / "docs" / "reference")
    assert gen.main([]) == 0
    assert gen.main(["--check"]) == 0
    (tmp_path / "docs" / "reference" / "errors.md").write_text("# Error codes\n")
    capsys.readouterr()
    assert gen.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "stale: docs/reference/errors.md" in err
    assert "cli.md" not in err


def test_every_error_code_has_meaning_and_advice() -> None:
    rows = {name: (meaning, todo) for _, name, _, meaning, todo in gen.error_rows()}
    assert set(rows) == {c.name for c in ErrorCode}
    for name, (meaning, todo) in rows.items():
        assert meaning.strip() and todo.strip(), name


@pytest.mark.parametrize("table", ["WHAT_TO_DO", "MEANINGS"])
def test_a_code_without_text_fails_naming_it(monkeypatch: pytest.MonkeyPatch, table: str) -> None:
    texts = dict(getattr(gen, table))
    texts.pop("NO_SPACE", None)
    monkeypatch.setattr(gen, table, texts)
    if table == "MEANINGS":  # NoSpaceError has no docstring: its meaning comes from the table
        with pytest.raises(gen.SourceError, match="NO_SPACE"):
            gen.error_rows()
    else:
        with pytest.raises(gen.SourceError, match="NO_SPACE.*WHAT_TO_DO"):
            gen.error_rows()


def test_text_for_a_retired_code_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gen, "WHAT_TO_DO", {**gen.WHAT_TO_DO, "LEASE_EXPIRED": "gone"})
    with pytest.raises(gen.SourceError, match="LEASE_EXPIRED"):
        gen.error_rows()


def test_every_env_field_has_a_variable() -> None:
    from dataclasses import fields

    from kvstore.env import Env

    documented = {field for field, _ in gen.env_variables().values()}
    assert documented == {f.name for f in fields(Env)}


def test_pages_ignore_this_shell(monkeypatch: pytest.MonkeyPatch, pages: dict[Path, str]) -> None:
    """Defaults are those of an empty environment: a developer's KVSTORE_* does not leak in."""
    monkeypatch.setenv("KVSTORE_LOG_LEVEL", "debug")
    monkeypatch.setenv("KVSTORE_ADMIN", "http://elsewhere:1")
    cli = gen.REFERENCE_DIR / "cli.md"
    assert gen.render()[cli] == pages[cli]


def test_cli_page_lists_every_command_and_flag(pages: dict[Path, str]) -> None:
    import argparse

    from kvstore.cli import build_parser
    from kvstore.env import Env

    text = pages[gen.REFERENCE_DIR / "cli.md"]

    def walk(parser: argparse.ArgumentParser, prog: str) -> None:
        assert f"## `{prog}`" in text, prog
        for action in parser._actions:
            if action.help is argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            for flag in action.option_strings:
                assert f"`{flag}" in text, f"{prog} {flag}"
        for name, _, sub in gen._subparsers(parser):
            walk(sub, f"{prog} {name}")

    walk(build_parser(Env()), "kvstore")


def test_metrics_page_has_labels(pages: dict[Path, str]) -> None:
    text = pages[gen.REFERENCE_DIR / "metrics.md"]
    assert "| `kvstore_requests_total` | counter | `code`, `verb` |" in text
    assert "`kvstore_node_segment_capacity_bytes`" in text
    assert "`kvstore_router_requests_total`" in text

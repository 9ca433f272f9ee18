"""Every snippet in README.md and docs/ keeps working: each Python block runs against a real pool
(a master and two storage nodes, real processes; the snippet's ``127.0.0.1:7700`` is replaced by
the pool's address), and each ``kvstore ...`` line of a shell block parses with the real command
line (every subcommand and flag exists). A Python block preceded by
``<!-- snippet: needs ... -->`` needs what that says (vLLM, a router) and is skipped here with
that reason."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cli import build_parser
from tests.support import Cluster, start_master

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
NEEDS = re.compile(r"<!--\s*snippet:\s*(needs[^>]*?)\s*-->\s*$")
ADDRESSES = re.compile(r"(127\.0\.0\.1|localhost):7700\b")
COMMAND = re.compile(r"^(?:[\w./-]*/)?kvstore\s")


def _blocks(lang: set[str]) -> Iterator[tuple[str, str, str | None]]:
    """``(page:line, code, why skipped or None)`` of every fenced block in ``lang``."""
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) not in lang:
                continue
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            needs = NEEDS.search(before)
            line = text.count("\n", 0, m.start()) + 1
            yield f"{page.relative_to(ROOT)}:{line}", m.group(2), needs and needs.group(1)


PYTHON = list(_blocks({"python", "py"}))
SHELL = list(_blocks({"sh", "bash", "shell", "console"}))


def _command_lines(code: str) -> Iterator[str]:
    """The ``kvstore`` command lines of a shell block, continuations joined; synopses (with
    ``[...]``, ``|`` or ``...``) are not commands and are left out."""
    for line in code.replace("\\\n", " ").splitlines():
        line = re.sub(r"\$\([^)]*\)", "X", line).strip()
        if not COMMAND.match(line):
            continue
        words = shlex.split(line, comments=True)
        if any(w in ("|", "||", "&&", ";", ">") or "..." in w or "[" in w for w in words):
            continue
        yield " ".join(words[1:]).removesuffix(" &")


COMMANDS = [(where, cmd) for where, code, _ in SHELL for cmd in _command_lines(code)]


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cluster = Cluster(tmp_path_factory.mktemp("snippets"), start_master())
    try:
        cluster.add_node("256MiB")
        cluster.add_node("256MiB")
        yield cluster.address
    finally:
        cluster.stop()


def test_the_pages_have_snippets() -> None:
    assert len(PYTHON) >= 5 and len(COMMANDS) >= 10


@pytest.mark.parametrize(("where", "code", "needs"), PYTHON, ids=[w for w, _, _ in PYTHON])
def test_a_python_snippet_runs(
    pool: str, tmp_path: Path, where: str, code: str, needs: str | None
) -> None:
    if needs:
        pytest.skip(f"{where} {needs}")
    script = tmp_path / "snippet.py"
    script.write_text(ADDRESSES.sub(pool, code))
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"{where}:\n{code}\n{done.stderr[-3000:]}"


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[f"{w} {c}" for w, c in COMMANDS])
def test_a_kvstore_command_line_parses(where: str, command: str) -> None:
    try:
        build_parser().parse_args(shlex.split(command))
    except SystemExit as exc:
        pytest.fail(f"{where}: `kvstore {command}` does not parse (exit {exc.code})")

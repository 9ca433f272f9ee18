"""Benchmarks write their own tables into the benchmarks page (``docs/benchmarks.md``).

The page holds one region per table, between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``;
a bench run with ``--markdown`` replaces its regions' contents with the table it just measured
and one line saying how, when and where: the command, the date, the machine (cores and the CPU
model from ``/proc/cpuinfo``). The page is regenerated, never appended to: history lives in git.
"""

from __future__ import annotations

import datetime
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS_PAGE = REPO_ROOT / "docs" / "benchmarks.md"


def machine() -> str:
    """``"<n> cores, <CPU model>"`` of this host (the model from ``/proc/cpuinfo``)."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {model}"


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as run from the repository root: ``.venv/bin/python bench/x.py ARGS``
    (``--markdown`` left out: it writes the page, it does not change what is measured)."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    try:
        shown = str(script.relative_to(REPO_ROOT))
    except ValueError:
        shown = argv[0]
    args = [a for a in argv[1:] if a != "--markdown"]
    return shlex.join([".venv/bin/python", shown, *args])


def table(head: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown pipe table; the first column left-aligned, the others right-aligned."""
    align = [":--", *["--:"] * (len(head) - 1)]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_table(
    name: str,
    body: str,
    command: str | None = None,
    page: Path = BENCHMARKS_PAGE,
    today: datetime.date | None = None,
) -> None:
    """Replace the region ``name`` of ``page`` with ``body`` and the line that dates it.

    Args:
        name: the region's name (``<!-- bench:NAME -->`` ... ``<!-- /bench:NAME -->``).
        body: Markdown (a table, and any notes under it).
        command: the command that measured it; None: this process's (:func:`command_line`).
        page: the page to edit.
        today: the date written (UTC today when None).

    Raises:
        ValueError: the page has no such region (or its end marker comes first).
    """
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    text = page.read_text()
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"{page} has no region {start} ... {end}")
    when = today or datetime.datetime.now(datetime.UTC).date()
    stamp = f"`{command or command_line()}` · {when.isoformat()} · {machine()}"
    region = f"{start}\n{body.strip()}\n\n{stamp}\n{end}"
    page.write_text(text[:i] + region + text[j + len(end) :])
    print(f"wrote the table {name!r} into {page.relative_to(REPO_ROOT)}", file=sys.stderr)

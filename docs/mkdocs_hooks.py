"""MkDocs hooks of the documentation site (``hooks:`` in mkdocs.yml).

Why a mirror of the sources: the folders of the layers install as one ``kvstore`` package through
pyproject's ``package-dir`` (``client/`` is ``kvstore.client``, ``apps/cli/`` is ``kvstore.cli``),
which griffe, the reader behind mkdocstrings, cannot follow: it looks for ``kvstore.client`` in
``kvstore/client/``. Importing the modules instead would run them (``kvstore.__main__`` runs the
command line). So before each build we copy every package's ``.py`` files into
``build/docs-src/kvstore/...``, laid out by import name, and griffe reads that copy statically.
Where each package lives comes from pyproject's package list and ``package-dir``, read at each
build: no folder is named here.
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parent.parent
#: Where the mirror goes (mkdocs.yml's ``paths`` of the python handler points here).
MIRROR = ROOT / "build" / "docs-src"


def package_folders(root: Path = ROOT) -> dict[str, Path]:
    """Each package the project installs → the folder its modules are in, by setuptools' rule
    (``[tool.setuptools] packages`` placed through ``package-dir``: the longest listed prefix
    of the name wins). Read from pyproject.toml, so a moved folder needs no change here, and
    nothing is imported (a module that is being edited cannot stop the build)."""
    with (root / "pyproject.toml").open("rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    dirs: dict[str, str] = setuptools.get("package-dir", {})
    folders = {}
    for name in setuptools["packages"]:
        parts = name.split(".")
        for i in range(len(parts), -1, -1):
            prefix = ".".join(parts[:i])
            if prefix in dirs:
                folders[name] = root.joinpath(dirs[prefix], *parts[i:])
                break
        else:
            folders[name] = root.joinpath(*parts)
    return folders


def mirror_sources(root: Path = ROOT, dest: Path = MIRROR) -> Path:
    """Copy each installed package's modules under ``dest``, one folder per import name.

    A listed package whose folder is gone (one on its way out) is left out: the pages name
    what they document, and a name missing from the mirror fails the strict build there.

    Returns:
        ``dest``.
    """
    if dest.exists():
        shutil.rmtree(dest)
    for name, source in package_folders(root).items():
        target = dest.joinpath(*name.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for module in source.glob("*.py"):
            shutil.copy2(module, target / module.name)
    return dest


@event_priority(100)  # before mkdocstrings' own on_config: its handler looks for the mirror
def on_config(config: Any) -> Any:
    """MkDocs hook: lay out the mirror before the pages are read (each build, each reload)."""
    mirror_sources()
    return config

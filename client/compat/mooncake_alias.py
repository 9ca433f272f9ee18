"""``python -m kvstore.client.compat.mooncake --install-alias``: a ``mooncake`` package whose
``mooncake.store`` is kvstore's Mooncake API, so a Mooncake program runs unmodified."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from kvstore.errors import InvalidRequestError

# ---------------------------------------------------------------- the `mooncake` import alias
_MARKER = "kvstore-mooncake-alias"
_ALIAS_STORE = f'''"""{_MARKER}: ``mooncake.store`` served by kvstore (python -m kvstore.client.compat.mooncake
--uninstall-alias removes this package)."""
from kvstore.client.compat.mooncake import *  # noqa: F401,F403
from kvstore.client.compat.mooncake import __all__  # noqa: F401
'''


def install_alias(target: str | os.PathLike[str] | None = None, force: bool = False) -> Path:
    """Write a ``mooncake`` package whose ``mooncake.store`` is this module.

    Args:
        target: the folder to write it in (default: this interpreter's site-packages).
        force: replace a ``mooncake`` package that is not ours (e.g. the real wheel's).

    Returns:
        The package folder written.

    Raises:
        InvalidRequestError: a real ``mooncake`` package is there and ``force`` is not set.
    """
    base = Path(target) if target is not None else Path(sysconfig.get_paths()["purelib"])
    pkg = base / "mooncake"
    init = pkg / "__init__.py"
    ours = init.exists() and _MARKER in init.read_text(errors="replace")
    if pkg.exists() and not ours and not force:
        raise InvalidRequestError(f"{pkg} holds another mooncake package; pass --force")
    pkg.mkdir(parents=True, exist_ok=True)
    init.write_text(f'"""{_MARKER}: Mooncake Store\'s API on kvstore."""\n')
    (pkg / "store.py").write_text(_ALIAS_STORE)
    return pkg


def uninstall_alias(target: str | os.PathLike[str] | None = None) -> bool:
    """Remove the package :func:`install_alias` wrote; False when there is none of ours."""
    base = Path(target) if target is not None else Path(sysconfig.get_paths()["purelib"])
    pkg = base / "mooncake"
    init = pkg / "__init__.py"
    if not (init.exists() and _MARKER in init.read_text(errors="replace")):
        return False
    for name in ("store.py", "__init__.py"):
        (pkg / name).unlink(missing_ok=True)
    cache = pkg / "__pycache__"
    if cache.is_dir():
        for f in cache.iterdir():
            f.unlink()
        cache.rmdir()
    pkg.rmdir()
    return True

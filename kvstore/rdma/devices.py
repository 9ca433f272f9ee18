"""Whether and where this host can do RDMA: pyverbs, devices, settings, the fallback line.

Part of the experimental :mod:`kvstore.rdma` package (read its docstring first). This module
opens nothing: it finds pyverbs (a Debian system package, not on PyPI), lists devices, reads the
``KVSTORE_RDMA*`` settings, and says once per process, in one shape, why a role uses TCP instead
(``"<role>: RDMA off (<why>); using TCP"``). The node and the client ask :func:`first_device`
before they open anything, so a host without a device pays for nothing more than this.

pyverbs is a Debian system package (``python3-pyverbs``), not on PyPI. A virtual environment does
not see system packages, so :func:`import_pyverbs` imports it from the system ``dist-packages``
folder alone (that one package, the path removed again afterwards), and only when it was built
for this interpreter's version.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from kvstore.env import Env
from kvstore.errors import TransportUnavailableError

log = logging.getLogger(__name__)

SYSTEM_DIST_PACKAGES = Path("/usr/lib/python3/dist-packages")
_logged: set[str] = set()
_logged_lock = threading.Lock()


def log_once(what: str, message: str, level: int = logging.INFO) -> None:
    """Log ``message`` at ``level`` once per process per ``what`` (the fallback must not spam)."""
    with _logged_lock:
        if what in _logged:
            return
        _logged.add(what)
    log.log(level, message)


def log_fallback(what: str, role: str, why: str, level: int = logging.INFO) -> None:
    """Say once per ``what`` that ``role`` (client, node ...) uses TCP instead of RDMA, and why.

    Every fallback line has one shape, ``"<role>: RDMA off (<why>); using TCP"``, so an operator
    (or a test) finds it by "RDMA off" whatever the cause: no pyverbs, no device, a refused
    connect, a bad offer. ``level``: INFO where RDMA was asked for or a device (here or on the
    peer) exists; DEBUG where nobody asked and there is none (every start on a host without
    RDMA would say it otherwise).
    """
    log_once(what, f"{role}: RDMA off ({why}); using TCP", level)


# ---------------------------------------------------------------- discovery
def import_pyverbs() -> ModuleType:
    """Import pyverbs, from the system dist-packages if the environment lacks it.

    Raises:
        TransportUnavailableError: pyverbs is not installed for this Python version.
    """
    try:
        return importlib.import_module("pyverbs")
    except ImportError:
        pass
    tag = f"cpython-{sys.version_info.major}{sys.version_info.minor}"
    pkg = SYSTEM_DIST_PACKAGES / "pyverbs"
    if not pkg.is_dir() or not any(tag in p.name for p in pkg.glob("*.so")):
        raise TransportUnavailableError(
            "pyverbs is not installed for this Python (Debian: apt-get install python3-pyverbs)"
        )
    sys.path.append(str(SYSTEM_DIST_PACKAGES))
    try:
        return importlib.import_module("pyverbs")
    except ImportError as exc:
        raise TransportUnavailableError(f"pyverbs does not import: {exc}") from None
    finally:
        sys.path.remove(str(SYSTEM_DIST_PACKAGES))


@dataclass(frozen=True, slots=True)
class RdmaDevice:
    name: str


def discover() -> list[RdmaDevice]:
    """The RDMA devices of this host.

    Raises:
        TransportUnavailableError: no pyverbs, or no device (with the reason).
    """
    import_pyverbs()
    device = importlib.import_module("pyverbs.device")
    try:
        found = device.get_device_list()
    except Exception as exc:  # noqa: BLE001 - pyverbs raises its own errors for "no devices"
        raise TransportUnavailableError(f"no RDMA device ({exc})") from None
    if not found:
        raise TransportUnavailableError("no RDMA device")
    return [
        RdmaDevice(d.name.decode() if isinstance(d.name, bytes) else str(d.name)) for d in found
    ]


#: Test-only hook (no device here): pretend this host has the named device. A node that cannot
#: open it still publishes an offer (so clients try RDMA, fail, and fall back), and answers
#: ``rdma_connect`` with TransportUnavailableError. Never set it outside tests.
TEST_DEVICE_ENV = "KVSTORE_TEST_RDMA_DEVICE"  # read by kvstore.env.Env (test_rdma_device)


@dataclass(frozen=True, slots=True)
class RdmaConfig:
    """Where and whether to use RDMA, from the environment (see :mod:`kvstore.rdma`)."""

    enabled: bool = True
    device: str | None = None
    port: int = 1
    gid_index: int = 0
    pretend_device: str | None = None

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None) -> RdmaConfig:
        """Raises EnvError (an InvalidRequestError) for a port or GID index that is not a small
        integer (:class:`kvstore.env.Env` reads the variables)."""
        read = Env.read(env)
        return RdmaConfig(
            enabled=read.rdma,
            device=read.rdma_device,
            port=read.rdma_port,
            gid_index=read.rdma_gid_index,
            pretend_device=read.test_rdma_device,
        )


def first_device(role: str, settings: RdmaConfig | None = None) -> RdmaDevice | None:
    """The device to use, or None after logging once why TCP is used instead."""
    settings = settings or RdmaConfig.from_env()
    if not settings.enabled:  # the operator said so: nothing to tell them
        log_fallback("rdma-off", role, "disabled by KVSTORE_RDMA=off", logging.DEBUG)
        return None
    if settings.pretend_device:
        return RdmaDevice(settings.pretend_device)
    try:
        found = discover()
    except TransportUnavailableError as err:
        # NOTE: only a device asked for by name makes its absence news (INFO).
        level = logging.DEBUG if settings.device is None else logging.INFO
        log_fallback("rdma-fallback", role, err.message, level)
        return None
    if settings.device is None:
        return found[0]
    for d in found:
        if d.name == settings.device:
            return d
    log_fallback("rdma-fallback", role, f"no RDMA device named {settings.device!r}")
    return None

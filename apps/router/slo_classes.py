"""SLO classes of the router: targets, a priority order, and how a request names its class.

A request's class comes from its API key (``Authorization: Bearer KEY`` mapped in the config
file) or, failing that, its ``X-SLO-Class`` header, else the default class. The config file is
TOML or JSON::

    default_class = "standard"
    promote_fraction = 0.7

    [[classes]]
    name = "critical"
    ttft_s = 0.3
    tbt_s = 0.02

    [api_keys]
    "sk-team-a" = "critical"

Classes are listed in priority order: the first is served first.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.errors import InvalidRequestError
from kvstore.routing.slo import SLOClass

#: The built-in classes, highest priority first. ``critical`` is the interactive target of the
#: brief (300 ms TTFT, 20 ms between tokens); the others are looser tiers.
DEFAULT_CLASSES = (
    SLOClass("critical", ttft_s=0.3, tbt_s=0.02),
    SLOClass("standard", ttft_s=10.0, tbt_s=0.5),
    SLOClass("batch", ttft_s=120.0, tbt_s=5.0),
)
#: A queued request that has used this fraction of its TTFT budget jumps the queue.
DEFAULT_PROMOTE_FRACTION = 0.7
SLO_HEADER = "X-SLO-Class"


@dataclass(frozen=True, slots=True)
class SLOPolicy:
    """The router's classes and how requests are mapped onto them.

    Attributes:
        classes: the classes, highest priority first.
        default_class: the class of a request that names none.
        api_keys: bearer token -> class name.
        promote_fraction: see :data:`DEFAULT_PROMOTE_FRACTION` (0 < f <= 1).

    Raises:
        InvalidRequestError: on creation, for no classes, duplicate names, an unknown default
            or mapped class, or a bad fraction.
    """

    classes: tuple[SLOClass, ...] = DEFAULT_CLASSES
    default_class: str = "standard"
    api_keys: Mapping[str, str] = field(default_factory=dict)
    promote_fraction: float = DEFAULT_PROMOTE_FRACTION
    _by_name: dict[str, tuple[int, SLOClass]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.classes:
            raise InvalidRequestError("at least one SLO class is needed")
        by_name = {slo.name: (i, slo) for i, slo in enumerate(self.classes)}
        if len(by_name) != len(self.classes):
            raise InvalidRequestError("SLO class names must be unique")
        for name in (self.default_class, *self.api_keys.values()):
            if name not in by_name:
                raise InvalidRequestError(
                    f"unknown SLO class {name!r}; known: {', '.join(by_name)}"
                )
        if not 0 < self.promote_fraction <= 1:
            raise InvalidRequestError(
                f"promote_fraction must be in (0, 1], got {self.promote_fraction}"
            )
        object.__setattr__(self, "_by_name", by_name)

    def get(self, name: str) -> tuple[int, SLOClass]:
        """The priority (0 is highest) and class called ``name``.

        Raises:
            InvalidRequestError: an unknown class.
        """
        try:
            return self._by_name[name]
        except KeyError:
            known = ", ".join(self._by_name)
            raise InvalidRequestError(f"unknown SLO class {name!r}; known: {known}") from None

    def classify(self, headers: Mapping[str, str]) -> tuple[int, SLOClass]:
        """The class of a request: its API key's, else its ``X-SLO-Class`` header's, else the
        default.

        Args:
            headers: the request's headers (case-insensitive mapping).

        Returns:
            (priority, class).

        Raises:
            InvalidRequestError: the header names an unknown class.
        """
        auth = headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            name = self.api_keys.get(auth[len("Bearer ") :].strip())
            if name is not None:
                return self.get(name)
        header = headers.get(SLO_HEADER)
        if header:
            return self.get(header.strip())
        return self.get(self.default_class)

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> SLOPolicy:
        """Build from a parsed config file (see the module docstring).

        Raises:
            InvalidRequestError: unknown keys or bad values.
        """
        unknown = sorted(set(data) - {"classes", "default_class", "api_keys", "promote_fraction"})
        if unknown:
            raise InvalidRequestError(f"SLO config: unknown keys {unknown}")
        raw = data.get("classes")
        if raw is None:
            classes = DEFAULT_CLASSES
        else:
            if not isinstance(raw, list):
                raise InvalidRequestError("SLO config: classes must be a list of tables")
            classes = tuple(_slo_class(item) for item in raw)
        keys = data.get("api_keys", {})
        if not isinstance(keys, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in keys.items()
        ):
            raise InvalidRequestError("SLO config: api_keys must map key strings to class names")
        fraction = data.get("promote_fraction", DEFAULT_PROMOTE_FRACTION)
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            raise InvalidRequestError("SLO config: promote_fraction must be a number")
        default = data.get("default_class", classes[0].name if raw and classes else "standard")
        return SLOPolicy(classes, str(default), dict(keys), float(fraction))

    @staticmethod
    def load(path: str | Path) -> SLOPolicy:
        """Read a ``.toml`` or ``.json`` config file.

        Raises:
            InvalidRequestError: a file that does not parse or holds bad values.
            OSError: the file cannot be read.
        """
        text = Path(path).read_text()
        try:
            data = json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
        except (ValueError, tomllib.TOMLDecodeError) as err:
            raise InvalidRequestError(f"SLO config {path}: {err}") from None
        if not isinstance(data, dict):
            raise InvalidRequestError(f"SLO config {path}: not a table")
        return SLOPolicy.from_dict(data)


def _slo_class(item: Any) -> SLOClass:
    if not isinstance(item, dict) or set(item) != {"name", "ttft_s", "tbt_s"}:
        raise InvalidRequestError("SLO config: each class needs exactly name, ttft_s and tbt_s")
    return SLOClass(item["name"], item["ttft_s"], item["tbt_s"])

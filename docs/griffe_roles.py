"""A griffe extension for the Python API pages (``extensions:`` of the python handler in
mkdocs.yml): our docstrings cross-reference with Sphinx roles (``:class:`~kvstore.keys.Namespace```),
which Markdown would print as they are; this turns each into a code span of the name it shows
(``Namespace``). Nothing becomes a link: a link to an object the site does not render would fail
the strict build.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`<]+?)`")


def plain_roles(text: str) -> str:
    """``text`` with each Sphinx role written as a Markdown code span.

    A leading ``~`` keeps only the last part of the dotted name, as Sphinx shows it.
    """
    return _ROLE.sub(
        lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text
    )


class PlainRoles(griffe.Extension):
    """Rewrite Sphinx roles in every docstring before it is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain_roles(obj.docstring.value)

"""A griffe extension for the API pages, so that ctrlcomm's docstrings render as written:
they name other objects with reST roles (``:meth:`create```, ``:class:`~ctrlcomm.Group```),
which Markdown would show as ``:meth:`` followed by code; each role becomes a plain code
span of the name it gives.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|meth|class|mod|attr|exc|data|obj|const):`(~?)([^`]+)`")


def _span(m: re.Match[str]) -> str:
    name = m.group(2)
    return f"`{name.rsplit('.', 1)[-1] if m.group(1) else name}`"


class ReSTDocstrings(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_span, obj.docstring.value)

"""A Griffe extension for the API reference (mkdocs.yml): the ``>>>`` examples of sd-accel's
docstrings are shown as Python console blocks, not read as Markdown (where ``>`` starts a quote
and ``x["a"]["b"]`` looks like a reference link).

>>> fence("Text.\\n\\n>>> 1 + 1\\n2\\n\\nMore.").split("\\n")
['Text.', '', '```pycon', '>>> 1 + 1', '2', '```', '', 'More.']
"""

from __future__ import annotations

from typing import Any

import griffe


def fence(text: str) -> str:
    """Each run of lines from a ``>>>`` line up to the next blank line, in a ``pycon`` fence."""
    out: list[str] = []
    inside = False
    for line in text.split("\n"):
        if not inside and line.lstrip().startswith(">>>"):
            out.append("```pycon")
            inside = True
        elif inside and not line.strip():
            out.append("```")
            inside = False
        out.append(line)
    if inside:
        out.append("```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence(obj.docstring.value)

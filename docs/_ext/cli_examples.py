"""The "Examples:" epilogs of the click commands as shell code blocks on the CLI page.

click prints a paragraph after a ``\\b`` line as it is written; sphinx-click turns it into a line block of
reStructuredText, where a command such as ``dask-lm score data/*.parquet`` reads as the start of emphasis (a build
error under ``-W``) and loses its monospace. Here such a block becomes a ``code-block:: shell``.
"""

from __future__ import annotations

from typing import Any

from sphinx.application import Sphinx


def examples_as_code(app: Sphinx, ctx: Any, lines: list[str]) -> None:
    out: list[str] = []
    in_block = False
    for line in lines:
        if line.startswith("| "):
            if not in_block:
                out += [".. code-block:: shell", ""]
                in_block = True
            out.append("   " + line[2:])
            continue
        if in_block:
            out.append("")
            in_block = False
        out.append(line)
    lines[:] = out


def setup(app: Sphinx) -> dict[str, Any]:
    app.setup_extension("sphinx_click")
    app.connect("sphinx-click-process-epilog", examples_as_code)
    app.connect("sphinx-click-process-description", examples_as_code)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

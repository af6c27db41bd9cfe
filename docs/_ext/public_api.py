"""The ``dask-lm-api`` directive: autodoc entries for every public name, grouped, generated from ``dask_lm.__all__``.

The API page lists no name by hand: each name of ``dask_lm.__all__`` is documented once, as ``dask_lm.<name>``, in
the first group below that claims it (by name, else by defining module), and a name no group claims lands in
"More", so a new public name shows up on the next build. The exception classes of :mod:`dask_lm.errors` follow
(``dask_lm.<name>`` where exported, else ``dask_lm.errors.<name>``), since users catch them by either path.
"""

from __future__ import annotations

import inspect
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

# (title, what it is for, names claimed, defining-module prefixes claimed)
GROUPS: list[tuple[str, str, tuple[str, ...], tuple[str, ...]]] = [
    (
        "Jobs",
        "Start or reach a cluster, score parquet datasets or Dask DataFrames, read the scores back, the demo's "
        "model and data.",
        ("connect", "score_parquet", "ScoreResult", "read_scores", "score", "demo_model", "demo_data", "set_progress"),
        (),
    ),
    (
        "The Policy",
        "NeMo RL's ``Policy`` on a Dask cluster, its configuration and its batches.",
        ("Policy", "PolicyFuture", "PolicyConfig"),
        ("dask_lm.engine.policy", "dask_lm.config", "dask_lm.data"),
    ),
    ("Losses", "NeMo RL's loss functions for ``Policy.train``.", (), ("dask_lm.losses",)),
    ("Metrics", "Timers and FLOP counts.", (), ("dask_lm.engine.metrics",)),
    ("Errors", "", (), ("dask_lm.errors",)),
]


def numpy_sections(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """Napoleon's numpy-style sections ("Parameters", "Examples") for functions and classes only: on an attribute's
    docstring napoleon reads "text: more" as a type followed by a description, and our attribute docstrings often
    start that way ("Wall time (this run): ...")."""
    if what not in ("function", "method", "class", "exception"):
        return
    from sphinx.ext.napoleon import Config
    from sphinx.ext.napoleon.docstring import NumpyDocstring

    lines[:] = NumpyDocstring(lines, Config(napoleon_use_rtype=False), app, what, name, obj, options).lines()


def _directive(name: str, obj: Any) -> list[str]:
    if inspect.isclass(obj):
        if issubclass(obj, BaseException):
            return [f".. autoexception:: {name}", ""]
        return [f".. autoclass:: {name}", "   :members:", ""]
    if callable(obj):
        return [f".. autofunction:: {name}", ""]
    return [f".. autodata:: {name}", "   :no-value:", ""]


def api_rst() -> list[str]:
    import dask_lm
    import dask_lm.errors

    exported = {n: getattr(dask_lm, n) for n in dask_lm.__all__ if n != "__version__"}
    errors = {n: getattr(dask_lm.errors, n) for n in dask_lm.errors.__all__}
    placed: set[str] = set()
    rst: list[str] = []
    for title, intro, names, modules in [*GROUPS, ("More", "", (), ("dask_lm",))]:
        mine = [n for n in names if n in exported and n not in placed]
        mine += sorted(
            (
                n
                for n, obj in exported.items()
                if n not in placed and n not in mine and getattr(obj, "__module__", "").startswith(modules)
            ),
            key=str.lower,
        )
        entries = [(f"dask_lm.{n}", exported[n]) for n in mine]
        placed.update(mine)
        if title == "Errors":  # every exception class of dask_lm.errors, exported or not
            entries += [(f"dask_lm.errors.{n}", obj) for n, obj in errors.items() if n not in exported]
            entries.sort(key=lambda e: e[0].rsplit(".", 1)[1])
        if not entries:
            continue
        rst += [title, "-" * len(title), ""] + ([intro, ""] if intro else [])
        for name, obj in entries:
            rst += _directive(name, obj)
    assert placed == set(exported), set(exported) - placed
    return rst


class PublicApi(SphinxDirective):
    def run(self) -> list[nodes.Node]:
        node = nodes.section()
        node.document = self.state.document
        nested_parse_with_titles(self.state, StringList(api_rst(), source="dask_lm/__init__.py"), node)
        return list(node.children)


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("dask-lm-api", PublicApi)
    app.connect("autodoc-process-docstring", numpy_sections)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

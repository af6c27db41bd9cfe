"""Sphinx configuration of dask-lm's documentation site.

Built in CI by ``tests/test_docs.py`` with ``sphinx-build -W --keep-going -b html docs <dir>``: a warning (a broken
cross-reference, a page outside every toctree, a bad directive) fails the build. By hand:
``python -m sphinx -W --keep-going -b html docs docs/_build/html``.

Pages are MyST Markdown; the reference pages are generated: the CLI from the click commands (sphinx-click), the
API from the docstrings (autodoc). The Policy config keys (``reference/config.md``) are a Markdown table that
``python -m dask_lm.config.doc --write`` generates from the dataclasses of ``dask_lm/config/``. No intersphinx: CI
reaches no network but the package index, so references to other projects' types cannot be linked
(``nitpick_ignore`` below lists the ones our public signatures name).
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "_ext"))
# the package documented is the one beside these docs (a worktree or a clone), not whichever is installed
sys.path.insert(0, os.path.dirname(HERE))

import dask_lm  # noqa: E402

project = "dask-lm"
author = "the dask-lm authors"
copyright = "the dask-lm authors"
version = release = dask_lm.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx_click",
    "cli_examples",  # _ext/cli_examples.py: the commands' "Examples:" epilogs as shell code blocks
    "public_api",  # _ext/public_api.py: the {dask-lm-api} directive (autodoc over dask_lm.__all__)
    "internal_refs",  # _ext/internal_refs.py: references by defining module, resolved to the public entries
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # `[text](page.md#a-heading)` links resolve to the heading's anchor (checked by -W)

# every cross-reference must resolve; the build fails on one that does not
nitpicky = True
# Types from other projects that our public signatures name. Without intersphinx (no network in CI) Sphinx has
# no inventory to link them to, so they are listed here instead of being left unresolved.
nitpick_ignore = [
    # torch's and distributed's types in our signatures (their docs are inventories we do not fetch)
    ("py:class", "torch.Tensor"),
    ("py:class", "torch.device"),
    ("py:class", "distributed.client.Client"),
    ("py:class", "distributed.client.Future"),
    ("py:class", "Future"),  # dask_lm.PolicyFuture's base and argument types, as distributed names them
    # pandas' and pyarrow's, as our signatures spell them (read_scores, ScoreResult.to_pandas / to_arrow)
    ("py:class", "pd.DataFrame"),
    ("py:class", "pandas.DataFrame"),
    ("py:class", "pa.Table"),
    ("py:class", "pyarrow.Table"),
    # Python's own (the standard library's inventory, likewise not fetched): base classes and annotations
    ("py:class", "os.PathLike"),
    ("py:class", "enum.Enum"),
    ("py:class", "collections.UserDict"),
    ("py:class", "collections.abc.Iterator"),
    ("py:class", "collections.abc.Mapping"),
    ("py:class", "collections.abc.Sequence"),
]

autodoc_member_order = "bysource"
autodoc_typehints = "description"  # types go into the parameter list, not into a 300-character signature
autodoc_default_options = {"show-inheritance": False}

html_theme = "pydata_sphinx_theme"
html_title = f"dask-lm {release}"
html_static_path = ["_static"]
html_css_files = ["dask-lm.css"]
html_theme_options = {
    "navbar_align": "left",
    "show_toc_level": 2,
    "navigation_with_keys": False,
    # nothing fetched at build or view time: no version switcher, no icon links to external sites, no analytics
    "icon_links": [],
}
# the section's pages on the left; the top-level pages without sub-pages get no (empty) left column
html_sidebars = {
    "**": ["sidebar-nav-bs"],
    "index": [],
    "quickstart": [],
    "benchmarks": [],
    "reference/config": [],
}  # its wide tables need the room; the navbar still leads to Reference
html_show_sourcelink = False
html_copy_source = False

"""Cross-references to dask-lm objects by their defining module, resolved for a site that documents public names.

The docstrings name where things live (``:mod:`dask_lm.io.hub```, ``:class:`~dask_lm.jobs.start.ClusterStart```)
and autodoc writes type hints by defining module (``dask_lm.data.batch.BatchedDataDict``), while the API reference
documents each public object once, under ``dask_lm.<name>``. Under ``nitpicky`` every such reference would be an
error. On Sphinx's ``missing-reference`` event, a ``py`` reference to ``dask_lm.*``:

- that imports to an object exported as ``dask_lm.<name>`` links to that entry;
- that imports to anything else (a private module or helper: not API, so it has no page) is shown as code;
- that does not import stays unresolved, so a misspelt name still fails the build.
"""

from __future__ import annotations

import importlib
from typing import Any

from docutils import nodes
from sphinx.addnodes import pending_xref
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment


def _import(target: str) -> tuple[bool, Any]:
    """``(found, object)`` for a dotted name: a module, or an attribute path under one."""
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False, None
        return True, obj
    return False, None


def _module_of(source: str) -> str | None:
    """The module whose docstring a node came from: autodoc names it ``.../dask_lm/x/y.py:docstring of ...``."""
    path = source.split(":docstring of ", 1)[0]
    if "/dask_lm/" not in path or not path.endswith(".py"):
        return None
    module = "dask_lm/" + path.rsplit("/dask_lm/", 1)[1].removesuffix(".py")
    return module.removesuffix("/__init__").replace("/", ".")


def _public_name(obj: Any) -> str | None:
    import dask_lm

    for name in dask_lm.__all__:
        if name != "__version__" and getattr(dask_lm, name) is obj:
            return f"dask_lm.{name}"
    return None


def resolve(app: Sphinx, env: BuildEnvironment, node: pending_xref, contnode: nodes.Element) -> nodes.Element | None:
    target = node.get("reftarget", "")
    if node.get("refdomain") != "py":
        return None
    if "." not in target:  # a name local to the docstring's module (``:func:`worth_compiling```)
        module = _module_of(node.source or "")
        target = f"{module}.{target}" if module else target
    if not target.startswith("dask_lm."):
        return None
    found, obj = _import(target)
    if not found:
        return None  # a name that does not exist: the warning stands
    public = _public_name(obj)
    if public is not None and public != target:
        domain = env.get_domain("py")
        ref = domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], public, node, contnode)
        if ref is not None:
            return ref
        ref = domain.resolve_xref(env, node["refdoc"], app.builder, "obj", public, node, contnode)
        if ref is not None:
            return ref
    return contnode  # exists, but is not documented API: plain code


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("missing-reference", resolve)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

"""The ``dask-lm-config`` directive: the Policy config keys, generated from the typed config in ``dask_lm/config.py``.

``.. dask-lm-config:: dask_lm.config.PolicyConfig`` walks the dataclass and every dataclass section under it
(``policy.dtensor_cfg``, ``policy.generation``, ...) and writes, per section, a table of its keys: the dotted key
as a user writes it (NeMo RL's spelling, so ``policy.dtensor_cfg._v2``), the type, the default (JSON, as in a YAML or
dict config) and the attribute docstring written under the field (read from the source with :mod:`ast`, since
Python keeps no such docstrings at run time; "—" where there is none). Keys that dask-lm accepts for NeMo RL
compatibility without acting on them say so, from the table the config check itself uses
(``dask_lm.config_keys._UNHONOURED``). Nothing here is typed by hand: a new field appears on the next build.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import textwrap
import types
import typing
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

NONE = "—"  # the description of a key whose field has no docstring


def field_docstrings(cls: type) -> dict[str, str]:
    """``{field name: docstring}`` of the string literals written right under a dataclass's fields."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def type_text(tp: Any) -> str:
    """An annotation as a user reads it in a YAML or dict config: ``null`` for None, literals quoted."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if tp is Any:
        return "Any"
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_text(a) for a in args)}]"
    return tp.__name__


def default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "its keys' defaults"
    return json.dumps(value)


def sections(cls: type, prefix: str) -> list[tuple[str, type]]:
    """``cls`` and every dataclass section reachable from it, depth first, with their dotted prefixes."""
    out = [(prefix, cls)]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        inner = _section_class(hints[f.name])
        if inner is not None:
            out += sections(inner, f"{prefix}.{f.metadata.get('key', f.name)}")
    return out


def _section_class(tp: Any) -> type | None:
    candidates = [tp, *typing.get_args(tp)] if typing.get_origin(tp) in (typing.Union, types.UnionType) else [tp]
    return next((c for c in candidates if isinstance(c, type) and dataclasses.is_dataclass(c)), None)


def _label(prefix: str) -> str:
    return f"config-{prefix}"


def section_rst(prefix: str, cls: type, unhonoured: dict[str, tuple[str, str]]) -> list[str]:
    hints = typing.get_type_hints(cls)
    docs = field_docstrings(cls)
    title = f"``{prefix}``"
    lines = [f".. _{_label(prefix)}:", "", title, "~" * len(title), ""]
    if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):  # not the dataclass-generated signature
        lines += [inspect.cleandoc(cls.__doc__), ""]
    lines += [".. list-table::", "   :header-rows: 1", "   :widths: 36 16 12 36", "   :class: config-keys", "",
              "   * - key", "     - type", "     - default", "     - meaning"]
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.metadata.get('key', f.name)}"
        inner = _section_class(hints[f.name])
        tp = type_text(hints[f.name])
        if inner is not None:  # the section's own table follows: link to it
            # a link by fragment: the section's label is its id (a :ref: would need it registered as a label)
            tp = tp.replace(inner.__name__, f"`{inner.__name__} <#{_label(key).replace('.', '-').replace('_', '-')}>`__")
        else:
            tp = f"``{tp}``"
        default = default_text(f)
        default = default if default in ("required", "its keys' defaults") else f"``{default}``"
        meaning = docs.get(f.name, NONE)
        short = key.removeprefix("policy.")
        if short in unhonoured:
            action, reason = unhonoured[short]
            what = {"refuse": "refused when set", "warn": "ignored with a warning when set",
                    "accept": "accepted and not acted on"}[action]
            meaning += f"\n\nNeMo RL compatibility: {what} ({reason})."
        lines += [f"   * - ``{key}``", f"     - {tp}", f"     - {default}"]
        lines += ["     - " + line if i == 0 else ("       " + line if line.strip() else "")
                  for i, line in enumerate(meaning.splitlines())]
    return lines + [""]


class ConfigKeys(SphinxDirective):
    required_arguments = 1  # the dataclass: module.Class

    def run(self) -> list[nodes.Node]:
        module_name, _, class_name = self.arguments[0].rpartition(".")
        module = importlib.import_module(module_name)
        cls = getattr(module, class_name)
        self.env.note_dependency(inspect.getsourcefile(module) or "")  # rebuilt when config.py changes
        from dask_lm.config_keys import _UNHONOURED

        unhonoured = {key: (action, reason) for key, action, _, reason in _UNHONOURED}
        rst: list[str] = []
        for prefix, section in sections(cls, "policy"):
            rst += section_rst(prefix, section, unhonoured)
        node = nodes.section()
        node.document = self.state.document
        nested_parse_with_titles(self.state, StringList(rst, source="dask_lm/config.py"), node)
        return list(node.children)


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("dask-lm-config", ConfigKeys)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

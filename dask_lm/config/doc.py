"""The config reference table, generated from the config's own dataclasses: ``python -m dask_lm.config.doc``.

For :class:`~dask_lm.config.PolicyConfig` and every section under it (``policy.dtensor_cfg``, ``policy.generation``,
``policy.generation.sglang_cfg``, ...), one Markdown table of its keys: the dotted key as a user writes it (NeMo RL's
spelling, so ``policy.dtensor_cfg._v2``), the type, the default (JSON, as a YAML or dict config writes it) and the
docstring written under the field. Python keeps no such docstrings at run time, so they are read from the source
with :mod:`ast`. Keys dask-lm accepts for NeMo RL compatibility without acting on them say so, from the table the
config check itself uses (:data:`dask_lm.config.keys.UNHONOURED`).

The table lives in ``docs/reference/config.md`` (the README links it) between two marker comments; ``--write``
rewrites it there, ``--check`` fails when it is stale, and ``tests/test_config.py`` asserts it equals this output, so
the page and the code cannot drift. Markdown rather than a Sphinx directive: the same file reads on GitHub and in the
built site."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import json
import pathlib
import re
import sys
import textwrap
import types
import typing
from collections.abc import Callable
from typing import Any

from dask_lm.config.keys import UNHONOURED, Row, condition
from dask_lm.config.policy import PolicyConfig

__all__ = ["field_docstrings", "sections", "markdown", "cell", "GeneratedTable"]

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
# what the table is made from and what to edit instead, as its begin marker says
_SOURCE = "dask_lm/config/; edit the field docstrings there, not this table"
_WHAT = {"refuse": "refused", "warn": "warned about", "accept": "accepted and not acted on"}


def field_docstrings(cls: type) -> dict[str, str]:
    """``{field name: docstring}`` of the string literals written right under a dataclass's fields."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
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
    return str(tp.__name__)


def default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "its keys' defaults"
    return f"`{json.dumps(value)}`"


def section_class(tp: Any) -> type | None:
    """The dataclass a field's annotation holds (``X`` or ``X | None``), else None."""
    candidates = [tp, *typing.get_args(tp)] if typing.get_origin(tp) in (typing.Union, types.UnionType) else [tp]
    return next((c for c in candidates if isinstance(c, type) and dataclasses.is_dataclass(c)), None)


def sections(cls: type, prefix: str) -> list[tuple[str, type]]:
    """``cls`` and every dataclass section reachable from it, depth first, with their dotted prefixes."""
    out = [(prefix, cls)]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        inner = section_class(hints[f.name])
        if inner is not None:
            out += sections(inner, f"{prefix}.{f.metadata.get('key', f.name)}")
    return out


def _anchor(prefix: str) -> str:
    # the heading's anchor as GitHub and MyST (myst_heading_anchors) both spell it: "`policy.x_y`" -> "policyx_y"
    return re.sub(r"[^\w\- ]", "", prefix.lower()).replace(" ", "-")


def cell(text: str) -> str:
    """Docstring text (reStructuredText) as one Markdown table cell."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"``\1``", text)  # a role (:mod:`x`) reads as code
    text = re.sub(r"``(.+?)``", r"`\1`", text, flags=re.S)
    return " ".join(text.split()).replace("|", "\\|")


def section_markdown(prefix: str, cls: type, unhonoured: dict[str, list[Row]]) -> list[str]:
    hints = typing.get_type_hints(cls)
    docs = field_docstrings(cls)
    lines = [f"## `{prefix}`", ""]
    if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):  # not the dataclass-generated signature
        lines += [cell(inspect.cleandoc(cls.__doc__)).replace("\\|", "|"), ""]
    lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.metadata.get('key', f.name)}"
        inner = section_class(hints[f.name])
        options = typing.get_args(hints[f.name]) if inner is not None else ()
        if inner is not None and options:  # `X | None`: the section's own table follows, linked
            link = f"[`{inner.__name__}`](#{_anchor(key)})"
            tp = " \\| ".join(link if a is inner else cell(f"``{type_text(a)}``") for a in options)
        elif inner is not None:
            tp = f"[`{inner.__name__}`](#{_anchor(key)})"
        else:
            tp = cell(f"``{type_text(hints[f.name])}``")
        meaning = docs.get(f.name)
        if meaning is None:
            raise ValueError(
                f"`{key}` ({cls.__module__}.{cls.__qualname__}.{f.name}) has no docstring: write one "
                "under the field, it is the key's entry in the config reference"
            )
        meaning = cell(meaning)
        short = key.removeprefix("policy.")
        for row in unhonoured.get(short, ()):
            what = " ".join(filter(None, [_WHAT[row.action], condition(row)]))
            meaning += f" *NeMo RL compatibility: {what} ({cell(row.reason)}).*"
        if any(k.startswith(short + ".") for k in unhonoured) and inner is None:
            meaning += " *NeMo RL compatibility: its keys are checked one by one ([NeMo RL keys](nemo_rl_keys.md)).*"
        lines.append(f"| `{key}` | {tp} | {default_text(f)} | {meaning} |")
    return lines + [""]


def _rows() -> list[str]:
    """Every section's table."""
    unhonoured: dict[str, list[Row]] = {}
    for row in UNHONOURED:
        unhonoured.setdefault(row.key, []).append(row)
    lines: list[str] = []
    for prefix, section in sections(PolicyConfig, "policy"):
        lines += section_markdown(prefix, section, unhonoured)
    return lines[:-1]  # each section ends with a blank line; the block's end marker follows one


def generated_block(page: pathlib.Path, begin: str, end: str) -> str:
    """The generated block ``page`` holds now (from the ``begin`` marker through the ``end`` one)."""
    text = page.read_text()
    if begin not in text or end not in text:
        raise ValueError(f"{page} has no generated table (the {begin!r} ... {end!r} markers)")
    return text[text.index(begin) : text.index(end) + len(end)] + "\n"


@dataclasses.dataclass(frozen=True)
class GeneratedTable:
    """A table generated into a docs page between two marker comments, and the command line that keeps it there
    (``python -m MODULE``): print it, ``--write`` it into the page, or ``--check`` that the page holds it (exit 1
    naming the command that rewrites it). Each generator module makes one and hands on its :meth:`current` and
    :meth:`main`."""

    module: str
    doc: str | None
    """The module's docstring: its first line describes the command line."""
    page_name: str
    """The page, under ``docs/reference/``."""
    what: str
    """What the table lists, as its markers name it (``config keys``)."""
    source: str
    """Where its text comes from and what to edit instead, as the begin marker says it."""
    rows: Callable[[], list[str]]
    """The block's lines between the markers."""

    @property
    def page(self) -> pathlib.Path:
        return DOCS / "reference" / self.page_name

    @property
    def begin(self) -> str:
        return f"<!-- {self.what}: generated by `python -m {self.module} --write` from {self.source} -->"

    @property
    def end(self) -> str:
        return f"<!-- end of the generated {self.what} -->"

    def markdown(self) -> str:
        """The generated block: the rows, between the begin and end markers."""
        return "\n".join([self.begin, "", *self.rows(), "", self.end]) + "\n"

    def current(self) -> str:
        """The block the page holds now (from the begin marker through the end one)."""
        return generated_block(self.page, self.begin, self.end)

    def main(self, argv: list[str] | None = None) -> int:
        description = (self.doc or "").splitlines()[0]
        parser = argparse.ArgumentParser(prog=f"python -m {self.module}", description=description)
        action = parser.add_mutually_exclusive_group()
        action.add_argument("--write", action="store_true", help=f"rewrite the table in {self.page.name}")
        action.add_argument("--check", action="store_true", help=f"exit 1 when the table in {self.page.name} is stale")
        args = parser.parse_args(argv)
        block = self.markdown()
        if args.write:
            self.page.write_text(self.page.read_text().replace(self.current().rstrip("\n"), block.rstrip("\n")))
        elif args.check:
            if self.current() != block:
                print(f"{self.page} is stale: run `python -m {self.module} --write`", file=sys.stderr)
                return 1
        else:
            sys.stdout.write(block)
        return 0


TABLE = GeneratedTable("dask_lm.config.doc", __doc__, "config.md", "config keys", _SOURCE, _rows)
markdown, current, main = TABLE.markdown, TABLE.current, TABLE.main


if __name__ == "__main__":
    sys.exit(main())

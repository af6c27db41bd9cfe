"""The NeMo RL key table: every key of NeMo RL's policy config, and whether dask-lm honours it, warns about it,
refuses it or accepts it with no effect, rendered from the config's own data (``python -m dask_lm.config.nemo_table``).

The rows are the config's: the keys of :class:`~dask_lm.config.PolicyConfig` and its sections, less the keys that are
dask-lm's own (:data:`dask_lm.config.keys.DASK_LM_KEYS`), each honoured unless the table of
:mod:`dask_lm.config.keys` (:data:`~dask_lm.config.keys.UNHONOURED`, which the config check runs) says otherwise,
plus that table's rows for keys inside a plain mapping (``dtensor_cfg.automodel_kwargs.*``). An honoured key's text
is the first sentence of its field's docstring; any other's is the table's reason.

The table lives in ``docs/reference/nemo_rl_keys.md`` between two marker comments, as the config reference does
(:mod:`dask_lm.config.doc`): ``--write`` rewrites it, ``--check`` fails when it is stale, and
``tests/test_nemo_configs.py`` asserts the page holds this output."""

from __future__ import annotations

import dataclasses
import sys
import typing
from typing import NamedTuple

from dask_lm.config.doc import GeneratedTable, cell, field_docstrings, section_class, sections
from dask_lm.config.keys import CLOSED, DASK_LM_KEYS, UNHONOURED, Row, condition
from dask_lm.config.policy import PolicyConfig

__all__ = ["KeyStatus", "key_statuses", "markdown"]

# what the table is made from and what to edit instead, as its begin marker says
_SOURCE = "dask_lm/config/keys.py and the config's field docstrings; edit those, not this table"
_STATUS = {"refuse": "refused", "warn": "warned", "accept": "no effect"}
# the catch-all fields that keep a section's other keys: shown as the keys they hold
_OTHER_KEY = (
    "any other key of this mapping: NeMo RL passes it on to NeMo Automodel, and dask-lm cannot tell whether "
    "it changes the model; remove it."
)
_CATCH_ALL = {"megatron_cfg.extra": "megatron_cfg.*", "generation.sglang_cfg.extra": "generation.sglang_cfg.*"}


class KeyStatus(NamedTuple):
    key: str  # dotted under `policy.`, as a NeMo RL config writes it
    status: str  # "honoured", "warned", "refused" or "no effect" (more than one: "refused / warned")
    when: str  # when a warning or refusal happens ("when > 1"); empty for honoured and no-effect keys
    what: str  # what the key does here


def _first_sentence(text: str) -> str:
    """Up to the first full stop outside parentheses (a docstring's first sentence), else the whole text."""
    flat, depth = " ".join(text.split()), 0
    for i, char in enumerate(flat):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "." and depth == 0 and (i + 1 == len(flat) or flat[i + 1] == " "):
            return flat[: i + 1]
    return flat


def _row_status(key: str, rows: list[Row]) -> KeyStatus:
    return KeyStatus(
        _CATCH_ALL.get(key, key),
        " / ".join(_STATUS[r.action] for r in rows),
        "; ".join(f"{_STATUS[r.action]} {condition(r)}" for r in rows if condition(r))
        if len(rows) > 1
        else condition(rows[0]),
        " ".join(r.reason if r.reason.endswith(".") else r.reason + "." for r in rows),
    )


def key_statuses() -> list[KeyStatus]:
    """One entry per NeMo RL key, in the config's order (each section's keys, then its sections'), the keys inside
    a plain mapping right after the mapping's own."""
    by_key: dict[str, list[Row]] = {}
    for row in UNHONOURED:
        by_key.setdefault(row.key, []).append(row)
    out: list[KeyStatus] = []
    for prefix, section in sections(PolicyConfig, "policy"):
        docs = field_docstrings(section)
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            key = f"{prefix}.{f.metadata.get('key', f.name)}".removeprefix("policy.")
            if key in DASK_LM_KEYS or section_class(hints[f.name]) is not None:
                continue  # dask-lm's own key, or a section (its keys follow)
            if key in by_key:
                out.append(_row_status(key, by_key[key]))
            elif key in CLOSED:
                out.append(KeyStatus(key, "checked key by key", "", "its keys below; any other is refused."))
            else:
                out.append(KeyStatus(key, "honoured", "", _first_sentence(docs[f.name])))
            inner = [k for k in by_key if k.startswith(key + ".")]
            out += [_row_status(k, by_key[k]) for k in inner]
            out += [
                KeyStatus(f"{k}.*", "refused", "when set", _OTHER_KEY)
                for k in CLOSED
                if k == key or k.startswith(key + ".")
            ]
    return out


def _rows() -> list[str]:
    return [
        "| key | here | when | what it does here |",
        "|---|---|---|---|",
        *(f"| `{e.key}` | {e.status} | {cell(e.when)} | {cell(e.what)} |" for e in key_statuses()),
    ]


TABLE = GeneratedTable("dask_lm.config.nemo_table", __doc__, "nemo_rl_keys.md", "NeMo RL keys", _SOURCE, _rows)
markdown, current, main = TABLE.markdown, TABLE.current, TABLE.main


if __name__ == "__main__":
    sys.exit(main())

"""The batch jobs' option tables (``docs/reference/jobs.md``), rendered from the jobs' specs
(``python -m dask_lm.job_options``): each option as Python and the command line spell it, whether the manifest pins it,
its default and what it does.

The tables live in the page between two marker comments, as the config reference's do (:mod:`dask_lm.config.doc`):
``--write`` rewrites them, ``--check`` fails when they are stale, and ``tests/test_job_specs.py`` asserts the page
holds this output."""

from __future__ import annotations

import dataclasses
import sys

from dask_lm.config.doc import GeneratedTable, cell
from dask_lm.jobs.spec import JobSpec, options_of
from dask_lm.scoring.spec import ScoreSpec
from dask_lm.sft.spec import SFTSpec

__all__ = ["markdown", "current"]

# what the table is made from and what to edit instead, as its begin marker says
_SOURCE = "the jobs' specs (dask_lm/scoring/spec.py, dask_lm/sft/spec.py); edit those, not these tables"
# what each role means on resume, in the table's words
_ROLE = {"source": "pinned by content", "pinned": "pinned", "setting": "setting"}
_JOBS: tuple[tuple[str, str, type[JobSpec]], ...] = (
    ("`dask_lm.score_parquet` / `dask-lm score`", "ScoreSpec", ScoreSpec),
    ("`dask_lm.sft.job.sft_parquet` / `dask-lm sft`", "SFTSpec", SFTSpec),
)


def _default(field: dataclasses.Field[object]) -> str:
    if field.default is dataclasses.MISSING:
        return "required"
    return f"`{field.default!r}`"


def _rows() -> list[str]:
    """One table per job."""
    lines: list[str] = []
    for title, name, spec in _JOBS:
        lines += [
            "",
            f"## {title} (`{spec.__module__}.{name}`)",
            "",
            "| Python | command line | on resume | default | what it does |",
            "|---|---|---|---|---|",
        ]
        for f, o in options_of(spec):
            flag = (o.flag or f"--{f.name.replace('_', '-')}") if o.cli else "INPUTS"
            if o.toggle:
                flag = f"{flag} / --no-{flag[2:]}"
            text = cell(o.help).replace("<", "&lt;")  # list<int> is no HTML tag
            lines.append(f"| `{f.name}` | `{flag}` | {_ROLE[o.role]} | {_default(f)} | {text} |")
    return lines[1:]  # the block's begin marker and a blank line come first


TABLE = GeneratedTable("dask_lm.job_options", __doc__, "jobs.md", "job options", _SOURCE, _rows)
markdown, current, main = TABLE.markdown, TABLE.current, TABLE.main


if __name__ == "__main__":
    sys.exit(main())

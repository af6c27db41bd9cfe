"""Every bad row of a scoring job, found by the driver while the workers load the model.

A bad row (a null, an id outside the vocabulary, a row over the position limit, text that is not UTF-8) found by
the worker that scores its partition is found after the cluster's start and the model's load, and one at a time,
so a newcomer fixing a dataset would pay a full start per bad row. Here the driver reads the scored columns and
runs the workers' own row checks (:func:`dask_lm.data.rows.prepare_rows`: same rules, same messages) over the
whole input, in a thread beside the hashes, while the workers import and load. A job with bad rows is refused
with all of them counted and the first few named, before anything is written.

Only where the data allows: the scan costs a second read and (for text) a second tokenization, so it runs for
jobs of at most :data:`PRESCAN_MAX_TOKENS` tokens (those it can finish within a model's load); larger jobs, and
``--skip-bad-rows`` jobs (which list bad rows instead of failing), leave the checks to the workers.
"""

from __future__ import annotations

import logging

from dask_lm.data.messages import ScoreOptions
from dask_lm.data.rows import RowModel, prepare_rows
from dask_lm.errors import BadRowError
from dask_lm.interface import opt
from dask_lm.io import modelcheck
from dask_lm.io import parquet as pio
from dask_lm.scoring.spans import Span
from dask_lm.scoring.spec import row_columns

__all__ = ["PRESCAN_MAX_TOKENS", "SHOWN", "bad_rows", "message", "refuse_bad_rows"]

logger = logging.getLogger("dask_lm")

# About what a fast tokenizer and pyarrow check in the ten seconds a worker takes to import and load a model
PRESCAN_MAX_TOKENS = 8_000_000
SHOWN = 5  # bad rows named in the message; the rest are counted


def bad_rows(inputs: pio.ScoreInputs, plan: list[Span], opts: ScoreOptions, vocab_size: int | None) -> list[str] | None:
    """The errors of every bad row of the job, in input order; ``None`` where the scan cannot stand in for the
    workers' (no vocabulary size stated, or the tokenizer does not load here: the workers then report)."""
    if vocab_size is None:
        return None
    tokenizer = None
    if not opts.ids_column:
        try:  # the class its config names, without AutoTokenizer's imports (torch): the scan starts in a second
            tokenizer = modelcheck.load_tokenizer(opts.tokenizer)
        except Exception as e:
            logger.debug("no pre-scan of the rows: the tokenizer does not load in the driver (%s)", e)
            return None
    model = RowModel(tokenizer, vocab_size, modelcheck.stated_positions(opts.model))
    columns = row_columns(opts)
    errors: list[str] = []
    for g in sorted({g for span in plan for g in span.groups}):
        file, group, first, rows = inputs.partitions[g]
        part = pio.read_partition(file, group, first, rows, columns)
        if isinstance(part, pio.UnreadableRowGroup):
            errors += [part.message()] * part.num_rows
            continue
        got = prepare_rows(part, opts, model, file=file, first_row=first)
        errors += [e for e in got.errors if e is not None]
    return errors


def refuse_bad_rows(inputs: pio.ScoreInputs, plan: list[Span], opts: ScoreOptions, vocab_size: int | None) -> None:
    """:func:`bad_rows`, as a refusal: :class:`~dask_lm.errors.BadRowError` naming them (:func:`message`)."""
    bad = bad_rows(inputs, plan, opts, vocab_size)
    if bad:
        raise BadRowError(message(bad))


def message(errors: list[str]) -> str:
    """The refusal: how many bad rows, the first :data:`SHOWN` of them, and the way on."""
    shown = "; ".join(errors[:SHOWN])
    more = f" (and {len(errors) - SHOWN} more)" if len(errors) > SHOWN else ""
    return (
        f"{len(errors)} bad row{'s' * (len(errors) != 1)} in the input, found before scoring: {shown}{more}; "
        f"fix the data, or pass {opt('skip_bad_rows', True)} to leave bad rows out (listed in _errors.parquet)"
    )

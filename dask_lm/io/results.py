"""Reading a scoring job's output back: ``read_scores`` (pandas) and :func:`scores_table` (Arrow), and the token
strings of ``--decode-topk``.

An output folder (:mod:`dask_lm.scoring.job`) holds ``part-NNNNN.parquet`` files, one per span of input rows, in
input order: part 0 holds the first rows of the first file, and the rows inside a part keep their input order. So
the parts read one after the other, by number, give the rows in input order. Beside them are the job's own files,
all named with a leading ``_`` or ``.`` (``_manifest.json``, ``_SUCCESS``, ``_errors.parquet``, the lock,
temporaries), which is why ``pd.read_parquet(output)`` gives the same rows in the same order too: pyarrow's dataset
discovery skips those names and lists the parts sorted by name, and the zero-padded numbers sort as the
integers do. What it does not do is check anything: it reads an unfinished output, or a folder that is not a
scoring output at all, without a word. :func:`read_scores` refuses both.

Nothing here touches a model or CUDA; :func:`token_strings` and :func:`decode_topk_column` take a tokenizer that
the caller loaded (a worker's replica, the CLI's ``logprobs``).
"""

from __future__ import annotations

import os
import re
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dask_lm.io import safe_paths
from dask_lm.io.manifest import read_manifest
from dask_lm.io.parquet import MANIFEST, SUCCESS, output_schema_columns, part_name

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa

__all__ = ["read_scores", "scores_table", "ScoreRows", "token_strings", "decode_topk_column"]

_PART = re.compile(r"part-(\d{5,})\.parquet")


def read_scores(
    output: str | os.PathLike[str], *, columns: Sequence[str] | None = None, allow_incomplete: bool = False
) -> pd.DataFrame:
    """The rows of a scoring output folder (``dask-lm score --output`` / ``score_parquet``'s ``output``) as one
    pandas DataFrame: the parts in order, the rows in input order, a fresh ``RangeIndex``.

    Every column is Arrow-backed (``pd.ArrowDtype``, which pandas allows for every type the output holds): the
    numbers (``int32[pyarrow]``, ``double[pyarrow]``) keep their width and their nulls (``<NA>``: a row with
    nothing scored has a null ``perplexity``, never a NaN), ``bool[pyarrow]`` keeps its nulls too (``is_greedy``),
    text is ``string[pyarrow]``, and the list columns (``logprobs``, ``topk_ids``, ``topk_logprobs``,
    ``topk_tokens``) are ``list<...>[pyarrow]``, a cell of which is a Python list. The input columns kept have
    their input types. ``columns`` reads only those columns (in that order).

    Refused, with a ``ValueError`` naming the folder and the fix: a folder that is not a dask-lm scoring output
    (no ``_manifest.json``, or another job's), an unfinished one (no ``_SUCCESS``: a job still running, or stopped;
    ``allow_incomplete=True`` reads the parts written so far, each complete, with gaps where parts are missing),
    and a finished one that lost a part.

    ``pd.read_parquet(output)`` gives the same rows in the same order (pyarrow skips the ``_``- and ``.``-prefixed
    files beside the parts), with NumPy-backed columns unless ``dtype_backend="pyarrow"`` (then the very same
    frame), but checks none of the above. ``ScoreResult.to_pandas()`` / ``to_arrow()`` read a job's output
    from its result."""
    import pandas as pd

    return scores_table(output, columns=columns, allow_incomplete=allow_incomplete).to_pandas(
        types_mapper=pd.ArrowDtype
    )


def scores_table(
    output: str | os.PathLike[str], *, columns: Sequence[str] | None = None, allow_incomplete: bool = False
) -> pa.Table:
    """The rows of a scoring output folder as one ``pyarrow.Table``: what :func:`read_scores` converts to
    pandas, with the same checks and refusals."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if isinstance(columns, str):  # list("id") would ask for columns "i" and "d"
        raise ValueError(f"columns= takes a list of column names, not the string {columns!r}: pass [{columns!r}]")
    path = os.fspath(output)
    parts, manifest = _part_files(path, allow_incomplete)
    wanted = list(columns) if columns is not None else None
    if not parts:  # a job of no rows (its inputs all empty), or an unfinished one before its first part
        return _empty(manifest, wanted, path)
    tables = []
    for name in parts:
        file = os.path.join(path, name)
        if wanted is not None:
            missing = [c for c in wanted if c not in pq.read_schema(file).names]
            if missing:
                raise ValueError(
                    f"{file} has no column {', '.join(map(repr, missing))} (columns: "
                    f"{pq.read_schema(file).names}); pass columns= from those"
                )
        tables.append(pq.read_table(file, columns=wanted))
    # parts written from files of one schema have one schema; "permissive" only widens what the writers typed
    # from the rows (an all-null column), and never reorders rows
    return pa.concat_tables(tables, promote_options="permissive")


class ScoreRows:
    """The rows of a finished job's output, from its result: :class:`~dask_lm.scoring.result.ScoreResult`'s
    ``to_pandas()`` and ``to_arrow()`` (a base class, so that they live beside the reader they call)."""

    output: str

    def to_pandas(self, columns: Sequence[str] | None = None) -> pd.DataFrame:
        """The output's rows, in input order, as :func:`read_scores` reads them (Arrow-backed columns)."""
        return read_scores(self.output, columns=columns)

    def to_arrow(self, columns: Sequence[str] | None = None) -> pa.Table:
        """The same rows as one ``pyarrow.Table`` (:func:`scores_table`)."""
        return scores_table(self.output, columns=columns)


def _part_files(output: str, allow_incomplete: bool) -> tuple[list[str], dict[str, Any]]:
    """The part files to read, in order, after the refusals; and the manifest."""
    what = (
        "read_scores reads the folder a scoring job wrote (dask-lm score --output, score_parquet's output); "
        "pass that folder"
    )
    if not os.path.isdir(output):
        raise ValueError(f"{output} is not a directory; {what}")
    manifest = read_manifest(output)
    if manifest is None:
        raise ValueError(f"{output} is not a dask-lm scoring output (it has no {MANIFEST}); {what}")
    if not isinstance(manifest.get("partitions"), int):  # an SFT run's manifest has no span plan
        raise ValueError(
            f"{output} is not a dask-lm scoring output ({MANIFEST} holds another kind of job, "
            f"such as an sft run's checkpoints); {what}"
        )
    planned = manifest["partitions"]
    found = {int(m.group(1)): n for n in os.listdir(output) if (m := _PART.fullmatch(n))}
    for name in [*found.values(), SUCCESS]:  # the rows of a part linked in from elsewhere are not the job's
        safe_paths.refuse_link(os.path.join(output, name))
    finished = os.path.exists(os.path.join(output, SUCCESS))
    if not finished and not allow_incomplete:
        raise ValueError(
            f"{output} holds an unfinished dask-lm scoring job (no {SUCCESS}: {len(found)} of {planned} "
            "parts written; it is still running, or it stopped): finish it by running its command "
            "again with --resume (score_parquet(..., resume=True)), or pass allow_incomplete=True to "
            "read the parts written so far"
        )
    if finished:
        missing = [i for i in range(planned) if i not in found]
        if missing:
            raise ValueError(
                f"{output} is a finished dask-lm scoring job that lost {len(missing)} of its {planned} "
                f"parts ({part_name(missing[0])} first) since it finished: run its command again with "
                "--overwrite (score_parquet(..., overwrite=True)) to score it again"
            )
    return [found[i] for i in sorted(found)], manifest


def _empty(manifest: dict[str, Any], columns: list[str] | None, output: str) -> pa.Table:
    """No part to read: the scoring columns of the job's options, without rows (the input columns' types are in
    no part to copy)."""
    import pyarrow as pa

    options = manifest.get("options") or {}
    fields = output_schema_columns(int(options.get("topk") or 0), bool(options.get("decode_topk")))
    schema = pa.schema(fields)
    if columns is not None:
        missing = [c for c in columns if c not in schema.names]
        if missing:
            raise ValueError(
                f"{output} has no part files, and no column {', '.join(map(repr, missing))} among the "
                f"scoring columns {schema.names}; pass columns= from those"
            )
        schema = pa.schema([schema.field(c) for c in columns])
    return schema.empty_table()


# --decode-topk's strings, and dask-lm logprobs': each id as ``tokenizer.decode([id])`` gives it, the text the
# token adds (" the", with its space), as the top_logprobs of vLLM's and OpenAI's APIs show it.
# ``convert_ids_to_tokens`` would give the vocabulary's own spelling instead ("Ġthe" in byte-level BPE, "▁the" in
# SentencePiece), which differs by tokenizer family and means nothing to a reader. The price: a token that is
# part of a multi-byte character decodes to U+FFFD, and two ids can decode alike (topk_ids tells them apart).
def token_strings(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each id of ``ids`` decoded alone (``tokenizer.decode([id])``), special tokens included."""
    return [str(s) for s in tokenizer.batch_decode([[int(i)] for i in ids])]


# each tokenizer's decoded ids, kept while the tokenizer lives (a worker's replica, over the parts of a job): a
# part's distinct ids are thousands, decoding one takes about 5 us, and a part of 100k tokens is scored in well
# under a second on a GPU
_DECODED: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()


def decode_topk_column(tokenizer: Any, topk_ids: pa.Array) -> pa.Array:
    """The ``topk_tokens`` column (``list<list<string>>``) of a ``topk_ids`` column (``list<list<int32>>``): the
    same shape, each id as :func:`token_strings` decodes it, each distinct id decoded once per tokenizer."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        known = _DECODED.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer class that is not hashable: decoded afresh each time
        known = {}
    inner = topk_ids.flatten()  # list<int32> per position
    flat = inner.flatten().to_numpy(zero_copy_only=False)
    present = np.zeros(int(flat.max()) + 1 if len(flat) else 0, dtype=bool)
    present[flat] = True
    missing = [i for i in np.flatnonzero(present).tolist() if i not in known]
    known.update(zip(missing, token_strings(tokenizer, missing)))
    lookup = pa.array([known.get(i) for i in range(len(present))], pa.string())
    strings = lookup.take(pa.array(flat, pa.int32()))

    def offsets(lists: pa.Array) -> pa.Array:
        lengths = pc.list_value_length(lists).fill_null(0).to_numpy(zero_copy_only=False)
        return pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))

    column = pa.ListArray.from_arrays(offsets(topk_ids), pa.ListArray.from_arrays(offsets(inner), strings))
    assert column.type == pa.list_(pa.list_(pa.string())) and len(column) == len(topk_ids), column.type
    return column

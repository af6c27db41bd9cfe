"""Scoring's own checks of its options and its model, before anything starts: shared by ``score_parquet``
(:mod:`dask_lm.scoring.job`) and ``dask_lm.score`` (:mod:`dask_lm.scoring.frame`).
"""

from __future__ import annotations

import os
from typing import Any

from dask_lm.interface import opt
from dask_lm.io import modelcheck
from dask_lm.jobs.model_files import check_columns, resolve_tokenizer

__all__ = ["check_score_options", "check_score_model"]


def check_score_options(*, text_column: str | None, ids_column: str | None, prompt_column: str | None,
                        response_column: str | None, prompt_length_column: str | None, convention: str, topk: int,
                        decode_topk: bool, max_length: int | None, batch_tokens: int | None,
                        task_tokens: int | None = None) -> Any:
    """The scoring options' own checks, shared by ``score_parquet`` and ``dask_lm.score``: one way to read the
    rows, the convention, the numbers' ranges. Returns the convention."""
    from dask_lm.data.continuation import check_convention

    check_columns(text_column=text_column, ids_column=ids_column, prompt_column=prompt_column,
                  response_column=response_column)
    conv = check_convention(convention, opt("convention"))
    if prompt_length_column is not None and ids_column is None:
        raise ValueError(f"{opt('prompt_length_column')} goes with {opt('ids_column')} (prompt + response text has "
                         f"its prompt length from {opt('prompt_column')})")
    if topk < 0 or (task_tokens or 0) < 0 or any(v is not None and v < 1 for v in (max_length, batch_tokens)):
        counts = f"{opt('topk')} and {opt('task_tokens')} must be" if task_tokens is not None else \
            f"{opt('topk')} must be"
        raise ValueError(f"{counts} >= 0, {opt('max_length')} and {opt('batch_tokens')} >= 1")
    if decode_topk and not topk:
        raise ValueError(f"{opt('decode_topk', True)} decodes the top-k ids: it needs {opt('topk', meta='K')} (e.g. "
                         f"{opt('topk', 5)})")
    return conv


def check_score_model(model: str, *, topk: int, tokenizer: Any, ids_column: str | None, decode_topk: bool,
                      check_tokenizer: bool = True) -> tuple[modelcheck.ModelInfo, str]:
    """The model's files and ``topk`` against the vocabulary they state; the tokenizer scoring needs (none for token
    ids without ``decode_topk``), resolved. Returns what the files say of the model, and the tokenizer."""
    info = modelcheck.check_model(model, load_config=False)
    stated = modelcheck.stated_vocab(model)
    if stated is not None and topk > stated:
        raise ValueError(f"{opt('topk', topk)} is larger than the model's vocabulary ({stated} tokens, vocab_size "
                         f"in {os.path.join(model, modelcheck.CONFIG)}); pass {opt('topk', stated)} or less")
    return info, resolve_tokenizer(tokenizer, model, check=check_tokenizer,
                                   fix=None if ids_column and not decode_topk
                                   else f"pass {opt('tokenizer')}, or score token ids with {opt('ids_column')}"
                                   if not ids_column else f"{opt('decode_topk', True)} decodes with it: pass "
                                   f"{opt('tokenizer')}")

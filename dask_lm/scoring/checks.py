"""Scoring's check of its model before anything starts, shared by ``score_parquet`` (:mod:`dask_lm.scoring.job`)
and ``dask_lm.score`` (:mod:`dask_lm.scoring.frame`); the options check themselves (:mod:`dask_lm.scoring.spec`).
"""

from __future__ import annotations

import os
from typing import Any

from dask_lm.interface import opt
from dask_lm.io import modelcheck
from dask_lm.jobs.model_files import resolve_tokenizer

__all__ = ["check_score_model"]


def check_score_model(
    model: str, *, topk: int, tokenizer: Any, ids_column: str | None, decode_topk: bool, check_tokenizer: bool = True
) -> tuple[modelcheck.ModelInfo, str]:
    """The model's files and ``topk`` against the vocabulary they state; the tokenizer scoring needs (none for token
    ids without ``decode_topk``), resolved. Returns what the files say of the model, and the tokenizer."""
    info = modelcheck.check_model(model, load_config=False)
    stated = modelcheck.stated_vocab(model)
    if stated is not None and topk > stated:
        raise ValueError(
            f"{opt('topk', topk)} is larger than the model's vocabulary ({stated} tokens, vocab_size "
            f"in {os.path.join(model, modelcheck.CONFIG)}); pass {opt('topk', stated)} or less"
        )
    return info, resolve_tokenizer(
        tokenizer,
        model,
        check=check_tokenizer,
        fix=None
        if ids_column and not decode_topk
        else f"pass {opt('tokenizer')}, or score token ids with {opt('ids_column')}"
        if not ids_column
        else f"{opt('decode_topk', True)} decodes with it: pass {opt('tokenizer')}",
    )

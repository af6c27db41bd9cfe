"""Rows of a Dask DataFrame on their way to a rank (``dask_lm.workers.dataflow``), run here as the tasks run on the
workers (no cluster): the rank gets exactly the partitions' ids and per-token values, in the plan's order, padded
to the batch's width, and the rows are encoded to Arrow once, by the cut, not decoded and encoded again by the
assemble."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pytest
import torch

from dask_lm.data import arrow
from dask_lm.data.messages import MicroBatchPlan
from dask_lm.workers import dataflow

PAD = 9


def _frame(ids: list[list[int]], with_mask: bool) -> pd.DataFrame:
    columns = {"input_ids": pd.Series(ids, dtype=pd.ArrowDtype(pa.list_(pa.int64())))}
    if with_mask:
        columns["token_mask"] = pd.Series(
            [[float(i % 2) for i in range(len(r))] for r in ids], dtype=pd.ArrowDtype(pa.list_(pa.float32()))
        )
        columns["sample_mask"] = pd.Series([1.0] * len(ids), dtype="float32")
    return pd.DataFrame(columns)


def _padded(rows: list[list[float]], width: int, fill: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=dtype)


@pytest.mark.parametrize("with_mask", [False, True])
def test_the_rank_gets_the_partitions_rows_encoded_once(monkeypatch, with_mask):
    parts = [[[1, 2, 3], [4]], [[5, 6], [7, 8, 0, 1, 2]]]
    batches = [
        dataflow.frame_batch(
            _frame(p, with_mask), pad_token_id=PAD, call="train", where=f"partition {i}", all_columns=with_mask
        )
        for i, p in enumerate(parts)
    ]
    # the rank's rows: partition 1's row 1, partition 0's rows 0 and 1, partition 1's row 0; plan order reversed
    pieces = [dataflow.cut(batches[0], [0, 1]), dataflow.cut(batches[1], [1, 0])]
    order = [3, 2, 1, 0]
    width = 5

    encoded = []
    real = arrow.encode_columns
    monkeypatch.setattr(arrow, "encode_columns", lambda data: encoded.append(1) or real(data))
    shard = dataflow.assemble(
        *pieces, order=order, plan=MicroBatchPlan(), width=width, pad_token_id=PAD, make=lambda s: s
    )
    assert not encoded, "the assemble task encoded the rows again"

    dealt = [[1, 2, 3], [4], [7, 8, 0, 1, 2], [5, 6]]  # the pieces' rows in partition order
    expected = [dealt[i] for i in order]
    rows = shard.rows()
    assert torch.equal(rows["input_ids"], _padded(expected, width, PAD, torch.int64))
    assert rows["input_lengths"].tolist() == [len(r) for r in expected]
    if with_mask:
        masks = [[float(i % 2) for i in range(len(r))] for r in expected]
        assert torch.equal(rows["token_mask"], _padded(masks, width, 0.0, torch.float32))
        assert rows["sample_mask"].tolist() == [1.0] * 4
    tokens = shard.tokens()  # what an inference pass reads: the values and offsets as they travelled
    assert tokens.values.tolist() == [t for r in expected for t in r]

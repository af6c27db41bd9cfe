"""Rows that go from the workers holding them to the ranks, never through the driver (``Policy.submit`` of a Dask
DataFrame or of a future of a batch). Four tasks, each run where Dask puts it:

1. :func:`prepare`, one per partition, where the partition is: the partition as a validated batch (the same checks
   as the driver's, with errors naming the partition and its row); it stays on that worker;
2. :func:`lengths`, one per partition: the rows' lengths and width, the only thing the driver gathers;
3. :func:`cut`, one per (partition, rank) with rows for that rank: the rank's rows of the partition, as a
   :class:`~dask_lm.data.messages.Shard` (Arrow, padding trimmed);
4. :func:`assemble`, one per rank, pinned to it: the rank's pieces joined as Arrow (no row decoded again), put in
   the plan's order, declared at the batch's width and wrapped in the call's request; that rank's ``serve`` task
   takes it as its argument.

A Dask DataFrame partition (pandas) becomes a batch by :func:`frame_batch`: ``input_ids`` (a list of token ids per
row) right-padded with the pad id, ``input_lengths`` the lists' lengths; for ``train``, every other list column one
value per token (``token_mask``, ``advantages``, ``prev_logprobs``...: float32, same length as the row's ids,
padded with 0) and every numeric scalar column one value per row (``sample_mask``: floats as float32, ints as
int64). Inference calls read only ``input_ids``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from dask_lm.data import arrow
from dask_lm.data.arrow import list_values_offsets, pad_from_offsets
from dask_lm.data.batch import BatchedDataDict
from dask_lm.data.messages import MicroBatchPlan, Shard

__all__ = ["frame_batch", "prepare", "lengths", "cut", "assemble"]


def _where(source: str, index: int) -> str:
    return "the future's batch" if source == "future" else f"partition {index} of the Dask DataFrame"


def frame_batch(frame: Any, *, pad_token_id: int, call: str, where: str, all_columns: bool) -> BatchedDataDict[Any]:
    """A pandas partition as a batch (see the module docstring); ``ValueError`` naming ``where``, the column and
    the row for what cannot be one."""
    if "input_ids" not in frame.columns:
        raise ValueError(
            f"{call}: {where} has no `input_ids` column (a list of token ids per row); it has {list(frame.columns)}"
        )
    ids_values, offsets = _list_column(frame, "input_ids", call=call, where=where)
    if ids_values.is_floating_point() or ids_values.dtype == torch.bool:
        raise ValueError(f"{call}: {where}: `input_ids` holds {ids_values.dtype} values; token ids must be integers")
    lens = offsets[1:] - offsets[:-1]
    out: BatchedDataDict[Any] = BatchedDataDict(
        input_ids=pad_from_offsets(ids_values, offsets, pad_value=pad_token_id, dtype=torch.int64),
        input_lengths=lens.clone(),
    )
    if not all_columns:
        return out
    for name in frame.columns:
        if name == "input_ids":
            continue
        col = frame[name]
        key = str(name)
        if _is_list_column(col):
            values, offs = _list_column(frame, name, call=call, where=where)
            n = offs[1:] - offs[:-1]
            bad = (n != lens).nonzero()
            if bad.numel():
                r = int(bad[0])
                raise ValueError(
                    f"{call}: {where}, row {r}: `{key}` has {int(n[r])} values but `input_ids` has "
                    f"{int(lens[r])}; a per-token column needs one value per token id"
                )
            out[key] = pad_from_offsets(
                values, offs, width=out["input_ids"].shape[1], pad_value=0.0, dtype=torch.float32
            )
        elif col.dtype.kind in "fiub":
            arr = col.to_numpy()
            out[key] = torch.as_tensor(arr.astype(np.float32 if arr.dtype.kind == "f" else np.int64))
        else:
            raise ValueError(
                f"{call}: {where}: column `{key}` ({col.dtype}) is neither a list of numbers per row nor "
                "a number per row; drop it before train (e.g. ddf.drop(columns=[...]))"
            )
    return out


def _is_list_column(col: Any) -> bool:
    import pandas as pd

    if isinstance(col.dtype, pd.ArrowDtype):
        return pa.types.is_list(col.dtype.pyarrow_dtype) or pa.types.is_large_list(col.dtype.pyarrow_dtype)
    if col.dtype != object or not len(col):
        return False
    first = col.iloc[0]
    return isinstance(first, (list, tuple, np.ndarray))


def _list_column(frame: Any, name: Any, *, call: str, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat values and offsets of a list-per-row column (Arrow-backed, or Python lists / numpy arrays)."""
    col = frame[name]
    try:
        arr = pa.array(col, from_pandas=True)
        if pa.types.is_large_list(arr.type):
            arr = arr.cast(pa.list_(arr.type.value_type))
        if not pa.types.is_list(arr.type):
            raise TypeError(f"type {arr.type}")
    except (pa.ArrowException, TypeError, ValueError) as e:
        hint = ""
        if "string" in str(e):  # dd.from_pandas turns an object column into strings (dataframe.convert-string)
            hint = (
                "; Dask converts object columns to strings: give the column an Arrow list type, e.g. "
                "pd.Series(rows, dtype=pd.ArrowDtype(pa.list_(pa.int64()))), or read it from parquet"
            )
        raise ValueError(f"{call}: {where}: column `{name}` must hold a list of numbers per row ({e}){hint}") from e
    if arr.null_count:
        r = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
        raise ValueError(f"{call}: {where}, row {r}: `{name}` is null; every row needs a list of values")
    values, offsets = list_values_offsets(arr)
    return values.clone(), offsets


def prepare(
    value: Any,
    *,
    source: str,
    index: int,
    call: str,
    pad_token_id: int,
    vocab_size: int | None,
    max_length: int | None,
    train: tuple[Any, Any] | None,
) -> BatchedDataDict[Any]:
    """One partition (a pandas DataFrame) or the future's batch, as the batch the driver path would have checked:
    :func:`~dask_lm.data.validation.validate_input_batch` (and for train ``validate_train_batch`` with
    ``train = (loss_fn, check_dim_skip_keys)``). Inference keeps only ``input_ids`` and ``input_lengths``."""
    from dask_lm.data.validation import validate_input_batch, validate_train_batch

    where = _where(source, index)
    if source == "frame":
        batch = frame_batch(value, pad_token_id=pad_token_id, call=call, where=where, all_columns=train is not None)
    else:
        if not isinstance(value, Mapping):
            raise ValueError(
                f"{call}: the future's result is a {type(value).__name__}, not a batch: a future passed "
                "as data must give a BatchedDataDict (or dict) with `input_ids` and `input_lengths`"
            )
        batch = BatchedDataDict(value)
        if "input_ids" not in batch and "output_ids" in batch and "unpadded_sequence_lengths" in batch:
            # generate()'s result: its prompts and generations, as the next call's rows
            batch = BatchedDataDict(
                input_ids=batch["output_ids"],
                input_lengths=batch["unpadded_sequence_lengths"],
                **{
                    k: v
                    for k, v in batch.items()
                    if train is not None and k not in ("output_ids", "unpadded_sequence_lengths")
                },
            )
    what = f"{call} ({where})"
    batch = validate_input_batch(
        batch, what=what, vocab_size=vocab_size, max_length=max_length, pad_token_id=pad_token_id
    )
    if train is None:
        return BatchedDataDict(input_ids=batch["input_ids"], input_lengths=batch["input_lengths"])
    loss_fn, skip = train
    return validate_train_batch(batch, loss_fn, check_dim_skip_keys=skip, vocab_size=vocab_size, what=what)


def lengths(batch: BatchedDataDict[Any]) -> tuple[torch.Tensor, int]:
    """The rows' lengths and the batch's padded width: what the driver plans from."""
    return batch["input_lengths"].to(torch.int64), int(batch["input_ids"].shape[1])


def cut(batch: BatchedDataDict[Any], rows: list[int]) -> Shard:
    """``rows`` of one partition, in that order, as they travel (Arrow, padding trimmed)."""
    return Shard.of(batch.select_indices(rows))


def assemble(
    *pieces: Shard, order: list[int], plan: MicroBatchPlan, width: int, pad_token_id: int, make: Callable[[Shard], Any]
) -> Any:
    """The rank's request: its pieces joined (partition order), put in the plan's row order, every per-token column
    right-padded to the batch's ``width`` (``input_ids`` with the pad id, the rest with 0) as the driver path
    pads them, wrapped by ``make`` (the call's request type, with its options).

    The pieces' Arrow tables are joined as they came (:func:`~dask_lm.data.arrow.join_tables`): the rows were
    encoded once, by :func:`cut`, and reach the rank in that form. Only columns that cannot be joined that way
    (kept whole, or Python objects) are decoded and joined as tensors."""
    identity = order == list(range(len(order)))
    table = (
        None
        if any(p.objects for p in pieces)
        else arrow.join_tables([p.table for p in pieces], width=width, pads={"input_ids": pad_token_id})
    )
    if table is not None:
        if not identity:
            table = table.take(pa.array(order, type=pa.int64()))
        return make(Shard(table, plan))
    batches = [p.rows() for p in pieces]
    keys = list(batches[0])
    joined: BatchedDataDict[Any] = BatchedDataDict.from_batches(batches, pad_value_dict={"input_ids": pad_token_id})
    data: BatchedDataDict[Any] = BatchedDataDict({k: joined[k] for k in keys})
    if not identity:
        data = data.select_indices(order)
    for key, value in data.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] < width:
            fill = pad_token_id if key == "input_ids" else 0
            pad = (0, 0) * (value.dim() - 2) + (0, width - value.shape[1])
            data[key] = torch.nn.functional.pad(value, pad, value=fill)
    shard = dataclasses.replace(Shard.of(data), plan=plan)
    return make(shard)

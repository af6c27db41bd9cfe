"""Join the ranks' answers to one Policy call into its result: the body of the *combine* task of a
:class:`~dask_lm.engine.futures.PolicyFuture`, run on rank 0's worker.

One function per kind of answer, each taking the ranks' answers in rank order (warnings already stripped), picked
by the type of the call's join (:data:`JOINS`, from :mod:`dask_lm.data.messages`):

* :class:`~dask_lm.data.messages.JoinRows`: per-row tensors (logprobs, top-k, scores) cut by rows over the ranks,
  joined and put back in the input's row order (dynamic batching and packing sort rows by length before dealing
  them out);
* :class:`~dask_lm.data.messages.JoinGenerated`: each rank's contiguous slice of rows, right-padded to the widest
  rank's output;
* :class:`~dask_lm.data.messages.ReduceTrain`: the ranks' step results reduced to NeMo RL's train() dict (loss and
  norms as rank 0 has them, every rank's micro-batch metrics in rank order, FLOP figures from the slowest rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dask_lm.data.batch import BatchedDataDict
from dask_lm.data.flops import aggregate_flops_metrics
from dask_lm.data.messages import ForwardOutput, Join, JoinGenerated, JoinRows, ReduceTrain, TrainResult

__all__ = ["JOINS", "combine", "join_rows", "join_generated", "reduce_train", "rank_frame"]


def join_rows(
    results: list[ForwardOutput], order: list[int] | None, keys: tuple[str, ...], cat: bool = False
) -> BatchedDataDict[Any]:
    """``keys`` of every rank's output as one batch in input order. ``cat``: same-width tensors (top-k, scores),
    else the ranks' [B, S] tensors right-padded to the widest."""
    out: BatchedDataDict[Any] = BatchedDataDict()
    for key in keys:
        if cat:
            joined: BatchedDataDict[Any] = BatchedDataDict({key: torch.cat([r.tensors[key] for r in results], dim=0)})
        else:
            joined = BatchedDataDict.from_batches([BatchedDataDict({key: r.tensors[key]}) for r in results])
        if order is not None:
            joined.reorder_data(order)
        out[key] = joined[key]
    return out


def join_generated(results: list[ForwardOutput], pad_token_id: int) -> BatchedDataDict[Any]:
    """Generation's contiguous per-rank slices as one batch; ``output_ids`` padded with the pad id."""
    tensors = [a.tensors for a in results]
    width = max((r["output_ids"].shape[1] for r in tensors), default=0)

    def cat(key: str, fill: float) -> torch.Tensor:
        parts = [torch.nn.functional.pad(r[key], (0, width - r[key].shape[1]), value=fill) for r in tensors]
        return torch.cat(parts, dim=0)

    return BatchedDataDict(
        output_ids=cat("output_ids", pad_token_id),
        logprobs=cat("logprobs", 0.0),
        generation_lengths=torch.cat([r["generation_lengths"] for r in tensors]),
        unpadded_sequence_lengths=torch.cat([r["unpadded_sequence_lengths"] for r in tensors]),
        truncated=torch.cat([r["truncated"] for r in tensors]),
    )


def reduce_train(results: list[TrainResult], total_flops: float | None, world_size: int) -> dict[str, Any]:
    """NeMo RL's train() result from the ranks' :class:`TrainResult` (rank order, as NeMo RL concatenates them)."""
    metrics: dict[str, list[Any]] = {}
    for r in results:
        for key, values in r.all_mb_metrics.items():
            metrics.setdefault(key, []).extend(values)
    first = results[0]
    out: dict[str, Any] = {
        "loss": first.loss,
        "grad_norm": first.grad_norm,
        "grad_norms": first.grad_norms,
        "all_mb_metrics": metrics,
        "gpu_name": first.gpu_name,
        "model_dtype": first.model_dtype,
        "num_tokens": sum(r.num_tokens for r in results),
    }
    out.update(
        aggregate_flops_metrics(
            [r.train_elapsed_seconds for r in results], [r.gpu_name for r in results], world_size, total_flops
        )
    )
    return out


def _rows(how: JoinRows, results: list[ForwardOutput]) -> BatchedDataDict[Any]:
    return join_rows(results, how.order, how.keys, cat=how.cat)


def _generated(how: JoinGenerated, results: list[ForwardOutput]) -> BatchedDataDict[Any]:
    return join_generated(results, how.pad_token_id)


def _train(how: ReduceTrain, results: list[TrainResult]) -> dict[str, Any]:
    return reduce_train(results, how.total_flops, len(results))


# the code that joins each kind of answer, by the type the driver sent (as the endpoint table maps requests)
JOINS: dict[type, Callable[[Any, list[Any]], Any]] = {JoinRows: _rows, JoinGenerated: _generated, ReduceTrain: _train}


def combine(how: Join, results: list[Any]) -> Any:
    """The result of one call from its ranks' answers, joined as ``how`` says."""
    join = JOINS.get(type(how))
    assert join is not None, f"no join for {type(how).__name__}"
    return join(how, results)


def rank_frame(answer: ForwardOutput, rows: list[int], lengths: list[int], keys: tuple[str, ...]) -> Any:
    """One rank's answer as a pandas partition (``Policy.submit(..., collect=False)``): ``row`` (the input row
    number), then per key one value per row: per-token values cut to the row's length (position 0 included, as
    in the [B, S] tensor), as Arrow lists; scores as float32. Columns as
    :func:`dask_lm.engine.futures.frame_meta` declares them."""
    import pandas as pd
    import pyarrow as pa

    lens = torch.as_tensor(lengths, dtype=torch.int64)
    columns: dict[str, Any] = {"row": pd.Series(rows, dtype="int64")}
    for key in keys:
        t = answer.tensors[key]
        if t.dim() == 1:  # scores
            columns[key] = pd.Series(pd.array(t.to(torch.float32).numpy(), dtype=pd.ArrowDtype(pa.float32())))
            continue
        valid = torch.arange(t.shape[1])[None, :] < lens[:, None]
        flat = t[valid]  # the real positions of every row, row after row
        offsets = pa.array(torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).numpy().astype("int32"))
        if t.dim() == 2:
            values = pa.array(flat.to(torch.float32).numpy())
        else:  # top-k: [tokens, k] -> a k-list per token
            k = t.shape[2]
            inner = flat.reshape(-1).numpy().astype("float32" if t.is_floating_point() else "int64")
            inner_offsets = pa.array((torch.arange(flat.shape[0] + 1, dtype=torch.int64) * k).numpy().astype("int32"))
            values = pa.ListArray.from_arrays(inner_offsets, pa.array(inner))
        arr = pa.ListArray.from_arrays(offsets, values)
        columns[key] = pd.Series(pd.arrays.ArrowExtensionArray(arr))
    return pd.DataFrame(columns)

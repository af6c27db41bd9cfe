"""A sharding plan made from row lengths alone, for rows that stay on the workers (``Policy.submit`` of a Dask
DataFrame or a future of a batch).

The driver path cuts a whole batch: ``Policy._shard`` (:mod:`dask_lm.data.sharding`, :mod:`dask_lm.data.packing`)
deals its rows out to the ranks, in micro-batches, and returns the permutation that restores input order. That
logic reads only the rows' lengths and the batch's padded width. So the same function runs here on a *skeleton*: a
batch whose only real column is ``input_lengths``, with a column of global row numbers riding along and a
one-byte placeholder for the width. Each rank's shard of the skeleton then says which rows it gets, in which order,
and how they are cut into micro-batches: the plan equals the driver path's by construction, not by a second
implementation.

The plan is then split by where the rows live (:class:`RankPlan`): for each partition, which of its rows each rank
takes; for each rank, the permutation that puts its pieces (concatenated in partition order) in the shard's order.
This is what the driver sends: integers per row, never a token.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import torch

from dask_lm.data.batch import BatchedDataDict
from dask_lm.data.messages import MicroBatchPlan

__all__ = ["ROW_KEY", "skeleton", "RankPlan", "rank_plans"]

ROW_KEY = "__dask_lm_row__"  # the skeleton's column of global row numbers


def skeleton(lengths: torch.Tensor, width: int) -> BatchedDataDict[Any]:
    """A batch of ``len(lengths)`` rows, ``width`` wide, that carries nothing but its lengths and row numbers.

    ``input_ids`` is a one-byte tensor of the right shape: sharding reads its width (dynamic batching caps a
    micro-batch's padded length by it) and cuts it like any other column, never its values."""
    b = int(lengths.shape[0])
    return BatchedDataDict(
        {
            "input_ids": torch.zeros((b, width), dtype=torch.uint8),
            "input_lengths": lengths.to(torch.int64),
            ROW_KEY: torch.arange(b, dtype=torch.int64),
        }
    )


@dataclass(frozen=True)
class RankPlan:
    """One rank's share of rows that live in partitions.

    ``pieces``: ``(partition, row indices inside it)`` in partition order, each piece's rows in the order the
    rank takes them; ``order``: the shard's rows as positions in the pieces concatenated; ``plan``: the
    micro-batches (as :class:`~dask_lm.data.messages.MicroBatchPlan`)."""

    pieces: tuple[tuple[int, list[int]], ...]
    order: list[int]
    plan: MicroBatchPlan
    rows: int


def rank_plans(shards: list[Any], counts: list[int], *, packed: bool) -> list[RankPlan]:
    """Each skeleton shard (from ``Policy._shard`` of :func:`skeleton`) as a :class:`RankPlan` over partitions of
    ``counts`` rows each (in order)."""
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    out = []
    for shard in shards:
        rows = shard[ROW_KEY].tolist()
        by_part: dict[int, list[tuple[int, int]]] = {}
        for pos, g in enumerate(rows):
            p = bisect.bisect_right(starts, g) - 1
            by_part.setdefault(p, []).append((pos, g - starts[p]))
        pieces, concat_pos = [], []
        for p in sorted(by_part):
            pieces.append((p, [local for _pos, local in by_part[p]]))
            concat_pos += [pos for pos, _local in by_part[p]]
        if not pieces:  # a rank without rows (fewer rows than ranks) still needs the columns' types: an empty piece
            pieces.append((0, []))
        # concat_pos[i]: the shard position of the i-th concatenated row; the shard wants the inverse
        order = [0] * len(rows)
        for i, pos in enumerate(concat_pos):
            order[pos] = i
        out.append(RankPlan(tuple(pieces), order, MicroBatchPlan.of(shard, packed=packed), len(rows)))
    return out

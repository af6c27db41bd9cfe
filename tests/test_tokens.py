"""TokenRows (dask_lm/data/tokens.py): the rows of a shard as they reach the forward, against Python loops over the
padded batch they came from, and the shard's table read back by from_arrow."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from dask_lm.data.arrow import from_arrow, to_arrow
from dask_lm.data.batch import BatchedDataDict
from dask_lm.data.messages import Shard
from dask_lm.data.tokens import TokenRows


def _batch(lengths: list[int], width: int, pad: int = 0, seed: int = 0) -> BatchedDataDict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 30_000, (len(lengths), width), generator=g)
    lens = torch.tensor(lengths)
    ids[torch.arange(width)[None, :] >= lens[:, None]] = pad
    return BatchedDataDict(input_ids=ids, input_lengths=lens)


def _as_lists(ids: torch.Tensor, lens: torch.Tensor) -> list[list[int]]:
    return [ids[b, :n].tolist() for b, n in enumerate(lens.tolist())]


def _rows_of(t: TokenRows) -> list[list[int]]:
    return [t.values[int(t.offsets[b]) : int(t.offsets[b + 1])].tolist() for b in range(t.size)]


def test_a_shards_rows_are_its_arrow_buffers_and_equal_the_padded_batch():
    batch = _batch([5, 1, 9, 3], 12, pad=7)
    shard = Shard.of(batch)
    rows = shard.tokens()
    assert _rows_of(rows) == _as_lists(batch["input_ids"], batch["input_lengths"])
    assert rows.width == 12 and rows.size == 4 and rows.num_tokens == 18
    assert rows.lengths.tolist() == [5, 1, 9, 3]
    # the ids were not copied out of the table: the tensor's memory is the Arrow values buffer's
    column = shard.table.column("input_ids").chunk(0)
    assert rows.values.dtype == torch.int32
    assert rows.values.data_ptr() == column.values.buffers()[1].address + 4 * column.offsets[0].as_py()


def test_a_column_that_could_not_be_trimmed_is_cut_by_its_lengths():
    batch = _batch([2, 4], 6)
    batch["input_ids"][0, 3] = 99  # a pad region of two values: to_arrow keeps the column whole
    table = to_arrow(batch)
    assert pa.types.is_fixed_size_list(table.schema.field("input_ids").type)
    rows = TokenRows.from_table(table)
    assert _rows_of(rows) == _as_lists(batch["input_ids"], batch["input_lengths"]) and rows.width == 6
    assert torch.equal(from_arrow(table)["input_ids"], batch["input_ids"])  # the rank's other path, unchanged


@pytest.mark.parametrize("start,end", [(0, 4), (1, 3), (2, 2), (3, 4)])
def test_slices_take_and_the_two_layouts_match_loops(start, end):
    batch = _batch([5, 1, 9, 3], 10)
    ids, lens = batch["input_ids"], batch["input_lengths"]
    rows = TokenRows.from_padded(ids, lens)
    part = rows.slice(start, end)
    assert _rows_of(part) == _as_lists(ids, lens)[start:end] and part.width == 10
    if end > start:
        pids, pos, cu = part.packed()
        flat = [t for r in _as_lists(ids, lens)[start:end] for t in r]
        positions = [p for n in lens[start:end].tolist() for p in range(n)]
        assert pids.tolist() == [flat] and pos.tolist() == [positions] and cu.dtype == torch.int32
        assert cu.tolist() == [0, *torch.cumsum(lens[start:end], 0).tolist()]
        longest = int(lens[start:end].max())
        assert torch.equal(part.padded(pad_value=0), ids[start:end, :longest])
    order = [2, 0, 3]
    assert _rows_of(rows.take(order)) == [_as_lists(ids, lens)[i] for i in order]


def test_rows_from_lists_equal_rows_from_the_padded_tensor():
    lists = [[4, 5, 6], [], [9], [1, 2, 3, 4, 5]]
    rows = TokenRows.from_lists(lists)
    assert _rows_of(rows) == lists and rows.width == 5 and rows.values.dtype == torch.int64
    padded = torch.zeros(4, 5, dtype=torch.int64)
    for b, r in enumerate(lists):
        padded[b, : len(r)] = torch.tensor(r, dtype=torch.int64)
    again = TokenRows.from_padded(padded, torch.tensor([len(r) for r in lists]))
    assert torch.equal(again.values, rows.values) and torch.equal(again.offsets, rows.offsets)

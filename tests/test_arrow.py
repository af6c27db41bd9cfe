"""Arrow round trips are lossless, token ids travel as list<int32>, and the list buffers become tensors uncopied."""

from __future__ import annotations

import pyarrow as pa
import torch

from dask_lm import BatchedDataDict
from dask_lm.data.arrow import from_arrow, list_values_offsets, pad_from_offsets, to_arrow


def _example():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=torch.tensor([3, 2, 4], dtype=torch.int32),
        advantages=torch.randn(3, 4),
        token_mask=torch.tensor([[1, 1, 0, 1], [0, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool),
        ref_bf16=torch.randn(3, 4).to(torch.bfloat16),
        topk=torch.randn(3, 4, 2),
        text=["a", "bb", "ccc"],
        meta=[{"k": 1}, {"k": (2, 3)}, None],
    )


def test_round_trip_is_lossless():
    b = _example()
    table = to_arrow(b)
    assert table.schema.field("input_ids").type == pa.list_(pa.int32())
    back = from_arrow(table)
    assert list(back) == list(b)
    for k, v in b.items():
        if isinstance(v, torch.Tensor):
            assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
            assert torch.equal(back[k], v), k
        else:
            assert back[k] == v, k


def test_padding_is_not_sent_but_irregular_padding_survives():
    b = _example()
    assert to_arrow(b).column("input_ids").combine_chunks().values.to_pylist() == [5, 6, 7, 8, 9, 1, 2, 3, 4]
    # advantages past the length are not one value: kept whole (fixed-size rows), still lossless
    assert pa.types.is_fixed_size_list(to_arrow(b).schema.field("advantages").type)


def test_list_buffers_become_tensors_without_copy_and_respect_slicing():
    arr = pa.array([[1, 2, 3], [4], [5, 6]], type=pa.list_(pa.int32()))
    values, offsets = list_values_offsets(arr)
    assert values.data_ptr() == arr.values.buffers()[1].address
    sliced_values, sliced_offsets = list_values_offsets(arr.slice(1, 2))
    assert sliced_values.tolist() == [4, 5, 6] and sliced_offsets.tolist() == [0, 1, 3]
    padded = pad_from_offsets(sliced_values, sliced_offsets, 4, pad_value=-1, dtype=torch.int64)
    assert padded.tolist() == [[4, -1, -1, -1], [5, 6, -1, -1]]


def test_foreign_table_from_dask_dataframe_columns():
    table = pa.table({"input_ids": pa.array([[3, 4], [5]], type=pa.list_(pa.int32())),
                      "input_lengths": pa.array([2, 1], type=pa.int64()), "id": ["x", "y"]})
    b = BatchedDataDict.from_arrow(table)
    assert b["input_ids"].tolist() == [[3, 4], [5, 0]] and b["input_lengths"].tolist() == [2, 1]
    assert b["id"] == ["x", "y"]


def test_edge_shapes_and_dtypes_round_trip():
    b = BatchedDataDict(input_ids=torch.tensor([[4, 5, 0]]), input_lengths=torch.tensor([2]),
                        bf=torch.tensor([[2.0, 3.0, 1.0]], dtype=torch.bfloat16),
                        mask=torch.tensor([[True, True, False]]), nothing=torch.zeros(1, 0),
                        wide=torch.tensor([[2**40, 1, 0]]))
    back = from_arrow(to_arrow(b))
    for k, v in b.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    empty = BatchedDataDict(input_ids=torch.zeros(0, 4, dtype=torch.long), input_lengths=torch.zeros(0))
    assert from_arrow(to_arrow(empty))["input_ids"].shape == (0, 4)

"""Arrow round trips are lossless, token ids travel as list<int32>, and the list buffers become tensors uncopied;
list columns are stored as data (Arrow types or JSON) that comes back exactly, and anything else is refused."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
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
        meta=[{"k": 1}, {"k": [2, 3]}, None],
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
            assert _identical(back[k], v), k


def test_padding_is_not_sent_but_irregular_padding_survives():
    b = _example()
    assert to_arrow(b).column("input_ids").combine_chunks().values.to_pylist() == [5, 6, 7, 8, 9, 1, 2, 3, 4]
    # advantages past the length are not one value: kept whole (fixed-size rows), still lossless
    assert pa.types.is_fixed_size_list(to_arrow(b).schema.field("advantages").type)


def test_list_buffers_become_tensors_without_copy_and_respect_slicing():
    arr = pa.array([[1, 2, 3], [4], [5, 6]], type=pa.list_(pa.int32()))
    values, _offsets = list_values_offsets(arr)
    assert values.data_ptr() == arr.values.buffers()[1].address
    sliced_values, sliced_offsets = list_values_offsets(arr.slice(1, 2))
    assert sliced_values.tolist() == [4, 5, 6] and sliced_offsets.tolist() == [0, 1, 3]
    padded = pad_from_offsets(sliced_values, sliced_offsets, 4, pad_value=-1, dtype=torch.int64)
    assert padded.tolist() == [[4, -1, -1, -1], [5, 6, -1, -1]]


def test_foreign_table_from_dask_dataframe_columns():
    table = pa.table(
        {
            "input_ids": pa.array([[3, 4], [5]], type=pa.list_(pa.int32())),
            "input_lengths": pa.array([2, 1], type=pa.int64()),
            "id": ["x", "y"],
        }
    )
    b = BatchedDataDict.from_arrow(table)
    assert b["input_ids"].tolist() == [[3, 4], [5, 0]] and b["input_lengths"].tolist() == [2, 1]
    assert b["id"] == ["x", "y"]


def test_edge_shapes_and_dtypes_round_trip():
    b = BatchedDataDict(
        input_ids=torch.tensor([[4, 5, 0]]),
        input_lengths=torch.tensor([2]),
        bf=torch.tensor([[2.0, 3.0, 1.0]], dtype=torch.bfloat16),
        mask=torch.tensor([[True, True, False]]),
        nothing=torch.zeros(1, 0),
        wide=torch.tensor([[2**40, 1, 0]]),
    )
    back = from_arrow(to_arrow(b))
    for k, v in b.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    empty = BatchedDataDict(input_ids=torch.zeros(0, 4, dtype=torch.long), input_lengths=torch.zeros(0))
    assert from_arrow(to_arrow(empty))["input_ids"].shape == (0, 4)


# ------------------------------------------------------------------------------------------- list columns as data
def _identical(a, b) -> bool:
    """Equal and of the same types all the way down (True is not 1, 1 is not 1.0, -0.0 is not 0.0), NaN equal to
    NaN, dict keys in the same order. Written here, apart from the library's own comparison."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a.keys()) == list(b.keys()) and all(_identical(a[k], b[k]) for k in a)
    return a == b


def test_the_comparison_tells_apart_what_plain_equality_does_not():
    for a, b in [
        ([1], [1.0]),
        ([True], [1]),
        ([0.0], [-0.0]),
        ([{"a": 1, "b": 2}], [{"b": 2, "a": 1}]),
        ([[1, 2]], [(1, 2)]),
        ([{"a": None}], [{}]),
        (["1"], [1]),
        ([b"x"], ["x"]),
    ]:
        assert not _identical(a, b) and not _identical(b, a), (a, b)
    assert _identical([float("nan"), {"x": [-0.0]}], [float("nan"), {"x": [-0.0]}])


# every kind of list column that used to travel pickled; "list" is Arrow's own type, "json" one JSON text per row
OBJECT_COLUMNS = {
    "strings_with_none": (["a", None, "ccc"], "list"),
    "nested_int_lists": ([[1, 2], [3], [4, 5, 6]], "list"),
    "ragged_nested_lists": ([[[1], [2, 3]], [], [[]]], "list"),
    "dicts_same_keys": ([{"a": 1, "b": "x"}, {"a": 2, "b": "y"}, {"a": 3, "b": None}], "list"),
    "dicts_same_keys_other_order": ([{"a": 1, "b": 2}, {"b": 3, "a": 4}, {"a": 5, "b": 6}], "json"),
    "dicts_differing_keys": ([{"a": 1}, {"b": 2}, {}], "json"),  # a struct would fill the missing keys with None
    "nested_dicts_in_lists": (
        [[{"role": "user", "content": "hi"}], [{"role": "assistant", "meta": {"t": [1]}}], []],
        "json",
    ),
    "mixed_per_row": ([1, 2.5, "s", None, True, [1], {"k": False}], "json"),
    "ints_and_floats": ([1, 2.5, 3], "json"),  # Arrow would make 1 into 1.0
    "bools_and_ints": ([True, 1, 0], "json"),
    "bytes": ([b"\x00\xff", b"", b"abc"], "list"),
    "empty_lists": ([[], [], []], "list"),
    "empty_dicts": ([{}, {}, {}], "json"),  # Arrow's struct<> cannot be written to parquet
    "big_ints": ([2**64 + 1, -(2**70), 3], "json"),
    "nan_and_signed_zero": ([float("nan"), 1.5, -0.0], "list"),
    "nan_in_mixed_rows": ([float("nan"), float("inf"), 1, -0.0], "json"),
    "all_none": ([None, None], "list"),
    "unicode": (["\u00e9\u4e2d", "\U0001f600", ""], "list"),
}


@pytest.mark.parametrize("key", list(OBJECT_COLUMNS))
def test_list_columns_round_trip_exactly_as_data(key, tmp_path):
    values, kind = OBJECT_COLUMNS[key]
    b = BatchedDataDict({key: values, "row": torch.arange(len(values))})
    table = to_arrow(b)
    meta = table.schema.field(key).metadata[b"dask_lm"]
    assert json.loads(meta) == {"kind": kind}
    assert kind != "json" or table.schema.field(key).type == pa.large_string()
    assert _identical(from_arrow(table)[key], values)
    pq.write_table(table, tmp_path / "b.parquet")
    back = from_arrow(pq.read_table(tmp_path / "b.parquet"))
    assert list(back) == [key, "row"] and _identical(back[key], values)
    assert torch.equal(back["row"], b["row"])


REFUSED = {
    "tuple": ([(1, 2), (3, 4)], 0, "tuple"),
    "numpy_array": ([[1], np.array([2, 3])], 1, "numpy.ndarray"),
    "tensor_in_a_list": ([[1], [torch.tensor(2)]], 1, "torch.Tensor"),
    "set": ([None, {1, 2}], 1, "set"),
    "object": ([object(), 1], 0, "object"),
    "dict_with_int_keys": ([{"a": 1}, {1: "b"}], 1, "dict key of type 'int'"),
    "numpy_scalar": ([1, np.int64(2)], 1, "numpy.int64"),
    "tuple_deep_inside": ([{"a": [1]}, {"a": [1]}, {"a": [{"b": (1,)}]}], 2, "tuple"),
}


@pytest.mark.parametrize("key", list(REFUSED))
def test_list_columns_that_are_not_data_are_refused(key):
    values, row, found = REFUSED[key]
    b = BatchedDataDict(input_ids=torch.ones(len(values), 2, dtype=torch.long), **{key: values})
    with pytest.raises(ValueError) as e:
        to_arrow(b)
    message = str(e.value)
    assert f"column {key!r}" in message and f"row {row} " in message and found in message, message
    assert "convert it to lists / dicts of str, numbers, bools and None, or to a tensor" in message
    with pytest.raises(ValueError, match=repr(key)):
        b.to_arrow()


def test_the_old_example_with_a_tuple_is_refused_naming_the_key():
    b = _example()
    b["meta"] = [{"k": 1}, {"k": (2, 3)}, None]
    with pytest.raises(ValueError, match=r"column 'meta': row 1 holds a value of type 'tuple'"):
        to_arrow(b)

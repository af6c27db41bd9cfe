"""A batch's columns <-> Arrow, both directions, losslessly and as data only, with token ids as ``list<int32>``.

Between processes a batch travels as an Arrow table: a right-padded ``[B, S]`` tensor becomes a list column holding
only each row's first ``input_lengths[b]`` values (when everything after that is one pad value, which is
recorded), so padding never crosses the wire; integer tensors whose values fit become ``int32``. The field
metadata records the torch dtype, the padded width and the pad value, so ``from_arrow(to_arrow(d))`` gives back the
same tensors, dtypes and shapes. Going back, the list's values and offsets buffers become torch tensors without a
copy (:func:`list_values_offsets`) and are padded in one scatter.

A list column (one Python value per row) is stored as data, never pickled: in Arrow's own type when Arrow's
inference gives back exactly the same values (types too, all the way down: ``True`` is not ``1``, ``1`` is not
``1.0``, dict keys keep their order), else as one JSON text per row when every row is a tree of None, bools, ints,
floats, strings, lists and dicts with string keys (mixed types, dicts whose keys differ, ints beyond int64).
:func:`to_arrow` refuses anything else (tuples, numpy arrays, tensors in lists, sets, objects), naming the column
and row. Why: a table is also a file (parquet keeps field metadata), and reading a shared file must not run code,
so :func:`from_arrow` never unpickles, whatever the metadata asks. Inside Dask's channel, whose workers unpickle
what their peers send anyway, such columns travel beside the table (:class:`dask_lm.data.messages.Shard`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch

__all__ = ["to_arrow", "from_arrow", "join_tables", "list_values_offsets", "pad_from_offsets", "trimmed_column"]

_META = b"dask_lm"
_TORCH_TO_NP = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}
_NAME_TO_TORCH = {str(t).replace("torch.", ""): t for t in [*_TORCH_TO_NP, torch.bfloat16]}
_KINDS = ("tensor", "list", "json")  # what from_arrow reads; anything else (a "pickle" column) is refused
_SCALARS = (type(None), bool, int, float, str)  # the leaves of a JSON tree (type(x) is, never isinstance)
_FIX_OBJECTS = "convert it to lists / dicts of str, numbers, bools and None, or to a tensor"
_FIX_FILE = (
    "re-encode the batch with this dask-lm's to_arrow, which stores only data (tensors, Arrow types and "
    "JSON), or drop the column"
)


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: carry the bits
        return t.view(torch.int16).numpy()
    return t.numpy()


def list_values_offsets(arr: pa.Array | pa.ChunkedArray) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat values and int64 offsets of a list column, sharing the Arrow buffers (no copy of the values).

    Respects slicing: ``.values`` ignores an array's offset, so the values are cut by the offsets' ends.
    """
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.chunk(0) if arr.num_chunks == 1 else arr.combine_chunks()  # combining is the one copy
    if arr.null_count:
        raise ValueError("list column has null rows; every row needs a list of values")
    offsets = arr.offsets.to_numpy(zero_copy_only=True)
    values = arr.values.to_numpy(zero_copy_only=True)[offsets[0] : offsets[-1]]
    import warnings

    with warnings.catch_warnings():  # Arrow buffers are read-only; we never write through these views
        warnings.simplefilter("ignore", UserWarning)
        v = torch.from_numpy(values)
    return v, torch.from_numpy((offsets - offsets[0]).astype(np.int64))


def pad_from_offsets(
    values: torch.Tensor,
    offsets: torch.Tensor,
    width: int | None = None,
    pad_value: Any = 0,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Right-pad jagged rows (values + offsets) into ``[B, width]`` with one scatter, on ``device``."""
    lengths = offsets[1:] - offsets[:-1]
    b = lengths.numel()
    width = int(lengths.max()) if width is None and b else (width or 0)
    dtype = dtype or values.dtype
    values = values.to(device=device, dtype=dtype, non_blocking=True)
    out = torch.full((b, width), pad_value, dtype=dtype, device=values.device)
    if values.numel():
        rows = torch.repeat_interleave(torch.arange(b, device=values.device), lengths.to(values.device))
        cols = torch.arange(values.numel(), device=values.device) - torch.repeat_interleave(
            offsets[:-1].to(values.device), lengths.to(values.device)
        )
        out[rows, cols] = values
    return out


def _trim_info(t: torch.Tensor, lengths: torch.Tensor | None) -> Any:
    """The single pad value after each row's length, or None when rows cannot be trimmed losslessly."""
    if lengths is None or t.dim() != 2 or t.shape[0] != lengths.shape[0] or t.shape[0] == 0:
        return None
    if bool((lengths > t.shape[1]).any()) or bool((lengths < 0).any()):
        return None
    pad_region = torch.arange(t.shape[1])[None, :] >= lengths[:, None]
    if not bool(pad_region.any()):
        return 0
    tail = t[pad_region]
    first = tail[0]
    return first.item() if bool((tail == first).all()) else None


def _tensor_column(value: torch.Tensor, lengths: torch.Tensor | None) -> tuple[pa.Array, dict[str, Any]]:
    meta: dict[str, Any] = dict(kind="tensor", dtype=str(value.dtype).replace("torch.", ""), shape=list(value.shape))
    arr = _np(value)
    inner = int(np.prod(arr.shape[1:])) if value.dim() > 1 else 1
    if value.dim() <= 1:
        col = pa.array(arr)
    elif inner == 0 or arr.shape[0] == 0:  # nothing to carry but the shape
        meta.update(empty=True)
        col = pa.nulls(arr.shape[0])
    else:
        # bf16 travels as int16 bits and bools have no zero-copy view: both go whole, untrimmed
        pad = None if value.dtype in (torch.bfloat16, torch.bool) else _trim_info(value.cpu(), lengths)
        if (
            pad is not None
            and value.dtype in (torch.int64, torch.int32)
            and value.numel()
            and int(value.min()) >= -(2**31)
            and int(value.max()) < 2**31
        ):
            arr = arr.astype(np.int32)  # token ids: list<int32>
        if pad is not None:
            assert lengths is not None  # _trim_info only trims rows it has lengths for
            meta.update(trimmed=True, pad=pad)
            keep = np.arange(arr.shape[1])[None, :] < lengths.numpy()[:, None]
            offs = np.zeros(arr.shape[0] + 1, dtype=np.int32)
            np.cumsum(lengths.numpy(), out=offs[1:])
            col = pa.ListArray.from_arrays(pa.array(offs), pa.array(arr[keep]))
        else:
            col = pa.FixedSizeListArray.from_arrays(pa.array(arr.reshape(-1)), inner)
    return col, meta


def _same(a: Any, b: Any) -> bool:
    """``a == b`` with the types compared too, all the way down: True is not 1, 1 is not 1.0, -0.0 is not 0.0,
    NaN is NaN, dict keys in the same order. Only data counts (what JSON or Arrow's inference can carry)."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return (a != a and b != b) or (a == b and math.copysign(1.0, a) == math.copysign(1.0, b))
    if type(a) is list:
        return len(a) == len(b) and all(map(_same, a, b))
    if type(a) is dict:
        return list(a) == list(b) and all(type(k) is str for k in a) and all(_same(a[k], b[k]) for k in a)
    return type(a) in (type(None), bool, int, str, bytes) and bool(a == b)


def _not_json(x: Any) -> str | None:
    """What keeps ``x`` from being a JSON tree (the type found, in words), or None when it is one."""
    if type(x) in _SCALARS:
        return None
    if type(x) is list:
        return next((w for w in map(_not_json, x) if w is not None), None)
    if type(x) is dict:
        key = next((k for k in x if type(k) is not str), None)
        if key is not None:
            return f"a dict key of type {_type_name(key)!r}"
        return next((w for w in map(_not_json, x.values()) if w is not None), None)
    return f"a value of type {_type_name(x)!r}"


def _type_name(x: Any) -> str:
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _parquet_can_write(t: pa.DataType) -> bool:
    """Parquet cannot store a struct without fields (what Arrow infers for ``{}``)."""
    if pa.types.is_struct(t):
        return t.num_fields > 0 and all(_parquet_can_write(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _parquet_can_write(t.value_type)
    return True


def _object_column(items: list[Any]) -> tuple[pa.Array, dict[str, Any]] | None:
    """A list column as data: Arrow's inferred type when it gives back exactly ``items``, else JSON text when every
    row is a JSON tree, else None (the column is not data)."""
    try:
        col = pa.array(items)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):  # mixed types, ints beyond 64 bits, ...
        col = None
    if col is not None and _parquet_can_write(col.type) and _same(col.to_pylist(), items):
        return col, {"kind": "list"}
    if any(_not_json(x) is not None for x in items):
        return None
    # Python's json writes NaN / Infinity (and reads them back), ints of any size and floats by their repr
    return pa.array([json.dumps(x, ensure_ascii=False) for x in items], pa.large_string()), {"kind": "json"}


def encode_columns(data: Mapping[str, Any]) -> tuple[pa.Table, dict[str, list[Any]]]:
    """The table of every column that is data, and the rest (key -> one object per row), in the batch's order.

    :func:`to_arrow` refuses the rest; :class:`dask_lm.data.messages.Shard` carries it beside the table."""
    lengths = data.get("input_lengths")
    lengths = lengths.detach().cpu().to(torch.int64) if isinstance(lengths, torch.Tensor) else None
    columns: list[pa.Array] = []
    fields: list[pa.Field] = []
    rest: dict[str, list[Any]] = {}
    for key, value in data.items():
        if isinstance(value, torch.Tensor):
            col, meta = _tensor_column(value, lengths)
        else:
            items = list(value)
            encoded = _object_column(items)
            if encoded is None:
                rest[key] = items
                continue
            col, meta = encoded
        columns.append(col)
        fields.append(pa.field(key, col.type, metadata={_META: json.dumps(meta).encode()}))
    return pa.Table.from_arrays(columns, schema=pa.schema(fields)), rest


def to_arrow(data: Mapping[str, Any]) -> pa.Table:
    """Arrow table of a batch's columns (tensors, or lists with one item per row), data only (see the module doc).

    A list column whose rows are not data (a tuple, a numpy array, a tensor, a set, any other object) is a
    ``ValueError`` naming the column, the first such row and the type found there."""
    table, rest = encode_columns(data)
    for key, items in rest.items():
        row, found = next((i, w) for i, w in enumerate(map(_not_json, items)) if w is not None)
        raise ValueError(
            f"column {key!r}: row {row} holds {found}, which an Arrow table cannot store as data "
            f"(dask-lm stores list columns as Arrow types or JSON, never pickled): {_FIX_OBJECTS}"
        )
    return table


def join_tables(tables: Sequence[pa.Table], *, width: int, pads: Mapping[str, Any]) -> pa.Table | None:
    """Tables :func:`to_arrow` made of rows of one batch, as one table: what ``to_arrow`` gives for those rows joined
    and right-padded to ``width`` (a trimmed column's pad is ``pads[name]``, else 0), with no value decoded (the
    chunks are the tables' own). None when a column does not travel the same way in every table (a ``[B, S]``
    column kept whole, another dtype or Arrow type, a list column): join the rows as tensors then."""
    names = tables[0].column_names
    if any(t.column_names != names for t in tables):
        return None
    rows = sum(t.num_rows for t in tables)
    fields, columns = [], []
    for name in names:
        found = [_field_meta(name, t.schema.field(name)) for t in tables]
        metas = [m for m in found if m is not None and m["kind"] == "tensor" and not m.get("empty")]
        types = {t.schema.field(name).type for t in tables}
        if len(types) != 1 or len(metas) != len(tables):
            return None
        first = metas[0]
        if any(m["dtype"] != first["dtype"] or len(m["shape"]) != len(first["shape"]) for m in metas):
            return None
        if len(first["shape"]) == 1:
            meta = {**first, "shape": [rows]}
        elif len(first["shape"]) == 2 and all(m.get("trimmed") for m in metas):
            meta = {**first, "shape": [rows, width], "pad": pads.get(name, 0)}
        else:
            return None
        (kind,) = types
        fields.append(pa.field(name, kind, metadata={_META: json.dumps(meta).encode()}))
        columns.append(pa.chunked_array([c for t in tables for c in t.column(name).chunks], kind))
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


def _field_meta(name: str, field: pa.Field) -> dict[str, Any] | None:
    """The dask-lm metadata of a column (None for a foreign one), checked: a kind this module reads, and for a
    tensor a known dtype and an integer shape."""
    if not field.metadata or _META not in field.metadata:
        return None
    raw = field.metadata[_META]
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError):
        meta = None
    if not isinstance(meta, dict) or not isinstance(meta.get("kind"), str):
        raise ValueError(
            f"column {name!r}: its dask-lm field metadata is not a JSON object with a 'kind' "
            f"({raw[:80]!r}): {_FIX_FILE}"
        )
    kind = meta["kind"]
    if kind == "pickle":
        raise ValueError(
            f"column {name!r} holds pickled Python objects (dask-lm metadata kind 'pickle'): dask-lm "
            f"never unpickles table data, since a file's bytes could run code when unpickled; "
            f"{_FIX_FILE}"
        )
    if kind not in _KINDS:
        raise ValueError(
            f"column {name!r}: dask-lm metadata kind {kind!r} is not one this dask-lm reads "
            f"({', '.join(_KINDS)}; it never unpickles): {_FIX_FILE}"
        )
    shape = meta.get("shape")
    if kind == "tensor" and (
        meta.get("dtype") not in _NAME_TO_TORCH
        or not isinstance(shape, list)
        or not all(type(n) is int and n >= 0 for n in shape)
    ):
        raise ValueError(
            f"column {name!r}: tensor dtype {meta.get('dtype')!r} and shape {shape!r} are not a dtype "
            f"dask-lm stores ({', '.join(_NAME_TO_TORCH)}) and a list of sizes: {_FIX_FILE}"
        )
    return meta


def trimmed_column(table: pa.Table, name: str) -> tuple[pa.ChunkedArray, int] | None:
    """A tensor column stored trimmed (each row's first ``input_lengths[b]`` values as a list) and its padded width,
    or None when the column was stored whole (its pad region was not one value) or is not this module's."""
    meta = _field_meta(name, table.schema.field(name))
    if meta is None or meta["kind"] != "tensor" or not meta.get("trimmed") or meta.get("empty"):
        return None
    return table.column(name), int(meta["shape"][1])


def _json_rows(name: str, col: pa.ChunkedArray) -> list[Any]:
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        raise ValueError(f"column {name!r}: a JSON column holds strings, not {col.type}: {_FIX_FILE}")
    try:
        return [json.loads(x) for x in col.to_pylist()]
    except (TypeError, ValueError, RecursionError) as e:  # a null row, or text that is not JSON
        raise ValueError(f"column {name!r}: a row is not JSON ({e}): {_FIX_FILE}") from None


def from_arrow(table: pa.Table, *, device: torch.device | str | None = None) -> dict[str, Any]:
    """The columns that ``to_arrow`` encoded, by name in the table's order (or plain Arrow columns: lists become
    padded tensors); :meth:`BatchedDataDict.from_arrow <dask_lm.data.batch.BatchedDataDict.from_arrow>` makes them
    a batch. This module knows columns, not the batch type, so that ``batch.py`` can call it without a cycle.

    Only data is read: a column whose metadata asks for anything else (a pickle) is a ``ValueError`` naming it."""
    out: dict[str, Any] = {}
    for name, col in zip(table.column_names, table.columns):
        meta = _field_meta(name, table.schema.field(name))
        if meta is None:  # a foreign table: numbers become tensors, list<number> padded tensors, rest lists
            if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
                v, o = list_values_offsets(col)
                out[name] = pad_from_offsets(v, o, device=device)
            elif pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_boolean(col.type):
                out[name] = torch.from_numpy(col.to_numpy().copy()).to(device)
            else:
                out[name] = col.to_pylist()
            continue
        if meta["kind"] == "list":
            out[name] = col.to_pylist()
            continue
        if meta["kind"] == "json":
            out[name] = _json_rows(name, col)
            continue
        dtype = _NAME_TO_TORCH[meta["dtype"]]
        shape = meta["shape"]
        carrier = torch.int16 if dtype == torch.bfloat16 else dtype
        if meta.get("empty"):
            t = torch.zeros(shape, dtype=carrier)
        elif len(shape) <= 1:
            t = torch.from_numpy(col.to_numpy().copy()).to(carrier)
        elif meta.get("trimmed"):
            v, o = list_values_offsets(col)
            t = pad_from_offsets(v, o, shape[1], meta["pad"], dtype=carrier, device=device)
        else:
            arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
            flat = arr.values.to_numpy(zero_copy_only=False)[
                arr.offset * arr.type.list_size : (arr.offset + len(arr)) * arr.type.list_size
            ]
            t = torch.from_numpy(flat.copy()).to(carrier).reshape(shape)
        if dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        out[name] = t.to(device) if device is not None else t
    return out

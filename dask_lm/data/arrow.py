"""BatchedDataDict <-> Arrow, losslessly, with token ids as ``list<int32>``.

Between processes a batch travels as an Arrow table: a right-padded ``[B, S]`` tensor becomes a list column holding
only each row's first ``input_lengths[b]`` values (when everything after that is one pad value, which is
recorded), so padding never crosses the wire; integer tensors whose values fit become ``int32``. The field
metadata records the torch dtype, the padded width and the pad value, so ``from_arrow(to_arrow(d))`` gives back the
same tensors, dtypes and shapes. Going back, the list's values and offsets buffers become torch tensors without a
copy (:func:`list_values_offsets`) and are padded in one scatter.
"""

from __future__ import annotations

import json
import pickle
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import torch

if TYPE_CHECKING:
    from dask_lm.data.batch import BatchedDataDict

__all__ = ["to_arrow", "from_arrow", "list_values_offsets", "pad_from_offsets"]

_META = b"dask_lm"
_TORCH_TO_NP = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
                torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
                torch.uint8: np.uint8, torch.bool: np.bool_}
_NAME_TO_TORCH = {str(t).replace("torch.", ""): t for t in [*_TORCH_TO_NP, torch.bfloat16]}


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
    values = arr.values.to_numpy(zero_copy_only=True)[offsets[0]: offsets[-1]]
    import warnings

    with warnings.catch_warnings():  # Arrow buffers are read-only; we never write through these views
        warnings.simplefilter("ignore", UserWarning)
        v = torch.from_numpy(values)
    return v, torch.from_numpy((offsets - offsets[0]).astype(np.int64))


def pad_from_offsets(values: torch.Tensor, offsets: torch.Tensor, width: int | None = None,
                     pad_value: Any = 0, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> torch.Tensor:
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
            offsets[:-1].to(values.device), lengths.to(values.device))
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


def to_arrow(data: Any) -> pa.Table:
    """Arrow table of a BatchedDataDict (tensors, or lists with one item per row)."""
    lengths = data.get("input_lengths")
    lengths = lengths.detach().cpu().to(torch.int64) if isinstance(lengths, torch.Tensor) else None
    columns, fields = [], []
    for key, value in data.items():
        meta: dict[str, Any] = {}
        if isinstance(value, torch.Tensor):
            meta.update(kind="tensor", dtype=str(value.dtype).replace("torch.", ""), shape=list(value.shape))
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
                if pad is not None and value.dtype in (torch.int64, torch.int32) and value.numel() and \
                        int(value.min()) >= -(2**31) and int(value.max()) < 2**31:
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
        else:
            items = list(value)
            try:
                col = pa.array(items)
                meta.update(kind="list")
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
                col = pa.array([pickle.dumps(x) for x in items], type=pa.binary())
                meta.update(kind="pickle")
        columns.append(col)
        fields.append(pa.field(key, col.type, metadata={_META: json.dumps(meta).encode()}))
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


def from_arrow(table: pa.Table, *, device: torch.device | str | None = None) -> BatchedDataDict[Any]:
    """The BatchedDataDict that ``to_arrow`` encoded (or plain Arrow columns: lists become padded tensors)."""
    from dask_lm.data.batch import BatchedDataDict

    out: BatchedDataDict[Any] = BatchedDataDict()
    for name, col in zip(table.column_names, table.columns):
        field = table.schema.field(name)
        meta = json.loads(field.metadata[_META]) if field.metadata and _META in field.metadata else None
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
        if meta["kind"] == "pickle":
            out[name] = [pickle.loads(x) for x in col.to_pylist()]
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
            flat = arr.values.to_numpy(zero_copy_only=False)[arr.offset * arr.type.list_size:
                                                             (arr.offset + len(arr)) * arr.type.list_size]
            t = torch.from_numpy(flat.copy()).to(carrier).reshape(shape)
        if dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        out[name] = t.to(device) if device is not None else t
    return out

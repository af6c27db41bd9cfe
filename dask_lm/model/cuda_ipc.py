"""CUDA IPC handles as plain data: what lets another process on the same machine map a tensor of this GPU without
a copy and without pickle.

torch's ``reduce_tensor`` gives the arguments of ``rebuild_cuda_tensor``, classes included; shipping those by
pickle would let whoever forges a handle run code. Here a handle is a dict of ints, strings, bools and bytes
(:func:`encode_cuda`), and :func:`open_cuda` checks every field (keys, types, the reference-counter file's name,
that the view lies inside the storage) before torch sees any of it, choosing the classes itself. Used by the ZMQ
refit (:mod:`dask_lm.refit.wire`) and by shared logits buffers (:mod:`dask_lm.model.shared_buffer`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from dask_lm.model import device

__all__ = ["cuda_handle", "encode_cuda", "cuda_rebuild_args", "open_cuda"]


def _is_int(x: Any) -> bool:
    return type(x) is int  # msgpack gives bools as bool; a bool is no byte count


# dtypes a handle may name
_DTYPES = device.dtypes_by_name(
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)
_CUDA_KEYS = (
    "size",
    "stride",
    "tensor_offset",
    "dtype",
    "device",
    "handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "requires_grad",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)
# torch names the shared-memory block of a CUDA IPC reference counter "/torch_<pid>_<random>_<n>"; the receiver
# opens it by that name, so nothing else (no other directory, no traversal) is accepted
_REF_COUNTER = re.compile(rb"/torch_[0-9A-Za-z_]{1,200}")
_MAX_HANDLE_BYTES = 1 << 16


def cuda_handle(args: Sequence[Any], device_uuid: str) -> dict[str, Any]:
    """Plain data from the arguments torch's ``reduce_tensor`` gives ``rebuild_cuda_tensor`` (torch 2.x: tensor
    class, size, stride, offset, storage class, dtype, device index, handle, storage bytes, storage offset,
    requires_grad, ref-counter handle and offset, event handle, event sync). The classes are left out (the receiver
    picks its own) and the device index becomes the GPU's UUID: the two processes see different
    ``CUDA_VISIBLE_DEVICES``."""
    assert len(args) == 15, f"torch's rebuild_cuda_tensor takes 15 arguments here, reduce_tensor gave {len(args)}"
    (
        _cls,
        size,
        stride,
        offset,
        _storage_cls,
        dtype,
        _index,
        handle,
        nbytes,
        storage_offset,
        requires_grad,
        ref_counter,
        ref_counter_offset,
        event,
        event_sync,
    ) = args
    return {
        "size": [int(s) for s in size],
        "stride": [int(s) for s in stride],
        "tensor_offset": int(offset),
        "dtype": device.dtype_name(dtype),
        "device": str(device_uuid),
        "handle": bytes(handle),
        "storage_size_bytes": int(nbytes),
        "storage_offset_bytes": int(storage_offset),
        "requires_grad": bool(requires_grad),
        "ref_counter_handle": bytes(ref_counter),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": bytes(event),
        "event_sync_required": bool(event_sync),
    }


def encode_cuda(t: torch.Tensor) -> dict[str, Any]:
    """A CUDA IPC handle of ``t`` as plain data (every call exports a fresh reference)."""
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(t)
    assert rebuild is reductions.rebuild_cuda_tensor, "encode_cuda takes a CUDA tensor"
    return cuda_handle(args, device.device_uuid(args[6]))


def _check_bytes(h: dict[str, Any], key: str) -> bytes:
    v = h[key]
    if not isinstance(v, bytes) or not 0 < len(v) <= _MAX_HANDLE_BYTES:
        raise ValueError(f"`ipc.{key}` of a CUDA IPC handle must be bytes, got {type(v).__name__}")
    return v


_REF_COUNTER_ENTRIES = 10_000
_MAX_STORAGE_BYTES = 1 << 40  # 1 TiB: more than any GPU holds


def cuda_rebuild_args(h: dict[str, Any], device_index: int) -> tuple[Any, ...]:
    """The arguments for torch's ``rebuild_cuda_tensor`` from a handle made by :func:`cuda_handle`, with classes
    chosen here (``torch.Tensor``, ``torch.UntypedStorage``) and ``device_index`` for the UUID. Checks every field,
    and that the view lies inside the shared storage."""
    if set(h) != set(_CUDA_KEYS):
        raise ValueError(f"`ipc` of a CUDA IPC handle has keys {sorted(h)}, expected {sorted(_CUDA_KEYS)}")
    size, stride = h["size"], h["stride"]
    for key in ("size", "stride"):
        if not isinstance(h[key], list) or len(h[key]) > 8 or not all(_is_int(d) and d >= 0 for d in h[key]):
            raise ValueError(f"`ipc.{key}` of a CUDA IPC handle must be a list of non-negative ints")
    if len(size) != len(stride):
        raise ValueError("`ipc.size` and `ipc.stride` of a CUDA IPC handle differ in length")
    for key in ("tensor_offset", "storage_size_bytes", "storage_offset_bytes", "ref_counter_offset"):
        if not _is_int(h[key]) or h[key] < 0:
            raise ValueError(f"`ipc.{key}` of a CUDA IPC handle must be a non-negative int, got {h[key]!r}")
    for key in ("requires_grad", "event_sync_required"):
        if not isinstance(h[key], bool):
            raise ValueError(f"`ipc.{key}` of a CUDA IPC handle must be a bool")
    if h["requires_grad"]:
        raise ValueError("`ipc.requires_grad` is true: shared buffers carry no autograd history")
    dtype = _DTYPES.get(h["dtype"]) if isinstance(h["dtype"], str) else None
    if dtype is None:
        raise ValueError(f"`ipc.dtype` {h['dtype']!r} is not one of {sorted(_DTYPES)}")
    handle, event = _check_bytes(h, "handle"), _check_bytes(h, "event_handle")
    ref_counter = _check_bytes(h, "ref_counter_handle")
    if not _REF_COUNTER.fullmatch(ref_counter):
        raise ValueError(
            f"`ipc.ref_counter_handle` {ref_counter[:80]!r} is not the name of a torch shared-memory reference counter"
        )
    if h["storage_size_bytes"] == 0:
        raise ValueError("`ipc.storage_size_bytes` is 0: a shared buffer is never empty")
    # torch decrements the int64 at ``ref_counter_offset`` of the counter file it maps, unchecked: an offset past
    # the file would write outside it (torch/csrc/CudaIPCTypes.h: CUDA_IPC_REF_COUNTER_FILE_SIZE entries)
    if h["ref_counter_offset"] >= _REF_COUNTER_ENTRIES:
        raise ValueError(
            f"`ipc.ref_counter_offset` {h['ref_counter_offset']} is outside torch's reference counter "
            f"file ({_REF_COUNTER_ENTRIES} entries)"
        )
    if h["storage_offset_bytes"] + h["storage_size_bytes"] > _MAX_STORAGE_BYTES:
        raise ValueError(
            f"the CUDA IPC storage ends at byte {h['storage_offset_bytes'] + h['storage_size_bytes']}, "
            "past any device's memory"
        )
    # the furthest element the view reaches must lie inside the storage the handle maps
    end = h["tensor_offset"] + sum((d - 1) * s for d, s in zip(size, stride)) + 1 if all(size) else 0
    if end * dtype.itemsize > h["storage_size_bytes"]:
        raise ValueError(
            f"the CUDA IPC view reaches byte {end * dtype.itemsize} of a storage of {h['storage_size_bytes']} bytes"
        )
    return (
        torch.Tensor,
        tuple(size),
        tuple(stride),
        h["tensor_offset"],
        torch.UntypedStorage,
        dtype,
        device_index,
        handle,
        h["storage_size_bytes"],
        h["storage_offset_bytes"],
        False,
        ref_counter,
        h["ref_counter_offset"],
        event,
        h["event_sync_required"],
    )


def open_cuda(h: dict[str, Any]) -> torch.Tensor:
    """The tensor a :func:`encode_cuda` handle describes, mapped from the producer's GPU memory (no copy)."""
    from torch.multiprocessing import reductions

    if not isinstance(h.get("device"), str):
        raise ValueError("`ipc.device` of a CUDA IPC handle must be a GPU UUID string")
    args = cuda_rebuild_args(h, 0)  # every field checked before the UUID is even looked up
    rebuild = (*args[:6], device.index_for_uuid(h["device"]), *args[7:])
    return reductions.rebuild_cuda_tensor(*rebuild)

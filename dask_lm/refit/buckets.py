"""The refit wire format: weights packed into flat byte buckets, and how a bucket travels between processes.

A refit moves every weight of the policy, as a full (unsharded) tensor in the serving dtype, to inference processes.
Tensors are packed back to back into one ``uint8`` buffer per bucket, each starting at a multiple of
:data:`ALIGN` bytes (so every view is aligned for any dtype, and SGLang's bucket code, which rebuilds each tensor
as ``flat[start:end].view(dtype).reshape(shape)``, accepts mixed dtypes). The producer and the consumer compute the
same plan from the refit info (``{name: (shape, dtype)}``, in order) and the buffer size, so only the bytes and
the names have to travel.

A bucket crosses to an SGLang server in one of three ways (``transport``):

- ``"ipc"``: a CUDA tensor pickled with torch's reductions, which export a CUDA IPC handle. The device is written
  as the GPU's UUID instead of the producer's local index, as SGLang's ``monkey_patch_torch_reductions`` expects,
  because the two processes see different ``CUDA_VISIBLE_DEVICES``.
- ``"shm"``: a CPU tensor in shared memory, named by file (torch's ``file_system`` sharing strategy), which any
  process on the same host can map while the producer keeps the tensor alive. The default ``file_descriptor``
  strategy would need the producer's multiprocessing authkey, which an unrelated server does not have.
- ``"value"``: the bytes inside the pickle. Works from any host; costs a copy and 4/3 in base64.

Every pickle produced here references only torch's own rebuild functions and builtins, so SGLang's restricted
unpickler accepts it; SGLang's bucket metadata is sent as ``types.SimpleNamespace`` for the same reason (the
server only reads its attributes). These pickles are for SGLang alone (its HTTP weight-update protocol): dask-lm
never unpickles anything a peer sends; its own ZMQ refit speaks the data-only :mod:`dask_lm.refit.wire`.
"""

from __future__ import annotations

import base64
import contextlib
import io
import pickle
import threading
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

__all__ = [
    "ALIGN",
    "Slot",
    "plan_buckets",
    "bucket_nbytes",
    "write_slot",
    "align_up",
    "unpack",
    "sglang_bucket",
    "dumps",
    "dumps_b64",
    "plan_digest",
]

ALIGN = 512
TRANSPORTS = ("ipc", "shm", "value")


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in its bucket: bytes ``[start, end)``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * dtype.itemsize


def align_up(n: int, align: int) -> int:
    return -(-n // align) * align


def plan_buckets(
    info: Mapping[str, tuple[Sequence[int], torch.dtype]], buffer_size_bytes: int, align: int = ALIGN
) -> list[list[Slot]]:
    """Cut the weights, in order, into buckets of at most ``buffer_size_bytes`` (a tensor larger than that gets a
    bucket of its own). Deterministic: the consumer calls it with the same arguments to find the tensors."""
    if buffer_size_bytes < 1:
        raise ValueError(f"the refit buffer size must be a positive number of bytes, got {buffer_size_bytes}")
    buckets: list[list[Slot]] = []
    current: list[Slot] = []
    used = 0
    for name, (shape, dtype) in info.items():
        size = _nbytes(shape, dtype)
        start = align_up(used, align)
        if current and start + size > buffer_size_bytes:
            buckets.append(current)
            current, start = [], 0
        current.append(Slot(name, tuple(int(d) for d in shape), dtype, start, start + size))
        used = start + size
    if current:
        buckets.append(current)
    return buckets


def bucket_nbytes(bucket: Sequence[Slot]) -> int:
    return bucket[-1].end if bucket else 0


def plan_digest(buckets: Sequence[Sequence[Slot]]) -> list[int]:
    """A small integer summary of a plan (buckets, tensors, bytes, a name checksum) that both ends compare
    before the first byte is read, so a mismatched plan fails loudly instead of loading shifted bytes."""
    import zlib

    names = "\n".join(s.name + str(s.shape) + str(s.dtype) for b in buckets for s in b)
    return [
        len(buckets),
        sum(len(b) for b in buckets),
        sum(bucket_nbytes(b) for b in buckets),
        zlib.crc32(names.encode()),
    ]


def write_slot(flat: torch.Tensor, slot: Slot, t: torch.Tensor) -> None:
    """Copy ``t``'s bytes into its slot of the bucket buffer ``flat``."""
    assert tuple(t.shape) == slot.shape and t.dtype == slot.dtype, (
        f"{slot.name}: got {tuple(t.shape)} {t.dtype}, planned {slot.shape} {slot.dtype}"
    )
    flat[slot.start : slot.end].copy_(t.contiguous().reshape(-1).view(torch.uint8))


def unpack(flat: torch.Tensor, bucket: Sequence[Slot]) -> list[tuple[str, torch.Tensor]]:
    """Views of the bucket's tensors inside ``flat`` (no copy)."""
    if flat.numel() < bucket_nbytes(bucket):
        raise ValueError(
            f"a refit bucket holds {flat.numel()} bytes but its plan needs {bucket_nbytes(bucket)}: "
            "both ends must plan with the same refit info and buffer size"
        )
    return [(s.name, flat[s.start : s.end].view(s.dtype).reshape(s.shape)) for s in bucket]


def sglang_bucket(flat: torch.Tensor, bucket: Sequence[Slot]) -> dict[str, Any]:
    """The object SGLang's ``load_format="flattened_bucket"`` expects (``numel`` counts bytes there)."""
    metadata = [
        types.SimpleNamespace(
            name=s.name, shape=torch.Size(s.shape), dtype=s.dtype, start_idx=s.start, end_idx=s.end, numel=s.nbytes
        )
        for s in bucket
    ]
    return {"flattened_tensor": flat, "metadata": metadata}


# ----------------------------------------------------------------------------------------- serialization
class _UuidPickler(ForkingPickler):
    """ForkingPickler (torch's sharing reductions) that names a CUDA tensor's device by UUID, not index."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dispatch_table[torch.Tensor] = _reduce_with_uuid


def _reduce_with_uuid(t: torch.Tensor) -> Any:
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(t)
    if rebuild is reductions.rebuild_cuda_tensor:
        from dask_lm.model import device

        args = list(args)
        args[6] = device.device_uuid(args[6])  # the 7th argument is the device index (torch's reduce_tensor)
        args = tuple(args)
    return rebuild, args


_SHARING_LOCK = threading.Lock()


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    # torch reads the sharing strategy from a process-wide setting while pickling; switch it only around our dump
    import torch.multiprocessing as tmp

    with _SHARING_LOCK:
        before = tmp.get_sharing_strategy()
        tmp.set_sharing_strategy("file_system")
        try:
            yield
        finally:
            tmp.set_sharing_strategy(before)


def dumps(obj: Any, transport: str) -> bytes:
    """Pickle ``obj`` (tensors inside travel by ``transport``); every call is a fresh export."""
    if transport not in TRANSPORTS:
        raise ValueError(f"refit transport must be one of {TRANSPORTS}, got {transport!r}")
    buf = io.BytesIO()
    if transport == "value":
        pickle.Pickler(buf, protocol=4).dump(obj)  # torch's own __reduce_ex__: storage bytes inline
    elif transport == "shm":
        with _file_system_sharing():
            _UuidPickler(buf, 4).dump(obj)
    else:
        _UuidPickler(buf, 4).dump(obj)
    return buf.getvalue()


def dumps_b64(obj: Any, transport: str) -> str:
    """What SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` produces: base64 of a pickle."""
    return base64.b64encode(dumps(obj, transport)).decode("ascii")

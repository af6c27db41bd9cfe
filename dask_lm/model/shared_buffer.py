"""A tensor another process on the same machine can map without a copy, described by a payload of plain data.

``Policy.get_full_logits_ipc`` leaves each rank's logits in one of these and hands the consumer (a distillation
student, an analysis process) a payload per buffer; :func:`open_payload` maps it there. Two kinds, one per device
(:func:`dask_lm.model.device.ipc_kind`):

- ``"cuda"``: CUDA IPC. The payload is the handle torch's ``reduce_tensor`` exports, as plain fields
  (:func:`dask_lm.model.cuda_ipc.encode_cuda`: the same checked codec the ZMQ refit uses);
- ``"shm"``: CPU ranks. A POSIX shared-memory file under ``/dev/shm`` named ``dask_lm_<pid>_<random>``, so CI runs
  the same path as a GPU machine.

A payload is a dict of ints, strings, bools, bytes and lists (msgpack-able): nothing in it is unpickled and no
class or function is looked up by a name from it. The consumer may have received it from anywhere, so
:func:`open_payload` checks every field (kind, keys, types, the shared-memory name, sizes against the file) before
mapping anything: a hostile payload can only fail validation.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import secrets
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from dask_lm.model import cuda_ipc, device

__all__ = ["SharedBuffer", "open_payload", "PAYLOAD_VERSION"]

PAYLOAD_VERSION = 1
SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"dask_lm_[0-9]{1,10}_[0-9a-f]{16}")  # a plain file name: no directory, no traversal
_SHM_KEYS = {"v", "kind", "name", "shape", "dtype", "nbytes"}
_CUDA_KEYS = {"v", "kind", "cuda"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MAX_DIMS = 8


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    assert name in _DTYPES, f"shared buffers hold {sorted(_DTYPES)}, not {name}"
    return name


class SharedBuffer:
    """A zero-filled tensor of ``shape`` on this rank's device, shareable with a process on the same machine.

    ``payload`` describes it (the same object for the buffer's life, so a consumer can tell two calls' entries of
    one buffer apart from a new one); :meth:`close` frees it (the shared-memory file is removed; a CUDA buffer is
    freed once every consumer let go of its mapping). A buffer not closed is removed when it is garbage-collected
    or the process exits."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, where: torch.device) -> None:
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype
        self.nbytes = math.prod(self.shape) * dtype.itemsize
        self._path: str | None = None
        self._map: mmap.mmap | None = None
        if device.ipc_kind() == "cuda":
            self.tensor = torch.zeros(self.shape, dtype=dtype, device=where)
            self.payload: dict[str, Any] = {"v": PAYLOAD_VERSION, "kind": "cuda",
                                            "cuda": cuda_ipc.encode_cuda(self.tensor)}
            return
        name = f"dask_lm_{os.getpid()}_{secrets.token_hex(8)}"
        self._path = os.path.join(SHM_DIR, name)
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # only this user may map it
        try:
            os.ftruncate(fd, max(self.nbytes, 1))  # a new file reads as zeros
            self._map = mmap.mmap(fd, max(self.nbytes, 1))
        except BaseException:
            os.unlink(self._path)
            raise
        finally:
            os.close(fd)
        # the file outlives this process unless removed: on garbage collection and at exit, whichever comes first
        self._finalizer = weakref.finalize(self, _remove, self._path)
        self.tensor = torch.frombuffer(self._map, dtype=dtype, count=math.prod(self.shape)).view(self.shape)
        self.payload = {"v": PAYLOAD_VERSION, "kind": "shm", "name": name, "shape": list(self.shape),
                        "dtype": _dtype_name(dtype), "nbytes": self.nbytes}

    def fits(self, shape: Sequence[int], dtype: torch.dtype) -> bool:
        """Whether a request of ``shape`` fits inside this buffer (every dimension at most as large)."""
        return dtype == self.dtype and len(shape) == len(self.shape) and \
            all(int(a) <= b for a, b in zip(shape, self.shape))

    def close(self) -> None:
        del self.tensor  # the mapping cannot close while a tensor still exports it
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._path is not None:
            self._finalizer()
            self._path = None


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ----------------------------------------------------------------------------------------- the consumer's side
def _is_int(x: Any) -> bool:
    return type(x) is int  # a bool is no size


def _check_keys(payload: dict[str, Any], keys: set[str]) -> None:
    if set(payload) != keys:
        raise ValueError(f"a shared-buffer payload of kind {payload.get('kind')!r} has keys {sorted(map(str, payload))}"
                         f", expected {sorted(keys)}")


def open_payload(payload: Any) -> torch.Tensor:
    """The tensor a :class:`SharedBuffer`'s ``payload`` describes, mapped into this process without a copy (on the
    GPU that made it, for ``"cuda"``; in host memory, for ``"shm"``). Every field is checked first; nothing in
    the payload is unpickled or imported."""
    if not isinstance(payload, dict) or payload.get("v") != PAYLOAD_VERSION:
        raise ValueError(f"not a dask-lm shared-buffer payload (a dict with \"v\": {PAYLOAD_VERSION}): "
                         f"got {type(payload).__name__}")
    kind = payload.get("kind")
    if kind == "cuda":
        _check_keys(payload, _CUDA_KEYS)
        if not isinstance(payload["cuda"], dict):
            raise ValueError("`cuda` of a shared-buffer payload must be a dict of the handle's fields")
        return cuda_ipc.open_cuda(payload["cuda"])
    if kind != "shm":
        raise ValueError(f"a shared-buffer payload's kind must be 'cuda' or 'shm', got {kind!r}")
    _check_keys(payload, _SHM_KEYS)
    name, shape, dtype_name, nbytes = payload["name"], payload["shape"], payload["dtype"], payload["nbytes"]
    if not isinstance(name, str) or not _SHM_NAME.fullmatch(name):
        raise ValueError(f"the shared-memory name {str(name)[:80]!r} is not one dask-lm makes (dask_lm_<pid>_<hex>)")
    if not isinstance(shape, list) or not 0 < len(shape) <= _MAX_DIMS or \
            not all(_is_int(d) and d >= 0 for d in shape):
        raise ValueError("`shape` of a shared-buffer payload must be a list of 1 to 8 non-negative ints")
    dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise ValueError(f"`dtype` of a shared-buffer payload must be one of {sorted(_DTYPES)}, got {dtype_name!r}")
    if not _is_int(nbytes) or nbytes != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"`nbytes` {nbytes!r} of a shared-buffer payload is not shape x itemsize")
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise ValueError(f"the shared buffer {name} is gone: the Policy released it (release_ipc_buffer) or its "
                         "worker exited; call get_full_logits_ipc again") from None
    try:
        size = os.fstat(fd).st_size
        if size < max(nbytes, 1):
            raise ValueError(f"the shared buffer {name} holds {size} bytes, the payload says {nbytes}")
        view = mmap.mmap(fd, max(nbytes, 1))
    finally:
        os.close(fd)
    if not nbytes:
        return torch.zeros(shape, dtype=dtype)
    # shared, as a CUDA IPC mapping is: the consumer sees the producer's memory (an in-place op changes it for every
    # reader until the next call overwrites it)
    return torch.frombuffer(view, dtype=dtype, count=math.prod(shape)).view(shape)

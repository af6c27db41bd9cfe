"""The consumer's side of ``Policy.get_full_logits_ipc``: map a teacher's full-vocabulary logits in another process
on the same machine, without a copy.

Example, in a student process (a distillation loss, an analysis script) that received the Policy's list::

    from dask_lm.teacher_logits import open_full_logits, open_full_logits_batch

    entries = teacher.get_full_logits_ipc(batch)            # on the driver; the list travels as plain data
    logits = open_full_logits(entries[0])                   # float32 [S, V], a view of the teacher rank's buffer
    batch_logits = open_full_logits_batch(entries[:4])      # float32 [4, S, V], a copy

The entries are plain data (ints, strings, bytes, lists): they can be sent with msgpack, JSON-with-bytes or Dask,
and nothing in them is unpickled or imported here; a forged entry fails validation
(:mod:`dask_lm.model.shared_buffer`). On GPUs the consumer must run on the same machine and see the teacher's GPU
(CUDA IPC is node-local); on CPU workers it must run on the same machine (``/dev/shm``). A view stays valid until
the teacher's next ``get_full_logits_ipc`` (which overwrites the buffer) or ``release_ipc_buffer``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dask_lm.model.shared_buffer import open_payload

__all__ = ["open_full_logits", "open_full_logits_batch"]

_INDEX_KEYS = ("buf_idx", "sample_index_in_buf")


def _shard(entry: Any) -> dict[str, Any]:
    """The one shard of an entry: dask-lm's ranks are data-parallel, so a row's logits are never split across
    ranks by vocabulary or sequence (NeMo RL's tensor / context-parallel teachers would give several)."""
    if isinstance(entry, dict) and "teacher_shards" in entry:
        shards = entry["teacher_shards"]
        if not isinstance(shards, list) or len(shards) != 1:
            raise ValueError(
                "an entry of get_full_logits_ipc from dask-lm has exactly one teacher shard; got "
                f"{len(shards) if isinstance(shards, list) else type(shards).__name__}"
            )
        entry = shards[0]
    if not isinstance(entry, dict) or "payload_ipc" not in entry:
        raise ValueError(
            "expected an entry of Policy.get_full_logits_ipc ({'teacher_shards': [shard]}) or one of "
            f"its shards; got {type(entry).__name__}"
        )
    for key in (*_INDEX_KEYS, "actual_shape", "storage_shape"):
        if key not in entry:
            raise ValueError(f"a full-logits shard lacks `{key}`")
    return entry


def _view(storage: torch.Tensor, shard: dict[str, Any]) -> torch.Tensor:
    for key in _INDEX_KEYS:
        if type(shard[key]) is not int:
            raise ValueError(f"`{key}` of a full-logits shard must be an int, got {shard[key]!r}")
    actual = shard["actual_shape"]
    if not isinstance(actual, (list, tuple)) or len(actual) != 2 or not all(type(d) is int for d in actual):
        raise ValueError(f"`actual_shape` of a full-logits shard must be (positions, vocabulary), got {actual!r}")
    if storage.dim() != 4 or list(storage.shape) != list(shard["storage_shape"]):
        raise ValueError(
            f"the buffer holds {list(storage.shape)}, the shard says {shard['storage_shape']!r}: it "
            "was grown or released since this list was made; call get_full_logits_ipc again"
        )
    n, b, s, v = storage.shape
    i, j = shard["buf_idx"], shard["sample_index_in_buf"]
    if not (0 <= i < n and 0 <= j < b and 0 <= actual[0] <= s and 0 <= actual[1] <= v):
        raise ValueError(
            f"a full-logits shard points outside its buffer {list(storage.shape)}: buf_idx {i}, "
            f"sample_index_in_buf {j}, actual_shape {tuple(actual)}"
        )
    return storage[i, j, : actual[0], : actual[1]]


def open_full_logits(entry: Any) -> torch.Tensor:
    """One row's logits: float32 ``[S, V]`` (``S`` the batch's padded width), a view of the teacher rank's
    buffer. ``entry`` is an element of ``get_full_logits_ipc``'s list or its shard."""
    shard = _shard(entry)
    return _view(open_payload(shard["payload_ipc"]), shard)


def open_full_logits_batch(entries: Sequence[Any]) -> torch.Tensor:
    """Several rows' logits stacked: float32 ``[B, S, V]`` (a copy, on the teacher's device; each rank's buffer is
    mapped once)."""
    if not entries:
        raise ValueError("open_full_logits_batch needs at least one entry")
    shards = [_shard(e) for e in entries]
    opened: dict[str, torch.Tensor] = {}  # a payload (as text: entries that crossed a wire are copies) -> mapping
    views = []
    for shard in shards:
        key = repr(shard["payload_ipc"])
        if key not in opened:
            opened[key] = open_payload(shard["payload_ipc"])
        views.append(_view(opened[key], shard))
    if len({tuple(v.shape) for v in views}) != 1:
        raise ValueError(
            f"the entries have different shapes {sorted({tuple(v.shape) for v in views})}: they come "
            "from different calls; open them one by one with open_full_logits"
        )
    return torch.stack(views)

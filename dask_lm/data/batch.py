"""``BatchedDataDict``: a dict of per-row values (tensors with dim 0 = batch, or lists), as in NeMo RL.

Tensors are right-padded: dim 1 is the sequence axis and ``input_lengths`` holds each row's true length.
Sharding (``shard_by_batch_size``) sets three attributes that plain dict operations do not carry over:
``micro_batch_indices`` (per global batch, ``[start, end)`` row ranges of each micro-batch),
``micro_batch_lengths`` (per global batch, each micro-batch's padded length or packed token count) and
``elem_counts_per_gb`` (packing: rows of this shard in each global batch).

Example
-------
>>> b = BatchedDataDict(input_ids=torch.tensor([[5, 6, 7], [8, 9, 0]]), input_lengths=torch.tensor([3, 2]))
>>> [s["input_lengths"].tolist() for s in b.shard_by_batch_size(2)]
[[3], [2]]
"""

from __future__ import annotations

import copy
from collections import UserDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import torch
import torch.nn.functional as F

from dask_lm.data.sharding import (
    BatchError,
    DynamicBatchingArgs,
    SequencePackingArgs,
    batch_size_of,
    shard_batch,
)

__all__ = ["BatchedDataDict", "SlicedDataDict", "DynamicBatchingArgs", "SequencePackingArgs"]

DictT = TypeVar("DictT", bound=Mapping[str, Any])


class BatchedDataDict(UserDict[str, Any], Generic[DictT]):
    """A batch of rows. See the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.micro_batch_indices: list[list[list[int]]] | None = None
        self.micro_batch_lengths: list[list[int]] | None = None
        self.elem_counts_per_gb: list[int] | None = None

    # ----------------------------------------------------------------------------------------- build / join
    @classmethod
    def from_batches(
        cls, batches: Sequence[Mapping[str, Any]], pad_value_dict: dict[str, int | float] | None = None
    ) -> BatchedDataDict[DictT]:
        """Stack batches row-wise. Lists concatenate; 1-D tensors concatenate; tensors with a sequence axis are
        right-padded along dim 1 (pad value from ``pad_value_dict``, default 0) to the widest, then stacked.

        A key may be missing from a batch with no rows (an empty shard, or an empty mapping): such a batch adds no
        rows to any key. A key missing from a batch that has rows is a ``KeyError`` (NeMo RL's contract)."""
        pad_value_dict = pad_value_dict or {}
        out = cls()
        # rows as NeMo RL counts them: the length of the first value (0 for an empty mapping)
        rows = [batch_size_of(next(iter(b.values()))) if len(b) else 0 for b in batches]
        keys = sorted(set().union(*(b.keys() for b in batches)))
        for k in keys:
            missing = [i for i, b in enumerate(batches) if rows[i] and k not in b]
            if missing:
                raise KeyError(f"Key {k!r} is missing from non-empty batches {missing}.")
            # 0-row values are left out where rows exist: an empty shard's `[]` or (0, 0) tensor must not decide
            # the type, dtype or trailing shape of the column; a key only empty batches hold keeps its 0 rows
            values = [b[k] for i, b in enumerate(batches) if k in b and rows[i]] or [b[k] for b in batches if k in b]
            first = values[0]
            if isinstance(first, list):
                out[k] = [x for v in values for x in v]
            elif isinstance(first, torch.Tensor):
                if all(v.dim() == 1 for v in values):
                    out[k] = torch.cat(values)
                    continue
                pad = pad_value_dict.get(k, 0)
                width = max(v.shape[1] for v in values)
                padded = [
                    F.pad(v, (0, 0) * (v.dim() - 2) + (0, width - v.shape[1]), value=pad) if v.shape[1] < width else v
                    for v in values
                ]
                out[k] = torch.cat(padded, dim=0)
            else:
                raise NotImplementedError(
                    f"Attempted to stack for unsupported type {type(first)} with key {k}. "
                    "Please provide either a tensor or a list of picklable objects."
                )
        return out

    # ----------------------------------------------------------------------------------------- shape
    @property
    def size(self) -> int:
        """Rows in the batch (0 when empty)."""
        if not self.data:
            return 0
        return batch_size_of(next(iter(self.data.values())))

    def get_dict(self) -> dict[str, Any]:
        return self.data

    def to(self, device: torch.device | str) -> BatchedDataDict[DictT]:
        """Move every tensor to ``device`` (in place) and return self."""
        for k, v in self.data.items():
            if isinstance(v, torch.Tensor):
                self.data[k] = v.to(device)
        return self

    def truncate_tensors(self, dim: int, truncated_len: int) -> None:
        """Cut every tensor with at least ``dim + 1`` dims to ``truncated_len`` along ``dim`` (in place)."""
        for k, v in self.data.items():
            if isinstance(v, torch.Tensor) and v.dim() >= dim + 1:
                self.data[k] = torch.narrow(v, dim, 0, min(truncated_len, v.shape[dim]))

    # ----------------------------------------------------------------------------------------- selection
    def slice(self, start: int, end: int) -> SlicedDataDict:
        """Rows ``[start, end)`` (tensor views, list slices); micro-batch attributes are not carried."""
        out = SlicedDataDict()
        for k, v in self.data.items():
            if isinstance(v, torch.Tensor):
                if end > v.shape[0]:
                    raise BatchError(f"end: {end} is greater than the shape of the tensor: {v.shape[0]} for key: {k}")
                out[k] = v[start:end]
            else:
                out[k] = v[start:end]
        return out

    def select_indices(self, indices: Sequence[int] | torch.Tensor) -> BatchedDataDict[DictT]:
        """Rows at ``indices``, in that order."""
        out = type(self)()
        for k, v in self.data.items():
            if isinstance(v, torch.Tensor):
                idx = indices if isinstance(indices, torch.Tensor) else torch.as_tensor(list(indices), dtype=torch.long)
                out[k] = v[idx.to(v.device)]
            elif isinstance(v, list):
                out[k] = [v[int(i)] for i in indices]
            else:
                raise TypeError(f"Unsupported type {type(v)} for index selection in BatchedDataDict")
        return out

    def chunk(self, rank: int, chunks: int) -> SlicedDataDict:
        """The ``rank``-th of ``chunks`` equal contiguous pieces."""
        sizes = {batch_size_of(v) for v in self.data.values()}
        if len(sizes) != 1:
            raise BatchError("batch sizes are not the same across the rollout batch")
        b = sizes.pop()
        if b % chunks:
            raise BatchError(f"batch size ({b}) is not a multiple of chunks ({chunks})")
        if b // chunks <= rank:
            raise BatchError(
                f"index OOB: not enough splits for this rank. rollout_batch_size: {b}, chunks ({chunks}), "
                f"rank_idx ({rank})"
            )
        idx = torch.arange(b).tensor_split(chunks)[rank]
        out = SlicedDataDict()
        for k, v in self.data.items():
            out[k] = v[idx].clone() if isinstance(v, torch.Tensor) else [v[int(i)] for i in idx]
        return out

    def repeat_interleave(self, num_repeats: int) -> BatchedDataDict[DictT]:
        """Each row ``num_repeats`` times in a row (list items are deep-copied)."""
        out = type(self)()
        for k, v in self.data.items():
            if isinstance(v, torch.Tensor):
                out[k] = v.repeat_interleave(num_repeats, dim=0)
            else:
                out[k] = [copy.deepcopy(x) for x in v for _ in range(num_repeats)]
        return out

    def reorder_data(self, reorded_indices: Sequence[int]) -> None:
        """Undo a sharding permutation in place: the row now at position j goes back to ``reorded_indices[j]``."""
        sizes = {batch_size_of(v) for v in self.data.values()}
        if len(sizes) > 1:
            raise BatchError("Batch sizes are not the same across the rollout batch")
        inverse = [j for _, j in sorted((int(r), j) for j, r in enumerate(reorded_indices))]
        for k, v in self.data.items():
            if isinstance(v, torch.Tensor):
                self.data[k] = v.index_select(0, torch.as_tensor(inverse, dtype=torch.long, device=v.device))
            else:
                self.data[k] = [v[i] for i in inverse]

    # ----------------------------------------------------------------------------------------- sharding
    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        dynamic_batching_args: DynamicBatchingArgs | None = None,
        sequence_packing_args: SequencePackingArgs | None = None,
    ) -> list[SlicedDataDict] | tuple[list[SlicedDataDict], list[int]]:
        """Split into ``shards`` data-parallel shards (see ``dask_lm.data.sharding``).

        Cuts the batch into ``batch_size`` chunks (default: one chunk) and gives shard s the s-th slice of each:
        with 8 rows, ``batch_size=4`` and 2 shards, shard 0 holds rows 0, 1, 4, 5. With dynamic batching or
        sequence packing returns ``(shards, batch_sorted_indices)``; ``reorder_data`` undoes the permutation.
        """
        return shard_batch(
            self,
            shards,
            batch_size,
            allow_uneven_shards,
            dynamic_batching_args,
            sequence_packing_args,
            sliced=SlicedDataDict,
        )

    def get_batch(self, batch_idx: int, batch_size: int | None = None) -> SlicedDataDict:
        """Global batch ``batch_idx`` of a shard, keeping only that batch's micro-batch metadata."""
        if self.elem_counts_per_gb is not None:
            if self.micro_batch_indices is None:
                raise BatchError("micro_batch_indices must be provided if sequence_packing is True")
            starts = [0]
            for n in self.elem_counts_per_gb:
                starts.append(starts[-1] + n)
            batch = self.slice(starts[batch_idx], starts[batch_idx + 1])
            batch.elem_counts_per_gb = [self.elem_counts_per_gb[batch_idx]]
        else:
            if batch_size is None:
                raise BatchError("get_batch needs batch_size for a shard without sequence packing")
            batch = self.slice(batch_size * batch_idx, batch_size * (batch_idx + 1))
        if self.micro_batch_indices is not None:
            batch.micro_batch_indices = [self.micro_batch_indices[batch_idx]]
            batch.micro_batch_lengths = [self.micro_batch_lengths[batch_idx]]  # type: ignore[index]
        return batch

    # ----------------------------------------------------------------------------------------- micro-batches
    def make_microbatch_iterator(self, microbatch_size: int) -> Iterator[SlicedDataDict]:
        size = self.size
        if size % microbatch_size:
            raise BatchError(
                f"Data dict size ({size}) is not a multiple of the provided microbatch size ({microbatch_size})"
            )
        for start in range(0, size, microbatch_size):
            yield self.slice(start, start + microbatch_size)

    def _single_chunk(self) -> tuple[list[list[int]], list[int]]:
        if self.micro_batch_indices is None or self.micro_batch_lengths is None or len(self.micro_batch_indices) != 1:
            raise BatchError(
                "micro-batch iterators need the micro-batch layout of exactly one global batch: call "
                "shard_by_batch_size with dynamic batching or packing, then get_batch(i)"
            )
        return self.micro_batch_indices[0], self.micro_batch_lengths[0]

    def make_microbatch_iterator_with_dynamic_shapes(self, sequence_dim: int = 1) -> Iterator[SlicedDataDict]:
        """Each dynamic micro-batch, with every tensor of 2+ dims cut to the micro-batch's padded length."""
        indices, lengths = self._single_chunk()
        for (start, end), length in zip(indices, lengths):
            mb = self.slice(start, end)
            mb.truncate_tensors(sequence_dim, length)
            yield mb

    def get_microbatch_iterator_dynamic_shapes_len(self) -> int:
        return len(self._single_chunk()[0])

    def make_microbatch_iterator_for_packable_sequences(self) -> Iterator[SlicedDataDict]:
        """The rows of each packed bin (not truncated; the forward packs them)."""
        indices, _ = self._single_chunk()
        for start, end in indices:
            yield self.slice(start, end)

    def get_microbatch_iterator_for_packable_sequences_len(self) -> tuple[int, int]:
        indices, lengths = self._single_chunk()
        return len(indices), max(lengths, default=0)

    # ----------------------------------------------------------------------------------------- arrow
    def to_arrow(self) -> Any:
        """An Arrow table (token ids as ``list<int32>``, padding trimmed when it is uniform); lossless, and data only:
        list columns become Arrow types or JSON text, and one that holds other objects (tuples, numpy arrays, tensors
        inside lists) is a ``ValueError`` naming it (:mod:`dask_lm.data.arrow`)."""
        from dask_lm.data.arrow import to_arrow  # lazy: pyarrow loads only when a batch is converted (no cycle)

        return to_arrow(self)

    @classmethod
    def from_arrow(cls, table: Any, *, device: torch.device | str | None = None) -> BatchedDataDict[Any]:
        """The batch ``to_arrow`` encoded, or a plain Arrow table's columns (lists of numbers become padded tensors).
        Only data is read, so a table from a file runs no code: a column marked as pickled is refused."""
        from dask_lm.data.arrow import from_arrow  # lazy: pyarrow loads only when a batch is converted (no cycle)

        return cls(from_arrow(table, device=device))

    def __repr__(self) -> str:
        parts = []
        for k, v in self.data.items():
            if isinstance(v, torch.Tensor):
                parts.append(f"{k}: {str(v.dtype).replace('torch.', '')}{list(v.shape)}")
            else:
                parts.append(f"{k}: list[{len(v)}]")
        return f"{type(self).__name__}({', '.join(parts)})"


class SlicedDataDict(BatchedDataDict[Any]):
    """A slice or shard of a larger batch."""

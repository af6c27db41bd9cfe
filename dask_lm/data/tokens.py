"""Rows of token ids as they reach the forward: one flat tensor of every row's ids and the rows' offsets.

This is the one representation of an inference call's tokens on a rank, from the wire to the device. A shard
crosses the wire as an Arrow table whose ``input_ids`` column is ``list<int32>`` with the padding trimmed
(:mod:`dask_lm.data.arrow`): its values and offsets buffers already *are* the packed ``ids [1, T]`` and the
``cu_seqlens`` a varlen forward takes. :meth:`TokenRows.from_table` wraps those buffers without a copy, a
micro-batch of contiguous rows is a view (:meth:`TokenRows.slice`), and only then does the micro-batch take the
form its forward needs: packed (:meth:`TokenRows.packed`, no copy of the ids) or right-padded to its own longest
row (:meth:`TokenRows.padded`, one scatter). Padding the whole shard to ``[B, S]`` on arrival and packing each
micro-batch again from that padding (``mask-select``) would cost two copies of every token and a ``[B, S]`` tensor
per call that exists only to be undone.

Scoring replicas build the same rows from the token lists a tokenizer gives (:meth:`TokenRows.from_lists`, one
concatenation) rather than through a padded tensor, and training, whose loss functions read padded micro-batches
(NeMo RL's contract), builds them from those (:meth:`TokenRows.from_padded`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from dask_lm.data import arrow

__all__ = ["TokenRows"]


@dataclass(frozen=True, slots=True)
class TokenRows:
    """``size`` rows of token ids: row ``b`` is ``values[offsets[b]:offsets[b + 1]]``. Host (CPU) tensors.

    ``width`` is the padded width the rows' per-token outputs take (``[size, width]``): the batch's ``input_ids``
    width, at least the longest row."""

    values: torch.Tensor  # [N] integer ids, every row's back to back
    offsets: torch.Tensor  # [size + 1] int64, offsets[0] == 0
    width: int

    def __post_init__(self) -> None:
        assert self.offsets.dtype == torch.int64 and self.offsets.dim() == 1 and self.offsets.numel() >= 1
        assert int(self.offsets[0]) == 0 and int(self.offsets[-1]) == self.values.numel(), "offsets span values"

    # ------------------------------------------------------------------------------------------- building
    @classmethod
    def from_padded(cls, ids: torch.Tensor, lengths: torch.Tensor) -> TokenRows:
        """The first ``lengths[b]`` ids of each row of right-padded ``ids [B, S]``."""
        lengths = lengths.detach().to("cpu", torch.int64)
        ids = ids.detach().cpu()
        keep = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        return cls(ids[keep], _offsets(lengths), int(ids.shape[1]))

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[int]], width: int | None = None) -> TokenRows:
        """Rows given as lists of ids (a tokenizer's output): one concatenation, no padded tensor."""
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
        flat = np.fromiter((t for r in rows for t in r), dtype=np.int64, count=int(lengths.sum()))
        longest = int(lengths.max()) if len(rows) else 0
        return cls(torch.from_numpy(flat), _offsets(lengths), longest if width is None else width)

    @classmethod
    def from_table(cls, table: pa.Table, ids: str = "input_ids", lengths: str = "input_lengths") -> TokenRows:
        """The rows of a shard's table (:func:`dask_lm.data.arrow.to_arrow`): its trimmed ``ids`` column's values and
        offsets as they are (no copy); a column that could not be trimmed (its pad region held more than one
        value) is decoded and cut by ``lengths``."""
        trimmed = arrow.trimmed_column(table, ids)
        if trimmed is not None:
            column, width = trimmed
            values, offsets = arrow.list_values_offsets(column)
            return cls(values, offsets, width)
        data = arrow.from_arrow(table.select([ids, lengths]))
        return cls.from_padded(data[ids], data[lengths])

    # ------------------------------------------------------------------------------------------- reading
    @property
    def size(self) -> int:
        return self.offsets.numel() - 1

    @property
    def lengths(self) -> torch.Tensor:
        """``[size]`` int64: each row's count of ids."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def num_tokens(self) -> int:
        return self.values.numel()

    def slice(self, start: int, end: int) -> TokenRows:
        """Rows ``[start, end)``, as views of this one's tensors."""
        lo, hi = int(self.offsets[start]), int(self.offsets[end])
        return TokenRows(self.values[lo:hi], self.offsets[start : end + 1] - lo, self.width)

    def take(self, rows: Sequence[int]) -> TokenRows:
        """Rows in the order ``rows`` lists them (a gather of their ids)."""
        index = torch.as_tensor(list(rows), dtype=torch.int64)
        lengths = self.lengths[index]
        starts = torch.repeat_interleave(self.offsets[:-1][index], lengths)
        offsets = _offsets(lengths)
        within = torch.arange(int(offsets[-1])) - torch.repeat_interleave(offsets[:-1], lengths)
        return TokenRows(self.values[starts + within], offsets, self.width)

    def packed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows as one sequence: ``(ids [1, T], position_ids [1, T], cu_seqlens [size + 1] int32)``; the ids
        are this object's values (no copy)."""
        total = self.num_tokens
        starts = torch.repeat_interleave(self.offsets[:-1], self.lengths, output_size=total)
        positions = (torch.arange(total) - starts)[None, :]
        return self.values[None, :], positions, self.offsets.to(torch.int32)

    def padded(self, pad_value: int = 0, width: int | None = None) -> torch.Tensor:
        """``[size, width]`` right-padded ids (``width`` defaults to the longest row), in one scatter."""
        return arrow.pad_from_offsets(self.values, self.offsets, width, pad_value)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets

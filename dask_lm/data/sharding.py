"""How a batch is split over data-parallel ranks and cut into micro-batches (pure functions, no processes).

Three ways, all as NeMo RL does them, so every rank of an FSDP group runs the same number of forwards:

* **plain**: the batch is cut into ``batch_size`` chunks (global batches); shard s takes the s-th contiguous
  slice of every chunk, so each rank's k-th local batch comes from global batch k.
* **dynamic batching**: within each chunk rows are sorted by length (stable) and dealt round-robin to the
  shards; micro-batch boundaries are then cut once for all shards from the per-position maximum length, so that
  ``rows x padded length <= max_tokens_per_microbatch``.
* **sequence packing**: within each chunk a packer puts rows into bins of at most ``max_tokens_per_microbatch``
  tokens, with a bin count that is a multiple of the shard count; bins go round-robin to the shards.

Sorting and packing return ``batch_sorted_indices``: the original row of each output position, in rank-major
order; ``BatchedDataDict.reorder_data`` undoes it after the ranks' outputs are concatenated.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence, ValuesView
from typing import Any, Literal, Protocol, TypedDict, TypeVar

import torch

from dask_lm.data.packing import get_packer
from dask_lm.errors import BatchError

if sys.version_info >= (3, 11):
    from typing import NotRequired
else:  # Python 3.10
    from typing_extensions import NotRequired

__all__ = ["BatchError", "DynamicBatchingArgs", "SequencePackingArgs", "shard_batch", "batch_size_of"]


class DynamicBatchingArgs(TypedDict):
    max_tokens_per_microbatch: int
    sequence_length_round: int
    input_key: str
    input_lengths_key: str


class SequencePackingArgs(TypedDict):
    max_tokens_per_microbatch: int
    input_key: str
    input_lengths_key: str
    algorithm: str
    sequence_length_pad_multiple: NotRequired[int]
    microbatch_order: NotRequired[Literal["packer", "largest_first"]]


class Rows(Protocol):
    """What sharding reads of a batch (a :class:`~dask_lm.data.batch.BatchedDataDict`): its columns, and a
    selection of its rows. Written here so that this module needs nothing of the batch module, which calls it."""

    def __getitem__(self, key: str, /) -> Any: ...

    def values(self) -> ValuesView[Any]: ...

    def select_indices(self, indices: Sequence[int], /) -> Rows: ...


class Cut(Protocol):
    """A shard as sharding hands it back (a :class:`~dask_lm.data.batch.SlicedDataDict`): rows and their
    micro-batch layout."""

    micro_batch_indices: list[list[list[int]]] | None
    micro_batch_lengths: list[list[int]] | None
    elem_counts_per_gb: list[int] | None

    def __getitem__(self, key: str, /) -> Any: ...


CutT = TypeVar("CutT", bound=Cut)


def batch_size_of(value: Any) -> int:
    return int(value.shape[0]) if isinstance(value, torch.Tensor) else len(value)


def shard_batch(
    data: Rows,
    shards: int,
    batch_size: int | None = None,
    allow_uneven_shards: bool = False,
    dynamic_batching_args: DynamicBatchingArgs | None = None,
    sequence_packing_args: SequencePackingArgs | None = None,
    *,
    sliced: Callable[[Rows], CutT],
) -> list[CutT] | tuple[list[CutT], list[int]]:
    """The body of ``BatchedDataDict.shard_by_batch_size`` (see there). ``sliced`` makes a shard of the selected
    rows (the shards' class), handed in by the batch module that defines it, so that this module needs nothing of
    that one."""
    if shards < 1:
        raise BatchError(f"shards must be >= 1, got {shards}")
    if allow_uneven_shards and batch_size is not None:
        raise BatchError("batch_size must be None if allow_uneven_shards is True")
    if dynamic_batching_args is not None and sequence_packing_args is not None:
        raise BatchError("dynamic_batching_args and sequence_packing_args cannot be passed together")
    sizes = sorted({batch_size_of(v) for v in data.values()})
    if len(sizes) > 1:
        raise BatchError(
            f"Batch sizes are not the same across the rollout batch, found sizes: [{','.join(str(s) for s in sizes)}]"
        )
    total = sizes[0] if sizes else 0
    batch_size = total if batch_size is None else batch_size
    if batch_size < 1 and total:
        raise BatchError(f"batch_size must be >= 1, got {batch_size}")
    if total and total % batch_size:
        raise BatchError(f"Total batch size ({total}) is not a multiple of batch_size ({batch_size})")
    if not allow_uneven_shards and batch_size % shards:
        raise BatchError(f"Batch size ({batch_size}) is not a multiple of shards ({shards})")
    num_chunks = total // batch_size if batch_size else 0

    if sequence_packing_args is not None:
        return _pack_shards(data, shards, batch_size, num_chunks, sequence_packing_args, allow_uneven_shards, sliced)

    sorted_indices: list[int] | None = None
    if dynamic_batching_args is not None:
        lengths = data[dynamic_batching_args["input_lengths_key"]]
        sorted_indices = []
        for c in range(num_chunks):
            start = c * batch_size
            local = sorted(range(batch_size), key=lambda i: int(lengths[start + i]))
            dealt = [start + i for s in range(shards) for i in local[s::shards]]
            sorted_indices.extend(dealt)
        data = data.select_indices(sorted_indices)

    shard_size = math.ceil(batch_size / shards) if allow_uneven_shards else batch_size // shards
    out: list[CutT] = []
    for s in range(shards):
        rows: list[int] = []
        for c in range(num_chunks):
            lo = c * batch_size + s * shard_size
            hi = c * batch_size + (s + 1) * shard_size
            if allow_uneven_shards:
                lo, hi = min(lo, (c + 1) * batch_size), min(hi, (c + 1) * batch_size)
            rows.extend(range(lo, hi))
        out.append(sliced(data.select_indices(rows)))
    if dynamic_batching_args is None:
        return out
    _cut_dynamic_micro_batches(
        out, shard_size, num_chunks, dynamic_batching_args, width=int(data[dynamic_batching_args["input_key"]].shape[1])
    )
    assert sorted_indices is not None  # set above whenever dynamic batching is on
    return out, sorted_indices


def _cut_dynamic_micro_batches(
    shards: list[Any], shard_size: int, num_chunks: int, args: DynamicBatchingArgs, *, width: int
) -> None:
    """Identical micro-batch boundaries for every shard: position j's length is the max over shards."""
    budget = int(args["max_tokens_per_microbatch"])
    rnd = int(args["sequence_length_round"])
    key = args["input_lengths_key"]
    indices, lengths = [], []
    for c in range(num_chunks):
        mbi: list[list[int]] = [[0, 0]]
        mbl: list[int] = [0]
        longest = 0
        for j in range(shard_size):
            m = max(
                (int(sh[key][c * shard_size + j]) for sh in shards if c * shard_size + j < batch_size_of(sh[key])),
                default=0,
            )
            m = min(math.ceil(m / rnd) * rnd, width)
            if m > budget:
                raise BatchError(
                    f"got an input of padded ({rnd}) sequence length of {m}, however max microbatch "
                    f"size is {budget} tokens; raise the token budget (logprob_mb_tokens / "
                    "train_mb_tokens) or shorten the row"
                )
            rows = mbi[-1][1] - mbi[-1][0] + 1
            longest = max(longest, m)
            if rows * longest <= budget:
                mbi[-1][1] += 1
                mbl[-1] = longest
            else:
                mbi.append([j, j + 1])
                longest = m
                mbl.append(longest)
        indices.append(mbi)
        lengths.append(mbl)
    for sh in shards:
        n = batch_size_of(sh[key]) if sh else 0
        # uneven shards: a shorter shard keeps the same count of micro-batches, its trailing ones clipped (empty
        # ones run as dummies on the rank, so collectives still pair up)
        sh.micro_batch_indices = [[[min(s, n), min(e, n)] for s, e in chunk] for chunk in indices]
        sh.micro_batch_lengths = [list(chunk) for chunk in lengths]


def _pack_shards(
    data: Rows,
    shards: int,
    batch_size: int,
    num_chunks: int,
    args: SequencePackingArgs,
    allow_uneven: bool,
    sliced: Callable[[Rows], CutT],
) -> tuple[list[CutT], list[int]]:
    order = args.get("microbatch_order")
    if order not in (None, "packer", "largest_first"):
        raise BatchError(f"sequence packing microbatch_order must be 'packer' or 'largest_first', got {order!r}")
    pad = int(args.get("sequence_length_pad_multiple", 1) or 1)
    lengths = data[args["input_lengths_key"]]
    if not isinstance(lengths, torch.Tensor):
        lengths = torch.tensor(lengths)
    per_shard_rows: list[list[int]] = [[] for _ in range(shards)]
    mbi: list[list[list[list[int]]]] = [[] for _ in range(shards)]
    mbl: list[list[list[int]]] = [[] for _ in range(shards)]
    counts: list[list[int]] = [[] for _ in range(shards)]
    for c in range(num_chunks):
        start = c * batch_size
        padded = [(int(x) + pad - 1) // pad * pad for x in lengths[start : start + batch_size].tolist()]
        # training needs a multiple of `shards` bins (equal counts, NeMo RL's rule); inference (allow_uneven) only
        # asks for a bin per rank when there are enough rows: ranks with fewer bins run dummy forwards
        if allow_uneven:
            min_bins, multiple = min(shards, len(padded)) or None, None
        else:
            min_bins = multiple = shards
        bins = _pack_chunk(padded, args["algorithm"], int(args["max_tokens_per_microbatch"]), min_bins, multiple)
        for s in range(shards):
            mine = bins[s::shards]
            if order == "largest_first":
                mine = sorted(mine, key=lambda b: -sum(padded[i] for i in b))
            chunk_idx, chunk_len, pos = [], [], 0
            for b in mine:
                per_shard_rows[s].extend(start + i for i in b)
                chunk_idx.append([pos, pos + len(b)])
                chunk_len.append(sum(padded[i] for i in b))
                pos += len(b)
            mbi[s].append(chunk_idx)
            mbl[s].append(chunk_len)
            counts[s].append(pos)
    out: list[CutT] = []
    for s in range(shards):
        shard = sliced(data.select_indices(per_shard_rows[s]))
        shard.micro_batch_indices, shard.micro_batch_lengths, shard.elem_counts_per_gb = mbi[s], mbl[s], counts[s]
        out.append(shard)
    return out, [i for rows in per_shard_rows for i in rows]


def _pack_chunk(
    padded: list[int], algorithm: str, capacity: int, min_bins: int | None, multiple: int | None
) -> list[list[int]]:
    """Bins of one chunk. The packer refuses a row longer than ``capacity`` (NeMo RL's contract); a Policy pass
    gives such a row a bin of its own instead of failing the whole batch (the forward of one overlong row works,
    it only exceeds the token budget). So the rows that fit are packed, the overlong ones appended as single
    bins, and only then is the bin count raised to the shard rules: a lone row is never split off its bin."""
    fitting = [i for i, n in enumerate(padded) if n <= capacity]
    overlong = [i for i, n in enumerate(padded) if n > capacity]
    inner = get_packer(algorithm, capacity).pack([padded[i] for i in fitting]) if fitting else []
    bins = [[fitting[j] for j in b] for b in inner] + [[i] for i in overlong]
    return get_packer(algorithm, capacity, min_bin_count=min_bins, bin_count_multiple=multiple).adjust_bin_count(bins)

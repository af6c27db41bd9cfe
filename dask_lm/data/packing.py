"""Bin packing of sequence lengths into micro-batches of at most ``bin_capacity`` tokens.

Names and behaviour follow NeMo RL's ``nemo_rl.data.packing.algorithms`` so code written against it ports:
``PackingAlgorithm`` (four algorithms), the ``SequencePacker`` family, and ``get_packer``. A packer returns bins as
lists of indices into the input lengths. ``min_bin_count`` / ``bin_count_multiple`` force more bins (data-parallel
ranks need the same number each) by moving one item at a time out of the fullest bins. As in NeMo RL, ``pack``
raises ``ValueError`` for a sequence longer than the capacity (its index, length and the capacity named); the
Policy's sharding (:mod:`dask_lm.data.sharding`) gives such a row a bin of its own instead, before packing the rest.

Example
-------
>>> get_packer("first_fit_decreasing", 100).pack([60, 50, 40, 30])
[[0, 2], [1, 3]]
"""

from __future__ import annotations

import bisect
import enum
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence

__all__ = [
    "PackingAlgorithm",
    "SequencePacker",
    "ConcatenativePacker",
    "FirstFitPacker",
    "FirstFitDecreasingPacker",
    "FirstFitShufflePacker",
    "ModifiedFirstFitDecreasingPacker",
    "get_packer",
    "longest_first",
]


class PackingAlgorithm(enum.Enum):
    CONCATENATIVE = "concatenative"
    FIRST_FIT_DECREASING = "first_fit_decreasing"
    FIRST_FIT_SHUFFLE = "first_fit_shuffle"
    MODIFIED_FIRST_FIT_DECREASING = "modified_first_fit_decreasing"


class SequencePacker(ABC):
    """Base class: ``pack(lengths) -> bins``; subclasses implement ``_pack_implementation``."""

    def __init__(
        self,
        bin_capacity: int,
        collect_metrics: bool = False,
        min_bin_count: int | None = None,
        bin_count_multiple: int | None = None,
    ) -> None:
        if min_bin_count is not None and min_bin_count < 0:
            raise ValueError("min_bin_count must be nonnegative")
        if bin_count_multiple is not None and bin_count_multiple < 1:
            raise ValueError("bin_count_multiple must be positive")
        self.bin_capacity = bin_capacity
        self.collect_metrics = collect_metrics
        self.min_bin_count = min_bin_count
        self.bin_count_multiple = bin_count_multiple
        self.metrics: dict[str, float] | None = {} if collect_metrics else None

    @abstractmethod
    def _pack_implementation(self, sequence_lengths: list[int]) -> list[list[int]]:
        """Bins for lengths that all fit the capacity."""

    def pack(self, sequence_lengths: list[int]) -> list[list[int]]:
        """Bins of indices into ``sequence_lengths``, their count raised to the bin-count rules.
        ``ValueError`` when a sequence is longer than the capacity (NeMo RL's contract): no bin can hold it."""
        lengths = [int(x) for x in sequence_lengths]
        # checked here, before any algorithm runs, so all four fail alike and the message can name the index
        for i, n in enumerate(lengths):
            if n > self.bin_capacity:
                raise ValueError(
                    f"Sequence length {n} (sequence {i}) exceeds bin capacity {self.bin_capacity}: "
                    "raise the capacity (the micro-batch token budget) or shorten that sequence"
                )
        bins = self.adjust_bin_count(self._pack_implementation(lengths))
        if self.collect_metrics:
            self.metrics = self.compute_metrics(lengths, bins)
        return bins

    def adjust_bin_count(self, bins: list[list[int]]) -> list[list[int]]:
        """``bins`` (from this packer or assembled by the caller) split up to ``min_bin_count`` and a multiple of
        ``bin_count_multiple``, as :meth:`pack` does. A bin of one sequence is never emptied, so a bin holding a
        single sequence longer than the capacity (see :mod:`dask_lm.data.sharding`) stays as it is."""
        return self._adjust_bin_count(bins)

    def _adjust_bin_count(self, bins: list[list[int]]) -> list[list[int]]:
        target = len(bins)
        if self.min_bin_count is not None:
            target = max(target, self.min_bin_count)
        if self.bin_count_multiple is not None and target % self.bin_count_multiple:
            target += self.bin_count_multiple - target % self.bin_count_multiple
        if target == len(bins):
            return bins
        total = sum(len(b) for b in bins)
        if total < target:
            raise ValueError(
                f"Cannot create {target} bins with only {total} sequences. Each bin must contain at "
                "least one sequence. Either reduce min_bin_count/bin_count_multiple or provide more "
                "sequences."
            )
        out = [list(b) for b in bins]
        # donors: the bins with the most items first (ties: later bin first); each gives items from its end
        # until one is left, so a lone (possibly oversized) sequence is never split off and no bin gets fuller
        donors = [i for _, i in sorted(((len(b), i) for i, b in enumerate(bins)), reverse=True)]
        d = 0
        for _ in range(target - len(bins)):
            while len(out[donors[d]]) <= 1:
                d += 1
                assert d < len(donors), "bin redistribution ran out of donors"
            out.append([out[donors[d]].pop()])
        return out

    def _validate_sequence_lengths(self, sequence_lengths: list[int]) -> None:
        for n in sequence_lengths:
            if n > self.bin_capacity:
                raise ValueError(f"Sequence length {n} exceeds bin capacity {self.bin_capacity}")

    def _create_indexed_lengths(self, sequence_lengths: list[int], reverse: bool = False) -> list[tuple[int, int]]:
        items = [(n, i) for i, n in enumerate(sequence_lengths)]
        return sorted(items, reverse=True) if reverse else items

    def _estimate_bins_needed(self, sequence_lengths: list[int]) -> int:
        return max(1, math.ceil(sum(sequence_lengths) / self.bin_capacity))

    def compute_metrics(self, sequence_lengths: list[int], bins: list[list[int]]) -> dict[str, float]:
        loads = [sum(sequence_lengths[i] for i in b) for b in bins]
        cap = len(bins) * self.bin_capacity
        return {
            "num_bins": float(len(bins)),
            "num_sequences": float(len(sequence_lengths)),
            "total_tokens": float(sum(loads)),
            "efficiency": sum(loads) / cap if cap else 0.0,
            "max_bin_load": float(max(loads, default=0)),
            "min_bin_load": float(min(loads, default=0)),
        }

    def reset_metrics(self) -> None:
        self.metrics = {} if self.collect_metrics else None

    def get_aggregated_metrics(self) -> dict[str, float]:
        return dict(self.metrics or {})


class ConcatenativePacker(SequencePacker):
    """Input order; a new bin whenever the next sequence would overflow the current one."""

    max_sequences_per_bin = -1  # -1: no limit

    def _pack_implementation(self, sequence_lengths: list[int]) -> list[list[int]]:
        self._validate_sequence_lengths(sequence_lengths)
        bins: list[list[int]] = []
        current: list[int] = []
        load = 0
        for i, n in enumerate(sequence_lengths):
            full = self.max_sequences_per_bin != -1 and len(current) >= self.max_sequences_per_bin
            if load + n > self.bin_capacity or full:
                if current:
                    bins.append(current)
                current, load = [i], n
            else:
                current.append(i)
                load += n
        if current:
            bins.append(current)
        return bins


class FirstFitPacker(SequencePacker):
    """Each sequence, in ``_prepare_sequences`` order, goes into the first bin with room."""

    def _prepare_sequences(self, sequence_lengths: list[int]) -> list[tuple[int, int]]:
        raise NotImplementedError("Subclasses must implement _prepare_sequences")

    def _pack_implementation(self, sequence_lengths: list[int]) -> list[list[int]]:
        bins: list[list[int]] = []
        room: list[int] = []
        for n, i in self._prepare_sequences(sequence_lengths):
            if n > self.bin_capacity:
                raise ValueError(f"Sequence length {n} exceeds bin capacity {self.bin_capacity}")
            for b, free in enumerate(room):
                if free >= n:
                    bins[b].append(i)
                    room[b] -= n
                    break
            else:
                bins.append([i])
                room.append(self.bin_capacity - n)
        return bins


class FirstFitDecreasingPacker(FirstFitPacker):
    def _prepare_sequences(self, sequence_lengths: list[int]) -> list[tuple[int, int]]:
        return self._create_indexed_lengths(sequence_lengths, reverse=True)


class FirstFitShufflePacker(FirstFitPacker):
    """First fit in a random order (Python's ``random``, so ``random.seed`` makes it repeatable)."""

    def _prepare_sequences(self, sequence_lengths: list[int]) -> list[tuple[int, int]]:
        items = self._create_indexed_lengths(sequence_lengths)
        random.shuffle(items)
        return items


class ModifiedFirstFitDecreasingPacker(SequencePacker):
    """Johnson & Garey's modified first-fit-decreasing: large items open bins, mediums and pairs of smalls
    fill them, a greedy pass tops them up, and what is left goes to the least-loaded bin that fits."""

    def _pack_implementation(self, sequence_lengths: list[int]) -> list[list[int]]:
        cap = self.bin_capacity
        if cap <= 0:
            raise ValueError("bin_capacity must be positive")
        if any(n <= 0 for n in sequence_lengths):
            raise ValueError("sequence lengths must be positive")
        self._validate_sequence_lengths(sequence_lengths)
        items = list(enumerate(sequence_lengths))  # (index, size)
        large = sorted((it for it in items if it[1] > cap / 2), key=lambda it: -it[1])
        medium = sorted((it for it in items if cap / 3 < it[1] <= cap / 2), key=lambda it: -it[1])
        small = sorted((it for it in items if cap / 6 < it[1] <= cap / 3), key=lambda it: it[1])
        tiny = sorted((it for it in items if it[1] <= cap / 6), key=lambda it: it[1])

        bins = [[it] for it in large]
        load = lambda b: sum(s for _, s in b)  # noqa: E731

        for b in bins:  # one medium per large bin, largest that fits
            free = cap - load(b)
            for j, (_, s) in enumerate(medium):
                if s <= free:
                    b.append(medium.pop(j))
                    break
        for b in reversed(bins):  # bins without a medium take the smallest small plus the largest that fits
            if any(cap / 3 < s <= cap / 2 for _, s in b) or len(small) < 2:
                continue
            free = cap - load(b)
            if small[0][1] + small[1][1] > free:
                continue
            first = small.pop(0)
            for j in range(len(small) - 1, -1, -1):
                if small[j][1] <= free - first[1]:
                    b.extend([first, small.pop(j)])
                    break
        rest = sorted(medium + small + tiny, key=lambda it: -it[1])
        for b in bins:  # greedy top-up with the largest item that still fits
            while rest:
                free = cap - load(b)
                if free < rest[-1][1]:
                    break
                j = next(j for j, (_, s) in enumerate(rest) if s <= free)
                b.append(rest.pop(j))
        # leftovers: into the least-loaded open bin when it fits, else a new bin (loads kept sorted)
        extra: list[list[tuple[int, int]]] = [[]]
        loads = [0]
        for it in rest:
            if it[1] <= cap - loads[0]:
                b, filled = extra.pop(0), loads.pop(0)
            else:
                b, filled = [], 0
            b.append(it)
            filled += it[1]
            pos = bisect.bisect(loads, filled)
            loads.insert(pos, filled)
            extra.insert(pos, b)
        bins.extend(extra)
        return [[i for i, _ in b] for b in bins if b]


_PACKERS: dict[PackingAlgorithm, type[SequencePacker]] = {
    PackingAlgorithm.CONCATENATIVE: ConcatenativePacker,
    PackingAlgorithm.FIRST_FIT_DECREASING: FirstFitDecreasingPacker,
    PackingAlgorithm.FIRST_FIT_SHUFFLE: FirstFitShufflePacker,
    PackingAlgorithm.MODIFIED_FIRST_FIT_DECREASING: ModifiedFirstFitDecreasingPacker,
}


def get_packer(
    algorithm: PackingAlgorithm | str,
    bin_capacity: int,
    collect_metrics: bool = False,
    min_bin_count: int | None = None,
    bin_count_multiple: int | None = None,
) -> SequencePacker:
    """A packer by enum member or (case-insensitive) name, e.g. ``"modified_first_fit_decreasing"``."""
    available = ", ".join(a.name for a in PackingAlgorithm)
    if isinstance(algorithm, str):
        try:
            algorithm = PackingAlgorithm[algorithm.upper()]
        except KeyError:
            raise ValueError(f"Unknown packing algorithm: {algorithm}. Available algorithms: {available}") from None
    if algorithm not in _PACKERS:
        raise ValueError(f"Unknown packing algorithm: {algorithm}. Available algorithms: {available}")
    return _PACKERS[algorithm](
        bin_capacity,
        collect_metrics=collect_metrics,
        min_bin_count=min_bin_count,
        bin_count_multiple=bin_count_multiple,
    )


def longest_first(lengths: Sequence[int], budget: int, *, padded: bool = False) -> list[list[int]]:
    """Indices into ``lengths``, longest first, cut into consecutive batches of at most ``budget`` tokens: real
    tokens, or with ``padded`` the batch's rows times its first (longest) row. A row longer than the budget goes
    alone. The one binning of scoring's micro-batches and of the lm-eval request engine's tasks: sorted rows in
    order keep each batch's lengths close, which is what padding and the varlen kernel both want, and it is
    O(n log n) where first-fit packing is not."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    used = 0
    for i in order:
        if not batches:
            fits = False
        elif padded:  # rows come longest first: the batch's first row sets the padded width
            fits = (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget
        else:
            fits = used + lengths[i] <= budget
        if fits:
            batches[-1].append(i)
            used += lengths[i]
        else:
            batches.append([i])
            used = lengths[i]
    return batches

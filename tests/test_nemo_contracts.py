"""Contracts of NeMo RL's data utilities that dask-lm's ports must keep, written from NeMo RL's own unit tests.

Sources (NVIDIA-NeMo/RL @7ea279a):
- ``tests/unit/data/packing/test_algorithms.py`` (``test_error_cases``, ``test_edge_cases``, ``test_empty_list``)
  for ``nemo_rl/data/packing/algorithms.py``: ``pack()`` raises ``ValueError`` when a sequence is longer than the
  bin capacity, for every algorithm; a sequence exactly at capacity fits; no sequences give no bins.
- ``tests/unit/distributed/test_batched_data_dict.py``
  (``test_from_batches_keeps_optional_keys_missing_only_from_empty_batches``,
  ``test_from_batches_keeps_keys_missing_from_empty_mapping``) for ``BatchedDataDict.from_batches`` in
  ``nemo_rl/distributed/batched_data_dict.py``: a key that only empty batches lack is kept, and empty batches
  add no rows; a key missing from a batch with rows is a ``KeyError`` naming that batch.

The expected values are worked out by hand from the inputs, not taken from our output.
"""

from __future__ import annotations

import pytest
import torch

from dask_lm import BatchedDataDict, PackingAlgorithm, get_packer

ALGORITHMS = list(PackingAlgorithm)


def _valid(lengths, bins, capacity):
    """Every index packed exactly once and no bin over capacity (NeMo's ``validate_solution``, restated)."""
    flat = sorted(i for b in bins for i in b)
    return flat == list(range(len(lengths))) and all(sum(lengths[i] for i in b) <= capacity for b in bins)


# ------------------------------------------------------------------------------------------ packing
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_pack_refuses_a_sequence_longer_than_the_capacity(algorithm):
    # NeMo's test_error_cases: [50, 150, 70] with capacity 100; sequence 1 (length 150) cannot be placed
    with pytest.raises(ValueError, match=r"Sequence length 150 \(sequence 1\) exceeds bin capacity 100"):
        get_packer(algorithm, 100).pack([50, 150, 70])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_pack_refuses_overlong_rows_even_with_bin_count_rules(algorithm):
    # the bin-count rules (min_bin_count / bin_count_multiple) do not make room for an overlong sequence either
    with pytest.raises(ValueError, match=r"\(sequence 2\) exceeds bin capacity 8"):
        get_packer(algorithm, 8, min_bin_count=4, bin_count_multiple=2).pack([3, 4, 9, 1])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize(
    "lengths", [[50], [30, 30, 30, 30, 30], [100, 100, 100], [10, 50, 100, 20, 80, 30, 70, 40, 60, 90]]
)
def test_pack_accepts_sequences_up_to_the_capacity(algorithm, lengths):
    bins = get_packer(algorithm, 100).pack(lengths)
    assert _valid(lengths, bins, 100)
    if lengths == [50]:
        assert bins == [[0]]
    if lengths == [100, 100, 100]:  # each full-capacity sequence alone
        assert sorted(bins) == [[0], [1], [2]]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_pack_of_nothing_is_no_bins(algorithm):
    assert get_packer(algorithm, 100).pack([]) == []


# ------------------------------------------------------------------------------------------ from_batches
def test_from_batches_keeps_optional_keys_missing_only_from_empty_batches():
    empty = BatchedDataDict(
        output_ids=torch.zeros((0, 0), dtype=torch.long), generation_lengths=torch.zeros(0, dtype=torch.long)
    )
    routed = torch.arange(1 * 3 * 2 * 2, dtype=torch.int32).reshape(1, 3, 2, 2)
    full = BatchedDataDict(
        output_ids=torch.tensor([[1, 2, 3]]), generation_lengths=torch.tensor([3]), routed_experts=routed
    )

    stacked = BatchedDataDict.from_batches([empty, full], pad_value_dict={"output_ids": 0})

    assert set(stacked) == {"output_ids", "generation_lengths", "routed_experts"}
    assert stacked["output_ids"].tolist() == [[1, 2, 3]]
    assert stacked["generation_lengths"].tolist() == [3]
    assert torch.equal(stacked["routed_experts"], routed) and stacked["routed_experts"].dtype == torch.int32


def test_from_batches_empty_batches_add_no_rows_wherever_they_sit():
    a = BatchedDataDict(ids=torch.tensor([[1, 2], [3, 4]]), tag=["a", "b"], extra=torch.tensor([10, 11]))
    b = BatchedDataDict(ids=torch.tensor([[5, 6, 7]]), tag=["c"], extra=torch.tensor([12]))
    empty = BatchedDataDict(ids=torch.zeros((0, 5), dtype=torch.long), tag=[])  # no `extra`

    stacked = BatchedDataDict.from_batches([empty, a, empty, b, BatchedDataDict()], pad_value_dict={"ids": -1})

    assert stacked["ids"].tolist() == [[1, 2, -1], [3, 4, -1], [5, 6, 7]]  # the empty (0, 5) adds no width
    assert stacked["tag"] == ["a", "b", "c"]
    assert stacked["extra"].tolist() == [10, 11, 12]


def test_from_batches_keeps_keys_missing_from_an_empty_mapping():
    full = BatchedDataDict(output_ids=torch.tensor([[1, 2, 3]]), generation_lengths=torch.tensor([3]))
    stacked = BatchedDataDict.from_batches([BatchedDataDict(), full])
    assert stacked["output_ids"].tolist() == [[1, 2, 3]] and stacked["generation_lengths"].tolist() == [3]


def test_from_batches_refuses_a_key_missing_from_a_batch_with_rows():
    with_key = BatchedDataDict(output_ids=torch.tensor([[1, 2, 3]]), routed_experts=torch.zeros(1, 3, 2, 2))
    without = BatchedDataDict(output_ids=torch.tensor([[4, 5, 6]]))
    with pytest.raises(KeyError, match=r"'routed_experts' is missing from non-empty batches \[1\]"):
        BatchedDataDict.from_batches([with_key, without])


def test_from_batches_of_only_empty_batches_keeps_their_keys():
    empty = BatchedDataDict(ids=torch.zeros((0, 4), dtype=torch.long), tag=[])
    stacked = BatchedDataDict.from_batches([empty, empty])
    assert set(stacked) == {"ids", "tag"} and stacked["ids"].shape[0] == 0 and stacked["tag"] == []
    assert len(BatchedDataDict.from_batches([])) == 0

"""Pure-logic tests of the DP split, dynamic batching, packing and the inverse permutation (no processes)."""

from __future__ import annotations

import random

import pytest
import torch

from dask_lm import BatchedDataDict, BatchError, PackingAlgorithm, get_packer


def _batch(lengths, width=None):
    width = width or max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.arange(1, n + 1)
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=torch.tensor(lengths),
        row=torch.arange(len(lengths)),
        tag=[f"r{i}" for i in range(len(lengths))],
    )


def test_plain_split_takes_the_same_slice_of_every_global_batch():
    b = BatchedDataDict(x=torch.arange(8), y=list("abcdefgh"))
    s0, s1 = b.shard_by_batch_size(2, batch_size=4)
    assert s0["x"].tolist() == [0, 1, 4, 5] and s1["x"].tolist() == [2, 3, 6, 7]
    assert s0["y"] == list("abef") and s1["y"] == list("cdgh")


def test_uneven_split_keeps_every_row_once_and_every_key():
    b = _batch([3, 1, 2, 5, 4])
    shards = b.shard_by_batch_size(3, allow_uneven_shards=True)
    assert [s.size for s in shards] == [2, 2, 1]
    assert torch.cat([s["row"] for s in shards]).tolist() == [0, 1, 2, 3, 4]
    tiny = _batch([3]).shard_by_batch_size(2, allow_uneven_shards=True)
    assert tiny[1].size == 0 and set(tiny[1]) == {"input_ids", "input_lengths", "row", "tag"}


def test_split_errors_name_the_problem_and_are_value_errors():
    b = BatchedDataDict(x=torch.arange(10))
    with pytest.raises(ValueError, match=r"Total batch size \(10\) is not a multiple of batch_size \(3\)"):
        b.shard_by_batch_size(2, batch_size=3)
    with pytest.raises(AssertionError, match="is not a multiple of shards"):  # NeMo RL code catches asserts
        BatchedDataDict(x=torch.arange(8)).shard_by_batch_size(3, batch_size=4)
    with pytest.raises(BatchError, match="Batch sizes are not the same"):
        BatchedDataDict(x=torch.arange(4), y=torch.arange(3)).shard_by_batch_size(2)


def test_dynamic_batching_reference_example():
    """The worked example: lengths (2,8,4,16,28,32,2,32), 2 shards, round 4, budget 32."""
    b = BatchedDataDict(data=torch.ones(8, 128), input_lengths=torch.tensor([2, 8, 4, 16, 28, 32, 2, 32]))
    args = {
        "input_key": "data",
        "input_lengths_key": "input_lengths",
        "sequence_length_round": 4,
        "max_tokens_per_microbatch": 32,
    }
    (s0, s1), order = b.shard_by_batch_size(2, dynamic_batching_args=args)
    assert order == [0, 2, 3, 5, 6, 1, 4, 7]  # sorted [0,6,2,1,3,4,5,7], dealt round-robin
    assert s0["input_lengths"].tolist() == [2, 4, 16, 32] and s1["input_lengths"].tolist() == [2, 8, 28, 32]
    for s in (s0, s1):
        assert s.micro_batch_indices == [[[0, 2], [2, 3], [3, 4]]]
        assert s.micro_batch_lengths == [[8, 28, 32]]
        shapes = [tuple(mb["data"].shape) for mb in s.make_microbatch_iterator_with_dynamic_shapes()]
        assert shapes == [(2, 8), (1, 28), (1, 32)]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("shards", [1, 2, 3])
def test_dynamic_batching_properties(seed, shards):
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    lengths = [rng.randint(1, 60) for _ in range(n)]
    b = _batch(lengths, width=64)
    budget = 128
    out, order = b.shard_by_batch_size(
        shards,
        allow_uneven_shards=True,
        dynamic_batching_args={
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "sequence_length_round": 8,
            "max_tokens_per_microbatch": budget,
        },
    )
    assert sorted(order) == list(range(n))
    counts = {len(s.micro_batch_indices[0]) for s in out}
    assert len(counts) == 1  # every rank runs the same number of forwards
    for s in out:
        for (lo, hi), length in zip(s.micro_batch_indices[0], s.micro_batch_lengths[0]):
            assert (hi - lo) * length <= budget
            if hi > lo:
                assert int(s["input_lengths"][lo:hi].max()) <= length
    joined = BatchedDataDict.from_batches(out)
    joined.reorder_data(order)
    assert torch.equal(joined["input_ids"], b["input_ids"]) and joined["tag"] == b["tag"]


@pytest.mark.parametrize("algorithm", [a.value for a in PackingAlgorithm])
@pytest.mark.parametrize("shards", [1, 2, 4])
def test_packing_properties(algorithm, shards):
    rng = random.Random(7)
    lengths = [rng.randint(1, 100) for _ in range(36)]
    b = _batch(lengths, width=100)
    out, order = b.shard_by_batch_size(
        shards,
        sequence_packing_args={
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "max_tokens_per_microbatch": 160,
            "algorithm": algorithm,
            "sequence_length_pad_multiple": 4,
        },
    )
    assert sorted(order) == list(range(len(lengths)))
    assert len({len(s.micro_batch_indices[0]) for s in out}) == 1  # bins are a multiple of the shard count
    seen = []
    for s in out:
        assert s.elem_counts_per_gb == [s.size]
        for mb, packed in zip(s.make_microbatch_iterator_for_packable_sequences(), s.micro_batch_lengths[0]):
            padded = ((mb["input_lengths"] + 3) // 4 * 4).sum().item()
            assert padded == packed <= 160
            seen.extend(mb["row"].tolist())
    assert sorted(seen) == list(range(len(lengths)))
    joined = BatchedDataDict.from_batches(out)
    joined.reorder_data(order)
    assert torch.equal(joined["row"], torch.arange(len(lengths)))


def test_packing_fewer_rows_than_ranks_for_inference():
    out, order = _batch([5]).shard_by_batch_size(
        2,
        allow_uneven_shards=True,
        sequence_packing_args={
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "max_tokens_per_microbatch": 16,
            "algorithm": "modified_first_fit_decreasing",
        },
    )
    assert [s.size for s in out] == [1, 0] and order == [0]
    with pytest.raises(ValueError, match="is not a multiple of shards"):  # training-style splits stay strict
        _batch([5]).shard_by_batch_size(
            2,
            sequence_packing_args={
                "input_key": "input_ids",
                "input_lengths_key": "input_lengths",
                "max_tokens_per_microbatch": 16,
                "algorithm": "concatenative",
            },
        )


def test_packers_respect_capacity_and_bin_counts():
    lengths = [10, 20, 30, 40, 50, 60, 70, 80, 90]
    for algo in PackingAlgorithm:
        bins = get_packer(algo, 100, min_bin_count=7, bin_count_multiple=7).pack(lengths)
        assert len(bins) == 7 and all(bins)
        assert sorted(i for b in bins for i in b) == list(range(9))
        assert all(sum(lengths[i] for i in b) <= 100 for b in bins)
    assert get_packer("first_fit_decreasing", 100).pack([60, 50, 40, 30]) == [[0, 2], [1, 3]]
    assert get_packer("CONCATENATIVE", 5).pack([4, 1, 3, 2, 1, 3, 4, 5]) == [[0, 1], [2, 3], [4, 5], [6], [7]]
    with pytest.raises(ValueError, match="Unknown packing algorithm"):
        get_packer("best_fit", 100)


def test_batched_data_dict_helpers():
    b = _batch([3, 1, 2, 4])
    assert b.slice(1, 3)["row"].tolist() == [1, 2]
    assert b.select_indices([3, 0])["tag"] == ["r3", "r0"]
    rep = b.repeat_interleave(2)
    assert rep["row"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3] and rep["tag"][:2] == ["r0", "r0"]
    assert [mb["row"].tolist() for mb in b.make_microbatch_iterator(2)] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="not a multiple of the provided microbatch size"):
        list(b.make_microbatch_iterator(3))
    assert b.chunk(1, 2)["row"].tolist() == [2, 3]
    joined = BatchedDataDict.from_batches(
        [
            b.slice(0, 2),
            BatchedDataDict(
                input_ids=torch.ones(2, 6, dtype=torch.long),
                input_lengths=torch.tensor([6, 6]),
                row=torch.tensor([8, 9]),
                tag=["x", "y"],
            ),
        ],
        pad_value_dict={"input_ids": -1},
    )
    assert joined["input_ids"].shape == (4, 6) and joined["input_ids"][0, 4:].tolist() == [-1, -1]
    assert b.to("cpu") is b and b.size == 4
    shards, _order = b.shard_by_batch_size(
        2,
        batch_size=4,
        dynamic_batching_args={
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "sequence_length_round": 1,
            "max_tokens_per_microbatch": 8,
        },
    )
    gb = shards[0].get_batch(0, batch_size=2)
    assert gb.micro_batch_indices == [shards[0].micro_batch_indices[0]]
    assert gb.get_microbatch_iterator_dynamic_shapes_len() == len(shards[0].micro_batch_indices[0])


@pytest.mark.parametrize("rows, shards", [(3, 2), (7, 4), (11, 2), (1, 3)])
def test_inference_packing_accepts_any_batch_size(rows, shards):
    b = _batch([8] * rows)
    out, order = b.shard_by_batch_size(
        shards,
        allow_uneven_shards=True,
        sequence_packing_args={
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "max_tokens_per_microbatch": 8,
            "algorithm": "modified_first_fit_decreasing",
        },
    )
    assert sorted(order) == list(range(rows)) and sum(s.size for s in out) == rows


@pytest.mark.parametrize("algorithm", [a.value for a in PackingAlgorithm])
def test_packing_gives_an_overlong_row_its_own_bin(algorithm):
    # the packer refuses a row over the budget (NeMo RL's contract); the Policy's sharding runs it alone instead.
    # Rows 1 (length 20) and 4 (length 17) exceed 16 tokens; the other four (14 tokens in all) fit one bin, so
    # there are 3 bins before the multiple-of-shards rule, which makes 4 by splitting the shared bin.
    lengths = [4, 20, 5, 3, 17, 2]
    out, order = _batch(lengths).shard_by_batch_size(
        2,
        sequence_packing_args={
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "max_tokens_per_microbatch": 16,
            "algorithm": algorithm,
        },
    )
    assert sorted(order) == list(range(6))
    bins = [[int(r) for r in s["row"][lo:hi]] for s in out for lo, hi in s.micro_batch_indices[0]]
    assert len(bins) == 4 and [1] in bins and [4] in bins
    assert all(sum(lengths[i] for i in b) <= 16 for b in bins if b not in ([1], [4]))

"""swap_weights_via_reshard between two Policies on different workers of one cluster (NeMo RL's training Policy
and generation-side Policy): after it, the receiver's weights, as its own save_checkpoint writes them, are
bit-identical to the sender's, and its logprobs equal a single-process Hugging Face forward of the sender's saved
weights; across rank counts (2 -> 1, 1 -> 2), through fp32 master weights, and from a plain collective broadcast.
Misuse (shared workers, wrong side, no group, unknown backend) is refused before any rank waits."""

from __future__ import annotations

import socket

import pytest
import torch
import transformers
from helpers import TEXTS, hf_logprobs, make_batch, saved_weights, sft_batch

import dask_lm

pytestmark = pytest.mark.cluster


def _cfg(model_dir, precision="float32", train=True):
    cfg = {
        "model_name": model_dir,
        "precision": precision,
        "train_global_batch_size": 4,
        "train_micro_batch_size": 2,
        "max_total_sequence_length": 128,
    }
    if train:
        cfg["optimizer"] = {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2}}
    return cfg


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_identical(got, want):
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), f"{name} differs"


@pytest.fixture(scope="module")
def three():
    """A CPU cluster of three worker processes (names 0, 1, 2)."""
    c = dask_lm.connect(n_workers=3, cluster="cpu")
    yield c
    c.close()
    c.cluster.close()


@pytest.fixture(scope="module")
def tok(tiny):
    return transformers.AutoTokenizer.from_pretrained(tiny["llama"])


def _batch(tok):
    ids, lens = make_batch(tok, TEXTS[4:8])
    return dask_lm.BatchedDataDict(input_ids=ids, input_lengths=lens)


def _swap(src, dst, backend="gloo"):
    port, world = _free_port(), src.data_parallel_size + dst.data_parallel_size
    a = src.init_collective_mcore_generation("127.0.0.1", port, world, rank_offset=0, refit_backend=backend)
    b = dst.init_collective_mcore_generation(
        "127.0.0.1", port, world, rank_offset=src.data_parallel_size, refit_backend=backend
    )
    assert src.client.gather(a + b) == [True] * world
    moved = src.swap_weights_via_reshard(is_source=True) + dst.swap_weights_via_reshard(is_source=False)
    assert src.client.gather(moved) == [True] * world


def test_two_ranks_to_one_equal_weights_and_logprobs(three, tiny, tok, tmp_path):
    src = dask_lm.Policy(three, _cfg(tiny["llama"]), tok, workers=[0, 1])
    dst = dask_lm.Policy(three, _cfg(tiny["llama"], train=False), tok, workers=[2], init_optimizer=False)
    try:
        src.train(sft_batch(tok, TEXTS[:4]), dask_lm.NLLLoss())
        data = _batch(tok)
        before = dst.get_logprobs(data)["logprobs"]
        _swap(src, dst)
        want = saved_weights(src, tmp_path / "src")
        _assert_identical(saved_weights(dst, tmp_path / "dst"), want)
        got = dst.get_logprobs(data)["logprobs"]
        ref, _logits = hf_logprobs(str(tmp_path / "src"), data["input_ids"], data["input_lengths"])
        assert (before - ref).abs().max() > 1e-3  # the step moved the weights: the swap had something to carry
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)
        torch.testing.assert_close(got, src.get_logprobs(data)["logprobs"], atol=2e-5, rtol=0)
        # the reference weights stay as loaded
        torch.testing.assert_close(
            dst.get_reference_policy_logprobs(data)["reference_logprobs"], before, atol=2e-5, rtol=0
        )
    finally:
        src.shutdown()
        dst.shutdown()


def test_one_bf16_rank_to_two_through_master_weights(three, tiny, tok, tmp_path):
    # the sender keeps fp32 masters beside its bf16 weights (one rank), the receiver fp32 FSDP shards: what moves
    # is the fp32 masters, so the two checkpoints (fp32 masters, both) are bit-identical
    src = dask_lm.Policy(three, _cfg(tiny["llama"], "bfloat16"), tok, workers=[2])
    dst = dask_lm.Policy(three, _cfg(tiny["llama"], "bfloat16"), tok, workers=[0, 1])
    try:
        src.train(sft_batch(tok, TEXTS[:4]), dask_lm.NLLLoss())
        data = _batch(tok)
        before = dst.get_logprobs(data)["logprobs"]
        _swap(src, dst)
        want = saved_weights(src, tmp_path / "src")
        assert next(iter(want.values())).dtype == torch.float32
        _assert_identical(saved_weights(dst, tmp_path / "dst"), want)
        # the receiver's forwards use the new shards (bf16 forwards over 1 and 2 ranks: close, not equal)
        ref = src.get_logprobs(data)["logprobs"]
        gap_before = (before - ref).abs().max().item()
        gap = (dst.get_logprobs(data)["logprobs"] - ref).abs().max().item()
        assert gap < 2e-2 and gap < gap_before / 10, (gap, gap_before)
    finally:
        src.shutdown()
        dst.shutdown()


def test_receiver_takes_a_collective_broadcast_and_misuse_is_refused(three, tiny, tok, tmp_path):
    src = dask_lm.Policy(three, _cfg(tiny["llama"]), tok, workers=[0, 1])
    dst = dask_lm.Policy(three, _cfg(tiny["llama"], train=False), tok, workers=[2], init_optimizer=False)
    try:
        with pytest.raises(ValueError, match="needs init_collective_mcore_generation"):
            dst.swap_weights_via_reshard(is_source=False)
        with pytest.raises(ValueError, match=r"'gloo' or 'nccl'.*NVSHMEM"):
            src.init_collective_mcore_generation("127.0.0.1", 1, 3, rank_offset=0, refit_backend="nvshmem")
        with pytest.raises(ValueError, match="needs GPU ranks"):
            src.init_collective_mcore_generation("127.0.0.1", 1, 3, rank_offset=0, refit_backend="nccl")
        with pytest.raises(ValueError, match="rank_offset is world_size - 1 = 2"):
            dst.init_collective_mcore_generation("127.0.0.1", 1, 3, rank_offset=1)
        src.train(sft_batch(tok, TEXTS[:4]), dask_lm.NLLLoss())
        port = _free_port()
        a = src.init_collective_mcore_generation("127.0.0.1", port, 3, rank_offset=0)
        b = dst.init_collective_mcore_generation("127.0.0.1", port, 3, rank_offset=2)
        src.client.gather(a + b)
        with pytest.raises(ValueError, match="as the receiving side"):
            dst.swap_weights_via_reshard(is_source=True)
        with pytest.raises(ValueError, match="as the sending side"):
            src.swap_weights_via_reshard(is_source=False)
        sent = src.broadcast_weights_for_collective(buffer_size_bytes=64 * 1024)
        got = dst.swap_weights_via_reshard(is_source=False)
        src.client.gather(sent + got)
        _assert_identical(saved_weights(dst, tmp_path / "dst"), saved_weights(src, tmp_path / "src"))
        # a third Policy on a worker that is already a member of this group is refused before any rank waits
        third = dask_lm.Policy(three, _cfg(tiny["llama"], train=False), tok, workers=[1], init_optimizer=False)
        try:
            with pytest.raises(ValueError, match=r"workers \[1\] already hold a member"):
                third.init_collective_mcore_generation("127.0.0.1", port, 3, rank_offset=2)
        finally:
            third.shutdown()
    finally:
        src.shutdown()
        dst.shutdown()


def test_workers_argument_is_checked(three, tiny, tok):
    with pytest.raises(ValueError, match="not both"):
        dask_lm.Policy(three, _cfg(tiny["llama"]), tok, workers=[0], workers_per_node=1)
    with pytest.raises(ValueError, match="distinct worker names"):
        dask_lm.Policy(three, _cfg(tiny["llama"]), tok, workers=[0, 0])
    with pytest.raises(ValueError, match=r"workers \[7\] are not in the cluster"):
        dask_lm.Policy(three, _cfg(tiny["llama"]), tok, workers=[7])

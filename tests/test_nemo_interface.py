"""The Policy interface as NeMo RL's own code uses it, written by us (CI cannot fetch NeMo RL).

Sources (NVIDIA-NeMo/RL @7ea279a), each restated here, not imported:
- NeMo RL's DTensor workers call a loss by keyword, ``loss_fn(data=mb, global_valid_seqs=...,
  global_valid_toks=..., **loss_input)`` (``nemo_rl/models/policy/workers/dtensor_policy_worker.py:927-932``,
  ``nemo_rl/models/automodel/train.py:646-651``), and declare their losses input first:
  ``__call__(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks)``
  (``nemo_rl/algorithms/loss/loss_functions.py:374-379``; ``logits`` first for a LOGIT loss, 919-924).
- ``Policy.sharding_annotations`` is ``NamedSharding(arange(world).reshape(pp, -1, cp, tp), ["pipeline_parallel",
  "data_parallel", "context_parallel", "tensor_parallel"])`` (``nemo_rl/models/policy/lm_policy.py:242-255``); the
  loops read ``get_axis_size("data_parallel")`` (``nemo_rl/algorithms/dpo.py:328``, ``sft.py:321``).
- ``train()`` leaves ``theoretical_tflops`` out when it cannot compute it (``lm_policy.py:839-845``); the loops
  test the key and divide by it (``sft.py:614-629``, ``dpo.py:758-773``, ``distillation.py:1097-1114``).
- ``Policy.flops_tracker`` is set in the constructor, None when the model has no FLOP formula
  (``lm_policy.py:331-337``); ``train()`` resets it and tracks the call's rows (``lm_policy.py:786-790``), and its
  ``total_flops`` is the result's ``total_flops`` (``lm_policy.py:835``).

References are independent: a single-process Hugging Face SGD step (``helpers.hf_nll_steps``) and the FLOP count
of a dense decoder written out from the model's config.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from helpers import TEXTS, hf_nll_steps, model_logprobs, sft_batch

import dask_lm

pytestmark = pytest.mark.cluster

CORPUS = TEXTS + ["Tokens flow through the cluster.", "Every rank runs the same steps.", "Short one."]
NEMO_AXES = ["pipeline_parallel", "data_parallel", "context_parallel", "tensor_parallel"]


def _cfg(model_dir, **extra):
    cfg = {
        "model_name": model_dir,
        "precision": "float32",
        "train_global_batch_size": 8,
        "train_micro_batch_size": 2,
        "logprob_batch_size": 2,
        "max_total_sequence_length": 128,
        "max_grad_norm": 1.0,
        "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}},
    }
    cfg.update(extra)
    return cfg


@pytest.fixture(scope="module")
def tok(tiny):
    return transformers.AutoTokenizer.from_pretrained(tiny["llama"])


@pytest.fixture(scope="module")
def batch(tok):
    return sft_batch(tok, CORPUS)


# ------------------------------------------------------------------------------------------ losses, NeMo RL's way
class NeMoStyleNLL(dask_lm.LossFunction):
    """An NLL loss written exactly as NeMo RL writes one: a subclass of the protocol, input first in ``__call__``,
    normalised by the global valid token count, metrics as Python numbers."""

    loss_type = dask_lm.LossType.TOKEN_LEVEL
    input_type = dask_lm.LossInputType.LOGPROB

    def __call__(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks):
        mask = data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)
        loss = -dask_lm.masked_mean(next_token_logprobs, mask, global_normalization_factor=global_valid_toks)
        return loss, {"loss": loss.item(), "num_valid_samples": data["sample_mask"].sum().item()}


class NeMoStyleLogitNLL:
    """The same NLL from the logits (``input_type`` LOGIT: ``logits`` first, as NeMo RL's ``PreferenceLossFn``),
    and no protocol base: plain duck typing."""

    loss_type = dask_lm.LossType.TOKEN_LEVEL
    input_type = dask_lm.LossInputType.LOGIT

    def __call__(self, logits, data, global_valid_seqs, global_valid_toks):
        ids = data["input_ids"]
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        mask = data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)
        loss = -(lp * mask).sum() / global_valid_toks
        return loss, {"loss": loss.item(), "num_valid_samples": data["sample_mask"].sum().item()}


class KeywordsOnly(NeMoStyleNLL):
    """Takes keywords only, and only the four NeMo RL passes for a LOGPROB loss: a positional call fails."""

    def __call__(self, **kwargs):
        names = sorted(kwargs)
        assert names == ["data", "global_valid_seqs", "global_valid_toks", "next_token_logprobs"], names
        return super().__call__(
            kwargs["next_token_logprobs"], kwargs["data"], kwargs["global_valid_seqs"], kwargs["global_valid_toks"]
        )


@pytest.mark.parametrize("loss_cls", [NeMoStyleNLL, NeMoStyleLogitNLL, KeywordsOnly])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_loss_written_as_nemo_rl_writes_one_trains_like_one_process(client, tiny, tok, batch, loss_cls, packed):
    """Loss, pre-clip gradient norm and the weights after one clipped SGD step on 2 ranks equal one Hugging Face
    process, for a loss that lists its input first and is called by keyword (4 micro-batches per rank)."""
    ref_losses, ref_norms, ref_model = hf_nll_steps(
        tiny["llama"],
        [(batch["input_ids"], batch["input_lengths"], batch["token_mask"], batch["sample_mask"])],
        lr=0.5,
        max_grad_norm=1.0,
    )
    extra = {"sequence_packing": {"enabled": True, "train_mb_tokens": 64, "logprob_mb_tokens": 64}} if packed else {}
    with dask_lm.Policy(client, _cfg(tiny["llama"], **extra), tok) as policy:
        out = policy.train(batch, loss_cls())
        after = policy.get_logprobs(batch)["logprobs"]
    assert float(out["loss"][0]) == pytest.approx(ref_losses[0], abs=1e-5)
    assert float(out["grad_norm"][0]) == pytest.approx(ref_norms[0], rel=1e-5)
    torch.testing.assert_close(
        after, model_logprobs(ref_model, batch["input_ids"], batch["input_lengths"]), atol=1e-4, rtol=0
    )
    assert sum(out["all_mb_metrics"]["num_valid_samples"]) == pytest.approx(len(CORPUS))


def test_the_loss_contract_is_declared_on_the_protocol():
    """The optional attributes the trainer reads have their defaults on LossFunction; a NeMo RL-style subclass
    inherits them, a duck-typed loss gets them through loss_attribute."""
    from dask_lm.losses.base import loss_attribute

    assert NeMoStyleNLL.required_keys == () and NeMoStyleNLL.requires_pairs is False
    assert loss_attribute(NeMoStyleLogitNLL(), "reference_policy_kl_penalty") == 0.0
    assert loss_attribute(dask_lm.DPOLossFn(), "requires_pairs") is True
    with pytest.raises(AssertionError, match="not an attribute of the LossFunction contract"):
        loss_attribute(NeMoStyleNLL(), "no_such_attribute")


# ------------------------------------------------------------------------------------------ Policy attributes
@pytest.fixture(scope="module")
def policy(client, tiny, tok):
    with dask_lm.Policy(client, _cfg(tiny["llama"]), tok) as p:
        yield p


@pytest.mark.parametrize("ranks", [1, 2])
def test_sharding_annotations_are_nemo_rl_axes(client, tiny, tok, ranks):
    with dask_lm.Policy(client, _cfg(tiny["llama"], optimizer=None), tok, workers_per_node=ranks) as policy:
        s = policy.sharding_annotations
        assert s.get_axis_size("data_parallel") == ranks == policy.data_parallel_size
        assert s.names == NEMO_AXES
        assert s.shape == {"pipeline_parallel": 1, "data_parallel": ranks, "context_parallel": 1, "tensor_parallel": 1}
        np.testing.assert_array_equal(s.layout, np.arange(ranks).reshape(1, -1, 1, 1))
        assert [s.get_worker_coords(r)["data_parallel"] for r in range(ranks)] == list(range(ranks))
        with pytest.raises(ValueError, match="no axis named 'dp'"):
            s.get_axis_size("dp")


def test_dpo_partial_batch_padding_uses_the_data_parallel_size(policy, batch):
    """NeMo RL pads a partial validation batch to a multiple of dp x micro-batch (dpo.py:328-334); the padded
    batch then shards evenly over the ranks."""
    dp = policy.sharding_annotations.get_axis_size("data_parallel")
    rows = batch.slice(0, 7)
    multiple = dp * 2
    pad = -rows.size % multiple
    padded = dask_lm.BatchedDataDict(
        {k: torch.cat([v, v[-1:].repeat(pad, *[1] * (v.dim() - 1))]) for k, v in rows.items()}
    )
    padded["sample_mask"][rows.size :] = 0
    out = policy.train(padded, dask_lm.NLLLoss(), eval_mode=True, gbs=padded.size, mbs=2)
    assert padded.size % multiple == 0 and sum(out["all_mb_metrics"]["num_valid_samples"]) == 7


def _training_flops(config, lengths):
    """3 x the forward FLOPs of a dense gated-MLP decoder (2 per multiply-add, causal attention as half the score
    matrix, the real length of each row): the Megatron convention, written out from the config."""
    h, n_layers, f, vocab = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    total = 0.0
    for s in lengths:
        s = int(s)
        projections = s * (h * q + 2 * h * kv + q * h + 3 * h * f)  # q, k, v, o and the gated MLP's 3 matrices
        scores = s * s * q  # QK^T and (scores)V under a causal mask: 2 x s^2 q / 2 multiply-adds
        total += 3 * 2 * (n_layers * (projections + scores) + s * h * vocab)
    return total


def test_flops_tracker_counts_each_train_call(policy, tiny, batch):
    config = transformers.AutoConfig.from_pretrained(tiny["llama"])
    expected = _training_flops(config, batch["input_lengths"].tolist())
    tracker = policy.flops_tracker
    assert tracker is not None  # llama has a formula
    first = policy.train(batch, dask_lm.NLLLoss())
    assert first["total_flops"] == pytest.approx(expected, rel=1e-9)
    assert tracker.total_flops == pytest.approx(expected, rel=1e-9)
    half = batch.slice(0, 4)
    second = policy.train(half, dask_lm.NLLLoss(), gbs=4)
    # reset per call, as NeMo RL's train() resets it: the second call's rows only
    assert (
        tracker.total_flops
        == second["total_flops"]
        == pytest.approx(_training_flops(config, half["input_lengths"].tolist()), rel=1e-9)
    )
    assert isinstance(second["num_ranks"], int) and second["num_ranks"] == 2


def test_flop_tracker_takes_nemo_rl_from_config_form(tiny):
    """``FLOPTracker.from_config(model_name, hf_config)`` as NeMo RL's tests and lm_policy.py:333-335 call it,
    then ``track_batch`` / ``track`` / ``reset`` (nemo_rl/utils/flops_tracker.py)."""
    config = transformers.AutoConfig.from_pretrained(tiny["llama"])
    tracker = dask_lm.FLOPTracker.from_config(tiny["llama"], config)
    tracker.track_batch([5, 9])
    assert tracker.total_flops == pytest.approx(_training_flops(config, [5, 9]), rel=1e-9)
    tracker.reset()
    tracker.track(3, 7)  # 3 sequences of 7 tokens
    assert tracker.total_flops == pytest.approx(_training_flops(config, [7, 7, 7]), rel=1e-9)


def test_theoretical_tflops_absent_on_cpu_and_nemo_rl_division_runs(policy, batch):
    out = policy.train(batch, dask_lm.NLLLoss())
    assert "theoretical_tflops" not in out and "mfu" not in out  # CPU ranks: no device peak
    # NeMo RL's step summary (sft.py:614-629), restated: the key's presence decides, then it divides
    timing = {"policy_training": out["train_elapsed_seconds"]}
    metrics = {}
    if "total_flops" in out:
        total_tflops = out["total_flops"] / timing["policy_training"] / 1e12
        per_rank = total_tflops / out["num_ranks"]
        if "theoretical_tflops" in out:
            metrics["train_fp_utilization"] = total_tflops / out["theoretical_tflops"]
        assert per_rank > 0
    assert metrics == {}

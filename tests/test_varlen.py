"""The varlen path for packed micro-batches, on the CPU: Hugging Face must hand our registered attention function
the packed sequence boundaries, build no [T, T] mask, and leave the model's own implementation in place after.
The flash kernel itself needs a GPU (tests/test_gpu.py); here a per-sequence SDPA stands in for it, so what is
checked is the plumbing around the kernel against an unpacked Hugging Face forward of each row."""

from __future__ import annotations

import pytest
import torch
import transformers

from dask_lm.data.messages import MicroBatchPlan
from dask_lm.data.tokens import TokenRows
from dask_lm.model import varlen
from dask_lm.model.forward import final_hidden_states


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, enable_gqa=False, window_size=(-1, -1)):
    """What varlen_attn computes, one sequence at a time: causal SDPA over [cu[i], cu[i+1])."""
    assert window_size == (-1, 0), "packed rows need causal attention"
    out = torch.empty_like(q)
    for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))  # [heads, len, dim]
        out[s:e] = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=enable_gqa
        ).transpose(0, 1)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_forward_through_the_registered_varlen_function_matches_unpacked_rows(tiny, family, monkeypatch):
    monkeypatch.setattr(varlen, "_varlen_attn", lambda: _reference_varlen)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny[family], dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    lengths = torch.tensor([7, 1, 12, 4])
    ids = torch.randint(3, 300, (4, 12))
    pids, pos, cu = TokenRows.from_padded(ids, lengths).packed()
    calls = []
    original = varlen._attention

    def counting(*args, **kwargs):
        calls.append(kwargs.get("cu_seq_lens_q"))
        assert args[4] is None  # attention_mask: no [T, T] tensor was built
        return original(*args, **kwargs)

    monkeypatch.setattr(varlen, "_attention", counting)
    varlen._REGISTERED = False  # register the counting wrapper
    with torch.no_grad(), varlen.packed_attention(model):
        packed = final_hidden_states(model, pids, position_ids=pos, **varlen.packed_kwargs(cu, int(lengths.max())))
    assert model.config._attn_implementation == "sdpa"  # restored for plain forwards and generation
    assert len(calls) == model.config.num_hidden_layers and all(torch.equal(c, cu) for c in calls)
    with torch.no_grad():
        for b, n in enumerate(lengths.tolist()):
            alone = final_hidden_states(model, ids[b : b + 1, :n])
            torch.testing.assert_close(packed[0, int(cu[b]) : int(cu[b]) + n], alone[0], atol=1e-5, rtol=1e-5)
    varlen._REGISTERED = False


def test_varlen_is_not_used_on_the_cpu():
    assert not varlen.available(torch.bfloat16) and not varlen.available(torch.float32)


def test_a_kernel_without_a_gqa_switch_gets_repeated_key_value_heads(tiny, monkeypatch):
    """torch 2.11's varlen_attn has neither ``enable_gqa`` nor ``window_size``: key/value heads are repeated and
    causality is asked for with ``is_causal``."""

    def old_kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, scale=None):
        assert is_causal and k.shape[1] == q.shape[1]
        return _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0))

    monkeypatch.setattr(varlen, "_varlen_attn", lambda: old_kernel)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny["qwen2"], dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # the tiny qwen2 uses GQA
    lengths = torch.tensor([5, 9])
    ids = torch.randint(3, 300, (2, 9))
    pids, pos, cu = TokenRows.from_padded(ids, lengths).packed()
    varlen._REGISTERED = False
    with torch.no_grad(), varlen.packed_attention(model):
        packed = final_hidden_states(model, pids, position_ids=pos, **varlen.packed_kwargs(cu, int(lengths.max())))
    with torch.no_grad():
        for b, n in enumerate(lengths.tolist()):
            alone = final_hidden_states(model, ids[b : b + 1, :n])
            torch.testing.assert_close(packed[0, int(cu[b]) : int(cu[b]) + n], alone[0], atol=1e-5, rtol=1e-5)
    varlen._REGISTERED = False


def test_packed_forwards_in_two_threads_take_turns(tiny, monkeypatch):
    """The implementation switch is model state: a second thread's packed forward waits for the first to end
    instead of having ``sdpa`` restored under its remaining layers (which would attend across sequences)."""
    import threading

    monkeypatch.setattr(varlen, "_varlen_attn", lambda: _reference_varlen)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny["llama"], dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    entered, go = threading.Event(), threading.Event()
    order = []

    def first():
        with varlen.packed_attention(model):
            order.append("first in")
            entered.set()
            go.wait(30)
            order.append("first out")

    def second():
        entered.wait(30)
        with varlen.packed_attention(model):
            order.append("second in")
            assert model.config._attn_implementation == varlen.NAME

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    entered.wait(30)
    threads[1].join(0.3)  # the second is blocked while the first holds the switch
    assert threads[1].is_alive()
    go.set()
    for t in threads:
        t.join(30)
    assert order == ["first in", "first out", "second in"]
    assert model.config._attn_implementation == "sdpa"


def test_packed_training_with_activation_checkpointing_recomputes_through_varlen(tiny, monkeypatch):
    """Activation checkpointing recomputes each layer in the backward, where Hugging Face looks the attention
    implementation up again: the packed step must give the gradients of the same step without checkpointing
    (under sdpa, the recomputed layers would attend across the packed sequences)."""
    from helpers import TEXTS, sft_batch

    import dask_lm
    from dask_lm.config import PolicyConfig
    from dask_lm.workers.policy_worker import PolicyWorker
    from dask_lm.workers.rank_model import RankPlace

    monkeypatch.setattr(varlen, "_varlen_attn", lambda: _reference_varlen)
    monkeypatch.setattr(varlen, "available", lambda dtype: True)
    monkeypatch.setattr(varlen, "_REGISTERED", False)
    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    batch = sft_batch(tok, TEXTS[:4])
    shards, _ = batch.shard_by_batch_size(
        1,
        batch_size=4,
        sequence_packing_args={
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "max_tokens_per_microbatch": 64,
            "algorithm": "modified_first_fit_decreasing",
            "sequence_length_pad_multiple": 1,
            "microbatch_order": "packer",
        },
    )
    plan = MicroBatchPlan(micro_batch_indices=shards[0].micro_batch_indices, packed=True)
    weights = []
    for checkpointing in (False, True):
        cfg = PolicyConfig.from_dict(
            {
                "model_name": tiny["llama"],
                "precision": "float32",
                "train_global_batch_size": 4,
                "train_micro_batch_size": 2,
                "sequence_packing": {"enabled": True, "train_mb_tokens": 64},
                "dtensor_cfg": {"activation_checkpointing": checkpointing},
                "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}},
            }
        )
        worker = PolicyWorker(cfg, RankPlace(0, 1), pad_token_id=0, init_optimizer=True, init_reference_model=False)
        assert worker.rank_model.varlen and worker.model.is_gradient_checkpointing == checkpointing
        worker.trainer.train(shards[0], plan, dask_lm.NLLLoss(), eval_mode=False, gbs=4, mbs=2, num_global_batches=1)
        weights.append({n: p.detach().clone() for n, p in worker.model.named_parameters()})
        assert worker.model.config._attn_implementation == "sdpa"  # restored after the step
    for name, w in weights[0].items():
        torch.testing.assert_close(weights[1][name], w, atol=1e-5, rtol=1e-5, msg=name)

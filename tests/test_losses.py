"""Losses against closed forms and hand-made tensors; the chunked training inputs against full logits."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import transformers

import dask_lm
from dask_lm.config import PolicyConfig
from dask_lm.data.tokens import TokenRows
from dask_lm.losses import calculate_kl, masked_mean, prepare_loss_input
from dask_lm.losses.base import LossConfigError
from dask_lm.model.inference import forward_rows
from dask_lm.model.loss_inputs import loss_inputs_from_hidden


def _pg_data(curr, prev, gen, ref, adv, token_mask=None, sample_mask=None):
    """[B, S-1] values placed at positions 1.. of [B, S] tensors, as get_logprobs returns them."""

    def full(x):
        return torch.cat([torch.zeros(x.shape[0], 1), x], dim=1)

    b, s1 = curr.shape
    return {
        "prev_logprobs": full(prev),
        "generation_logprobs": full(gen),
        "reference_policy_logprobs": full(ref),
        "advantages": full(adv),
        "token_mask": token_mask if token_mask is not None else torch.cat([torch.zeros(b, 1), torch.ones(b, s1)], 1),
        "sample_mask": sample_mask if sample_mask is not None else torch.ones(b),
    }


def test_clipped_pg_on_policy_is_minus_mean_advantage_with_its_gradient():
    g = torch.Generator().manual_seed(0)
    curr = (-torch.rand(3, 5, generator=g) * 3).requires_grad_()
    adv = torch.randn(3, 5, generator=g)
    tm = (torch.rand(3, 6, generator=g) > 0.3).float()
    sm = torch.tensor([1.0, 0.0, 1.0])
    data = _pg_data(curr.detach(), curr.detach(), curr.detach(), curr.detach(), adv, tm, sm)
    mask = tm[:, 1:] * sm[:, None]
    n = mask.sum()
    loss, metrics = dask_lm.ClippedPGLossFn({"reference_policy_kl_penalty": 0.2})(
        data, torch.tensor(float(n)), torch.tensor(float(n)), next_token_logprobs=curr
    )
    assert loss.item() == pytest.approx(-float((adv * mask).sum() / n), abs=1e-6)
    assert metrics["kl_penalty"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["probs_ratio"] == pytest.approx(1.0, abs=1e-6)
    loss.backward()
    # d/dc of -A exp(c - p) at c = p is -A; the k3 KL has zero gradient at the reference
    torch.testing.assert_close(curr.grad, -adv * mask / n, atol=1e-6, rtol=0)


def test_clipping_and_dual_clip_by_hand():
    prev = torch.zeros(1, 4)
    curr = torch.log(torch.tensor([[1.5, 0.5, 1.5, 5.0]]))  # ratios
    adv = torch.tensor([[1.0, -1.0, -1.0, -2.0]])
    data = _pg_data(curr, prev, prev, prev, adv)
    cfg = {"reference_policy_kl_penalty": 0.0, "ratio_clip_min": 0.2, "ratio_clip_max": 0.3}
    loss, m = dask_lm.ClippedPGLossFn(cfg)(data, torch.tensor(1.0), torch.tensor(4.0), next_token_logprobs=curr)
    # per token max(-A r, -A clip(r)): A>0 r=1.5 -> -1.3 (clipped above); A<0 r=0.5 -> 0.8 (clipped below);
    # A<0 r=1.5 -> 1.5 (pessimistic, unclipped); A=-2 r=5 -> 10
    assert float(loss) == pytest.approx((-1.3 + 0.8 + 1.5 + 10.0) / 4, abs=1e-5)
    assert m["probs_ratio_clamped_max"] == pytest.approx(1.3) and m["probs_ratio_max"] == pytest.approx(5.0)
    dual, _ = dask_lm.ClippedPGLossFn({**cfg, "ratio_clip_c": 3.0})(
        data, torch.tensor(1.0), torch.tensor(4.0), next_token_logprobs=curr
    )
    # the dual clip caps negative-advantage tokens at -A * c: 10 -> 6
    assert float(dual) == pytest.approx((-1.3 + 0.8 + 1.5 + 6.0) / 4, abs=1e-5)


def test_k3_kl_and_clamps_by_hand():
    lp = torch.tensor([-1.0, -1.0, -1.0])
    ref = torch.tensor([-0.5, -40.0, 30.0])
    kl = calculate_kl(lp, ref, "k3", input_clamp_value=20.0, output_clamp_value=10.0)
    r = torch.tensor([0.5, -20.0, 20.0])  # ref - lp, input-clamped
    expected = (torch.exp(r) - 1 - r).clamp(-10, 10)
    torch.testing.assert_close(kl, expected)
    assert float(calculate_kl(lp, ref, "k1", None, None)[0]) == pytest.approx(-0.5)
    assert float(calculate_kl(lp, ref, "k2", None, None)[0]) == pytest.approx(0.125)
    with pytest.raises(ValueError, match="kl_type"):
        calculate_kl(lp, ref, "k4")


def test_dpo_at_the_reference_is_log2_and_sft_term():
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.1, -4.0]])
    data = {
        "token_mask": torch.tensor([[0.0, 1, 1, 1], [0, 1, 1, 0]]),
        "sample_mask": torch.ones(2),
        "reference_policy_logprobs": torch.cat([torch.zeros(2, 1), lp], 1),
    }
    loss, m = dask_lm.DPOLossFn()(data, torch.tensor(2.0), torch.tensor(5.0), next_token_logprobs=lp)
    assert float(loss) == pytest.approx(math.log(2), abs=1e-6)
    assert m["accuracy"] == 0.0 and m["num_valid_samples"] == 1.0
    both, m = dask_lm.DPOLossFn({"sft_loss_weight": 0.5})(
        data, torch.tensor(2.0), torch.tensor(5.0), next_token_logprobs=lp
    )
    assert m["sft_loss"] == pytest.approx(3.5)  # -sum of the chosen row's masked logprobs, over 1 pair
    assert float(both) == pytest.approx(math.log(2) + 0.5 * 3.5, abs=1e-6)


def test_distillation_of_identical_distributions_is_zero():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 11, generator=g)
    top = torch.topk(logits, 4, dim=-1)
    data = {
        "input_ids": torch.zeros(2, 5, dtype=torch.long),
        "token_mask": torch.ones(2, 5),
        "sample_mask": torch.ones(2),
        "teacher_topk_logits": top.values,
        "teacher_topk_indices": top.indices,
    }
    for kl in ("forward", "reverse", "mixed"):
        fn = dask_lm.DistillationLossFn({"kl_type": kl})
        inputs, _ = prepare_loss_input(logits, data, fn)
        loss, _ = fn(data, torch.tensor(2.0), torch.tensor(8.0), **inputs)
        assert abs(float(loss)) < 1e-6, kl


def test_masked_mean_and_configs():
    assert float(masked_mean(torch.ones(3), torch.zeros(3))) == 0.0
    assert float(
        masked_mean(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 1.0]), global_normalization_factor=4)
    ) == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"'ratio_clip_mn' \(did you mean 'ratio_clip_min'\?\)"):
        dask_lm.ClippedPGLossFn({"ratio_clip_mn": 0.1})
    with pytest.raises(ValueError, match="use_cispo is incompatible with dual clipping"):
        dask_lm.ClippedPGLossFn({"use_cispo": True, "ratio_clip_c": 3.0})
    with pytest.raises(LossConfigError, match="ratio_min must be <="):
        dask_lm.ClippedPGLossFn(
            {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "tis",
                "truncated_importance_sampling_ratio": 1.0,
                "truncated_importance_sampling_ratio_min": 2.0,
            }
        )
    cfg = dask_lm.ClippedPGLossConfig(reference_policy_kl_penalty=0.0)
    cfg.token_level_loss = False  # configs are mutable, read when the loss is built
    assert dask_lm.ClippedPGLossFn(cfg).loss_type == dask_lm.LossType.SEQUENCE_LEVEL
    assert dask_lm.ClippedPGLossFn(cfg).required_keys == (
        "token_mask",
        "sample_mask",
        "advantages",
        "generation_logprobs",
        "prev_logprobs",
    )
    assert dask_lm.ClippedPGLossFn({"force_on_policy_ratio": True}).required_keys[-1] == "reference_policy_logprobs"


def test_both_calling_conventions_agree():
    lp = torch.tensor([[-1.0, -2.0]])
    data = {"token_mask": torch.ones(1, 3), "sample_mask": torch.ones(1)}
    new, _ = dask_lm.NLLLoss()(data, torch.tensor(1.0), torch.tensor(2.0), next_token_logprobs=lp)
    old, _ = dask_lm.NLLLoss()(lp, data, global_valid_seqs=None, global_valid_toks=torch.tensor(2.0))
    assert float(new) == float(old) == pytest.approx(1.5)
    with pytest.raises(TypeError, match="next_token_logprobs"):
        dask_lm.NLLLoss()(data, torch.tensor(1.0), torch.tensor(2.0))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("loss_name", ["nll", "pg_filtered", "distill_reverse_zero", "distill_forward"])
def test_chunked_training_inputs_equal_full_logits(tiny, packed, loss_name):
    """The trainer's memory-flat inputs (chunks recomputed in backward, packed rows mapped back) give the same loss
    and the same parameter gradients as prepare_loss_input on the full [B, S, V] logits."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny["qwen2"])
    enc = tok(
        ["a short row", "a considerably longer row of several more tokens here", "mid sized row"],
        padding=True,
        return_tensors="pt",
    )
    ids, lens = enc["input_ids"], enc["attention_mask"].sum(1)
    b, s = ids.shape
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny["qwen2"], dtype=torch.float32)
    generation = {"temperature": 0.7, "top_k": 20, "top_p": 0.9} if loss_name == "pg_filtered" else None
    cfg = PolicyConfig.from_dict(
        {"model_name": tiny["qwen2"], "precision": "float32", "logprob_chunk_size": 4, "generation": generation}
    )
    worker = SimpleNamespace(model=model, cfg=cfg, temperature=0.7 if generation else 1.0)
    valid = torch.arange(s)[None] < lens[:, None]
    g = torch.Generator().manual_seed(3)
    data = {
        "input_ids": ids,
        "input_lengths": lens,
        "token_mask": valid.float(),
        "sample_mask": torch.ones(b),
        "advantages": torch.randn(b, s, generator=g),
        "prev_logprobs": -torch.rand(b, s, generator=g),
        "generation_logprobs": -torch.rand(b, s, generator=g),
        "reference_policy_logprobs": -torch.rand(b, s, generator=g),
    }
    with torch.no_grad():
        top = torch.topk(torch.randn(b, s, 64, generator=g), 5, dim=-1)
    data["teacher_topk_logits"], data["teacher_topk_indices"] = top.values, top.indices * 3
    loss_fn = {
        "nll": dask_lm.NLLLoss(),
        "pg_filtered": dask_lm.ClippedPGLossFn({"reference_policy_kl_penalty": 0.1}),
        "distill_reverse_zero": dask_lm.DistillationLossFn({"kl_type": "reverse", "zero_outside_topk": True}),
        "distill_forward": dask_lm.DistillationLossFn({"kl_type": "forward"}),
    }[loss_name]
    gvs, gvt = torch.tensor(float(b)), torch.tensor(float(valid[:, 1:].sum()))

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    # reference: full logits, prepare_loss_input (top-k / top-p as the sampler filtered, unfiltered copy for KL)
    ref_data = dict(data)
    logits = model(ids, attention_mask=valid.long()).logits.float() / worker.temperature
    inputs, ref_data = prepare_loss_input(logits, ref_data, loss_fn, sampling_params=generation)
    ref_loss, _ = loss_fn(ref_data, gvs, gvt, **inputs)
    ref_grads = grads(ref_loss)
    # the training path
    # the rows through the worker's own forward (its host layout; block-diagonal mask when packed)
    hidden, info = forward_rows(
        model, TokenRows.from_padded(ids, lens), packed=packed, varlen_ok=False, where=ids.device
    )
    mb_data = dict(data)
    ours, mb_data = loss_inputs_from_hidden(worker, hidden, info, mb_data, loss_fn), mb_data
    loss, _ = loss_fn(mb_data, gvs, gvt, **ours)
    assert float(loss) == pytest.approx(float(ref_loss), abs=1e-5)
    for name, grad in grads(loss).items():
        torch.testing.assert_close(grad, ref_grads[name], atol=2e-5, rtol=1e-4, msg=name)


def test_metrics_are_numbers_for_callers_and_tensors_inside_the_trainer():
    """A loss called by user code returns Python numbers (NeMo RL's convention); inside the trainer's
    ``deferred_metrics`` the same values stay tensors (read back once per step instead of a host sync each)."""
    from dask_lm.losses.base import deferred_metrics

    lp = -torch.rand(2, 5)
    data = dask_lm.BatchedDataDict(token_mask=torch.ones(2, 6), sample_mask=torch.ones(2))
    _loss, numbers = dask_lm.NLLLoss()(data, torch.tensor(2.0), torch.tensor(10.0), next_token_logprobs=lp)
    with deferred_metrics():
        _, tensors = dask_lm.NLLLoss()(data, torch.tensor(2.0), torch.tensor(10.0), next_token_logprobs=lp)
    assert all(isinstance(v, float) for v in numbers.values())
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in tensors.values())
    assert {k: float(v) for k, v in tensors.items()} == numbers
    assert numbers["loss"] == pytest.approx(float(-(lp.sum() / 10.0)))
    assert numbers["num_unmasked_tokens"] == 10.0 and numbers["num_valid_samples"] == 2.0


def test_metric_values_keep_their_python_type_and_one_element_tensors_become_numbers():
    """Counts from integer masks stay ints when the trainer reads them back (only float metrics are averaged over
    global batches), and a one-element tensor is a number for callers, as ``.item()`` gave before."""
    from dask_lm.losses.base import metric
    from dask_lm.workers.trainer import _to_number

    assert _to_number(torch.tensor(3)) == 3 and isinstance(_to_number(torch.tensor(3)), int)
    assert isinstance(_to_number(torch.tensor(2.5)), float) and _to_number(torch.tensor([1.0, 2.0])) == [1.0, 2.0]
    assert metric(torch.tensor([2.0])) == 2.0 and isinstance(metric(torch.tensor([2.0])), float)


def test_the_fused_optimizer_step_is_chosen_only_where_the_config_leaves_it_open(monkeypatch):
    from dask_lm.config import PolicyConfig
    from dask_lm.model import device
    from dask_lm.workers import optim

    monkeypatch.setattr(device, "fused_optimizer_capable", lambda params: True)  # as on a GPU
    params = [torch.nn.Parameter(torch.zeros(3))]

    def built(name, **kwargs):
        cfg = PolicyConfig.from_dict({"model_name": "m", "optimizer": {"name": name, "kwargs": kwargs}})
        return optim.build_optimizer(params, cfg).defaults

    assert built("torch.optim.AdamW", lr=1e-3)["fused"] is True
    assert built("torch.optim.SGD", lr=1e-3)["fused"] is True
    assert not built("torch.optim.AdamW", lr=1e-3, foreach=True).get("fused")  # the config chose
    assert not built("torch.optim.Adam", lr=1e-3, differentiable=True).get("fused")
    assert "fused" not in built("torch.optim.Adagrad", lr=1e-3) or not built("torch.optim.Adagrad", lr=1e-3)["fused"]

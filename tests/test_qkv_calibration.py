"""calibrate_qkv_fp8_scales against a single-process Hugging Face reference: Q / K / V recomputed from each
layer's input (the projections and RoPE applied here, not read from our attention hook), their largest magnitude
over the real tokens (padding left out), NeMo RL's percentile of the per-forward samples, times the margin, over 448."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import TEXTS, make_batch, qkv_reference_samples

import dask_lm

pytestmark = pytest.mark.cluster


def _nemo_percentile(values, p):
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))]


def _cfg(model_dir):
    return {"model_name": model_dir, "precision": "float32", "max_total_sequence_length": 128}


def _loud_padding_model(tiny, tok, path):
    """The tiny llama where padding is loud in the first layer: the pad token and id 0 (what a rank fills a padded
    tail with) embed along hidden dimension 0 only, which no other token uses, and that layer's Q / K / V
    projections read it 100x louder (RMSNorm would undo a plain scaling of the embedding). Padding counted as
    tokens would set the first layer's scales."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float32)
    pads = [0, tok.pad_token_id]
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[:, 0] = 0
        emb[pads] = 0
        emb[pads, 0] = 1
        att = model.model.layers[0].self_attn
        for proj in (att.q_proj, att.k_proj, att.v_proj):
            proj.weight[:, 0] *= 100
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_scales_match_a_hf_reference_over_two_ranks_and_one(client, tiny, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    tiny = {"llama": _loud_padding_model(tiny, tok, tmp_path / "llama")}
    ids, lens = make_batch(tok, TEXTS[:6])
    data = dask_lm.BatchedDataDict(input_ids=ids, input_lengths=lens)
    assert int(lens.min()) < ids.shape[1]  # padding that must be left out
    # two ranks, percentile 100: the largest magnitude over every real token, however the rows were split
    with dask_lm.Policy(client, _cfg(tiny["llama"]), tok, init_optimizer=False) as policy:
        assert policy.data_parallel_size == 2
        got = policy.calibrate_qkv_fp8_scales(data, micro_batch_size=2, percentile=100, margin=1.05, include_q=True)
    ref = qkv_reference_samples(tiny["llama"], ids, lens, len(TEXTS))
    assert got["format"] == "fp8" and got["percentile"] == 100 and got["margin"] == 1.05
    want = {}
    for i, samples in ref.items():
        want[f"model.layers.{i}.self_attn.attn.q_scale"] = max(samples["q"]) * 1.05 / 448
        want[f"model.layers.{i}.self_attn.k_scale"] = max(samples["k"]) * 1.05 / 448
        want[f"model.layers.{i}.self_attn.v_scale"] = max(samples["v"]) * 1.05 / 448
    assert sorted(got["layers"]) == sorted(want)
    for key, v in want.items():
        assert got["layers"][key] == pytest.approx(v, rel=1e-5), key
    # one rank, two rows per forward, the median of the three samples: NeMo RL's percentile of per-forward amaxes
    with dask_lm.Policy(client, _cfg(tiny["llama"]), tok, init_optimizer=False, workers_per_node=1) as policy:
        got = policy.calibrate_qkv_fp8_scales(data, micro_batch_size=2, percentile=50, margin=1.0)
    ref = qkv_reference_samples(tiny["llama"], ids, lens, 2)
    assert sorted(got["layers"]) == sorted(f"model.layers.{i}.self_attn.{n}_scale" for i in ref for n in "kv")
    for i, samples in ref.items():
        for n in "kv":
            assert len(set(samples[n])) > 1  # the percentile has something to choose between
            assert got["layers"][f"model.layers.{i}.self_attn.{n}_scale"] == pytest.approx(
                _nemo_percentile(samples[n], 50) / 448, rel=1e-5
            ), (i, n)


def test_bad_arguments_are_refused_before_any_work(client, tiny):
    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    ids, lens = make_batch(tok, TEXTS[:2])
    data = dask_lm.BatchedDataDict(input_ids=ids, input_lengths=lens)
    with dask_lm.Policy(client, _cfg(tiny["llama"]), tok, init_optimizer=False, workers_per_node=1) as policy:
        for kwargs, match in [
            ({"percentile": 0}, "percentile"),
            ({"percentile": 101}, "percentile"),
            ({"margin": 0}, "margin"),
            ({"micro_batch_size": 0}, "micro_batch_size"),
        ]:
            with pytest.raises(ValueError, match=match):
                policy.calibrate_qkv_fp8_scales(data, **kwargs)

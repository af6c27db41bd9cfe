"""GPU tier: LocalCUDACluster, NCCL between ranks when there are two GPUs, bf16. Skipped without a GPU.

Tolerances: bf16 has an 8-bit mantissa, so one logit of magnitude ~10 carries an error of ~0.04, and the engine's
batch shapes differ from the reference's (different GEMM tiling). bf16 results are therefore compared with a
single-process bf16 Hugging Face forward on the same GPU at atol 0.1 (max) and 0.01 (mean); float32 on the GPU
matches the CPU float32 reference at atol 1e-3 (TF32 stays off for matmuls by default).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import dask_lm
from dask_lm import BatchedDataDict
from helpers import TEXTS, hf_logprobs, make_batch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_client():
    c = dask_lm.connect(cluster="cuda")
    yield c
    cluster = c.cluster
    c.close()
    cluster.close()


def _hf_bf16_logprobs(model_dir, ids, lens):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda")
    with torch.no_grad():
        logits = model(ids.cuda()).logits.float().cpu()
    del model
    torch.cuda.empty_cache()
    lp = torch.log_softmax(logits, -1)
    out = torch.zeros(ids.shape)
    out[:, 1:] = lp[:, :-1].gather(2, ids[:, 1:, None]).squeeze(2)
    return out * (torch.arange(ids.shape[1])[None, :] < lens[:, None])


@pytest.mark.parametrize("mode", ["plain", "dynamic", "packed"])
def test_bf16_logprobs_on_cuda_cluster(gpu_client, tiny, mode):
    tok = transformers.AutoTokenizer.from_pretrained(tiny["qwen2"])
    ids, lens = make_batch(tok, TEXTS * 3)
    cfg = {"model_name": tiny["qwen2"], "precision": "bfloat16", "logprob_batch_size": 4}
    if mode == "dynamic":
        cfg["dynamic_batching"] = {"enabled": True, "logprob_mb_tokens": 128, "sequence_length_round": 16}
    if mode == "packed":
        cfg["sequence_packing"] = {"enabled": True, "logprob_mb_tokens": 128}
    with dask_lm.Policy(gpu_client, cfg, tok) as policy:
        infos = policy.worker_info
        assert all(i["device"] == "cuda" for i in infos)
        assert len({i["gpu_uuid"] for i in infos}) == len(infos)  # one distinct GPU per rank
        out = policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))["logprobs"]
        ref = policy.get_reference_policy_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))
        assert policy.get_free_memory_bytes() > 0
    expected = _hf_bf16_logprobs(tiny["qwen2"], ids, lens)
    diff = (out - expected).abs()
    print(f"{mode}: ranks={len(infos)} max|diff|={diff.max():.4f} mean|diff|={diff.mean():.5f}")
    assert diff.max() < 0.1 and diff.mean() < 0.01
    assert torch.equal(ref["reference_logprobs"], out)


def test_fp32_on_gpu_matches_cpu_reference_and_topk_and_scores(gpu_client, tiny):
    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    ids, lens = make_batch(tok, TEXTS)
    expected, logits = hf_logprobs(tiny["llama"], ids, lens)
    cfg = {"model_name": tiny["llama"], "precision": "float32", "logprob_batch_size": 2}
    with dask_lm.Policy(gpu_client, cfg, tok) as policy:
        out = policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))["logprobs"]
        tk = policy.get_topk_logits(BatchedDataDict(input_ids=ids, input_lengths=lens), k=3)
    torch.testing.assert_close(out, expected, atol=1e-3, rtol=0)
    valid = (torch.arange(ids.shape[1])[None, :] < lens[:, None])[..., None]
    torch.testing.assert_close(tk["topk_logits"] * valid, logits.topk(3, -1).values * valid, atol=1e-3, rtol=0)
    rm_cfg = {"model_name": tiny["llama_rm"], "precision": "float32", "reward_model_cfg": {"enabled": True}}
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tiny["llama_rm"], dtype=torch.float32)
    model.config.pad_token_id = tok.pad_token_id
    with torch.no_grad():
        want = model(ids, attention_mask=(ids != tok.pad_token_id).long()).logits.squeeze(-1)
    with dask_lm.Policy(gpu_client, rm_cfg, tok, init_reference_model=False) as rm:
        scores = rm.score(BatchedDataDict(input_ids=ids, input_lengths=lens))["scores"]
    torch.testing.assert_close(scores, want, atol=1e-3, rtol=0)

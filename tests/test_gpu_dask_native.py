"""GPU tier for the Dask-native paths (issue 28): ``dask_lm.score`` on a Dask DataFrame and ``Policy.submit`` fed by
a Dask DataFrame, on a LocalCUDACluster in bf16. Skipped without a GPU.

The references are independent: a single-process bf16 Hugging Face forward on the same GPU (tolerances as in
tests/test_gpu.py: atol 0.1 max, 0.01 mean, for bf16's 8-bit mantissa and other GEMM tiling), and the blocking
call on a BatchedDataDict, which plans the same shards and micro-batches from the same lengths and so runs the same
kernels on the same shapes: equal to the last bit.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import TEXTS, make_batch
from test_gpu import _hf_bf16_logprobs, gpu_client  # noqa: F401  (the module's CUDA cluster fixture)

import dask_lm
from dask_lm import BatchedDataDict

pytestmark = [pytest.mark.gpu, pytest.mark.cluster]


def _frame(ids, lens, npartitions, **columns):
    import dask.dataframe as dd
    import pandas as pd
    import pyarrow as pa

    rows = [ids[i, : int(n)].tolist() for i, n in enumerate(lens)]
    data = {"input_ids": pd.Series(rows, dtype=pd.ArrowDtype(pa.list_(pa.int64())))}
    for name, values in columns.items():
        data[name] = pd.Series(
            [values[i, : int(n)].tolist() for i, n in enumerate(lens)], dtype=pd.ArrowDtype(pa.list_(pa.float32()))
        )
    return dd.from_pandas(pd.DataFrame(data), npartitions=npartitions)


def test_dask_lm_score_of_a_dask_dataframe_on_gpus_matches_hf_bf16(gpu_client, tiny):  # noqa: F811
    """A lazy Dask DataFrame scored on the GPU workers (a bf16 replica each), computed, against a same-GPU bf16 HF
    forward, row by row through the index."""
    import dask.dataframe as dd
    import pandas as pd

    tok = transformers.AutoTokenizer.from_pretrained(tiny["qwen2"])
    texts = TEXTS * 4
    ddf = dd.from_pandas(pd.DataFrame({"id": range(len(texts)), "text": texts}), npartitions=4)
    out = dask_lm.score(
        ddf, model=tiny["qwen2"], text_column="text", convention="separate", client=gpu_client
    ).compute()
    ids, lens = make_batch(tok, texts)
    expected = _hf_bf16_logprobs(tiny["qwen2"], ids, lens)
    diffs = [
        (torch.tensor(r.logprobs, dtype=torch.float32) - expected[r.id, : int(lens[r.id])]).abs()
        for r in out.itertuples()
    ]
    worst, mean = max(float(d.max()) for d in diffs), float(torch.cat(diffs).mean())
    print(f"dask_lm.score on GPUs: {len(out)} rows, max|diff| vs HF bf16 = {worst:.4f}, mean {mean:.5f}")
    assert sorted(out.id) == list(range(len(texts)))
    assert worst < 0.1 and mean < 0.01


def test_policy_futures_fed_by_a_dask_dataframe_equal_the_blocking_calls_on_gpus(gpu_client, tiny):  # noqa: F811
    """bf16 ranks on the GPUs: get_logprobs and a train step submitted with a Dask DataFrame of token ids equal the
    blocking calls on the same rows as a BatchedDataDict (same plan, same kernels), and get_logprobs matches HF."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    texts = TEXTS * 4
    ids, lens = make_batch(tok, texts)
    mask = (torch.arange(ids.shape[1])[None, :] < lens[:, None]).float()
    batch = BatchedDataDict(input_ids=ids, input_lengths=lens, token_mask=mask, sample_mask=torch.ones(len(texts)))
    frame = _frame(ids, lens, 3, token_mask=mask)
    cfg = {
        "model_name": tiny["llama"],
        "precision": "bfloat16",
        "train_global_batch_size": len(texts),
        "train_micro_batch_size": 4,
        "max_total_sequence_length": 128,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-4}},
    }
    with dask_lm.Policy(gpu_client, cfg, tok) as a, dask_lm.Policy(gpu_client, cfg, tok) as b:
        blocking = a.get_logprobs(batch)["logprobs"]
        submitted = b.submit("get_logprobs", frame).result()["logprobs"]
        assert torch.equal(blocking, submitted)
        expected = _hf_bf16_logprobs(tiny["llama"], ids, lens)
        assert float((blocking - expected).abs().max()) < 0.1
        step_a = a.train(batch, dask_lm.NLLLoss())
        step_b = b.submit("train", frame, dask_lm.NLLLoss()).result()
        print(
            f"bf16 train step on {a.data_parallel_size} GPU rank(s): loss {float(step_a['loss']):.6f} (batch) vs "
            f"{float(step_b['loss']):.6f} (Dask DataFrame)"
        )
        assert float(step_a["loss"]) == float(step_b["loss"])
        assert torch.equal(a.get_logprobs(batch)["logprobs"], b.submit("get_logprobs", frame).result()["logprobs"])

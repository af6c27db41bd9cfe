"""Compiled decoder layers in a training step (``policy.train_compile``), on the CPU through Inductor's C++
backend: the step must equal the eager step, and the compiled code must actually have run."""

from __future__ import annotations

import torch
import transformers
from helpers import TEXTS, sft_batch

import dask_lm
from dask_lm.config import PolicyConfig
from dask_lm.data.messages import MicroBatchPlan
from dask_lm.workers.policy_worker import PolicyWorker
from dask_lm.workers.rank_model import RankPlace


def _step(model_dir: str, batch: dask_lm.BatchedDataDict, compile_: bool, packed: bool) -> tuple[float, dict]:
    cfg = {
        "model_name": model_dir,
        "precision": "float32",
        "train_global_batch_size": 4,
        "train_micro_batch_size": 2,
        "max_grad_norm": 1.0,
        "train_compile": compile_,
        "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}},
    }
    if packed:
        cfg["sequence_packing"] = {"enabled": True, "train_mb_tokens": 64}
    cfg = PolicyConfig.from_dict(cfg)
    worker = PolicyWorker(cfg, RankPlace(0, 1), pad_token_id=0, init_optimizer=True, init_reference_model=False)
    model = worker.rank_model
    assert model.train_compile is compile_ and not model.compile  # inference stays eager on the CPU
    args = {"batch_size": 4}
    if packed:
        args["sequence_packing_args"] = {
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "max_tokens_per_microbatch": 64,
            "algorithm": "modified_first_fit_decreasing",
            "sequence_length_pad_multiple": 1,
            "microbatch_order": "packer",
        }
    shards = batch.shard_by_batch_size(1, **args)
    shard = shards[0][0] if packed else shards[0]  # packing also returns the order it sorted the rows in
    plan = MicroBatchPlan(micro_batch_indices=shard.micro_batch_indices, packed=packed)
    out = worker.trainer.train(shard, plan, dask_lm.NLLLoss(), eval_mode=False, gbs=4, mbs=2, num_global_batches=1)
    return float(out.loss[0]), {n: p.detach().clone() for n, p in worker.model.named_parameters()}


def test_a_compiled_training_step_equals_the_eager_one(tiny, monkeypatch):
    from dask_lm.model import fused

    compiled_calls = []
    real_dispatch = fused._dispatch

    def counting(compiled, eager, *args, **kwargs):
        compiled_calls.append(bool(fused._SWITCH.compiled))
        return real_dispatch(compiled, eager, *args, **kwargs)

    monkeypatch.setattr(fused, "_dispatch", counting)
    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    batch = sft_batch(tok, TEXTS[:4])
    for packed in (False, True):
        loss, weights = _step(tiny["llama"], batch, False, packed)
        assert compiled_calls == []  # train_compile false: the layers were not even wrapped
        c_loss, c_weights = _step(tiny["llama"], batch, True, packed)
        assert compiled_calls and all(compiled_calls)  # every layer call of the step went to the compiled code
        compiled_calls.clear()
        assert abs(c_loss - loss) <= 1e-5 * abs(loss)
        for name, w in weights.items():
            torch.testing.assert_close(c_weights[name], w, atol=1e-5, rtol=1e-5, msg=name)

"""A rank without peers compiles its inference forward in the background (``dask_lm.workers.compile_ahead``):
calls made meanwhile run eagerly and are not held up; once it is done, the graphs it traced serve calls of other
sizes and both layouts (packed and padded) with no further trace. On the CPU (``inference_compile: true``), with
Dynamo's tracing as in production but its ``eager`` backend instead of Inductor's C++ code generation (a minute per
test on two busy cores; ``test_compiled_training.py`` and the GPU tier check Inductor's code), against a
single-process Hugging Face forward."""

from __future__ import annotations

import threading

import torch
import transformers
from helpers import TEXTS, hf_logprobs, make_batch
from torch._dynamo.utils import counters

from dask_lm.config import PolicyConfig
from dask_lm.data.messages import MicroBatchPlan
from dask_lm.data.tokens import TokenRows
from dask_lm.model import fused
from dask_lm.workers import compile_ahead
from dask_lm.workers.policy_worker import PolicyWorker
from dask_lm.workers.rank_model import RankPlace


def _worker(model_dir: str) -> PolicyWorker:
    cfg = PolicyConfig.from_dict(
        {"model_name": model_dir, "precision": "float32", "max_total_sequence_length": 128, "inference_compile": True}
    )
    return PolicyWorker(cfg, RankPlace(0, 1), pad_token_id=0, init_optimizer=False, init_reference_model=False)


def _counting(monkeypatch) -> list[bool]:
    """Every decoder layer call from now on, as whether it went to the compiled code; and the compiles traced by
    Dynamo but run by its eager backend."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, dynamic=kw["dynamic"], backend="eager"))
    calls: list[bool] = []
    real = fused._dispatch

    def counting(compiled, eager, *args, **kwargs):
        calls.append(bool(fused._SWITCH.compiled))
        return real(compiled, eager, *args, **kwargs)

    monkeypatch.setattr(fused, "_dispatch", counting)
    return calls


def _rows(tiny, texts):
    tok = transformers.AutoTokenizer.from_pretrained(tiny["tokenizer"])
    ids, lens = make_batch(tok, texts)
    return ids, lens, TokenRows.from_padded(ids, lens)


def _packed(n: int, cut: int) -> MicroBatchPlan:
    return MicroBatchPlan(packed=True, micro_batch_indices=[[[0, cut], [cut, n]]])


def test_a_call_made_while_the_rank_compiles_runs_eagerly_and_is_not_held_up(tiny, monkeypatch):
    release = threading.Event()
    real_run = compile_ahead.CompileAhead._run

    def held(self):
        release.wait(600)  # the compile has not finished while the call runs
        real_run(self)

    monkeypatch.setattr(compile_ahead.CompileAhead, "_run", held)
    calls = _counting(monkeypatch)
    worker = _worker(tiny["llama"])
    ahead = worker.rank_model.compile_ahead
    assert ahead is not None and not ahead.done()
    ids, lens, rows = _rows(tiny, TEXTS[:5])
    try:
        got = worker.rank_model.get_logprobs(rows, _packed(5, 2))["logprobs"]
        assert calls and not any(calls)  # every layer ran eagerly
        assert not ahead.done()
    finally:
        release.set()
    assert ahead.wait(600) and ahead.failed is None
    ref, _ = hf_logprobs(tiny["llama"], ids, lens)
    torch.testing.assert_close(got[:, : ids.shape[1]], ref, atol=2e-5, rtol=1e-5)


def test_once_compiled_ahead_every_later_call_runs_compiled_without_another_trace(tiny, monkeypatch):
    calls = _counting(monkeypatch)
    worker = _worker(tiny["llama"])
    rm = worker.rank_model
    ahead = rm.compile_ahead
    assert ahead is not None and ahead.wait(600) and ahead.failed is None, ahead.failed
    traced = counters["stats"]["unique_graphs"]
    assert traced > 0  # the thread traced the forward (and its output head, where that compiles)
    calls.clear()
    for texts, plan, mbs in ((TEXTS[:5], _packed(5, 3), None), (TEXTS[1:4], MicroBatchPlan(), 2)):
        ids, lens, rows = _rows(tiny, texts)
        got = rm.get_logprobs(rows, plan, mbs)["logprobs"]
        ref, _ = hf_logprobs(tiny["llama"], ids, lens)
        torch.testing.assert_close(got[:, : ids.shape[1]], ref, atol=2e-5, rtol=1e-5)
    assert calls and all(calls)  # every layer of both calls (packed, then padded) went to the compiled code
    assert counters["stats"]["unique_graphs"] == traced  # other sizes, both layouts: no new graph
    assert rm.compile

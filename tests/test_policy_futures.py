"""Policy.submit: futures of Policy calls on a real 2-process LocalCluster, against the blocking calls and
single-process Hugging Face."""

from __future__ import annotations

import pytest
import torch
import transformers
from distributed import Future, as_completed, wait
from helpers import TEXTS, hf_logprobs, hf_nll_steps, model_logprobs, sft_batch

import dask_lm
from dask_lm import BatchedDataDict

pytestmark = pytest.mark.cluster

CORPUS = TEXTS + ["Tokens flow through the cluster.", "Every rank runs the same steps.", "Short one."]


def _cfg(model_dir, **extra):
    cfg = {
        "model_name": model_dir,
        "precision": "float32",
        "train_global_batch_size": 8,
        "train_micro_batch_size": 2,
        "logprob_batch_size": 2,
        "logprob_chunk_size": 5,
        "max_total_sequence_length": 128,
        "max_grad_norm": 1.0,
        "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}},
        "generation": {"max_new_tokens": 4, "temperature": 1.0},
    }
    cfg.update(extra)
    return cfg


@pytest.fixture(scope="module")
def tok(tiny):
    return transformers.AutoTokenizer.from_pretrained(tiny["llama"])


@pytest.fixture(scope="module")
def batch(tok):
    return sft_batch(tok, CORPUS)


@pytest.fixture(scope="module")
def policy(client, tiny, tok):
    """Reference weights stay those of tiny["llama"]: tests that train restore nothing, so they compare against
    what the policy itself gives before and after."""
    with dask_lm.Policy(client, _cfg(tiny["llama"]), tok) as p:
        assert p.data_parallel_size == 2
        yield p


def _same(a, b):
    assert set(a) == set(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_futures_equal_the_blocking_calls(policy, batch):
    """Each inference method: the future's result is the blocking method's, exactly (the weights do not change)."""
    fwd = BatchedDataDict(input_ids=batch["input_ids"], input_lengths=batch["input_lengths"])
    calls = [
        ("get_logprobs", (fwd,), {}),
        ("get_reference_policy_logprobs", (fwd,), {"micro_batch_size": 1}),
        ("get_topk_logits", (fwd,), {"k": 3}),
        ("generate", (fwd,), {"greedy": True}),
    ]
    futures = [policy.submit(name, *args, **kwargs) for name, args, kwargs in calls]
    assert all(isinstance(f, Future) and isinstance(f, dask_lm.PolicyFuture) for f in futures)
    wait(futures)
    assert [f.status for f in futures] == ["finished"] * len(futures)
    for (name, args, kwargs), fut in zip(calls, futures):
        _same(fut.result(), getattr(policy, name)(*args, **kwargs))
    expected, _ = hf_logprobs(policy.cfg.model_name, fwd["input_ids"], fwd["input_lengths"])
    torch.testing.assert_close(futures[0].result()["logprobs"], expected, atol=1e-4, rtol=0)


def test_score_futures_equal_the_blocking_scores(client, tiny, tok, batch):
    """A reward model's score: the future, a Dask DataFrame as data and collect=False give the blocking scores,
    and those are the sequence-classification model's."""
    fwd = BatchedDataDict(input_ids=batch["input_ids"], input_lengths=batch["input_lengths"])
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tiny["llama_rm"], dtype=torch.float32)
    model.config.pad_token_id = tok.pad_token_id
    with torch.no_grad():
        ids = fwd["input_ids"]
        expected = model(ids, attention_mask=(ids != tok.pad_token_id).long()).logits.float().squeeze(-1)
    cfg = _cfg(tiny["llama_rm"], reward_model_cfg={"enabled": True})
    with dask_lm.Policy(client, cfg, tok, init_reference_model=False) as p:
        fut, from_frame = p.submit("score", fwd), p.submit("score", _frame(fwd, npartitions=2))
        frame = p.submit("score", fwd, collect=False)
        blocking = p.score(fwd)
        _same(fut.result(), blocking)
        _same(from_frame.result(), blocking)
        kept = frame.compute().sort_values("row")
    assert kept["row"].tolist() == list(range(ids.shape[0]))
    torch.testing.assert_close(torch.tensor(kept["scores"].tolist()), blocking["scores"], rtol=0, atol=0)
    torch.testing.assert_close(blocking["scores"], expected, atol=1e-4, rtol=0)


def test_as_completed_and_gather_take_policy_futures(policy, batch, client):
    fwd = BatchedDataDict(input_ids=batch["input_ids"], input_lengths=batch["input_lengths"])
    futures = [policy.submit("get_logprobs", fwd), policy.submit("get_topk_logits", fwd, 2)]
    done = {f.key for f in as_completed(futures)}
    assert done == {f.key for f in futures}
    gathered = client.gather(futures)
    _same(gathered[0], futures[0].result())
    _same(gathered[1], futures[1].result())


def test_submission_order_holds_for_interleaved_train_and_logprobs(client, tiny, tok, batch):
    """get_logprobs submitted before a train step finished sees the trained weights; one submitted before the
    step sees the weights before it: both against single-process HF."""
    losses, norms, ref_model = hf_nll_steps(
        tiny["llama"],
        [(batch["input_ids"], batch["input_lengths"], batch["token_mask"], batch["sample_mask"])],
        lr=0.5,
        max_grad_norm=1.0,
    )
    fwd = BatchedDataDict(input_ids=batch["input_ids"], input_lengths=batch["input_lengths"])
    before, _ = hf_logprobs(tiny["llama"], fwd["input_ids"], fwd["input_lengths"])
    after = model_logprobs(ref_model, fwd["input_ids"], fwd["input_lengths"])
    with dask_lm.Policy(client, _cfg(tiny["llama"]), tok) as p:
        first = p.submit("get_logprobs", fwd)
        step = p.submit("train", batch, dask_lm.NLLLoss())
        second = p.submit("get_logprobs", fwd)
        assert step.status == "pending"  # submitted while the step had not run yet
        torch.testing.assert_close(second.result()["logprobs"], after, atol=1e-4, rtol=0)
        torch.testing.assert_close(first.result()["logprobs"], before, atol=1e-4, rtol=0)
        out = step.result()
    assert abs(float(out["loss"][0]) - losses[0]) < 1e-5
    assert abs(float(out["grad_norm"][0]) - norms[0]) < 1e-5 * norms[0]


def test_submit_names_the_methods_it_takes_and_validates_before_any_work(policy, batch):
    with pytest.raises(ValueError, match=r"get_logprobs.*train"):
        policy.submit("save_checkpoint", "/tmp/x")
    bad = BatchedDataDict(input_ids=batch["input_ids"].float(), input_lengths=batch["input_lengths"])
    with pytest.raises(ValueError, match=r"get_logprobs: `input_ids` has dtype torch.float32"):
        policy.submit("get_logprobs", bad)
    # SGLang generation runs from the driver: there is no future of it, and submit says so
    import dataclasses

    cfg = policy.cfg
    policy.cfg = dataclasses.replace(cfg, generation=dataclasses.replace(cfg.generation, backend="sglang"))
    try:
        with pytest.raises(ValueError, match=r"call policy.generate"):
            policy.submit("generate", batch)
    finally:
        policy.cfg = cfg


class _FailingLoss(dask_lm.NLLLoss):
    """NLL, except that rank 1 raises in its first micro-batch; with ``peer_too`` rank 0 raises PeerFailedError
    (as a rank told of its peer's failure does), else it goes on into the step's collectives and waits there."""

    def __init__(self, peer_too: bool) -> None:
        super().__init__()
        self.peer_too = peer_too

    def __call__(self, *args, **kwargs):
        from distributed import get_worker

        from dask_lm.errors import PeerFailedError

        if str(get_worker().name) == "1":
            raise RuntimeError("boom on rank 1")
        if self.peer_too:
            raise PeerFailedError("a peer failed")
        return super().__call__(*args, **kwargs)


def test_a_rank_error_surfaces_at_result_with_the_blocking_text(policy, batch):
    with pytest.raises(dask_lm.RankFailedError) as blocking:
        policy.train(batch, _FailingLoss(peer_too=True))
    fut = policy.submit("train", batch, _FailingLoss(peer_too=True))
    with pytest.raises(dask_lm.RankFailedError) as future:
        fut.result()
    assert str(future.value) == str(blocking.value)
    assert str(future.value) == "train failed on rank 1 (worker 1): RuntimeError: boom on rank 1"
    assert fut.status == "error"
    # the Policy keeps working after a failed call, in both forms
    fwd = BatchedDataDict(input_ids=batch["input_ids"], input_lengths=batch["input_lengths"])
    _same(policy.submit("get_logprobs", fwd).result(), policy.get_logprobs(fwd))


def test_an_error_on_one_rank_does_not_hang_result_wait_or_as_completed(tiny, tok, batch):
    """Rank 1 fails while rank 0 waits in the step's collectives: .result() raises rank 1's error after the group's
    settle time, not after the collective timeout (the Policy is then broken, as a blocking call leaves it), and
    wait / as_completed return as soon as rank 1's task failed."""
    client = dask_lm.connect(n_workers=2, cluster="cpu")
    try:
        # a collective timeout far beyond the settle time: rank 0 is certainly still waiting when .result() raises
        p = dask_lm.Policy(client, _cfg(tiny["llama"], collective_timeout_s=300.0), tok)
        p.group.settle_timeout_s = 3.0
        fut = p.submit("train", batch, _FailingLoss(peer_too=False))
        wait([fut], timeout=600)  # a guard against a hang only: it returns when rank 1 fails
        assert fut.status == "error"
        assert list(as_completed([fut], timeout=600)) == [fut]
        ranks = list(fut._ranks)
        with pytest.raises(
            dask_lm.RankFailedError,
            match=r"^train failed on rank 1 \(worker 1\): RuntimeError: "
            r"boom on rank 1$",
        ):
            fut.result()
        assert ranks[0].status == "pending"  # rank 0 was still in its collective when .result() raised
        with pytest.raises(dask_lm.RankFailedError, match="did not finish train after a peer failed"):
            p.submit("get_logprobs", batch)
    finally:
        # no graceful shutdown: rank 0 waits in its collective; closing the cluster ends its process
        client.close()
        client.cluster.close()


# ------------------------------------------------------------------------------------------- rows on the workers
def _frame(batch, npartitions=3):
    """The batch's rows as a Dask DataFrame of token-id lists (plus train's per-token / per-row columns)."""
    import dask.dataframe as dd
    import pandas as pd
    import pyarrow as pa

    lens = batch["input_lengths"].tolist()
    ids = pd.ArrowDtype(pa.list_(pa.int64()))
    cols = {"input_ids": pd.Series([batch["input_ids"][i, :n].tolist() for i, n in enumerate(lens)], dtype=ids)}
    if "token_mask" in batch:
        cols["token_mask"] = pd.Series(
            [batch["token_mask"][i, :n].tolist() for i, n in enumerate(lens)],
            dtype=pd.ArrowDtype(pa.list_(pa.float32())),
        )
        cols["sample_mask"] = batch["sample_mask"].numpy()
    return dd.from_pandas(pd.DataFrame(cols), npartitions=npartitions, sort=False)


@pytest.mark.parametrize("mode", ["plain", "packed"])
def test_a_train_step_fed_by_a_dask_dataframe_equals_the_step_fed_by_a_batch(client, tiny, tok, batch, mode):
    extra = (
        {"sequence_packing": {"enabled": True, "train_mb_tokens": 64, "logprob_mb_tokens": 64}}
        if mode == "packed"
        else {}
    )
    fwd = BatchedDataDict(input_ids=batch["input_ids"], input_lengths=batch["input_lengths"])
    with dask_lm.Policy(client, _cfg(tiny["llama"], **extra), tok) as p:
        expected = p.train(batch, dask_lm.NLLLoss())
        lp_expected = p.get_logprobs(fwd)["logprobs"]
    frame = _frame(batch)
    assert frame.npartitions == 3
    with dask_lm.Policy(client, _cfg(tiny["llama"], **extra), tok) as p:
        out = p.submit("train", frame, dask_lm.NLLLoss()).result()
        lp = p.submit("get_logprobs", frame[["input_ids"]]).result()["logprobs"]
    torch.testing.assert_close(out["loss"], expected["loss"], rtol=0, atol=1e-6)
    torch.testing.assert_close(out["grad_norm"], expected["grad_norm"], rtol=0, atol=1e-6)
    assert out["all_mb_metrics"].keys() == expected["all_mb_metrics"].keys()
    for key, values in expected["all_mb_metrics"].items():
        assert out["all_mb_metrics"][key] == pytest.approx(values, rel=1e-6, abs=1e-6), key
    assert out["num_tokens"] == expected["num_tokens"]
    torch.testing.assert_close(lp, lp_expected, rtol=0, atol=1e-6)


def test_dataframes_and_futures_as_inference_data(policy, batch, client):
    """get_logprobs / top-k of a Dask DataFrame, of a future of a batch, and of generate's PolicyFuture equal the
    blocking calls on the same rows."""
    fwd = BatchedDataDict(input_ids=batch["input_ids"], input_lengths=batch["input_lengths"])
    frame = _frame(fwd, npartitions=2)
    _same(policy.submit("get_logprobs", frame).result(), policy.get_logprobs(fwd))
    _same(policy.submit("get_topk_logits", frame, 2).result(), policy.get_topk_logits(fwd, 2))
    [remote] = client.scatter([fwd])
    _same(policy.submit("get_reference_policy_logprobs", remote).result(), policy.get_reference_policy_logprobs(fwd))
    prompts = BatchedDataDict(input_ids=fwd["input_ids"][:5, :6], input_lengths=fwd["input_lengths"][:5].clamp(max=6))
    generated = policy.submit("generate", prompts, greedy=True)
    scored = policy.submit("get_logprobs", generated)  # the generated rows go from rank 0's worker to the ranks
    gen = generated.result()
    expected = policy.get_logprobs(
        BatchedDataDict(input_ids=gen["output_ids"], input_lengths=gen["unpadded_sequence_lengths"])
    )
    _same(scored.result(), expected)


def test_an_eval_step_fed_by_a_future_of_a_batch_made_by_a_task(policy, batch, client):
    """train(eval_mode=True) of a batch a task made on a worker equals the same call on the batch (nothing trains)."""
    made = client.submit(BatchedDataDict, dict(batch), pure=False)
    out = policy.submit("train", made, dask_lm.NLLLoss(), eval_mode=True).result()
    expected = policy.train(batch, dask_lm.NLLLoss(), eval_mode=True)
    torch.testing.assert_close(out["loss"], expected["loss"], rtol=0, atol=0)
    assert out["all_mb_metrics"] == expected["all_mb_metrics"] and out["grad_norm"] is None


def test_rows_on_the_workers_are_checked_there_with_partition_and_row(policy, batch):
    fwd = BatchedDataDict(input_ids=batch["input_ids"], input_lengths=batch["input_lengths"])
    frame = _frame(fwd, npartitions=2)
    pdf = frame.compute()
    import dask.dataframe as dd
    import pandas as pd
    import pyarrow as pa

    rows = pdf["input_ids"].tolist()
    rows[-1] = [3, 4, policy.vocab_size + 7]
    pdf["input_ids"] = pd.Series(rows, dtype=pd.ArrowDtype(pa.list_(pa.int64())), index=pdf.index)

    bad = dd.from_pandas(pdf, npartitions=2, sort=False)
    last = len(bad.partitions[1].compute()) - 1
    with pytest.raises(
        ValueError,
        match=rf"get_logprobs \(partition 1 of the Dask DataFrame\): "
        rf"`input_ids\[{last}, 2\]` = {policy.vocab_size + 7} is outside the "
        "model's vocabulary",
    ):
        policy.submit("get_logprobs", bad)
    with pytest.raises(
        ValueError,
        match=r"train \(partition 0 of the Dask DataFrame\): NLLLoss needs the data keys "
        r"\['token_mask'\]",
    ):
        policy.submit("train", frame, dask_lm.NLLLoss())
    # nothing ran: the Policy is as it was
    _same(policy.submit("get_logprobs", frame).result(), policy.get_logprobs(fwd))


def test_collect_false_leaves_the_outputs_on_the_workers_as_a_dask_dataframe(policy, batch, client):
    """Each partition is one rank's rows, made on its worker; sorted by `row`, the values are the blocking call's
    cut to each row's length."""
    import dask.dataframe as dd

    fwd = BatchedDataDict(input_ids=batch["input_ids"], input_lengths=batch["input_lengths"])
    lens = fwd["input_lengths"].tolist()
    frame = policy.submit("get_logprobs", _frame(fwd, npartitions=2), collect=False)
    assert isinstance(frame, dd.DataFrame) and frame.npartitions == policy.data_parallel_size
    top = policy.submit("get_topk_logits", fwd, 2, collect=False)
    got, got_top = frame.compute().sort_values("row"), top.compute().sort_values("row")
    # once done, the ranks' answers are the frame's alone: the rank chain lets go of them (a done callback)
    _poll(lambda: all(last is None for last in policy.group._last))
    assert all(last is None for last in policy.group._last)
    assert got["row"].tolist() == list(range(len(lens)))
    assert dict(got.dtypes) == dict(frame._meta.dtypes) and dict(got_top.dtypes) == dict(top._meta.dtypes)
    expected = policy.get_logprobs(fwd)["logprobs"]
    expected_top = policy.get_topk_logits(fwd, 2)
    for i, n in enumerate(lens):
        torch.testing.assert_close(
            torch.tensor(got["logprobs"].iloc[i], dtype=torch.float32), expected[i, :n], rtol=0, atol=0
        )
        torch.testing.assert_close(
            torch.tensor(list(got_top["topk_logits"].iloc[i]), dtype=torch.float32),
            expected_top["topk_logits"][i, :n],
            rtol=0,
            atol=0,
        )
        assert list(got_top["topk_indices"].iloc[i]) == expected_top["topk_indices"][i, :n].tolist()
    with pytest.raises(ValueError, match="collect=False"):
        policy.submit("train", batch, dask_lm.NLLLoss(), collect=False)


def _poll(done, seconds=60.0):
    """Until ``done()``: releases travel through distributed's callback thread (a hang guard, not a timing)."""
    import time

    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.1)


def _wanted(dask_scheduler, keys):
    return [k for k in keys if k in dask_scheduler.tasks and dask_scheduler.tasks[k].who_wants]


def test_a_finished_future_lets_go_of_its_rank_tasks(policy, batch, client):
    """Neither the future nor the rank chain keeps the rank tasks of a finished call, even when its result is never
    taken with .result() (wait and gather only): no client wants them on the scheduler."""
    fwd = BatchedDataDict(input_ids=batch["input_ids"], input_lengths=batch["input_lengths"])
    fut = policy.submit("get_logprobs", fwd)
    rank_keys = [f.key for f in fut._ranks]
    wait([fut])
    _same(client.gather(fut), policy.get_logprobs(fwd))
    _poll(lambda: fut._ranks is None and not client.run_on_scheduler(_wanted, keys=rank_keys))
    assert fut._ranks is None and all(last is None for last in policy.group._last)
    assert client.run_on_scheduler(_wanted, keys=rank_keys) == []
    assert fut.status == "finished"

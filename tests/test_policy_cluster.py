"""Policy on a real 2-process LocalCluster (gloo, FSDP2 over both ranks), against single-process Hugging Face."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import TEXTS, hf_logprobs, make_batch

import dask_lm
from dask_lm import BatchedDataDict

pytestmark = pytest.mark.cluster

MODES = {
    "plain": {},
    "dynamic": {"dynamic_batching": {"enabled": True, "logprob_mb_tokens": 48, "sequence_length_round": 4}},
    "packed": {"sequence_packing": {"enabled": True, "logprob_mb_tokens": 64}},
}


def _cfg(model_dir, mode="plain", **extra):
    cfg = {
        "model_name": model_dir,
        "precision": "float32",
        "logprob_batch_size": 2,
        "logprob_chunk_size": 5,
        "max_total_sequence_length": 128,
        **MODES[mode],
    }
    cfg.update(extra)
    return cfg


@pytest.fixture(scope="module")
def tok(tiny):
    return transformers.AutoTokenizer.from_pretrained(tiny["llama"])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("mode", ["plain", "dynamic", "packed"])
@pytest.mark.parametrize("n_ranks", [1, 2])
def test_logprobs_match_hf(client, tiny, tok, family, mode, n_ranks):
    ids, lens = make_batch(tok, TEXTS)
    expected, _ = hf_logprobs(tiny[family], ids, lens)
    with dask_lm.Policy(client, _cfg(tiny[family], mode), tok, workers_per_node=None if n_ranks == 2 else 1) as policy:
        assert policy.data_parallel_size == n_ranks
        out = policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))["logprobs"]
    assert out.dtype == torch.float32 and out.shape == ids.shape
    assert torch.all(out[:, 0] == 0)
    assert torch.all(out[torch.arange(ids.shape[1])[None, :] >= lens[:, None]] == 0)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=0)


def test_inference_packs_by_itself_where_configured(client, tiny, tok):
    """policy.inference_packing: auto packs only on GPU workers (not here); true packs calls that name no
    micro_batch_size, and the values stay the unpacked reference's."""
    ids, lens = make_batch(tok, TEXTS)
    batch = BatchedDataDict(input_ids=ids, input_lengths=lens)
    expected, _ = hf_logprobs(tiny["llama"], ids, lens)
    with dask_lm.Policy(client, _cfg(tiny["llama"]), tok, workers_per_node=1) as policy:
        assert policy._shard(batch, auto_pack=True)[2] is False  # CPU workers: rows per micro-batch
    with dask_lm.Policy(client, _cfg(tiny["llama"], inference_packing=True, inference_mb_tokens=16), tok) as policy:
        shards, _order, packed = policy._shard(batch, auto_pack=True)
        assert packed and shards[0].micro_batch_indices
        # the budget is never below max_total_sequence_length, so every row fits a micro-batch
        assert policy._auto_packing() == 128
        assert policy._shard(batch, auto_pack=False)[2] is False
        out = policy.get_logprobs(batch)["logprobs"]
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=0)
        ref = policy.get_reference_policy_logprobs(batch, micro_batch_size=1)["reference_logprobs"]
        torch.testing.assert_close(ref, expected, atol=1e-4, rtol=0)


def test_compiled_inference_on_fsdp_ranks_matches_hf(client, tiny, tok):
    """inference_compile: true compiles the decoder layers of both FSDP ranks (Inductor's C++ backend here: on GPUs
    the same per-layer compilation is the default), runs the logprob and top-k passes through them (FSDP's
    all-gather hooks around each compiled layer) and keeps the values of the eager reference."""
    ids, lens = make_batch(tok, TEXTS)
    batch = BatchedDataDict(input_ids=ids, input_lengths=lens)
    expected, logits = hf_logprobs(tiny["llama"], ids, lens)
    with dask_lm.Policy(client, _cfg(tiny["llama"], "dynamic", inference_compile=True), tok) as policy:
        assert policy.data_parallel_size == 2
        out = policy.get_logprobs(batch)["logprobs"]
        tk = policy.get_topk_logits(batch, k=3)

        def compiled_state(dask_worker):
            from torch._dynamo.utils import counters

            flags = [pw.rank_model.compile for pw in dask_worker.plugins["dask-lm"].policies.values()]
            return flags, counters["stats"]["unique_graphs"]

        # still compiled after the passes (no silent fallback to eager), and graphs were really built
        states = client.run(compiled_state)
        assert all(flags == [True] and graphs > 0 for flags, graphs in states.values()), states
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=0)
    valid = (torch.arange(ids.shape[1])[None, :] < lens[:, None])[..., None]
    torch.testing.assert_close(tk["topk_logits"] * valid, logits.topk(3, -1).values * valid, atol=1e-4, rtol=0)


def test_topk_reference_temperature_and_odd_batches(client, tiny, tok):
    """One policy, several calls: top-k vs logits.topk, reference = base weights, temperature, odd batch sizes."""
    ids, lens = make_batch(tok, TEXTS)
    cfg = _cfg(tiny["llama"], "packed", generation={"temperature": 0.7})
    expected, _logits = hf_logprobs(tiny["llama"], ids, lens, temperature=0.7)
    with dask_lm.Policy(client, cfg, tok, weights_path=tiny["llama_tuned"]) as policy:
        # the restored weights drive get_logprobs; the reference stays the weights of model_name
        tuned, _ = hf_logprobs(tiny["llama_tuned"], ids, lens, temperature=0.7)
        out = policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))["logprobs"]
        torch.testing.assert_close(out, tuned, atol=1e-4, rtol=0)
        ref = policy.get_reference_policy_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))
        torch.testing.assert_close(ref["reference_logprobs"], expected, atol=1e-4, rtol=0)
        # the swap back restored the live weights
        again = policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))["logprobs"]
        assert torch.equal(again, out)

        tk = policy.get_topk_logits(BatchedDataDict(input_ids=ids, input_lengths=lens), k=4)
        _, tuned_logits = hf_logprobs(tiny["llama_tuned"], ids, lens, temperature=0.7)
        top = tuned_logits.topk(4, dim=-1)
        valid = (torch.arange(ids.shape[1])[None, :] < lens[:, None])[..., None]
        assert tk["topk_logits"].shape == (len(TEXTS), ids.shape[1], 4)
        assert tk["topk_indices"].dtype == torch.int64
        torch.testing.assert_close(tk["topk_logits"] * valid, top.values * valid, atol=1e-4, rtol=0)
        assert torch.equal(tk["topk_indices"] * valid, top.indices * valid)

        # a batch of one row, and 3 rows over 2 ranks
        for rows in ([2], [0, 3, 4]):
            sub_ids, sub_lens = ids[rows], lens[rows]
            got = policy.get_logprobs(BatchedDataDict(input_ids=sub_ids, input_lengths=sub_lens))["logprobs"]
            torch.testing.assert_close(got, tuned[rows], atol=1e-4, rtol=0)


def test_generation_filtering_applies_to_policy_not_reference(client, tiny, tok):
    ids, lens = make_batch(tok, TEXTS[:2])
    cfg = _cfg(tiny["llama"], generation={"temperature": 1.0, "top_k": 5})
    _, logits = hf_logprobs(tiny["llama"], ids, lens)
    kth = logits.topk(5, dim=-1).values[..., -1:]
    filtered = torch.log_softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
    expected = torch.zeros(ids.shape)
    expected[:, 1:] = filtered[:, :-1].gather(2, ids[:, 1:, None]).squeeze(2)
    valid = torch.arange(ids.shape[1])[None, :] < lens[:, None]
    expected = torch.where(valid & torch.isfinite(expected), expected, torch.zeros(()))
    with dask_lm.Policy(client, cfg, tok) as policy:
        out = policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))["logprobs"]
        ref = policy.get_reference_policy_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=0)
    plain, _ = hf_logprobs(tiny["llama"], ids, lens)
    torch.testing.assert_close(ref["reference_logprobs"], plain, atol=1e-4, rtol=0)


@pytest.mark.parametrize("mode", ["plain", "packed"])
def test_reward_scores_match_sequence_classification(client, tiny, tok, mode):
    ids, lens = make_batch(tok, TEXTS)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tiny["llama_rm"], dtype=torch.float32)
    model.config.pad_token_id = tok.pad_token_id
    with torch.no_grad():
        expected = model(ids, attention_mask=(ids != tok.pad_token_id).long()).logits.float().squeeze(-1)
    cfg = _cfg(tiny["llama_rm"], mode, reward_model_cfg={"enabled": True})
    with dask_lm.Policy(client, cfg, tok, init_reference_model=False) as policy:
        scores = policy.score(BatchedDataDict(input_ids=ids, input_lengths=lens))["scores"]
    assert scores.dtype == torch.float32 and scores.shape == (len(TEXTS),)
    torch.testing.assert_close(scores, expected, atol=1e-4, rtol=0)


def test_bad_input_is_rejected_and_policy_keeps_working(client, tiny, tok):
    ids, lens = make_batch(tok, TEXTS[:3])
    with dask_lm.Policy(client, _cfg(tiny["llama"], max_total_sequence_length=40), tok) as policy:
        cases = [
            (BatchedDataDict(input_lengths=lens), "input_ids"),
            (BatchedDataDict(input_ids=ids), "input_lengths"),
            (BatchedDataDict(input_ids=ids.float(), input_lengths=lens), "integers"),
            (BatchedDataDict(input_ids=ids, input_lengths=lens[:2]), "input_lengths"),
            (BatchedDataDict(input_ids=ids, input_lengths=lens + ids.shape[1]), "columns"),
            (BatchedDataDict(input_ids=torch.where(ids == ids[0, 1], 10_000, ids), input_lengths=lens), "vocabulary"),
            (BatchedDataDict(input_ids=ids, input_lengths=lens, advantages=torch.zeros(2)), "advantages"),
        ]
        long_ids, long_lens = make_batch(tok, [TEXTS[2] * 3])
        cases.append((BatchedDataDict(input_ids=long_ids, input_lengths=long_lens), "max_total_sequence_length"))
        left = torch.full_like(ids[:1], tok.pad_token_id)
        n = int(lens[1])
        left[0, -n:] = ids[1, :n]
        cases.append((BatchedDataDict(input_ids=left, input_lengths=lens[1:2]), "left-padded"))
        for batch, needle in cases:
            with pytest.raises(ValueError, match=needle):
                policy.get_logprobs(batch)
        with pytest.raises(ValueError, match="reward model"):
            policy.score(BatchedDataDict(input_ids=ids, input_lengths=lens))
        expected, _ = hf_logprobs(tiny["llama"], ids[:1], lens[:1])
        out = policy.get_logprobs(BatchedDataDict(input_ids=ids[:1], input_lengths=lens[:1]))["logprobs"]
        torch.testing.assert_close(out, expected[:, : out.shape[1]], atol=1e-4, rtol=0)


def test_policies_side_by_side_and_shutdown_frees_workers(client, tiny, tok):
    ids, lens = make_batch(tok, TEXTS)
    batch = BatchedDataDict(input_ids=ids, input_lengths=lens)
    policy = dask_lm.Policy(client, _cfg(tiny["llama"]), tok)
    reward = dask_lm.Policy(
        client, _cfg(tiny["llama_rm"], reward_model_cfg={"enabled": True}), tok, init_reference_model=False
    )
    lp = policy.get_logprobs(batch)["logprobs"]
    scores = reward.score(batch)["scores"]
    torch.testing.assert_close(lp, hf_logprobs(tiny["llama"], ids, lens)[0], atol=1e-4, rtol=0)
    assert scores.shape == (len(TEXTS),)
    assert policy.get_free_memory_bytes() > 0
    held = client.run(lambda dask_worker: sorted(dask_worker.plugins["dask-lm"].policies))
    assert all(len(v) == 2 for v in held.values())
    policy.shutdown()
    reward.shutdown()
    state = client.run(
        lambda dask_worker: (
            len(dask_worker.plugins["dask-lm"].policies),
            __import__("torch").distributed.is_initialized(),
        )
    )
    assert all(v == (0, False) for v in state.values()), state
    with pytest.raises(RuntimeError, match="shut down"):
        policy.get_logprobs(batch)
    # a fresh Policy on the same client starts cleanly
    with dask_lm.Policy(client, _cfg(tiny["qwen2"], "dynamic"), tok) as again:
        torch.testing.assert_close(
            again.get_logprobs(batch)["logprobs"], hf_logprobs(tiny["qwen2"], ids, lens)[0], atol=1e-4, rtol=0
        )


class CountingExtension:
    """A worker extension: its methods run on each rank with access to the rank's model."""

    def count_parameters(self, scale: int = 1) -> int:
        from dask_lm.workers.policy_worker import local_tensor

        return scale * sum(local_tensor(p).numel() for p in self.model.parameters())

    def whoami(self, tag: str) -> str:
        return f"{tag}:{self.rank}"


def test_run_all_workers_with_extension(client, tiny, tok):
    with dask_lm.Policy(
        client,
        _cfg(tiny["llama"]),
        tok,
        init_reference_model=False,
        worker_extension_cls_fqn="test_policy_cluster.CountingExtension",
    ) as policy:
        total = transformers.AutoModelForCausalLM.from_pretrained(tiny["llama"]).num_parameters()
        shards = policy.run_all_workers_single_data("count_parameters", scale=2)
        assert len(shards) == 2 and sum(shards) == 2 * total  # FSDP: each rank holds half
        assert policy.run_all_workers_multiple_data("whoami", ["a", "b"]) == ["a:0", "b:1"]
        with pytest.raises(ValueError, match="one per worker"):
            policy.run_all_workers_multiple_data("whoami", ["a"])
        # a call that fails on the workers leaves the Policy usable (the failed tasks leave the rank chains)
        ids, lens = make_batch(tok, TEXTS[:3])
        batch = BatchedDataDict(input_ids=ids, input_lengths=lens)
        with pytest.raises(ValueError, match="init_reference_model"):
            policy.get_reference_policy_logprobs(batch)
        torch.testing.assert_close(
            policy.get_logprobs(batch)["logprobs"], hf_logprobs(tiny["llama"], ids, lens)[0], atol=1e-4, rtol=0
        )
        policy.print_node_ip_and_gpu_id()
        policy.prepare_for_lp_inference()
        policy.offload_to_cpu()
        policy.start_gpu_profiling()
        policy.stop_gpu_profiling()


def test_calls_show_as_dask_spans_with_token_counts(client, tiny, tok):
    ids, lens = make_batch(tok, TEXTS)
    with dask_lm.Policy(client, _cfg(tiny["llama"]), tok, init_reference_model=False) as policy:
        policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))

    def span_tokens(dask_scheduler):
        total = 0
        for span in dask_scheduler.extensions["spans"].spans.values():
            if span.name and span.name[-1] == "dask-lm/get_logprobs":
                total += sum(v for k, v in span.cumulative_worker_metrics.items() if k[-2:] == ("tokens", "count"))
        return total

    import time

    deadline = time.time() + 20  # worker metrics reach the scheduler with the heartbeat
    while time.time() < deadline and client.run_on_scheduler(span_tokens) < int(lens.sum()):
        time.sleep(0.5)
    assert client.run_on_scheduler(span_tokens) >= int(lens.sum())

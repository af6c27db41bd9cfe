"""Policy.generate in the policy's own workers (hf backend) against Hugging Face generate and get_logprobs."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import TEXTS, make_batch

import dask_lm
from dask_lm import BatchedDataDict

pytestmark = pytest.mark.cluster


def _cfg(model_dir, **generation):
    return {
        "model_name": model_dir,
        "precision": "float32",
        "max_total_sequence_length": 128,
        "logprob_batch_size": 2,
        "generation": {"max_new_tokens": 12, **generation},
    }


@pytest.fixture(scope="module")
def tok(tiny):
    return transformers.AutoTokenizer.from_pretrained(tiny["llama"])


@pytest.mark.parametrize("n_ranks", [1, 2])
def test_greedy_equals_hf_generate(client, tiny, tok, n_ranks):
    ids, lens = make_batch(tok, TEXTS)
    with dask_lm.Policy(
        client, _cfg(tiny["llama"]), tok, workers_per_node=n_ranks, init_optimizer=False, init_reference_model=False
    ) as policy:
        out = policy.generate(BatchedDataDict(input_ids=ids, input_lengths=lens), greedy=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float32)
    for b in range(ids.shape[0]):
        n = int(lens[b])
        want = model.generate(
            ids[b : b + 1, :n],
            attention_mask=torch.ones(1, n, dtype=torch.long),
            do_sample=False,
            max_new_tokens=12,
            pad_token_id=tok.pad_token_id,
        )[0, n:]
        g = int(out["generation_lengths"][b])
        assert out["output_ids"][b, :n].tolist() == ids[b, :n].tolist()
        assert out["output_ids"][b, n : n + g].tolist() == want[:g].tolist()
        assert out["unpadded_sequence_lengths"][b] == n + g
        assert (out["output_ids"][b, n + g :] == tok.pad_token_id).all()
        assert (out["logprobs"][b, :n] == 0).all() and (out["logprobs"][b, n + g :] == 0).all()
        assert bool(out["truncated"][b]) == (g == 12)


def test_sampled_logprobs_equal_get_logprobs_and_stop_tokens(client, tiny, tok):
    ids, lens = make_batch(tok, TEXTS)
    gen = {"temperature": 0.7, "top_k": 50, "top_p": 0.95}
    with dask_lm.Policy(
        client, _cfg(tiny["llama"], **gen), tok, init_optimizer=False, init_reference_model=False
    ) as policy:
        out = policy.generate(BatchedDataDict(input_ids=ids, input_lengths=lens), seed=0)
        seqs = BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
        lp = policy.get_logprobs(seqs)["logprobs"]
    gen_mask = out["logprobs"] != 0
    assert int(out["generation_lengths"].sum()) == int(gen_mask.sum())
    # the same float32 arithmetic in two orders (a KV-cached one-token decode step against a full forward with
    # other GEMM shapes), scaled by 1 / temperature: a few ulps of logprobs up to ~10 nats, so a relative bound too
    # (CI saw 1.1e-5 at a logprob of -3.9: 2.8e-6 relative)
    torch.testing.assert_close(lp * gen_mask, out["logprobs"], atol=1e-5, rtol=1e-5)


def test_a_stop_token_ends_a_row_early(client, tiny, tok):
    ids, lens = make_batch(tok, TEXTS[:2])
    batch = BatchedDataDict(input_ids=ids, input_lengths=lens)
    with dask_lm.Policy(client, _cfg(tiny["llama"]), tok, init_optimizer=False, init_reference_model=False) as p:
        free = p.generate(batch, greedy=True)
    n = int(lens[0])
    third = int(free["output_ids"][0, n + 2])  # row 0's third greedy token becomes a stop token
    cut = free["output_ids"][0, n : n + 3].tolist().index(third) + 1
    with dask_lm.Policy(
        client, _cfg(tiny["llama"], stop_token_ids=[third]), tok, init_optimizer=False, init_reference_model=False
    ) as p:
        out = p.generate(batch, greedy=True)
    assert int(out["generation_lengths"][0]) == cut and not bool(out["truncated"][0])
    assert out["output_ids"][0, n : n + cut].tolist() == free["output_ids"][0, n : n + cut].tolist()
    assert (out["output_ids"][0, n + cut :] == tok.pad_token_id).all()
    with (
        pytest.raises(ValueError, match="max_new_tokens"),
        dask_lm.Policy(
            client, {**_cfg(tiny["llama"]), "generation": None}, tok, init_optimizer=False, init_reference_model=False
        ) as p,
    ):
        p.generate(batch)


def test_a_stop_string_ends_a_row(client, tiny, tok):
    ids, lens = make_batch(tok, TEXTS[:1])
    batch = BatchedDataDict(input_ids=ids, input_lengths=lens)
    with dask_lm.Policy(client, _cfg(tiny["llama"]), tok, init_optimizer=False, init_reference_model=False) as p:
        free = p.generate(batch, greedy=True)
    n = int(lens[0])
    new = free["output_ids"][0, n : n + int(free["generation_lengths"][0])].tolist()
    k = next(
        i
        for i in range(2, len(new) + 1)
        if tok.decode(new[:i]).strip() and tok.decode(new[:i]).strip() not in tok.decode(new[: i - 1])
    )
    stop = tok.decode(new[:k]).strip()
    with dask_lm.Policy(
        client, _cfg(tiny["llama"], stop_strings=[stop]), tok, init_optimizer=False, init_reference_model=False
    ) as p:
        out = p.generate(batch, greedy=True)
    assert int(out["generation_lengths"][0]) == k and not bool(out["truncated"][0])

"""Refit into SGLang over HTTP, and generation through SGLang, against a fake SGLang 0.5.23 server
(tests/sglang_server.py) that decodes every payload with SGLang's own deserializer and bucket code, loads the
weights into a Hugging Face model and answers as the real server does."""

from __future__ import annotations

import glob
import hashlib
import socket

import pytest
import torch
import transformers
from helpers import TEXTS, hf_logprobs, make_batch, sft_batch
from safetensors.torch import load_file
from sglang_server import start_server

import dask_lm
from dask_lm import BatchedDataDict

# `cluster` is marked per test here, not for the module: the tests without it start no cluster and run in the fast tier
# (pytest -m "not cluster")
BUFFER = 64 * 1024  # several buckets for the tiny model; its 96 KiB embedding is alone in one


def _cfg(model_dir, **extra):
    cfg = {
        "model_name": model_dir,
        "precision": "float32",
        "train_global_batch_size": 4,
        "train_micro_batch_size": 2,
        "max_total_sequence_length": 128,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2}},
    }
    cfg.update(extra)
    return cfg


def _sha(t):
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def tok(tiny):
    return transformers.AutoTokenizer.from_pretrained(tiny["llama"])


@pytest.fixture(scope="module")
def policy(client, tiny, tok):
    p = dask_lm.Policy(client, _cfg(tiny["llama"]), tok)
    yield p
    p.shutdown()


def _refit(policy, urls, tp, **kwargs):
    policy.set_rollout_num_gpus_per_engine(tp)
    return policy.client.gather(policy.stream_weights_via_http(urls, BUFFER, **kwargs))


def _train_step(policy, tok, texts):
    policy.train(sft_batch(tok, texts), dask_lm.NLLLoss())


def _assert_serves_policy(server, policy, tok):
    ids, lens = make_batch(tok, TEXTS)
    want = policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))["logprobs"]
    torch.testing.assert_close(server.logprobs(ids, lens), want, rtol=0, atol=1e-5)


@pytest.mark.cluster
def test_refit_after_train_serves_the_policys_weights(policy, tiny, tok, tmp_path):
    with start_server(tiny["llama"]) as server:
        _train_step(policy, tok, TEXTS[:4])
        stats = _refit(policy, [server.url], 1)
        _assert_serves_policy(server, policy, tok)
        # bit-identical to the checkpoint the policy writes
        policy.save_checkpoint(str(tmp_path / "w"))
        saved = {}
        for f in glob.glob(str(tmp_path / "w" / "*.safetensors")):
            saved.update(load_file(f))
        shas = server.state_dict_sha()
        assert {n: _sha(t) for n, t in saved.items()} == {n: shas[n] for n in saved}
        st = server.state()
        assert st["sessions_begun"] == st["sessions_ended"] == 1 and not st["session_open"]
        assert len(st["updates"]) == stats[0]["buckets"] > 3
        assert all(
            u["num_entries"] == 1
            and u["load_format"] == "flattened_bucket"
            and u["flush_cache"] is False
            and u["weight_version"] == st["weight_version"]
            for u in st["updates"]
        )
        assert ["model.embed_tokens.weight"] in [u["names"] for u in st["updates"]]  # oversized: alone
        assert all(u["bucket_bytes"] <= BUFFER for u in st["updates"] if len(u["names"]) > 1)
        assert st["flushes"] == 1
        sent = [n for u in st["updates"] for n in u["names"]]
        assert sorted(sent) == sorted(saved) and len(sent) == len(set(sent))  # every checkpointed weight, once
        # a second refit after another step: a new weight version, a new session
        _train_step(policy, tok, TEXTS[1:5])
        _refit(policy, [server.url], 1)
        _assert_serves_policy(server, policy, tok)
        st2 = server.state()
        assert st2["sessions_begun"] == 2 and int(st2["weight_version"]) == int(st["weight_version"]) + 1


@pytest.mark.cluster
def test_tp2_engine_gets_one_entry_per_rank(policy, tiny, tok):
    # 2 policy ranks colocated with one TP=2 server: each rank shares its own bucket (shared memory), rank 0 gathers
    # the two entries and posts them; the server decodes each as its own TP rank and checks they agree bit for bit
    with start_server(tiny["llama"], tp=2) as server:
        _refit(policy, [server.url], 2)
        _assert_serves_policy(server, policy, tok)
        st = server.state()
        assert st["updates"] and all(u["num_entries"] == 2 for u in st["updates"])


@pytest.mark.cluster
def test_two_engines_one_per_rank(policy, tiny, tok):
    with start_server(tiny["llama"]) as a, start_server(tiny["llama"]) as b:
        _refit(policy, [a.url, b.url], 1)
        for server in (a, b):
            _assert_serves_policy(server, policy, tok)
            assert server.state()["sessions_ended"] == 1


@pytest.mark.cluster
def test_single_rank_feeds_a_tp2_engine(client, tiny, tok):
    with (
        dask_lm.Policy(client, _cfg(tiny["llama"]), tok, workers_per_node=1) as one,
        start_server(tiny["llama"], tp=2) as server,
    ):
        _train_step(one, tok, TEXTS[:4])
        _refit(one, [server.url], 2, transport="value")  # the bytes inside the payload, as for a remote server
        _assert_serves_policy(server, one, tok)
        assert all(u["num_entries"] == 2 for u in server.state()["updates"])


@pytest.mark.cluster
def test_refused_bucket_raises_the_servers_message_and_ends_the_session(policy, tiny, tok):
    with start_server(tiny["llama"], extra_args=["--fail-update", "2"]) as server:
        with pytest.raises(dask_lm.RefitError, match="injected failure on bucket 2"):
            _refit(policy, [server.url], 1)
        st = server.state()
        assert st["sessions_begun"] == st["sessions_ended"] == 1 and not st["session_open"]
        assert len(st["updates"]) == 2  # nothing sent after the refusal
        # the policy and the server both take the next refit
        _refit(policy, [server.url], 1)
        _assert_serves_policy(server, policy, tok)


@pytest.mark.cluster
def test_server_down_names_the_url(policy):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(dask_lm.RefitError, match=f"{url} did not answer"):
        _refit(policy, [url], 1)


@pytest.mark.cluster
def test_older_server_without_sessions_and_busy_flushes(policy, tiny, tok):
    with start_server(tiny["llama"], extra_args=["--no-sessions", "--busy-flushes", "2"]) as server:
        _refit(policy, [server.url], 1)
        _assert_serves_policy(server, policy, tok)
        st = server.state()
        assert st["sessions_begun"] == 0 and st["flushes"] == 3


@pytest.mark.cluster
def test_bad_arguments_fail_before_any_work(policy):
    policy._rollout_gpus_per_engine = None
    with pytest.raises(ValueError, match="set_rollout_num_gpus_per_engine"):
        policy.stream_weights_via_http(["http://127.0.0.1:1"], BUFFER)
    policy.set_rollout_num_gpus_per_engine(1)
    with pytest.raises(ValueError, match="rollout_engine_urls"):
        policy.stream_weights_via_http("http://127.0.0.1:1", BUFFER)
    with pytest.raises(ValueError, match=r"rollout_engine_urls\[0\]"):
        policy.stream_weights_via_http(["127.0.0.1:1"], BUFFER)
    with pytest.raises(ValueError, match="num_gpus_per_engine"):
        policy.set_rollout_num_gpus_per_engine(0)


# ----------------------------------------------------------------------------------------- generation backend
def _sglang_policy(client, tiny, tok, urls, **generation):
    gen = {"backend": "sglang", "max_new_tokens": 10, "sglang_cfg": {"server_urls": urls}, **generation}
    return dask_lm.Policy(
        client,
        _cfg(tiny["llama"], generation=gen),
        tok,
        init_optimizer=False,
        init_reference_model=False,
        workers_per_node=1,
    )


@pytest.mark.cluster
def test_sglang_generate_greedy_equals_hf_generate(client, tiny, tok):
    ids, lens = make_batch(tok, TEXTS)
    with (
        start_server(tiny["llama"]) as a,
        start_server(tiny["llama"]) as b,
        _sglang_policy(
            client, tiny, tok, [a.url, b.url], sglang_cfg={"server_urls": [a.url, b.url], "rows_per_request": 2}
        ) as policy,
    ):
        out = policy.generate(BatchedDataDict(input_ids=ids, input_lengths=lens), greedy=True)
        na, nb = len(a.state()["generate_requests"]), len(b.state()["generate_requests"])
        assert na >= 1 and nb >= 1 and na + nb == -(-ids.shape[0] // 2)  # chunks of 2 rows, round-robin
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float32)
    for r in range(ids.shape[0]):
        n, g = int(lens[r]), int(out["generation_lengths"][r])
        want = model.generate(
            ids[r : r + 1, :n],
            attention_mask=torch.ones(1, n, dtype=torch.long),
            do_sample=False,
            max_new_tokens=10,
            pad_token_id=tok.pad_token_id,
        )[0, n:]
        assert out["output_ids"][r, :n].tolist() == ids[r, :n].tolist()
        assert out["output_ids"][r, n : n + g].tolist() == want[:g].tolist()
        assert bool(out["truncated"][r]) == (g == 10)
        assert int(out["unpadded_sequence_lengths"][r]) == n + g
        assert (out["output_ids"][r, n + g :] == tok.pad_token_id).all()
    # logprobs of the generated tokens equal a plain HF forward over the returned sequences
    ref, _ = hf_logprobs(tiny["llama"], out["output_ids"], out["unpadded_sequence_lengths"])
    gen_mask = torch.zeros_like(ref, dtype=torch.bool)
    for r in range(ids.shape[0]):
        gen_mask[r, int(lens[r]) : int(out["unpadded_sequence_lengths"][r])] = True
    torch.testing.assert_close(out["logprobs"][gen_mask], ref[gen_mask], rtol=0, atol=1e-5)
    assert (out["logprobs"][~gen_mask] == 0).all()


@pytest.mark.cluster
def test_sglang_generate_sends_only_keys_sglang_accepts(client, tiny, tok):
    ids, lens = make_batch(tok, TEXTS[:3])
    with (
        start_server(tiny["llama"], extra_args=["--drop-first-generate", "1"]) as server,
        _sglang_policy(
            client,
            tiny,
            tok,
            [server.url],
            temperature=0.7,
            top_k=20,
            top_p=0.9,
            stop_token_ids=[5],
            stop_strings=["zz"],
        ) as policy,
    ):
        out = policy.generate(BatchedDataDict(input_ids=ids, input_lengths=lens), seed=3)
        reqs = server.state()["generate_requests"]
    assert out["output_ids"].shape[0] == 3 and (out["generation_lengths"] >= 1).all()
    assert len(reqs) == 2 and reqs[0] == reqs[1]  # the dropped request, then its retry
    common = {
        "max_new_tokens": 10,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "stop_token_ids": [5],
        "stop": ["zz"],
    }
    # a seed per row: SGLang's seeded sampler would give equal prompts equal samples under one seed
    assert reqs[0]["sampling_params"] == [dict(common, sampling_seed=3 + r) for r in range(3)]


@pytest.mark.cluster
def test_sglang_generate_server_down(client, tiny, tok):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    ids, lens = make_batch(tok, TEXTS[:2])
    with (
        _sglang_policy(client, tiny, tok, [url], sglang_cfg={"server_urls": [url], "retries": 1}) as policy,
        pytest.raises(ConnectionError, match=f"{url} is unreachable"),
    ):
        policy.generate(BatchedDataDict(input_ids=ids, input_lengths=lens))


def test_cuda_ipc_payload_passes_sglang_unpickler_and_fails_only_at_the_device(tmp_path):
    """Our pickler's CUDA payload, built without a GPU (see refit_peers.sglang_cuda_payload_check): SGLang's
    restricted unpickler accepts every global in it, and only the device lookup by UUID fails here."""
    import multiprocessing as mp

    import refit_peers

    out = tmp_path / "result.txt"
    proc = mp.get_context("spawn").Process(target=refit_peers.sglang_cuda_payload_check, args=(str(out),))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    result = out.read_text()
    assert "Blocked" not in result
    assert "Invalid device_uuid=GPU-12345678-1234-1234-1234-123456789abc" in result, result

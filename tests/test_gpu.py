"""GPU tier: LocalCUDACluster, NCCL between ranks when there are two GPUs, bf16. Skipped without a GPU.

Tolerances: bf16 has an 8-bit mantissa, so one logit of magnitude ~10 carries an error of ~0.04, and the engine's
batch shapes differ from the reference's (different GEMM tiling). bf16 results are therefore compared with a
single-process bf16 Hugging Face forward on the same GPU at atol 0.1 (max) and 0.01 (mean); float32 on the GPU
matches the CPU float32 reference at atol 1e-3 (TF32 stays off for matmuls by default).
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from helpers import TEXTS, hf_logprobs, make_batch

import dask_lm
from dask_lm import BatchedDataDict

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


@pytest.mark.cluster
@pytest.mark.parametrize("mode", ["plain", "dynamic", "packed", "auto"])
def test_bf16_logprobs_on_cuda_cluster(gpu_client, tiny, mode):
    tok = transformers.AutoTokenizer.from_pretrained(tiny["qwen2"])
    ids, lens = make_batch(tok, TEXTS * 3)
    cfg = {"model_name": tiny["qwen2"], "precision": "bfloat16", "logprob_batch_size": 4}
    if mode == "plain":
        cfg["inference_packing"] = False
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
        # no batching configured: GPU workers pack by themselves (policy.inference_packing auto)
        packed = policy._shard(BatchedDataDict(input_ids=ids, input_lengths=lens), auto_pack=True)[2]
        assert packed == (mode in ("packed", "auto")), (mode, packed)
        # packed bf16 rows run through flash varlen attention (no [T, T] mask) on these GPUs, and every rank
        # (FSDP-sharded ones included) through compiled layers (fused.py)
        flags = gpu_client.run(
            lambda dask_worker: [
                (pw.rank_model.varlen, pw.rank_model.compile) for pw in dask_worker.plugins["dask-lm"].policies.values()
            ]
        )
        assert all(f == [(True, True)] for f in flags.values()), flags
    expected = _hf_bf16_logprobs(tiny["qwen2"], ids, lens)
    diff = (out - expected).abs()
    # against float32 (CPU): the engine's bf16 error must not exceed the plain bf16 forward's by more than noise
    exact, _ = hf_logprobs(tiny["qwen2"], ids, lens)
    ours, theirs = (out - exact).abs(), (expected - exact).abs()
    print(
        f"{mode}: ranks={len(infos)} max|diff|={diff.max():.4f} mean|diff|={diff.mean():.5f}; vs fp32 "
        f"mean {ours.mean():.5f} (HF bf16 {theirs.mean():.5f}) max {ours.max():.4f} (HF bf16 {theirs.max():.4f})"
    )
    assert diff.max() < 0.1 and diff.mean() < 0.01
    assert ours.mean() <= 1.25 * theirs.mean() + 1e-4
    assert torch.equal(ref["reference_logprobs"], out)


def test_compiled_training_layers_do_not_recompile_across_token_counts():
    """Compiled decoder layers trained on micro-batches of 2k tokens, then 8k and 1k: one graph for all of them.
    Inductor's mix-order reduction heuristic (RMSNorm's backward) guarded on the first token count
    (``nrow * hidden >= 5 * 2**20``: 5120 tokens at hidden 1024) and recompiled every layer past it; the compile
    options in ``model/fused.py`` switch that guard off."""
    from torch._dynamo.utils import counters

    from dask_lm.model import fused

    torch._dynamo.reset()
    cfg = transformers.Qwen2Config(
        vocab_size=512,
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg).to("cuda", torch.bfloat16)
    assert fused.compile_decoder_layers(model) == 2
    before = None
    for n in (2048, 8192, 1024):
        ids = torch.randint(0, 512, (1, n), device="cuda")
        with fused.use_compiled(True):
            hidden = model.model(input_ids=ids).last_hidden_state
        hidden.float().square().mean().backward()
        torch.cuda.synchronize()
        if before is None:
            before = counters["stats"]["unique_graphs"]
            assert before > 0  # the layers really were compiled
    assert counters["stats"]["unique_graphs"] == before, "a later token count recompiled the layers"


@pytest.mark.cluster
def test_fp32_on_gpu_matches_cpu_reference_and_topk_and_scores(gpu_client, tiny):
    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    ids, lens = make_batch(tok, TEXTS)
    expected, logits = hf_logprobs(tiny["llama"], ids, lens)
    cfg = {"model_name": tiny["llama"], "precision": "float32", "logprob_batch_size": 2}
    with dask_lm.Policy(gpu_client, cfg, tok) as policy:
        # float32 has no flash varlen kernel: no packing by default (a dense [T, T] mask would cost more)
        assert policy._shard(BatchedDataDict(input_ids=ids, input_lengths=lens), auto_pack=True)[2] is False
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


def _sft(tok, texts):
    from helpers import sft_batch

    return sft_batch(tok, texts)


def _hf_bf16_master_step(model_dir, batch, lr, max_norm):
    """Independent references on the same GPU, from the same weights: (1) a bf16 compute copy of fp32 master
    weights, the globally normalised NLL, backward, clip by the total norm, one SGD step on the masters (HF's
    eager bf16 arithmetic throughout); (2) the same step entirely in fp32, the truth both bf16 steps aim at.
    Returns (bf16 loss, bf16 grad norm, logprobs after the bf16 step, logprobs after the fp32 step)."""
    import math

    ids, lens = batch["input_ids"].cuda(), batch["input_lengths"].cuda()
    mask = torch.arange(ids.shape[1], device="cuda")[None, :] < lens[:, None]
    m = (batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]).cuda()

    def logprobs(model):
        logits = model(ids, attention_mask=mask.long()).logits.float()
        return torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None]).squeeze(2)

    def step(compute_dtype):
        master = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
        compute = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=compute_dtype).cuda()
        loss = -(logprobs(compute) * m).sum() / m.sum()
        loss.backward()
        grads = {n: p.grad.float() for n, p in compute.named_parameters() if p.grad is not None}
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
        coef = min(1.0, max_norm / (norm + 1e-6))
        with torch.no_grad():
            masters = dict(master.named_parameters())
            for n, p in compute.named_parameters():
                if n in grads:
                    masters[n] -= lr * coef * grads[n]
                p.copy_(masters[n])
            after = torch.zeros(ids.shape, device="cuda")
            after[:, 1:] = logprobs(compute)
        out = float(loss.detach()), norm, (after * mask).cpu()
        del master, compute
        torch.cuda.empty_cache()
        return out

    loss, norm, bf16_after = step(torch.bfloat16)
    _, _, fp32_after = step(torch.float32)
    return loss, norm, bf16_after, fp32_after


@pytest.mark.cluster
@pytest.mark.parametrize("n_ranks", [1, 2])
@pytest.mark.parametrize("mode", ["dynamic", "packed"])
def test_bf16_train_step_on_cuda_cluster(gpu_client, tiny, n_ranks, mode):
    """One clipped SGD step in bf16 with fp32 masters, on 1 GPU and on 2 (NCCL, FSDP2 mixed precision), against
    the same step done by hand in one process on the GPU."""
    if n_ranks > torch.cuda.device_count():
        pytest.skip(f"needs {n_ranks} GPUs")
    tok = transformers.AutoTokenizer.from_pretrained(tiny["qwen2"])
    batch = _sft(tok, TEXTS + TEXTS[:3])
    cfg = {
        "model_name": tiny["qwen2"],
        "precision": "bfloat16",
        "train_global_batch_size": 8,
        "train_micro_batch_size": 2,
        "max_total_sequence_length": 128,
        "max_grad_norm": 1.0,
        "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}},
    }
    if mode == "dynamic":
        cfg["dynamic_batching"] = {
            "enabled": True,
            "train_mb_tokens": 96,
            "logprob_mb_tokens": 96,
            "sequence_length_round": 16,
        }
    else:
        cfg["sequence_packing"] = {"enabled": True, "train_mb_tokens": 96, "logprob_mb_tokens": 96}
    with dask_lm.Policy(gpu_client, cfg, tok, workers_per_node=n_ranks) as policy:
        assert policy.data_parallel_size == n_ranks and all(i["device"] == "cuda" for i in policy.worker_info)
        out = policy.train(batch, dask_lm.NLLLoss())
        after = policy.get_logprobs(batch)["logprobs"]
    loss, norm, hf_bf16, fp32 = _hf_bf16_master_step(tiny["qwen2"], batch, 0.5, 1.0)
    # Both bf16 arms (ours: compiled layers, packed varlen rows, fp32-output head with its closed-form backward;
    # HF's: eager, padded, bf16 logits) are held to the same step done in fp32: the step (lr 0.5, so it amplifies
    # bf16 gradient rounding) and the forward after it both count, and ours must stay as close as HF's own
    diff, hf_diff = (after - fp32).abs(), (hf_bf16 - fp32).abs()
    print(
        f"train {mode} ranks={n_ranks}: loss {float(out['loss'][0]):.5f} vs {loss:.5f}, grad norm "
        f"{float(out['grad_norm'][0]):.4f} vs {norm:.4f}, logprobs after vs the fp32 step max|diff|={diff.max():.4f} "
        f"mean={diff.mean():.5f} (HF bf16: {hf_diff.max():.4f} / {hf_diff.mean():.5f}), MFU field {out['mfu']}"
    )
    assert float(out["loss"][0]) == pytest.approx(loss, rel=1e-2)
    assert float(out["grad_norm"][0]) == pytest.approx(norm, rel=3e-2)
    assert diff.max() < max(0.15, 1.5 * hf_diff.max()) and diff.mean() < 1.5 * hf_diff.mean() + 2e-3, (
        f"max {diff.max():.4f} mean {diff.mean():.5f} vs HF bf16 max {hf_diff.max():.4f} mean {hf_diff.mean():.5f}"
    )
    assert out["theoretical_tflops"] and out["mfu"] is not None and out["total_flops"] > 0


@pytest.mark.cluster
def test_offload_frees_and_restores_device_memory(gpu_client, tmp_path):
    """offload_before_refit moves the optimizer state off the GPUs, offload_to_cpu the weights too, and
    prepare_for_training brings both back: measured by get_free_memory_bytes (NVML's view of each device)."""
    from dask_lm.tiny import train_tiny_tokenizer

    tok_dir = train_tiny_tokenizer(str(tmp_path / "tok"))
    cfg = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(tmp_path / "m")
    del model
    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    batch = _sft(tok, TEXTS * 4)
    ranks = min(2, torch.cuda.device_count())
    pcfg = {
        "model_name": str(tmp_path / "m"),
        "precision": "bfloat16",
        "train_global_batch_size": 20,
        "train_micro_batch_size": 5,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-5}},
    }
    with dask_lm.Policy(gpu_client, pcfg, tok, init_reference_model=False) as policy:
        policy.train(batch, dask_lm.NLLLoss())
        trained = policy.get_free_memory_bytes()
        policy.offload_before_refit()
        no_optimizer = policy.get_free_memory_bytes()
        policy.offload_to_cpu()
        nothing = policy.get_free_memory_bytes()
        policy.prepare_for_training()
        back = policy.get_free_memory_bytes()
        lp = policy.get_logprobs(batch)["logprobs"]
    adam = 8 * n_params / ranks  # two fp32 moments per parameter, sharded over the ranks
    print(
        f"free GiB per GPU (min over {ranks}): trained {trained / 2**30:.2f}, optimizer offloaded "
        f"{no_optimizer / 2**30:.2f}, all offloaded {nothing / 2**30:.2f}, back {back / 2**30:.2f}; "
        f"Adam state {adam / 2**30:.2f} GiB/GPU"
    )
    assert no_optimizer - trained > 0.8 * adam
    # then the weights left: at least their bf16 copy (the fp32 masters went with the optimizer state above)
    assert nothing - no_optimizer > 0.8 * 2 * n_params / ranks
    assert trained - back < 0.25 * adam and nothing - back > 0.8 * adam  # all back on the devices
    assert torch.isfinite(lp).all()


@pytest.mark.cluster
def test_async_checkpoint_on_gpus_round_trips(gpu_client, tiny, tmp_path):
    """Async save on the GPUs (DCP in a background thread on the gloo group while NCCL training goes on), then a
    restore on the same ranks reproduces the logprobs and the next step."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny["qwen2"])
    batch = _sft(tok, TEXTS + TEXTS[:3])
    cfg = {
        "model_name": tiny["qwen2"],
        "precision": "bfloat16",
        "train_global_batch_size": 8,
        "train_micro_batch_size": 4,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-3}},
    }
    with dask_lm.Policy(gpu_client, cfg, tok) as policy:
        policy.train(batch, dask_lm.NLLLoss())
        saved = policy.get_logprobs(batch)["logprobs"]
        policy.save_checkpoint(tmp_path / "w", optimizer_path=tmp_path / "o", checkpointing_cfg={"async_save": True})
        nxt = policy.train(batch, dask_lm.NLLLoss())
        policy.finalize_async_save()
    with dask_lm.Policy(gpu_client, cfg, tok, weights_path=tmp_path / "w", optimizer_path=tmp_path / "o") as again:
        torch.testing.assert_close(again.get_logprobs(batch)["logprobs"], saved, atol=0, rtol=0)
        got = again.train(batch, dask_lm.NLLLoss())
        ranks = again.data_parallel_size
    print(f"async checkpoint on {ranks} GPUs: next loss {float(got['loss'][0]):.6f} vs {float(nxt['loss'][0]):.6f}")
    assert float(got["loss"][0]) == pytest.approx(float(nxt["loss"][0]), rel=1e-6)


@pytest.mark.cluster
@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "eager"])
def test_score_parquet_on_gpus_matches_hf_bf16(gpu_client, tiny, tmp_path, compile):
    """score_parquet on the GPU workers (a bf16 replica each) against a same-GPU bf16 HF forward: compiled layers
    and head, and the eager path a short job takes; both through the pipelined micro-batches (the results of one
    copied to the host while the next runs), several per part at this batch size."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = transformers.AutoTokenizer.from_pretrained(tiny["qwen2"])
    texts = TEXTS * 4
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), tmp_path / "d.parquet", row_group_size=5)
    res = dask_lm.score_parquet(
        tmp_path / "d.parquet",
        tmp_path / "out",
        model=tiny["qwen2"],
        client=gpu_client,
        text_column="text",
        id_column="id",
        topk=2,
        progress=False,
        compile=compile,  # a job this short would not compile by default
        batch_tokens=64,  # several micro-batches per part: the pipeline's lag shows
        convention="separate",
    )  # tokenizer(text), as make_batch below
    table = pa.concat_tables(
        [pq.read_table(tmp_path / "out" / f) for f in sorted(os.listdir(tmp_path / "out")) if f.startswith("part-")]
    )
    ids, lens = make_batch(tok, texts)
    expected = _hf_bf16_logprobs(tiny["qwen2"], ids, lens)
    worst = 0.0
    for r in table.to_pylist():
        n = int(lens[r["id"]])
        worst = max(worst, float((torch.tensor(r["logprobs"]) - expected[r["id"], :n]).abs().max()))
    print(
        f"score_parquet on GPUs: {res.rows} rows, {res.parts} parts, max|diff| vs HF bf16 = {worst:.4f}; "
        f"load {res.model_load_seconds:.1f}s, compile {res.compile_seconds:.1f}s"
    )
    assert res.rows == len(texts) and worst < 0.1
    assert (res.compile_seconds > 0) == compile  # compiled layers and head, or nothing compiled


@pytest.mark.cluster
def test_lm_eval_requests_on_gpus_match_hf_fp32(gpu_client, tiny):
    """The lm-eval request engine on the GPU workers in float32 (the compiled greedy head included) against a
    single-process float32 HF forward on the CPU: sums within 1e-3 and the same is_greedy, in request order."""
    from dask_lm.evaluation.engine import RequestEngine

    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float32).eval()
    pairs = []
    for i, text in enumerate(TEXTS * 3):
        ids = tok(text)["input_ids"]
        if len(ids) < 2:
            continue
        cut = 1 + i % (len(ids) - 1)
        pairs.append((ids[:cut], ids[cut:]))
    with torch.no_grad():  # and one greedy continuation, so that is_greedy is true at least once
        ctx = tok(TEXTS[0])["input_ids"]
        pairs.append(
            (ctx, model.generate(torch.tensor([ctx]), max_new_tokens=6, do_sample=False)[0, len(ctx) :].tolist())
        )
    with RequestEngine(tiny["llama"], client=gpu_client, precision="fp32", compile=True, progress=False) as engine:
        got = engine.loglikelihood(pairs)
    for (ctx, cont), (total, greedy) in zip(pairs, got):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ctx + cont])).logits[0].double(), -1)[len(ctx) - 1 : -1]
        want = logp.gather(1, torch.tensor(cont)[:, None]).sum()
        assert abs(total - float(want)) < 1e-3
        assert greedy == bool((logp.argmax(-1) == torch.tensor(cont)).all())
    assert got[-1][1]


@pytest.mark.cluster
def test_generate_on_gpus(gpu_client, tiny):
    """fp32 greedy decoding on the GPU ranks (NCCL-synchronised steps) equals HF generate on one GPU; bf16 sampled
    logprobs equal get_logprobs on the returned sequences."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    ids, lens = make_batch(tok, TEXTS)
    batch = BatchedDataDict(input_ids=ids, input_lengths=lens)
    cfg = {"model_name": tiny["llama"], "precision": "float32", "generation": {"max_new_tokens": 16}}
    with dask_lm.Policy(gpu_client, cfg, tok, init_optimizer=False, init_reference_model=False) as policy:
        out = policy.generate(batch, greedy=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float32).cuda()
    for b in range(ids.shape[0]):
        n, g = int(lens[b]), int(out["generation_lengths"][b])
        want = model.generate(
            ids[b : b + 1, :n].cuda(),
            attention_mask=torch.ones(1, n, dtype=torch.long).cuda(),
            do_sample=False,
            max_new_tokens=16,
            pad_token_id=tok.pad_token_id,
        )[0, n:].cpu()
        assert out["output_ids"][b, n : n + g].tolist() == want[:g].tolist()
    del model
    cfg = {
        "model_name": tiny["llama"],
        "precision": "bfloat16",
        "generation": {"max_new_tokens": 16, "temperature": 0.8, "top_p": 0.9},
    }
    with dask_lm.Policy(gpu_client, cfg, tok, init_optimizer=False, init_reference_model=False) as policy:
        out = policy.generate(batch, seed=1)
        lp = policy.get_logprobs(
            BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
        )["logprobs"]
        ranks = policy.data_parallel_size
    mask = out["logprobs"] != 0
    diff = ((lp - out["logprobs"]) * mask).abs()
    print(
        f"generate on {ranks} GPUs: greedy fp32 equals HF generate; bf16 sampled logprobs vs get_logprobs "
        f"max|diff|={diff.max():.4f} mean={diff.sum() / mask.sum():.5f}"
    )
    assert diff.max() < 0.1


# ----------------------------------------------------------------------------------------- refit on GPUs
@pytest.mark.cluster
def test_full_logits_over_cuda_ipc_match_cpu_reference(gpu_client, tiny):
    """get_full_logits_ipc on CUDA ranks: this process (not the workers') maps each rank's buffer through CUDA IPC
    and reads float32 [S, V] logits equal to the CPU float32 reference; the buffer is reused, then released."""
    from dask_lm.teacher_logits import open_full_logits, open_full_logits_batch

    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    ids, lens = make_batch(tok, TEXTS)
    _, logits = hf_logprobs(tiny["llama"], ids, lens)
    valid = torch.arange(ids.shape[1])[None, :] < lens[:, None]
    cfg = {"model_name": tiny["llama"], "precision": "float32", "logprob_batch_size": 2}
    with dask_lm.Policy(gpu_client, cfg, tok, init_reference_model=False) as policy:
        batch = BatchedDataDict(input_ids=ids, input_lengths=lens)
        entries = policy.get_full_logits_ipc(batch)
        assert entries[0]["teacher_shards"][0]["payload_ipc"]["kind"] == "cuda"
        got = open_full_logits_batch(entries)
        assert got.is_cuda and got.dtype == torch.float32
        torch.testing.assert_close(got.cpu()[valid], logits[valid], atol=1e-3, rtol=0)
        assert torch.all(got.cpu()[~valid] == 0)
        again = policy.get_full_logits_ipc(batch)
        assert again[0]["teacher_shards"][0]["payload_ipc"] == entries[0]["teacher_shards"][0]["payload_ipc"]
        torch.testing.assert_close(open_full_logits(again[1]).cpu()[: lens[1]], logits[1][: lens[1]], atol=1e-3, rtol=0)
        del got
        torch.cuda.synchronize()
        policy.release_ipc_buffer()


@pytest.mark.cluster
def test_qkv_fp8_calibration_on_cuda_ranks_matches_cpu_reference(gpu_client, tiny):
    """calibrate_qkv_fp8_scales on CUDA ranks (fp32: TF32 stays off) equals the CPU fp32 reference's largest
    magnitudes over the real tokens."""
    from helpers import qkv_reference_samples

    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    ids, lens = make_batch(tok, TEXTS)
    cfg = {"model_name": tiny["llama"], "precision": "float32"}
    with dask_lm.Policy(gpu_client, cfg, tok, init_reference_model=False, init_optimizer=False) as policy:
        got = policy.calibrate_qkv_fp8_scales(
            BatchedDataDict(input_ids=ids, input_lengths=lens),
            micro_batch_size=2,
            percentile=100,
            margin=1.0,
            include_q=True,
        )
    ref = qkv_reference_samples(tiny["llama"], ids, lens, len(TEXTS))
    for i, samples in ref.items():
        for n, key in (("q", "attn.q_scale"), ("k", "k_scale"), ("v", "v_scale")):
            assert got["layers"][f"model.layers.{i}.self_attn.{key}"] == pytest.approx(
                max(samples[n]) / 448, rel=1e-4
            ), (i, n)

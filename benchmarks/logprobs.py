"""Logprob throughput on long-tailed row lengths: ``Policy.get_logprobs`` against the loop a competent user writes.

A benchmark, not a test: it prints numbers and asserts nothing about speed. Arm B (dask-lm) runs first, once per
worker count of ``--n-workers`` (a comma-separated list; each count on a fresh cluster, closed before the next);
then, in this process on one device, after the last cluster is closed (the arms never share a GPU), the competent
arm (``user_score.score_rows``: rows longest first, padded batches up to 64k tokens, sdpa, the head and an fp32
logsumexp in 1024-position slices: the headline ratio) and arm A (fixed 16-row batches in data order, right-padded
to the batch max, full-vocab float32 log_softmax + gather: a baseline nobody who knows the job runs, kept as the
second line). The dask-lm / HF ratio lines compare the HF arms with the smallest worker count (1 by default on a CPU
machine); the scaling table at the end gives every count: tokens/s, per worker, per-GPU MFU, the efficiency against
one worker (``tokens/s(N) / (N x tokens/s(1))``) and the per-call driver overhead (the call's wall time less the
slowest rank's time inside its ``get_logprobs``). FLOPs follow perf_anchors.md section 2 (forward, causal half, real
tokens only).

With ``--processes`` (the default) both users also run as whole processes first, on the same rows written to
parquet, while no cluster holds the GPU: the competent user's script (``user_score.py``) and a Policy user's
(``policy_logprobs.py``: ``connect()``, ``Policy``, one ``get_logprobs``, exit), imports, cluster start and model
load included. Their wall-time ratio is what a user who times the two scripts sees.

Examples
--------
    python benchmarks/logprobs.py                                  # CPU: tiny random llama, about 1-2 minutes
    python benchmarks/logprobs.py --n-workers 1,2 --num-rows 32    # CPU: a 1- and a 2-worker arm
    python benchmarks/logprobs.py --shape qwen2.5-0.5b             # GPU: 1, 2, 4, ... workers up to the GPU count
    python benchmarks/logprobs.py --shape qwen2.5-0.5b --n-workers 1,2,4,8
    python benchmarks/logprobs.py --model /models/qwen --mode packed --num-rows 4096 --n-workers 1
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
import time
from typing import Any, Literal

import click
import torch
from common import (  # benchmarks/ is on sys.path when a script in it runs
    GIB,
    H200_BF16_DENSE,
    SHAPE_CHOICES,
    _worker_last_call_seconds,
    _worker_peak_bytes,
    _worker_reset_peak,
    build_model,
    make_rows,
    measured_peak,
    sync,
)
from scaling import (
    N_WORKERS_HELP,
    add_efficiency,
    efficiency_header,
    mfu_columns,
    print_table,
    worker_counts,
)

Mode = Literal["dynamic", "packed", "plain", "auto"]


def forward_flops(cfg: Any, lens: torch.Tensor) -> float:
    """Forward FLOPs over the real tokens: per token 2*N_matmul (lm_head included) + 2*L*heads*head_dim*T."""
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    h, layers, heads = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or h // heads
    per_layer = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * cfg.intermediate_size
    n_matmul = layers * per_layer + h * cfg.vocab_size
    t = lens.double()
    # summing 2*L*heads*hd*T over the T positions of a row gives the causal half: 2*L*heads*hd*T^2 per row
    return float((2 * n_matmul * t + 2 * layers * heads * hd * t * t).sum())


def hf_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``[b, w-1]`` logprobs of tokens 1.. given their prefix. No attention mask: with right padding, causal
    attention already keeps real positions from seeing the pad tail (the anchors' baseline does the same)."""
    logits = model(input_ids=ids, use_cache=False).logits
    return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def run_hf(
    model_dir: str, dtype: torch.dtype, device: torch.device, ids: torch.Tensor, lens: torch.Tensor, batch_size: int
) -> tuple[torch.Tensor, float, int, int]:
    """Arm A: ``(logprobs [N, S] with position 0 = 0, seconds, peak bytes, computed tokens incl. padding)``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    out = torch.zeros(ids.shape, dtype=torch.float32)
    batches = [(s, min(s + batch_size, ids.shape[0])) for s in range(0, ids.shape[0], batch_size)]
    with torch.inference_mode():
        hf_logprobs(model, ids[:4, :64].to(device))  # warm-up: kernel selection, allocator, cuBLAS handles
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        for s, e in batches:
            w = int(lens[s:e].max())
            lp = hf_logprobs(model, ids[s:e, :w].to(device, non_blocking=True))
            # a blocking copy: a non_blocking device-to-host copy may still be in flight when `out` is written
            out[s:e, 1:w] = lp.to("cpu")
        sync(device)
        seconds = time.perf_counter() - t0
    peak = (
        torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    computed = sum((e - s) * int(lens[s:e].max()) for s, e in batches)
    del model
    return out, seconds, peak, computed


def run_competent(
    model_dir: str,
    dtype: torch.dtype,
    device: torch.device,
    ids: torch.Tensor,
    lens: torch.Tensor,
    budget: int = 65536,
    chunk: int = 16384,
) -> tuple[torch.Tensor, float]:
    """The competent arm: what a user who knows the job writes (``user_score.score_rows``: rows longest first,
    padded batches up to ``budget`` tokens, sdpa, the head and an fp32 logsumexp in slices of ``chunk`` tokens).
    ``(logprobs [N, S] with position 0 = 0, seconds)``, timed like arm A: after the load and a warm-up."""
    from user_score import load, score_rows

    model = load(model_dir, dtype, device)
    rows = [ids[i, : int(lens[i])].tolist() for i in range(ids.shape[0])]
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    warm = rows[:4]
    score_rows(model, warm, sorted(range(len(warm)), key=lambda i: -len(warm[i])), budget, chunk, device)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    _sums, per_token, _first = score_rows(model, rows, order, budget, chunk, device, per_token=True)
    sync(device)
    seconds = time.perf_counter() - t0
    out = torch.zeros(ids.shape, dtype=torch.float32)
    for i, lp in enumerate(per_token):
        out[i, 1 : 1 + lp.shape[0]] = lp
    del model
    return out, seconds


def run_processes(
    root: str, model_dir: str, ids: torch.Tensor, lens: torch.Tensor, n_workers: int, hf_budget: int
) -> dict[str, Any]:
    """The two users as whole processes on the same parquet files: wall seconds, time to the first result, and
    how far the Policy's per-row sums are from the competent script's (relative)."""
    import sys

    import pyarrow.parquet as pq
    from score import max_rel_diff, write_dataset
    from score_processes import policy_process, timed_process, user_process

    data = write_dataset(root, ids, lens, 4, None)
    # one throw-away process first: both find torch's and transformers' files in the page cache alike
    timed_process(
        [
            sys.executable,
            "-c",
            "import torch, transformers, pyarrow.parquet; from transformers import AutoModelForCausalLM",
        ],
        "warming the page cache",
    )
    user = user_process(model_dir, data, os.path.join(root, "user.parquet"), hf_budget)
    out = os.path.join(root, "policy.parquet")
    policy = policy_process(model_dir, data, out, n_workers)
    t = pq.read_table(out, columns=["id", "sum_logprob"]).to_pydict()
    res = {
        "user_seconds": user["seconds"],
        "user_first_result_seconds": user["first_row_seconds"],
        "user_phases_at": user["phases_at"],
        "policy_seconds": policy["seconds"],
        "policy_first_result_seconds": policy["first_result_seconds"],
        "policy_phases_at": policy["phases_at"],
        "policy_start_phases": policy["start_phases"],
        "ratio": user["seconds"] / policy["seconds"],
        "max_rel_sum_diff": max_rel_diff(dict(zip(t["id"], t["sum_logprob"])), user["sums"]),
    }
    for who in ("user", "policy"):
        print(
            f"{who} process: {res[who + '_seconds']:.2f}s, result at {res[who + '_first_result_seconds']:.2f}s; "
            "phases ended at " + ", ".join(f"{k} {v:.2f}s" for k, v in res[who + "_phases_at"].items()),
            flush=True,
        )
    print(
        f"whole processes: user script {res['user_seconds']:.2f}s, Policy script {policy['seconds']:.2f}s: "
        f"**{res['ratio']:.2f}x**; sums agree to {res['max_rel_sum_diff']:.2g} (relative)",
        flush=True,
    )
    return res


def run_dask(
    model_dir: str,
    precision: str,
    tokenizer: Any,
    ids: torch.Tensor,
    lens: torch.Tensor,
    *,
    mode: Mode,
    n_workers: int,
    mb_tokens: int,
    hf_batch_size: int,
    max_len: int,
    compile_: bool | None = None,
) -> tuple[torch.Tensor, float, int, int, dict[str, float]]:
    """Arm B: ``(logprobs [N, S], seconds, peak bytes (max over workers), torch threads per worker, timings)``.

    The whole set is scored twice: the first call pays one-time costs at full size (the allocator growing to 32k
    token micro-batches, kernel selection for new shapes); the second is the steady state of a training loop or a
    long scoring job, and the one the ratio uses. Both are printed."""
    import dask_lm
    from dask_lm import BatchedDataDict

    modes: dict[str, dict[str, Any]] = {
        "dynamic": {"dynamic_batching": {"enabled": True, "logprob_mb_tokens": mb_tokens, "sequence_length_round": 64}},
        "packed": {"sequence_packing": {"enabled": True, "logprob_mb_tokens": mb_tokens}},
        # plain = the same fixed row count per micro-batch as arm A, but sharded and run by the engine
        "plain": {"logprob_batch_size": hf_batch_size, "inference_packing": False},
        # auto = nothing configured: what a user gets (packed micro-batches of inference_mb_tokens on GPUs)
        "auto": {"inference_mb_tokens": mb_tokens},
    }
    config = {
        "model_name": model_dir,
        "precision": precision,
        "logprob_chunk_size": 4096,
        "max_total_sequence_length": max_len,
        "inference_compile": compile_,
        **modes[mode],
    }
    client = dask_lm.connect(n_workers=n_workers)
    cluster = client.cluster
    try:
        policy = dask_lm.Policy(client, config, tokenizer)
        warm = BatchedDataDict(input_ids=ids[:8].clone(), input_lengths=lens[:8].clone())
        t0 = time.perf_counter()
        policy.get_logprobs(warm)  # the first call compiles (GPU) and picks kernels: not part of the timing
        print(f"dask-lm first call (8 rows; compilation on a GPU): {time.perf_counter() - t0:.1f}s", flush=True)
        threads = min(client.run(_worker_reset_peak).values())
        data = BatchedDataDict(input_ids=ids, input_lengths=lens)
        t0 = time.perf_counter()
        policy.get_logprobs(data)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = policy.get_logprobs(data)["logprobs"]
        seconds = time.perf_counter() - t0
        rank_seconds = max(client.run(_worker_last_call_seconds).values())
        print(
            f"dask-lm whole set: first call {first:.2f}s, second call {seconds:.2f}s (of which {rank_seconds:.2f}s "
            f"inside the slowest rank's get_logprobs, {seconds - rank_seconds:.3f}s outside the rank's method)",
            flush=True,
        )
        peak = max(client.run(_worker_peak_bytes).values())
        policy.shutdown()  # frees the worker's GPU memory before arm A uses the same device
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    return out, seconds, peak, threads, {"first_call_seconds": first, "rank_seconds": rank_seconds}


@click.command()
@click.option(
    "--shape",
    type=click.Choice(SHAPE_CHOICES),
    default="tiny",
    show_default=True,
    help="Random model to build when --model is not given.",
)
@click.option(
    "--model",
    "model_dir",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="An existing Hugging Face model directory (overrides --shape).",
)
@click.option(
    "--precision",
    type=click.Choice(["auto", "float32", "bfloat16"]),
    default="auto",
    show_default=True,
    help="auto: float32 on CPU, bfloat16 on GPU.",
)
@click.option(
    "--mode",
    type=click.Choice(["dynamic", "packed", "plain", "auto"]),
    default="auto",
    show_default=True,
    help="auto: no batching configured (packed on GPUs, rows per micro-batch on CPUs).",
)
@click.option("--num-rows", type=int, default=None, help="Rows to score [default: 96 on CPU, 2048 on GPU].")
@click.option("--min-len", type=int, default=16, show_default=True)
@click.option("--max-len", type=int, default=2048, show_default=True)
@click.option("--median-len", type=int, default=256, show_default=True, help="Median of the lognormal lengths.")
@click.option("--sigma", type=float, default=1.0, show_default=True, help="Log-space spread of the lengths.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--hf-batch-size", type=int, default=16, show_default=True)
@click.option(
    "--hf-budget",
    type=int,
    default=65536,
    show_default=True,
    help="Padded tokens per batch of the competent HF loop. 64k fits an H200 (139 GiB) at 0.5B; its "
    "fp32 head slice of 64 rows x 1024 positions x 152k vocab alone is 37 GiB, so an 80 GB card "
    "needs 32768 or less, as its user would pick.",
)
@click.option("--mb-tokens", type=int, default=None, help="dask-lm token budget [default: 8192 CPU, 32768 GPU].")
@click.option(
    "--n-workers",
    "n_workers_spec",
    default=None,
    help=f"{N_WORKERS_HELP} [default: all on a GPU machine, 1 on a CPU one].",
)
@click.option(
    "--processes/--no-processes",
    default=True,
    show_default=True,
    help="Also time both users as whole processes (user_score.py, policy_logprobs.py) first.",
)
@click.option(
    "--compile",
    "compile_",
    type=click.Choice(["auto", "on", "off"]),
    default="auto",
    show_default=True,
    help="policy.inference_compile: auto = compiled on GPU ranks.",
)
def main(
    shape: str,
    model_dir: str | None,
    precision: str,
    mode: Mode,
    num_rows: int | None,
    min_len: int,
    max_len: int,
    median_len: int,
    sigma: float,
    seed: int,
    hf_batch_size: int,
    hf_budget: int,
    mb_tokens: int | None,
    n_workers_spec: str | None,
    processes: bool,
    compile_: str,
) -> None:
    import transformers

    from dask_lm.engine.cluster import count_gpus
    from dask_lm.tiny import train_tiny_tokenizer

    # counted through NVML, not torch.cuda: this process keeps no CUDA context while the cluster starts
    on_gpu = count_gpus() > 0
    precision = precision if precision != "auto" else ("bfloat16" if on_gpu else "float32")
    num_rows = num_rows or (2048 if on_gpu else 96)
    mb_tokens = mb_tokens or (32768 if on_gpu else 8192)
    counts, _named = worker_counts(n_workers_spec, on_gpu=on_gpu, cpu_default=1)
    with tempfile.TemporaryDirectory(prefix="dask-lm-bench-") as root:
        t0 = time.perf_counter()
        given_dir = model_dir
        model_dir = model_dir or build_model(shape, root, max_len)
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError):  # a bare model dir: ids are generated directly, only a pad id is needed
            tokenizer = transformers.AutoTokenizer.from_pretrained(train_tiny_tokenizer(os.path.join(root, "tok")))
        pad_id = next((v for v in (tokenizer.pad_token_id, tokenizer.eos_token_id) if isinstance(v, int)), 0)
        cfg = transformers.AutoConfig.from_pretrained(model_dir)
        vocab = (cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg).vocab_size
        ids, lens = make_rows(num_rows, min_len, max_len, median_len, sigma, vocab, pad_id, seed)
        useful = int(lens.sum())
        flops = forward_flops(cfg, lens)
        print(
            f"model {model_dir} ({precision}); rows {num_rows}, useful tokens {useful}, lengths "
            f"min/median/mean/max {int(lens.min())}/{int(lens.median())}/{useful / num_rows:.0f}/{int(lens.max())}, "
            f"forward {flops / 1e12:.3f} TFLOP; setup {time.perf_counter() - t0:.1f}s",
            flush=True,
        )

        whole = run_processes(root, model_dir, ids, lens, counts[0], hf_budget) if processes else None
        arms: list[dict[str, Any]] = []
        for n in counts:  # each on a fresh cluster of n workers, closed before the next (and before arm A)
            print(f"--- dask-lm, {n} worker(s) ---", flush=True)
            lp, sec, peak, threads_n, timings = run_dask(
                model_dir,
                precision,
                tokenizer,
                ids,
                lens,
                mode=mode,
                n_workers=n,
                mb_tokens=mb_tokens,
                hf_batch_size=hf_batch_size,
                max_len=max_len,
                compile_={"auto": None, "on": True, "off": False}[compile_],
            )
            print(f"dask-lm ({mode}, {n} worker(s)): {sec:.2f}s", flush=True)
            arms.append({"workers": n, "logprobs": lp, "seconds": sec, "peak": peak, "threads": threads_n, **timings})
        # the existing single-arm figures (ratio lines, top-level JSON) are the smallest count's
        ref = arms[0]
        n_workers, lp_b, sec_b, peak_b = ref["workers"], ref["logprobs"], ref["seconds"], ref["peak"]
        threads = min(a["threads"] for a in arms)
        device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
        if device.type == "cpu":
            # Dask starts CPU workers with OMP_NUM_THREADS=1; give arm A the same thread count so the ratio
            # compares engines, not core counts
            torch.set_num_threads(threads)
        peak_flops, peak_what = measured_peak(device)
        dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
        lp_c, sec_c = run_competent(model_dir, dtype, device, ids, lens, budget=hf_budget)
        print(
            f"competent HF loop (longest first, {hf_budget:,}-token batches, sdpa, chunked fp32 head): {sec_c:.2f}s",
            flush=True,
        )
        lp_a, sec_a, peak_a, computed_a = run_hf(model_dir, dtype, device, ids, lens, hf_batch_size)
        print(f"plain HF loop: {sec_a:.2f}s", flush=True)
        accuracy = {}
        if dtype != torch.float32:  # both arms against a float32 forward of the same weights, on a sample of rows
            n_ref = min(64, num_rows)
            lp_ref = run_hf(model_dir, torch.float32, device, ids[:n_ref], lens[:n_ref], 8)[0]
            ok = (torch.arange(ids.shape[1])[None, :] < lens[:n_ref, None]) & (torch.arange(ids.shape[1])[None, :] >= 1)
            for arm, lp in (("hf", lp_a), ("dask_lm", lp_b)):
                err = (lp[:n_ref, : ok.shape[1]] - lp_ref[:, : lp.shape[1]]).abs()[ok[:, : lp.shape[1]]]
                accuracy[f"{arm}_vs_fp32_max"], accuracy[f"{arm}_vs_fp32_mean"] = float(err.max()), float(err.mean())

    valid = (torch.arange(ids.shape[1])[None, :] < lens[:, None]) & (torch.arange(ids.shape[1])[None, :] >= 1)
    w = min(lp_a.shape[1], lp_b.shape[1])
    diff = float(((lp_a[:, :w] - lp_b[:, :w]).abs() * valid[:, :w]).max())
    tps_a, tps_b = useful / sec_a, useful / sec_b
    # per device: the dask-lm arm's FLOP rate over its n_workers GPUs (or CPU workers)
    mfu = {
        arm: flops / sec / peak_flops / n
        for arm, sec, n in (("hf", sec_a, 1), ("competent", sec_c, 1), ("dask_lm", sec_b, n_workers))
    }
    wc = min(lp_c.shape[1], lp_b.shape[1])
    diff_c = float(((lp_c[:, :wc] - lp_b[:, :wc]).abs() * valid[:, :wc]).max())
    scaling = []
    for a in arms:
        n, sec = a["workers"], a["seconds"]
        wa = min(lp_a.shape[1], a["logprobs"].shape[1])
        scaling.append(
            {
                "workers": n,
                "seconds": sec,
                "tok_per_s": useful / sec,
                "per_worker_tok_per_s": useful / sec / n,
                "mfu_989": flops / sec / H200_BF16_DENSE / n if device.type == "cuda" else None,
                "mfu_measured": flops / sec / peak_flops / n,
                "ratio_over_hf": (useful / sec) / tps_a,
                "first_call_seconds": a["first_call_seconds"],
                "rank_seconds": a["rank_seconds"],
                # what a scaling model takes as measured: the call's wall time outside the slowest rank's method
                # (driver sharding and scheduling, the transfers in and out, the gather of the results)
                "driver_overhead_seconds": sec - a["rank_seconds"],
                "peak_gib": a["peak"] / GIB,
                "max_abs_logprob_diff_vs_hf": float(
                    ((lp_a[:, :wa] - a["logprobs"][:, :wa]).abs() * valid[:, :wa]).max()
                ),
            }
        )
    n0 = add_efficiency(scaling, "tok_per_s", "efficiency")
    res: dict[str, Any] = {
        "model": given_dir or f"random {shape}",
        "shape": None if given_dir else shape,
        "precision": precision,
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "mode": mode,
        "n_workers": n_workers,
        "n_workers_list": counts,
        "compile": compile_,
        "rows": num_rows,
        "useful_tokens": useful,
        "hf_computed_tokens": computed_a,
        "hf_batch_size": hf_batch_size,
        "hf_budget": hf_budget,
        "mb_tokens": mb_tokens,
        "forward_tflop": flops / 1e12,
        "competent_seconds": sec_c,
        "ratio_dask_lm_over_competent": sec_c / sec_b,
        "max_abs_logprob_diff_vs_competent": diff_c,
        "hf_seconds": sec_a,
        "dask_lm_seconds": sec_b,
        "hf_tok_per_s": tps_a,
        "dask_lm_tok_per_s": tps_b,
        "ratio_dask_lm_over_hf": tps_b / tps_a,
        "engine_cost_hf_over_dask_lm": tps_a / tps_b,
        "hf_peak_gib": peak_a / GIB,
        "dask_lm_peak_gib": peak_b / GIB,
        "measured_peak_tflops": peak_flops / 1e12,
        "measured_peak_kind": peak_what,
        "hf_mfu_measured": mfu["hf"],
        "dask_lm_mfu_measured": mfu["dask_lm"],
        "max_abs_logprob_diff": diff,
        "efficiency_base_workers": n0,
        "scaling": scaling,
        "processes": whole,
    }
    if device.type == "cuda":
        res["hf_mfu_989"] = flops / sec_a / H200_BF16_DENSE
        res["dask_lm_mfu_989"] = flops / sec_b / H200_BF16_DENSE / n_workers
    mem = "peak allocated" if device.type == "cuda" else "process peak RSS"
    print(
        f"\nrows {num_rows}, useful tokens {useful} (plain HF computes {computed_a}: "
        f"{computed_a / useful:.2f}x with padding)"
    )
    print(f"{'arm':<24}{'seconds':>9}{'tok/s':>12}{'GiB ' + mem:>26}{'fwd MFU/device':>16}")
    for name, sec, tps, peak, m in (
        ("competent HF loop", sec_c, useful / sec_c, float("nan"), mfu["competent"]),
        ("plain HF loop", sec_a, tps_a, peak_a, mfu["hf"]),
        (f"dask-lm {mode} x{n_workers}", sec_b, tps_b, peak_b, mfu["dask_lm"]),
    ):
        print(f"{name:<24}{sec:>9.2f}{tps:>12.0f}{peak / GIB:>26.2f}{m:>16.1%}")
    print(
        f"dask-lm / competent HF loop = {sec_c / sec_b:.2f}x (the headline); dask-lm / plain 16-row loop = "
        f"{tps_b / tps_a:.2f}x; max |logprob(competent) - logprob(dask-lm)| = {diff_c:.3g}"
    )
    print(
        f"MFU against measured {peak_what} = {peak_flops / 1e12:.2f} TFLOP/s"
        + (
            f" (vs 989.5 datasheet: HF {res['hf_mfu_989']:.1%}, dask-lm {res['dask_lm_mfu_989']:.1%})"
            if device.type == "cuda"
            else f" on {torch.get_num_threads()} thread(s)"
        )
    )
    print(f"max |logprob(HF) - logprob(dask-lm)| over real positions = {diff:.3g} ({precision})")
    if whole:
        print(
            f"whole processes (imports, cluster, load included): competent script {whole['user_seconds']:.2f}s, "
            f"Policy script {whole['policy_seconds']:.2f}s: {whole['ratio']:.2f}x"
        )
    if accuracy:
        print(
            f"against a float32 forward ({min(64, num_rows)} rows): plain HF {precision} max "
            f"{accuracy['hf_vs_fp32_max']:.3g} / mean {accuracy['hf_vs_fp32_mean']:.3g}; dask-lm max "
            f"{accuracy['dask_lm_vs_fp32_max']:.3g} / mean {accuracy['dask_lm_vs_fp32_mean']:.3g}"
        )
    print_table(
        f"scaling: get_logprobs of the whole set (second call), {useful} useful tokens, dask-lm {mode}, "
        f"a fresh cluster per worker count",
        [
            ("workers", "workers", "{}"),
            ("seconds", "seconds", "{:.2f}"),
            ("tokens/s", "tok_per_s", "{:,.0f}"),
            ("per-worker tokens/s", "per_worker_tok_per_s", "{:,.0f}"),
            *mfu_columns(device.type == "cuda", "mfu_989", "mfu_measured", peak_what),
            (efficiency_header(n0), "efficiency", "{:.1%}"),
            ("vs HF (1 device)", "ratio_over_hf", "{:.2f}x"),
            ("driver overhead/call s", "driver_overhead_seconds", "{:.3f}"),
            ("slowest rank in method s", "rank_seconds", "{:.3f}"),
            ("max |dlogprob| vs HF", "max_abs_logprob_diff_vs_hf", "{:.2g}"),
        ],
        scaling,
        ["driver overhead/call = the call's wall time less the slowest rank's time inside its get_logprobs"],
    )
    print(json.dumps(res))


if __name__ == "__main__":  # Dask's LocalCluster spawns worker processes that re-import this module
    main()

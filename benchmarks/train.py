"""SFT training throughput and MFU: ``Policy.train(NLLLoss)`` against a plain single-process Hugging Face loop.

A benchmark, not a test: it prints numbers and asserts nothing about speed. Both arms train the same rows
(lognormal lengths) for the same optimizer steps with the same recipe: fp32 master weights, bf16 compute, AdamW,
gradient clipping at 1.0, the NLL of every real token normalised over the global batch.

* arm B, dask-lm: ``Policy.train`` on ``--n-workers`` workers (one GPU each), micro-batches cut by
  ``--mode`` (dynamic batching or sequence packing under a ``--mb-tokens`` budget); one warm-up step first.
* arm A, plain HF: the model in fp32 under ``torch.autocast(bfloat16)``, fixed ``--hf-batch-size``-row micro-batches
  in data order padded to their longest row, full-vocabulary logits, fused AdamW; one warm-up step first. It runs
  after the cluster is closed, so the two never share a GPU.

FLOPs are NeMo RL's convention (``dask_lm.engine.metrics``: forward + backward = 3 x forward, causal half
attention, real tokens only), divided by wall time; MFU against the bf16 matmul peak measured in the same run and
against the datasheet 989.5 TFLOP/s.

Examples
--------
    python benchmarks/train.py                                    # CPU: tiny llama, fp32, a minute or two
    python benchmarks/train.py --shape qwen2.5-0.5b               # GPU
    python benchmarks/train.py --shape qwen2.5-1.5b --n-workers 2
"""

from __future__ import annotations

import json
import tempfile
import time
from typing import Any

import click
import torch
from common import (  # benchmarks/ is on sys.path when a script in it runs
    GIB,
    H200_BF16_DENSE,
    SHAPE_CHOICES,
    _worker_peak_bytes,
    _worker_reset_peak,
    build_model,
    make_rows,
    measured_peak,
    sync,
)


def run_hf(model_dir: str, precision: str, device: torch.device, steps: list[tuple[torch.Tensor, torch.Tensor]],
           batch_size: int, lr: float) -> tuple[list[float], float, int]:
    """Arm A: ``(losses of the timed steps, seconds for them, peak bytes)``; ``steps[0]`` is the warm-up."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, fused=device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bfloat16")
    losses, t0 = [], 0.0
    for i, (ids, lens) in enumerate(steps):
        if i == 1:
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = float((lens - 1).clamp(min=0).sum())
        step_loss = 0.0
        for s in range(0, ids.shape[0], batch_size):
            e = min(s + batch_size, ids.shape[0])
            w = int(lens[s:e].max())
            x = ids[s:e, :w].to(device, non_blocking=True)
            mask = (torch.arange(w, device=device)[None, :] < lens[s:e, None].to(device))[:, 1:]
            with autocast:
                logits = model(input_ids=x, use_cache=False).logits
            lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, x[:, 1:, None]).squeeze(-1)
            loss = -(lp * mask).sum() / total
            loss.backward()
            step_loss += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if i >= 1:
            losses.append(step_loss)
    sync(device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    del model, opt
    return losses, seconds, peak


def run_dask(model_dir: str, precision: str, tokenizer: Any, steps: list[tuple[torch.Tensor, torch.Tensor]], *,
             mode: str, n_workers: int, mb_tokens: int, max_len: int, lr: float) -> dict[str, Any]:
    """Arm B: losses, seconds and the train() FLOP figures of the timed steps; ``steps[0]`` is the warm-up."""
    import dask_lm
    from dask_lm import BatchedDataDict

    batching = ({"dynamic_batching": {"enabled": True, "train_mb_tokens": mb_tokens, "logprob_mb_tokens": mb_tokens,
                                      "sequence_length_round": 64}} if mode == "dynamic" else
                {"sequence_packing": {"enabled": True, "train_mb_tokens": mb_tokens, "logprob_mb_tokens": mb_tokens}})
    gbs = steps[0][0].shape[0]
    config = {"model_name": model_dir, "precision": precision, "logprob_chunk_size": 4096,
              "max_total_sequence_length": max_len, "train_global_batch_size": gbs, "train_micro_batch_size": 8,
              "max_grad_norm": 1.0, "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": lr, "fused": True}
                                                  if torch.cuda.is_available() else {"lr": lr}},
              **batching}
    client = dask_lm.connect(n_workers=n_workers)
    cluster = client.cluster
    losses, seconds, flops, per_call, threads = [], 0.0, 0.0, [], []
    try:
        policy = dask_lm.Policy(client, config, tokenizer, init_reference_model=False)
        for i, (ids, lens) in enumerate(steps):
            mask = (torch.arange(ids.shape[1])[None, :] < lens[:, None]).float()
            data = BatchedDataDict(input_ids=ids, input_lengths=lens, token_mask=mask,
                                   sample_mask=torch.ones(ids.shape[0]))
            if i == 1:
                threads.extend(client.run(_worker_reset_peak).values())
            t0 = time.perf_counter()
            out = policy.train(data, dask_lm.NLLLoss())
            elapsed = time.perf_counter() - t0
            if i >= 1:
                losses.append(float(out["loss"][0]))
                seconds += elapsed
                flops += out["total_flops"] or 0.0
                per_call.append({k: out[k] for k in ("train_elapsed_seconds", "achieved_tflops", "mfu")})
        peak = max(client.run(_worker_peak_bytes).values())
        policy.shutdown()
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    return {"losses": losses, "seconds": seconds, "flops": flops, "peak": peak, "per_call": per_call,
            "threads": min(threads) if threads else torch.get_num_threads()}


@click.command()
@click.option("--shape", type=click.Choice(SHAPE_CHOICES), default="tiny", show_default=True)
@click.option("--precision", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True)
@click.option("--mode", type=click.Choice(["dynamic", "packed"]), default="dynamic", show_default=True)
@click.option("--rows-per-step", type=int, default=None, help="Global batch [default: 16 CPU, 128 GPU].")
@click.option("--steps", type=int, default=3, show_default=True, help="Timed optimizer steps (after one warm-up).")
@click.option("--min-len", type=int, default=16, show_default=True)
@click.option("--max-len", type=int, default=2048, show_default=True)
@click.option("--median-len", type=int, default=None, help="[default: 64 CPU, 512 GPU]")
@click.option("--sigma", type=float, default=0.8, show_default=True)
@click.option("--hf-batch-size", type=int, default=8, show_default=True)
@click.option("--mb-tokens", type=int, default=None, help="dask-lm token budget [default: 2048 CPU, 16384 GPU].")
@click.option("--n-workers", type=int, default=1, show_default=True)
@click.option("--lr", type=float, default=1e-5, show_default=True)
def main(shape: str, precision: str, mode: str, rows_per_step: int | None, steps: int, min_len: int, max_len: int,
         median_len: int | None, sigma: float, hf_batch_size: int, mb_tokens: int | None, n_workers: int,
         lr: float) -> None:
    import transformers

    from dask_lm.engine.cluster import count_gpus
    from dask_lm.engine.metrics import flops_per_sequence
    from dask_lm.tiny import train_tiny_tokenizer

    on_gpu = count_gpus() > 0
    precision = precision if precision != "auto" else ("bfloat16" if on_gpu else "float32")
    rows_per_step = rows_per_step or (128 if on_gpu else 16)
    median_len = median_len or (512 if on_gpu else 64)
    max_len = max_len if on_gpu else min(max_len, 256)
    mb_tokens = mb_tokens or (16384 if on_gpu else 2048)
    with tempfile.TemporaryDirectory(prefix="dask-lm-bench-") as root:
        model_dir = build_model(shape, root, max_len)
        tokenizer = transformers.AutoTokenizer.from_pretrained(train_tiny_tokenizer(f"{root}/tok"))
        cfg = transformers.AutoConfig.from_pretrained(model_dir)
        batches = [make_rows(rows_per_step, min_len, max_len, median_len, sigma, cfg.vocab_size, 0, seed)
                   for seed in range(steps + 1)]
        useful = sum(int(lens.sum()) for _ids, lens in batches[1:])
        flops = sum(flops_per_sequence(cfg, int(n)) for _ids, lens in batches[1:] for n in lens)
        print(f"model random {shape} ({precision}); {steps} timed steps of {rows_per_step} rows, {useful} useful "
              f"tokens, training {flops / 1e12:.2f} TFLOP", flush=True)
        b = run_dask(model_dir, precision, tokenizer, batches, mode=mode, n_workers=n_workers, mb_tokens=mb_tokens,
                     max_len=max_len, lr=lr)
        print(f"dask-lm ({mode}, {n_workers} worker(s)): {b['seconds']:.2f}s", flush=True)
        device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
        if device.type == "cpu":  # Dask's CPU workers run one torch thread; so does arm A, for a fair ratio
            torch.set_num_threads(b["threads"])
        peak_flops, peak_what = measured_peak(device)
        losses_a, sec_a, peak_a = run_hf(model_dir, precision, device, batches, hf_batch_size, lr)
        print(f"plain HF loop: {sec_a:.2f}s", flush=True)

    tps_a, tps_b = useful / sec_a, useful / b["seconds"]
    res: dict[str, Any] = {
        "shape": shape, "precision": precision, "device": str(device), "mode": mode, "n_workers": n_workers,
        "rows_per_step": rows_per_step, "steps": steps, "useful_tokens": useful, "train_tflop": flops / 1e12,
        "hf_seconds": sec_a, "dask_lm_seconds": b["seconds"], "hf_tok_per_s": tps_a, "dask_lm_tok_per_s": tps_b,
        "ratio_dask_lm_over_hf": tps_b / tps_a, "hf_peak_gib": peak_a / GIB, "dask_lm_peak_gib": b["peak"] / GIB,
        "measured_peak_tflops": peak_flops / 1e12, "measured_peak_kind": peak_what,
        "hf_mfu_measured": flops / sec_a / peak_flops,
        "dask_lm_mfu_measured": flops / b["seconds"] / peak_flops / n_workers,
        "dask_lm_train_call_mfu": [c["mfu"] for c in b["per_call"]],
        "hf_losses": losses_a, "dask_lm_losses": b["losses"],
        "max_rel_loss_diff": max(abs(x - y) / abs(x) for x, y in zip(losses_a, b["losses"])),
    }
    if device.type == "cuda":
        res["hf_mfu_989"] = flops / sec_a / H200_BF16_DENSE
        res["dask_lm_mfu_989"] = flops / b["seconds"] / H200_BF16_DENSE / n_workers
    print(f"\n{'arm':<22}{'seconds':>9}{'tok/s':>12}{'peak GiB':>10}{'MFU (measured peak)':>22}")
    print(f"{'plain HF loop':<22}{sec_a:>9.2f}{tps_a:>12.0f}{peak_a / GIB:>10.2f}{res['hf_mfu_measured']:>22.1%}")
    print(f"{'dask-lm ' + mode + f' x{n_workers}':<22}{b['seconds']:>9.2f}{tps_b:>12.0f}{b['peak'] / GIB:>10.2f}"
          f"{res['dask_lm_mfu_measured']:>22.1%}")
    print(f"dask-lm / HF = {tps_b / tps_a:.2f}x; MFU per GPU against measured {peak_what} = {peak_flops / 1e12:.1f} "
          f"TFLOP/s; losses HF {[round(x, 4) for x in losses_a]} vs dask-lm {[round(x, 4) for x in b['losses']]}")
    # Policy.train's own timer per step: a step that compiled (the first one does, and Inductor may compile once
    # more when a micro-batch falls on the other side of one of its size guards) shows as an outlier here
    steps_s = [c["train_elapsed_seconds"] for c in b["per_call"]]
    print("dask-lm per timed step (train() timer): " + ", ".join(
        f"{t:.2f}s" + (f" {c['mfu']:.1%} MFU" if c.get("mfu") is not None else "")
        for t, c in zip(steps_s, b["per_call"])))
    print(json.dumps(res))


if __name__ == "__main__":  # Dask's LocalCluster spawns worker processes that re-import this module
    main()

"""SFT training throughput and MFU: ``Policy.train(NLLLoss)`` against a plain single-process Hugging Face loop.

A benchmark, not a test: it prints numbers and asserts nothing about speed. Both arms train the same rows
(lognormal lengths) for the same optimizer steps with the same recipe: fp32 master weights, bf16 compute, AdamW,
gradient clipping at 1.0, the NLL of every real token normalised over the global batch.

* arm B, dask-lm: ``Policy.train`` once per worker count of ``--n-workers`` (a comma-separated list, one GPU per
  worker; each count on a fresh cluster, closed before the next), micro-batches cut by ``--mode`` (dynamic batching
  or sequence packing under a ``--mb-tokens`` budget); one warm-up step first.
* arm A, plain HF: the model in fp32 under ``torch.autocast(bfloat16)``, fixed ``--hf-batch-size``-row micro-batches
  in data order padded to their longest row, full-vocabulary logits, fused AdamW; one warm-up step first. It runs
  once, on one device, after the last cluster is closed, so the two never share a GPU.

Scaling is strong by default: every worker count trains the same global batches of ``--rows-per-step`` rows (which
each count must divide). ``--weak`` scales the global batch with the count instead (``--rows-per-step`` x N rows a
step: the same rows per worker); arm A then trains the 1-worker batches. The dask-lm / HF ratio lines compare arm A
with the smallest count; the scaling table at the end gives every count: tokens/s over the timed optimizer steps,
per worker, per-GPU MFU, the efficiency against one worker (``tokens/s(N) / (N x tokens/s(1))``) and the per-step
driver overhead (a ``train`` call's wall time less the slowest rank's time inside its ``train``).

FLOPs are NeMo RL's convention (``dask_lm.engine.metrics``: forward + backward = 3 x forward, causal half
attention, real tokens only), divided by wall time; MFU against the bf16 matmul peak measured in the same run and
against the datasheet 989.5 TFLOP/s.

Examples
--------
    python benchmarks/train.py                                    # CPU: tiny llama, fp32, a minute or two
    python benchmarks/train.py --n-workers 1,2                    # CPU: a 1- and a 2-worker arm
    python benchmarks/train.py --shape qwen2.5-0.5b               # GPU: 1, 2, 4, ... workers up to the GPU count
    python benchmarks/train.py --shape qwen2.5-1.5b --n-workers 1,2,4,8
    python benchmarks/train.py --shape qwen2.5-1.5b --n-workers 1,2,4,8 --weak   # 128 rows a step per GPU
"""

from __future__ import annotations

import json
import tempfile
from typing import Any

import click
import torch
from common import (  # benchmarks/ is on sys.path when a script in it runs
    GIB,
    H200_BF16_DENSE,
    SHAPE_CHOICES,
    build_model,
    make_rows,
    measured_peak,
)
from scaling import (
    N_WORKERS_HELP,
    add_efficiency,
    efficiency_header,
    mfu_columns,
    print_table,
    worker_counts,
)
from train_arms import run_dask, run_hf


def compare_driver_bytes(
    model_dir: str,
    precision: str,
    tokenizer: Any,
    rows_list: list[int],
    make_batches: Any,
    *,
    mode: str,
    n_workers: int,
    mb_tokens: int,
    max_len: int,
    lr: float,
    scratch: str,
) -> None:
    """``--driver-bytes``: the bytes the driver writes per train() step, with a BatchedDataDict made here and with a
    Dask DataFrame the workers read, at each global batch size of ``rows_list``: the first grows with the tokens
    (the driver scatters every one), the second only with the rows (the plan: lengths, order, micro-batches)."""
    table = []
    for rows in rows_list:
        batches = make_batches(rows)
        for kind in ("batch", "dataframe"):
            print(f"--- {kind} input, {rows} rows a step, {n_workers} worker(s) ---", flush=True)
            arm = run_dask(
                model_dir,
                precision,
                tokenizer,
                batches,
                mode=mode,
                n_workers=n_workers,
                mb_tokens=mb_tokens,
                max_len=max_len,
                lr=lr,
                input_kind=kind,
                scratch=f"{scratch}/bytes-{rows}-{kind}",
            )
            st = arm["steps"]
            table.append(
                {
                    "input": kind,
                    "rows": rows,
                    "tokens": sum(s["tokens"] for s in st) / len(st),
                    "driver_bytes": sum(s["driver_bytes"] for s in st) / len(st),
                    "seconds": sum(s["seconds"] for s in st) / len(st),
                    "losses": arm["losses"],
                }
            )
    for row in table:
        row["bytes_per_token"] = row["driver_bytes"] / row["tokens"]
        row["bytes_per_row"] = row["driver_bytes"] / row["rows"]
    print_table(
        f"driver bytes per train() step ({mode}, {n_workers} worker(s), timed steps after a warm-up)",
        [
            ("input", "input", "{}"),
            ("rows", "rows", "{}"),
            ("tokens", "tokens", "{:,.0f}"),
            ("driver bytes/step", "driver_bytes", "{:,.0f}"),
            ("bytes/token", "bytes_per_token", "{:.1f}"),
            ("bytes/row", "bytes_per_row", "{:.0f}"),
            ("step s", "seconds", "{:.2f}"),
        ],
        table,
        [
            "driver bytes: written by the driver process to the scheduler during the call (tasks, "
            "scattered rows, plans); the losses of both inputs are the same steps': "
            + "; ".join(f"{r['input']}@{r['rows']}: {[round(x, 5) for x in r['losses']]}" for r in table)
        ],
    )
    print(json.dumps({"driver_bytes": table, "mode": mode, "n_workers": n_workers}))


@click.command()
@click.option("--shape", type=click.Choice(SHAPE_CHOICES), default="tiny", show_default=True)
@click.option("--precision", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True)
@click.option("--mode", type=click.Choice(["dynamic", "packed"]), default="dynamic", show_default=True)
@click.option(
    "--rows-per-step", type=int, default=None, help="Global batch (with --weak: per worker) [default: 16 CPU, 128 GPU]."
)
@click.option("--steps", type=int, default=3, show_default=True, help="Timed optimizer steps (after one warm-up).")
@click.option("--min-len", type=int, default=16, show_default=True)
@click.option("--max-len", type=int, default=2048, show_default=True)
@click.option("--median-len", type=int, default=None, help="[default: 64 CPU, 512 GPU]")
@click.option("--sigma", type=float, default=0.8, show_default=True)
@click.option("--hf-batch-size", type=int, default=8, show_default=True)
@click.option("--mb-tokens", type=int, default=None, help="dask-lm token budget [default: 2048 CPU, 16384 GPU].")
@click.option(
    "--n-workers",
    "n_workers_spec",
    default=None,
    help=f"{N_WORKERS_HELP} [default: all on a GPU machine, 1 on a CPU one].",
)
@click.option(
    "--weak",
    is_flag=True,
    help="Weak scaling: a global batch of --rows-per-step x N rows on N workers (default: strong, the "
    "same global batch on every count).",
)
@click.option("--lr", type=float, default=1e-5, show_default=True)
@click.option(
    "--input",
    "input_kind",
    type=click.Choice(["batch", "dataframe"]),
    default="batch",
    show_default=True,
    help="What train() is given: a BatchedDataDict made here, or a Dask DataFrame the workers read from "
    "parquet (the rows then never pass through the driver).",
)
@click.option(
    "--driver-bytes",
    "driver_bytes_rows",
    default=None,
    help="Only compare the driver's bytes per step of both --input kinds at these global batch sizes "
    "(comma-separated rows per step, e.g. 32,128) on the first worker count, and print a table.",
)
def main(
    shape: str,
    precision: str,
    mode: str,
    rows_per_step: int | None,
    steps: int,
    min_len: int,
    max_len: int,
    median_len: int | None,
    sigma: float,
    hf_batch_size: int,
    mb_tokens: int | None,
    n_workers_spec: str | None,
    weak: bool,
    lr: float,
    input_kind: str,
    driver_bytes_rows: str | None,
) -> None:
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
    counts, named = worker_counts(n_workers_spec, on_gpu=on_gpu, cpu_default=1)
    if not weak:  # Policy.train shards each global batch evenly over the ranks
        odd = [n for n in counts if rows_per_step % n]
        if odd and named:
            raise click.BadParameter(
                f"a global batch of {rows_per_step} rows cannot be split over {odd} workers; "
                "pass --rows-per-step a multiple of each count, or --weak",
                param_hint="--n-workers",
            )
        if odd:
            print(f"leaving out {odd} workers: they do not divide the {rows_per_step}-row global batch", flush=True)
            counts = [n for n in counts if n not in odd]
    with tempfile.TemporaryDirectory(prefix="dask-lm-bench-") as root:
        model_dir = build_model(shape, root, max_len)
        tokenizer = transformers.AutoTokenizer.from_pretrained(train_tiny_tokenizer(f"{root}/tok"))
        cfg = transformers.AutoConfig.from_pretrained(model_dir)

        def make_batches(rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
            return [
                make_rows(rows, min_len, max_len, median_len, sigma, cfg.vocab_size, 0, seed)
                for seed in range(steps + 1)
            ]

        def totals(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, float]:
            return (
                sum(int(lens.sum()) for _ids, lens in batches[1:]),
                sum(flops_per_sequence(cfg, int(n)) for _ids, lens in batches[1:] for n in lens),
            )

        if driver_bytes_rows:
            compare_driver_bytes(
                model_dir,
                precision,
                tokenizer,
                [int(r) for r in driver_bytes_rows.split(",")],
                make_batches,
                mode=mode,
                n_workers=counts[0],
                mb_tokens=mb_tokens,
                max_len=max_len,
                lr=lr,
                scratch=root,
            )
            return
        # arm A's batches; strong scaling trains these on every count, weak scaling N x as many rows on N workers
        batches = make_batches(rows_per_step)
        useful, flops = totals(batches)
        print(
            f"model random {shape} ({precision}); {steps} timed steps of {rows_per_step} rows"
            f"{' per worker' if weak else ''}, {useful} useful tokens, training {flops / 1e12:.2f} TFLOP"
            f"{' at 1 worker' if weak else ''}",
            flush=True,
        )
        arms: list[dict[str, Any]] = []
        for n in counts:  # each on a fresh cluster of n workers, closed before the next (and before arm A)
            print(f"--- dask-lm, {n} worker(s) ---", flush=True)
            batches_n = make_batches(rows_per_step * n) if weak and n > 1 else batches
            useful_n, flops_n = totals(batches_n)
            arm = run_dask(
                model_dir,
                precision,
                tokenizer,
                batches_n,
                mode=mode,
                n_workers=n,
                mb_tokens=mb_tokens,
                max_len=max_len,
                lr=lr,
                input_kind=input_kind,
                scratch=f"{root}/frames-{n}",
            )
            print(
                f"dask-lm ({mode}, {n} worker(s), {batches_n[0][0].shape[0]} rows a step, {input_kind} input): "
                f"{arm['seconds']:.2f}s",
                flush=True,
            )
            arms.append(
                {
                    "workers": n,
                    "global_batch": batches_n[0][0].shape[0],
                    "useful": useful_n,
                    "flops": flops_n,
                    "same_rows_as_hf": batches_n is batches,
                    **arm,
                }
            )
        # the existing single-arm figures (ratio lines, top-level JSON) are the smallest count's
        b = arms[0]
        n_workers = b["workers"]
        b["threads"] = min(a["threads"] for a in arms)
        device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
        if device.type == "cpu":  # Dask's CPU workers run one torch thread; so does arm A, for a fair ratio
            torch.set_num_threads(b["threads"])
        peak_flops, peak_what = measured_peak(device)
        losses_a, sec_a, peak_a = run_hf(model_dir, precision, device, batches, hf_batch_size, lr)
        print(f"plain HF loop: {sec_a:.2f}s", flush=True)

    tps_a, tps_b = useful / sec_a, b["useful"] / b["seconds"]

    def loss_diff(losses: list[float]) -> float:
        return max(abs(x - y) / abs(x) for x, y in zip(losses_a, losses))

    scaling = []
    for a in arms:
        n, sec = a["workers"], a["seconds"]
        over = [s["driver_overhead_seconds"] for s in a["steps"]]
        scaling.append(
            {
                "workers": n,
                "global_batch": a["global_batch"],
                "rows_per_worker": a["global_batch"] / n,
                "useful_tokens": a["useful"],
                "train_tflop": a["flops"] / 1e12,
                "seconds": sec,
                "tok_per_s": a["useful"] / sec,
                "per_worker_tok_per_s": a["useful"] / sec / n,
                "mfu_989": a["flops"] / sec / H200_BF16_DENSE / n if device.type == "cuda" else None,
                "mfu_measured": a["flops"] / sec / peak_flops / n,
                "ratio_over_hf": a["useful"] / sec / tps_a,
                "step_seconds": [s["seconds"] for s in a["steps"]],
                "rank_seconds": [s["rank_seconds"] for s in a["steps"]],
                # what a scaling model takes as measured: a step's wall time outside the slowest rank's train()
                "driver_overhead_seconds": over,
                "mean_driver_overhead_seconds": sum(over) / len(over),
                "driver_bytes": [s["driver_bytes"] for s in a["steps"]],
                "mean_driver_bytes": sum(s["driver_bytes"] for s in a["steps"]) / len(a["steps"]),
                "mean_rank_seconds": sum(s["rank_seconds"] for s in a["steps"]) / len(a["steps"]),
                "peak_gib": a["peak"] / GIB,
                "losses": a["losses"],
                # only arms that trained arm A's rows (every arm under strong scaling) have comparable losses
                "max_rel_loss_diff_vs_hf": loss_diff(a["losses"]) if a["same_rows_as_hf"] else None,
            }
        )
    n0 = add_efficiency(scaling, "tok_per_s", "efficiency")
    res: dict[str, Any] = {
        "shape": shape,
        "precision": precision,
        "device": str(device),
        "mode": mode,
        "n_workers": n_workers,
        "input": input_kind,
        "n_workers_list": counts,
        "scaling_kind": "weak" if weak else "strong",
        "rows_per_step": rows_per_step,
        "steps": steps,
        "useful_tokens": useful,
        "train_tflop": flops / 1e12,
        "hf_seconds": sec_a,
        "dask_lm_seconds": b["seconds"],
        "hf_tok_per_s": tps_a,
        "dask_lm_tok_per_s": tps_b,
        "ratio_dask_lm_over_hf": tps_b / tps_a,
        "hf_peak_gib": peak_a / GIB,
        "dask_lm_peak_gib": b["peak"] / GIB,
        "measured_peak_tflops": peak_flops / 1e12,
        "measured_peak_kind": peak_what,
        "hf_mfu_measured": flops / sec_a / peak_flops,
        "dask_lm_mfu_measured": b["flops"] / b["seconds"] / peak_flops / n_workers,
        "dask_lm_train_call_mfu": [c["mfu"] for c in b["per_call"]],
        "hf_losses": losses_a,
        "dask_lm_losses": b["losses"],
        "max_rel_loss_diff": loss_diff(b["losses"]) if b["same_rows_as_hf"] else None,
        "dask_lm_global_batch": b["global_batch"],
        "efficiency_base_workers": n0,
        "scaling": scaling,
    }
    if device.type == "cuda":
        res["hf_mfu_989"] = flops / sec_a / H200_BF16_DENSE
        res["dask_lm_mfu_989"] = b["flops"] / b["seconds"] / H200_BF16_DENSE / n_workers
    print(f"\n{'arm':<22}{'seconds':>9}{'tok/s':>12}{'peak GiB':>10}{'MFU (measured peak)':>22}")
    print(f"{'plain HF loop':<22}{sec_a:>9.2f}{tps_a:>12.0f}{peak_a / GIB:>10.2f}{res['hf_mfu_measured']:>22.1%}")
    print(
        f"{'dask-lm ' + mode + f' x{n_workers}':<22}{b['seconds']:>9.2f}{tps_b:>12.0f}{b['peak'] / GIB:>10.2f}"
        f"{res['dask_lm_mfu_measured']:>22.1%}"
    )
    print(
        f"dask-lm / HF = {tps_b / tps_a:.2f}x; MFU per GPU against measured {peak_what} = {peak_flops / 1e12:.1f} "
        f"TFLOP/s; losses HF {[round(x, 4) for x in losses_a]} vs dask-lm {[round(x, 4) for x in b['losses']]}"
    )
    # Policy.train's own timer per step: a step that compiled (the first one does, and Inductor may compile once
    # more when a micro-batch falls on the other side of one of its size guards) shows as an outlier here
    steps_s = [c["train_elapsed_seconds"] for c in b["per_call"]]
    print(
        "dask-lm per timed step (train() timer): "
        + ", ".join(
            f"{t:.2f}s" + (f" {c['mfu']:.1%} MFU" if c.get("mfu") is not None else "")
            for t, c in zip(steps_s, b["per_call"])
        )
    )
    kind = (
        f"weak scaling: a global batch of {rows_per_step} rows per worker"
        if weak
        else f"strong scaling: the same {rows_per_step}-row global batch on every count"
    )
    print_table(
        f"scaling: {steps} timed optimizer steps, dask-lm {mode}, {kind}; a fresh cluster per worker count",
        [
            ("workers", "workers", "{}"),
            ("global batch", "global_batch", "{}"),
            ("seconds", "seconds", "{:.2f}"),
            ("tokens/s", "tok_per_s", "{:,.0f}"),
            ("per-worker tokens/s", "per_worker_tok_per_s", "{:,.0f}"),
            *mfu_columns(device.type == "cuda", "mfu_989", "mfu_measured", peak_what),
            (efficiency_header(n0), "efficiency", "{:.1%}"),
            ("vs HF (1 device)", "ratio_over_hf", "{:.2f}x"),
            ("driver overhead/step s", "mean_driver_overhead_seconds", "{:.3f}"),
            ("driver bytes/step", "mean_driver_bytes", "{:,.0f}"),
            ("slowest rank in train s", "mean_rank_seconds", "{:.3f}"),
            ("max rel loss diff vs HF", "max_rel_loss_diff_vs_hf", "{:.2g}"),
        ],
        scaling,
        [
            (
                "tokens/s = useful tokens of the timed steps / their wall time; driver overhead/step = a train() "
                "call's wall time less the slowest rank's time inside its train() (mean over the timed steps)"
            ),
            f"driver bytes/step: what the driver process wrote to the scheduler during a train() call ({input_kind} "
            "input; see --driver-bytes)",
        ]
        + (
            ["vs HF under --weak: arm A trains the 1-worker batches; losses compare only arms on the same rows"]
            if weak
            else []
        ),
    )
    print(json.dumps(res))


if __name__ == "__main__":  # Dask's LocalCluster spawns worker processes that re-import this module
    main()

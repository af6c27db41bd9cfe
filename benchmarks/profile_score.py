"""Where the time of a scoring job's scoring phase goes: the worker's partition task profiled in one process.

A benchmark, not a test. It builds a random model of ``--shape`` and ``benchmarks/score.py``'s long-tailed dataset,
plans the job's spans as ``score_parquet`` would (:mod:`dask_lm.scoring.spans`), reads them as the job's read tasks do,
and runs :func:`dask_lm.scoring.scorer.score_partition` on each, without Dask around it (the replica is the one
this process loads). Then it prints:

1. each phase's seconds summed over the spans (read, rows, model, output) and the tokens/s and MFU of the model
   phase and of the whole task, beside the competent user's batches (``benchmarks/user_score.py``'s
   ``score_rows``) on the same rows in the same process;
2. with ``--profile``, a ``torch.profiler`` trace of one span's task: the GPU's busy share and the top kernels
   and host functions, so the idle time between micro-batches shows.

Examples
--------
    python benchmarks/profile_score.py --shape qwen2.5-0.5b
    python benchmarks/profile_score.py --shape qwen2.5-1.5b --compile --profile
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import defaultdict
from typing import Any

import click
import torch
from common import H200_BF16_DENSE, SHAPE_CHOICES, build_model, make_rows, measured_peak, sync
from score import write_dataset


def _job(
    data: str, model_dir: str, out: str, compile_: bool, head: bool, batch_tokens: int | None, chunk_size: int
) -> tuple[Any, list, Any]:
    """The job's inputs, spans and options, as ``score_parquet`` plans them for token ids."""
    from dask_lm.data.messages import ScoreOptions
    from dask_lm.io import parquet as pio
    from dask_lm.scoring import spans

    files = sorted(os.path.join(data, f) for f in os.listdir(data))
    inputs = pio.inspect_inputs(
        files, text_column=None, ids_column="ids", prompt_column=None, response_column=None, id_column="id"
    )
    plan = spans.plan_spans(inputs.partitions, inputs.group_tokens)
    opts = ScoreOptions(
        model=model_dir,
        tokenizer=model_dir,
        precision="bfloat16",
        output=out,
        ids_column="ids",
        id_column="id",
        compile=compile_,
        compile_head=head,
        batch_tokens=batch_tokens,
        chunk_size=chunk_size,
    )
    return inputs, plan, opts


def _read(span: Any, inputs: Any) -> tuple[list[Any], list[int], list[int]]:
    from dask_lm.io import parquet as pio

    pieces, firsts, counts = [], [], []
    for g in span.groups:
        file, group, first, n = inputs.partitions[g]
        piece = pio.read_partition(file, group, first, n, ["id", "ids"])
        if not span.whole:
            piece, first, n = pio.slice_rows(piece, span.offset, span.num_rows), span.first_row, span.num_rows
        pieces.append(piece)
        firsts.append(first)
        counts.append(n)
    return pieces, firsts, counts


def _run_spans(plan: list, inputs: Any, opts: Any, scorer: Any) -> tuple[dict[str, float], float, int]:
    phases: dict[str, float] = defaultdict(float)
    tokens = 0
    dev = torch.device("cuda")
    sync(dev)
    t0 = time.perf_counter()
    for i, span in enumerate(plan):
        t = time.perf_counter()
        pieces, firsts, counts = _read(span, inputs)
        phases["read"] += time.perf_counter() - t
        stats = scorer.score_partition(pieces, firsts, counts, i, span.file, opts)
        for k, v in stats["phases"].items():
            phases[k] += v
        tokens += stats["tokens"]
    sync(dev)
    return dict(phases), time.perf_counter() - t0, tokens


@click.command()
@click.option("--shape", type=click.Choice(SHAPE_CHOICES), default="qwen2.5-0.5b", show_default=True)
@click.option("--num-rows", type=int, default=8192, show_default=True)
@click.option("--files", type=int, default=8, show_default=True)
@click.option("--compile/--no-compile", "compile_", default=False, show_default=True)
@click.option(
    "--compile-head/--no-compile-head",
    "head",
    default=True,
    show_default=True,
    help="Compile the head's fused reductions (what a job of this size chooses).",
)
@click.option("--batch-tokens", type=int, default=None, help="Micro-batch tokens (default: the job's).")
@click.option("--chunk-size", type=int, default=1024, show_default=True, help="Head positions per chunk.")
@click.option("--profile", "profile", is_flag=True, help="Also trace one span's task with torch.profiler.")
@click.option(
    "--user/--no-user",
    default=True,
    show_default=True,
    help="Also time the competent user's batches on the same rows (about as long as the job).",
)
@click.option(
    "--liger-layers/--no-liger-layers",
    default=True,
    show_default=True,
    help="Uncompiled layers' RMSNorms and SwiGLU products through liger-kernel's kernels, as the replica "
    "does by default (dask_lm/model/liger_layers.py); --no-liger-layers: HF's eager modules.",
)
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
def main(
    shape: str,
    num_rows: int,
    files: int,
    compile_: bool,
    head: bool,
    batch_tokens: int | None,
    chunk_size: int,
    profile: bool,
    user: bool,
    liger_layers: bool,
    json_out: str | None,
) -> None:
    import transformers
    from user_score import score_rows

    from dask_lm.engine.metrics import flops_per_sequence
    from dask_lm.scoring import replicas, scorer

    assert torch.cuda.is_available(), "profile_score.py profiles the GPU path"
    dev = torch.device("cuda")
    peak, peak_what = measured_peak(dev)
    res: dict[str, Any] = {"shape": shape, "compile": compile_, "compile_head": head, "peak_tflops": peak / 1e12}
    with tempfile.TemporaryDirectory(prefix="dask-lm-prof-") as root:
        model_dir = build_model(shape, root, 4096)
        cfg = transformers.AutoConfig.from_pretrained(model_dir)
        ids, lens = make_rows(num_rows, 1, 4096, 330, 1.0, cfg.vocab_size, 0, seed=0)
        data = write_dataset(root, ids, lens, files, None)
        flops = sum(flops_per_sequence(cfg, int(n), training=False) for n in lens)
        inputs, plan, opts = _job(data, model_dir, os.path.join(root, "out"), compile_, head, batch_tokens, chunk_size)
        os.makedirs(os.path.join(opts.output, "_errors"), exist_ok=True)
        t = time.perf_counter()
        rep = replicas.Replica(model_dir, model_dir, "bfloat16", compile=compile_, compile_head=head)
        res["replica_seconds"] = time.perf_counter() - t
        if not liger_layers:
            from dask_lm.model import liger_layers as liger

            liger.unpatch(rep.model)
        res["liger_layers"] = rep.liger_layers if liger_layers else 0
        rep.last_used = time.monotonic()
        replicas.replica_for = lambda _opts: rep  # no worker plugin here: every span uses this process's replica
        print(
            f"{shape}: {num_rows} rows, {int(lens.sum())} tokens, {len(plan)} spans; replica in "
            f"{res['replica_seconds']:.1f} s (compile {rep.compile_seconds:.1f} s, {res['liger_layers']} liger "
            f"modules); peak {peak / 1e12:.0f} "
            f"TFLOP/s ({peak_what})",
            flush=True,
        )

        weights = torch.cuda.memory_allocated()
        _run_spans(plan[:1], inputs, opts, scorer)  # warm: the allocator, cuBLAS's heuristics, the kernels
        phases, wall, tokens = _run_spans(plan, inputs, opts, scorer)
        res.update(phases=phases, task_seconds=wall, tokens=tokens)
        res["peak_gib_above_weights"] = (torch.cuda.max_memory_allocated() - weights) / 2**30

        if user:
            rows = [ids[i, : int(lens[i])].tolist() for i in range(ids.shape[0])]
            order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
            model = rep.model
            score_rows(model, rows, order[:64], 65536, 16384, dev)  # warm
            sync(dev)
            t = time.perf_counter()
            score_rows(model, rows, order, 65536, 1024, dev)
            sync(dev)
            res["user_seconds"] = time.perf_counter() - t

        def rate(seconds: float) -> str:
            return (
                f"{tokens / seconds:,.0f} tok/s, MFU {flops / seconds / H200_BF16_DENSE:.1%} "
                f"({flops / seconds / peak:.1%} of measured)"
            )

        print(f"peak device memory above the weights: {res['peak_gib_above_weights']:.2f} GiB")
        print("phase seconds (summed over spans): " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
        print(f"dask-lm task, whole: {wall:.2f} s, {rate(wall)}")
        print(f"dask-lm model phase: {phases['model']:.2f} s, {rate(phases['model'])}")
        if user:
            print(
                f"user's batches (model only, same process): {res['user_seconds']:.2f} s, {rate(res['user_seconds'])}"
            )

        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            big = max(range(len(plan)), key=lambda i: plan[i].num_rows)
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                _, span_wall, _ = _run_spans(plan[big : big + 1], inputs, opts, scorer)
            events = prof.key_averages()
            gpu_us = sum(e.self_device_time_total for e in events)
            print(
                f"span {big} ({plan[big].num_rows} rows): {span_wall:.2f} s under the profiler, GPU kernels "
                f"{gpu_us / 1e6:.2f} s ({gpu_us / 1e6 / span_wall:.0%} busy)"
            )
            print(events.table(sort_by="self_device_time_total", row_limit=18))
            print(events.table(sort_by="self_cpu_time_total", row_limit=18))
            res["profile"] = {"span_seconds": span_wall, "gpu_seconds": gpu_us / 1e6}
    if json_out:
        with open(json_out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

"""Offline scoring throughput: ``dask_lm.score_parquet`` against a plain Hugging Face batched loop, same parquet rows.

A benchmark, not a test: it prints numbers and asserts nothing about speed. Rows of long-tailed (lognormal)
lengths are written as a parquet dataset of token ids (several files, several row groups each). Both arms run end to
end, model loading and reading included, writing one result row per input row:

* arm B, dask-lm: ``score_parquet(ids_column=...)`` on a local cluster, once per worker count of ``--n-workers``
  (a comma-separated list, one GPU per worker; each count on a fresh cluster, closed before the next; 2 CPU workers
  by default on a CPU machine), dynamic micro-batches of ``--batch-tokens`` padded tokens, chunked logprobs. On
  each cluster the job runs cold (fresh worker processes) and then warm (the same workers again);
* arm A, plain HF: ``pandas.read_parquet`` of every file, padded batches of ``--hf-batch-size`` rows in data
  order, full-vocabulary float32 log_softmax + gather, the per-row sums written as one parquet file. It runs once,
  after the last cluster is closed, in this process, on the first GPU (or one CPU thread per worker).

The dask-lm / HF ratio lines compare arm A with the smallest worker count; the scaling table at the end gives every
count, cold and warm: end-to-end tokens/s, per worker, per-GPU MFU (warm), the efficiency against one worker
(``tokens/s(N) / (N x tokens/s(1))``) and the per-partition task overhead: the worker-seconds of the job that no
worker phase accounts for, ``(N x (job seconds - slowest model load - slowest compile) - summed worker phase
seconds) / partitions`` (scheduling, reading the row group, the task's own bookkeeping, and idle workers at the
tail), from ``ScoreResult.seconds``, ``phase_seconds`` and ``parts``. Inductor's on-disk compile cache is shared by
the counts unless ``--fresh-compile-cache``: after the first count, a cold job finds its compiled kernels there.

Examples
--------
    python benchmarks/score.py                                  # CPU, tiny model, 2 workers
    python benchmarks/score.py --n-workers 1,2 --num-rows 128   # CPU: a 1- and a 2-worker arm
    python benchmarks/score.py --shape qwen2.5-0.5b             # GPU: 1, 2, 4, ... workers up to the GPU count
    python benchmarks/score.py --shape qwen2.5-0.5b --n-workers 1,2,4,8 --fresh-compile-cache
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

import click
import torch
from common import (  # benchmarks/ is on sys.path when a script in it runs
    H200_BF16_DENSE,
    SHAPE_CHOICES,
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

CACHE_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def write_dataset(root: str, ids: torch.Tensor, lens: torch.Tensor, files: int, row_group: int) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = os.path.join(root, "data")
    os.makedirs(data)
    rows = [ids[i, : int(lens[i])].tolist() for i in range(ids.shape[0])]
    per = -(-len(rows) // files)
    for f in range(files):
        chunk = rows[f * per:(f + 1) * per]
        table = pa.table({"id": list(range(f * per, f * per + len(chunk))),
                          "ids": pa.array(chunk, pa.list_(pa.int32()))})
        pq.write_table(table, os.path.join(data, f"part-{f:03d}.parquet"), row_group_size=row_group)
    return data


def run_hf(model_dir: str, data: str, out: str, dtype: torch.dtype, device: torch.device, batch_size: int
           ) -> tuple[float, list[float]]:
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    df = pd.concat([pd.read_parquet(os.path.join(data, f)) for f in sorted(os.listdir(data))], ignore_index=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    rows = df["ids"].tolist()
    sums: list[float] = []
    with torch.inference_mode():
        for s in range(0, len(rows), batch_size):
            batch = rows[s:s + batch_size]
            width = max(len(r) for r in batch)
            x = torch.zeros(len(batch), width, dtype=torch.int64)
            for i, r in enumerate(batch):
                x[i, : len(r)] = torch.as_tensor(r)
            x = x.to(device)
            logits = model(input_ids=x, use_cache=False).logits
            lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, x[:, 1:, None]).squeeze(-1)
            mask = torch.arange(width - 1, device=device)[None, :] < torch.tensor([len(r) - 1 for r in batch],
                                                                                  device=device)[:, None]
            sums.extend((lp * mask).double().sum(1).tolist())
    pq.write_table(pa.table({"id": df["id"].tolist(), "sum_logprob": sums}), out)
    sync(device)
    return time.perf_counter() - t0, sums


@click.command()
@click.option("--shape", type=click.Choice(SHAPE_CHOICES), default="tiny", show_default=True)
@click.option("--num-rows", type=int, default=None, help="[default: 256 CPU, 4096 GPU]")
@click.option("--files", type=int, default=4, show_default=True)
@click.option("--row-group", type=int, default=None, help="Rows per row group = per partition [default: 32 CPU, 256 GPU].")
@click.option("--min-len", type=int, default=16, show_default=True)
@click.option("--max-len", type=int, default=2048, show_default=True)
@click.option("--median-len", type=int, default=None, help="[default: 64 CPU, 256 GPU]")
@click.option("--sigma", type=float, default=1.0, show_default=True)
@click.option("--batch-tokens", type=int, default=None, help="dask-lm token budget [default: 4096 CPU, 32768 GPU].")
@click.option("--hf-batch-size", type=int, default=16, show_default=True)
@click.option("--n-workers", "n_workers_spec", default=None,
              help=f"{N_WORKERS_HELP} [default: all on a GPU machine, 2 on a CPU one].")
@click.option("--compile/--no-compile", "compile_", default=None,
              help="score_parquet(compile=...): compiled forward on GPU workers [default: score_parquet's choice, "
              "by the job's size].")
@click.option("--again", is_flag=True, help="Also run the job on a second fresh cluster (on-disk compile cache warm).")
@click.option("--fresh-compile-cache", is_flag=True,
              help="Give each worker count's workers their own empty Inductor / Triton cache directories, so that "
              "every count's cold job compiles from scratch.")
def main(shape: str, num_rows: int | None, files: int, row_group: int | None, min_len: int, max_len: int,
         median_len: int | None, sigma: float, batch_tokens: int | None, hf_batch_size: int,
         n_workers_spec: str | None, compile_: bool | None, again: bool, fresh_compile_cache: bool) -> None:
    import pyarrow.parquet as pq
    import transformers

    import dask_lm
    from dask_lm.engine.cluster import count_gpus
    from dask_lm.engine.metrics import flops_per_sequence

    on_gpu = count_gpus() > 0
    num_rows = num_rows or (4096 if on_gpu else 256)
    row_group = row_group or (256 if on_gpu else 32)
    median_len = median_len or (256 if on_gpu else 64)
    max_len = max_len if on_gpu else min(max_len, 512)
    batch_tokens = batch_tokens or (32768 if on_gpu else 4096)
    precision = "bfloat16" if on_gpu else "float32"
    counts, _named = worker_counts(n_workers_spec, on_gpu=on_gpu, cpu_default=2)
    with tempfile.TemporaryDirectory(prefix="dask-lm-bench-") as root:
        model_dir = build_model(shape, root, max_len)
        cfg = transformers.AutoConfig.from_pretrained(model_dir)
        vocab = cfg.vocab_size
        ids, lens = make_rows(num_rows, min_len, max_len, median_len, sigma, vocab, 0, seed=0)
        data = write_dataset(root, ids, lens, files, row_group)
        useful = int(lens.sum())
        flops = sum(flops_per_sequence(cfg, int(n), training=False) for n in lens)  # forward, every row whole
        print(f"random {shape} ({precision}); {num_rows} rows in {files} files, {useful} tokens, forward "
              f"{flops / 1e12:.3f} TFLOP", flush=True)

        def job(client: Any, tag: str, run: str, startup: dict[str, dict[str, Any]]) -> Any:
            t0 = time.perf_counter()
            res = dask_lm.score_parquet(data, os.path.join(root, f"out-{tag}-{run}"), model=model_dir, client=client,
                                        ids_column="ids", id_column="id", batch_tokens=batch_tokens, progress=False,
                                        compile=compile_)
            total = time.perf_counter() - t0
            startup[run] = {"total": total, "prepare": res.prepare_seconds, "model_load": res.model_load_seconds,
                            "compile": res.compile_seconds, "scoring_after_startup": total - res.prepare_seconds
                            - res.model_load_seconds - res.compile_seconds}
            startup[run]["worker_phases"] = dict(res.phase_seconds)
            print(f"{run}: " + ", ".join(f"{k} {v:.2f}s" for k, v in startup[run].items() if isinstance(v, float))
                  + "; worker time per phase: " + ", ".join(f"{k} {v:.2f}s" for k, v in res.phase_seconds.items()),
                  flush=True)
            # the scaling model's inputs: the job's wall time on the cluster and the worker time its phases account
            # for; the worker-seconds left over, per partition, are the per-task overhead
            startup[run]["job_seconds"] = res.seconds
            startup[run]["partitions"] = res.parts
            return res

        arms: list[dict[str, Any]] = []
        saved_env = {k: os.environ.get(k) for k in CACHE_VARS}
        for n in counts:  # each on fresh clusters of n workers, closed before the next (and before arm A)
            print(f"--- dask-lm, {n} worker(s) ---", flush=True)
            startup: dict[str, dict[str, Any]] = {}
            if fresh_compile_cache:  # the worker processes inherit this process's environment when they start
                for k in CACHE_VARS:
                    os.environ[k] = os.path.join(root, f"cache-{n}", k.lower())
            # cold: the first job on fresh workers pays imports, CUDA initialisation, the model load and the
            # compilation; warm: the same job again on the same workers (the replicas are reloaded, the processes
            # are warm); cold_again (--again): fresh worker processes on a machine that has run the job once, so
            # the compilation mostly comes from Inductor's on-disk cache (what a user's second job sees)
            try:
                for runs in [("cold", "warm")] + ([("cold_again",)] if again else []):
                    client = dask_lm.connect(n_workers=n)
                    try:
                        workers = len(client.scheduler_info(n_workers=-1)["workers"])
                        threads = min(client.run(torch.get_num_threads).values())
                        for run in runs:
                            res = job(client, str(n), run, startup)
                    finally:
                        cluster = client.cluster
                        client.close()
                        cluster.close()
            finally:
                for k, v in saved_env.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            print(f"dask-lm score ({workers} workers): cold {startup['cold']['total']:.2f}s, warm "
                  f"{startup['warm']['total']:.2f}s", flush=True)
            got: dict[int, float] = {}
            for f in sorted(os.listdir(os.path.join(root, f"out-{n}-cold"))):
                if f.startswith("part-"):
                    t = pq.read_table(os.path.join(root, f"out-{n}-cold", f), columns=["id", "sum_logprob"]).to_pydict()
                    got.update(zip(t["id"], t["sum_logprob"]))
            arms.append({"workers": workers, "requested": n, "threads": threads, "parts": res.parts,
                         "startup": startup, "sums": got})
        # the existing single-arm figures (ratio lines, top-level JSON) are the smallest count's
        ref = arms[0]
        workers, startup, got = ref["workers"], ref["startup"], ref["sums"]
        sec_b, sec_warm = startup["cold"]["total"], startup["warm"]["total"]
        threads = min(a["threads"] for a in arms)
        device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
        if device.type == "cpu":
            torch.set_num_threads(threads)
        peak_flops, peak_what = measured_peak(device)
        dtype = torch.bfloat16 if on_gpu else torch.float32
        sec_a, sums = run_hf(model_dir, data, os.path.join(root, "hf.parquet"), dtype, device, hf_batch_size)
        print(f"plain HF loop: {sec_a:.2f}s", flush=True)

    def sum_diff(got: dict[int, float]) -> float:
        return max(abs(got[i] - s) / max(1.0, abs(s)) for i, s in enumerate(sums))

    diff = sum_diff(got)
    scaling = []
    for a in arms:
        n, st = a["workers"], a["startup"]
        row: dict[str, Any] = {"workers": n, "partitions": a["parts"],
                               "max_rel_sum_logprob_diff_vs_hf": sum_diff(a["sums"])}
        for run in ("cold", "warm", "cold_again"):
            if run not in st:
                continue
            r = st[run]
            phases = sum(r["worker_phases"].values())
            busy = r["job_seconds"] - r["model_load"] - r["compile"]
            row.update({
                f"{run}_seconds": r["total"], f"{run}_tok_per_s": useful / r["total"],
                f"{run}_per_worker_tok_per_s": useful / r["total"] / n,
                f"{run}_job_seconds": r["job_seconds"], f"{run}_model_load_seconds": r["model_load"],
                f"{run}_compile_seconds": r["compile"], f"{run}_worker_phase_seconds": r["worker_phases"],
                # worker-seconds of the job outside every phase (and outside the slowest load and compilation),
                # per partition: scheduling, reading the row group, the task's bookkeeping, idle tail workers
                f"{run}_task_overhead_seconds_per_partition": (n * busy - phases) / a["parts"],
                f"{run}_phase_seconds_per_partition": phases / a["parts"],
            })
        row["warm_mfu_989"] = flops / row["warm_seconds"] / H200_BF16_DENSE / n if device.type == "cuda" else None
        row["warm_mfu_measured"] = flops / row["warm_seconds"] / peak_flops / n
        row["cold_ratio_over_hf"], row["warm_ratio_over_hf"] = sec_a / row["cold_seconds"], sec_a / row["warm_seconds"]
        scaling.append(row)
    n0 = add_efficiency(scaling, "cold_tok_per_s", "cold_efficiency")
    add_efficiency(scaling, "warm_tok_per_s", "warm_efficiency")
    out: dict[str, Any] = {
        "shape": shape, "precision": precision, "rows": num_rows, "tokens": useful, "files": files,
        "row_group": row_group, "compile": compile_, "partitions": ref["parts"], "workers": workers,
        "batch_tokens": batch_tokens,
        "hf_batch_size": hf_batch_size, "dask_lm_seconds": sec_b, "hf_seconds": sec_a,
        "dask_lm_rows_per_s": num_rows / sec_b, "hf_rows_per_s": num_rows / sec_a,
        "dask_lm_tok_per_s": useful / sec_b, "hf_tok_per_s": useful / sec_a, "ratio": sec_a / sec_b,
        "dask_lm_warm_seconds": sec_warm, "dask_lm_warm_tok_per_s": useful / sec_warm, "ratio_warm": sec_a / sec_warm,
        "max_rel_sum_logprob_diff": diff, "startup": startup, "n_workers_list": counts,
        "fresh_compile_cache": fresh_compile_cache, "forward_tflop": flops / 1e12,
        "measured_peak_tflops": peak_flops / 1e12, "measured_peak_kind": peak_what,
        "efficiency_base_workers": n0, "scaling": scaling,
    }
    print(f"\n{'arm':<24}{'seconds':>9}{'rows/s':>10}{'tok/s':>12}")
    print(f"{'plain HF loop (1 device)':<24}{sec_a:>9.2f}{num_rows / sec_a:>10.1f}{useful / sec_a:>12.0f}")
    print(f"{f'dask-lm score x{workers} cold':<24}{sec_b:>9.2f}{num_rows / sec_b:>10.1f}{useful / sec_b:>12.0f}")
    print(f"{f'dask-lm score x{workers} warm':<24}{sec_warm:>9.2f}{num_rows / sec_warm:>10.1f}"
          f"{useful / sec_warm:>12.0f}")
    if "cold_again" in startup:
        sec_again = startup["cold_again"]["total"]
        print(f"{f'dask-lm x{workers} cold again':<24}{sec_again:>9.2f}{num_rows / sec_again:>10.1f}"
              f"{useful / sec_again:>12.0f}   ({sec_a / sec_again:.2f}x)")
    print(f"dask-lm / HF = {sec_a / sec_b:.2f}x cold, {sec_a / sec_warm:.2f}x warm, end to end (model loading and "
          "parquet I/O included); "
          f"max relative |sum_logprob| difference {diff:.2g}")
    eff = efficiency_header(n0)
    print_table(
        f"scaling: score_parquet end to end, {useful} tokens in {ref['parts']} partitions, a fresh cluster per "
        f"worker count; cold = fresh workers, warm = the same job again on them",
        [("workers", "workers", "{}"), ("cold s", "cold_seconds", "{:.2f}"), ("warm s", "warm_seconds", "{:.2f}"),
         ("cold tokens/s", "cold_tok_per_s", "{:,.0f}"), ("warm tokens/s", "warm_tok_per_s", "{:,.0f}"),
         ("cold per-worker tokens/s", "cold_per_worker_tok_per_s", "{:,.0f}"),
         ("warm per-worker tokens/s", "warm_per_worker_tok_per_s", "{:,.0f}"),
         *mfu_columns(device.type == "cuda", "warm_mfu_989", "warm_mfu_measured", peak_what, " warm"),
         (f"cold {eff}", "cold_efficiency", "{:.1%}"), (f"warm {eff}", "warm_efficiency", "{:.1%}"),
         ("warm vs HF (1 device)", "warm_ratio_over_hf", "{:.2f}x"),
         ("cold task overhead/partition s", "cold_task_overhead_seconds_per_partition", "{:.3f}"),
         ("warm task overhead/partition s", "warm_task_overhead_seconds_per_partition", "{:.3f}"),
         ("warm phases/partition s", "warm_phase_seconds_per_partition", "{:.3f}")],
        scaling,
        [("task overhead/partition = (N x (job seconds - slowest model load - slowest compile) - summed worker "
          "phase seconds) / partitions")]
        + ([] if fresh_compile_cache or len(counts) == 1 else
           [("the on-disk compile cache is shared: after the first count a cold job finds its kernels compiled "
             "(--fresh-compile-cache gives each count its own)")]))
    print(json.dumps(out))


if __name__ == "__main__":  # Dask's LocalCluster spawns worker processes that re-import this module
    main()

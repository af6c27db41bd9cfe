"""Offline scoring, as the user waits for it: ``dask-lm score`` against the script a competent user would write.

A benchmark, not a test: it prints numbers and asserts nothing about speed. Rows of long-tailed (lognormal)
lengths are written as a parquet dataset of token ids (several files; pyarrow's default row groups unless
``--row-group``). The headline compares whole processes, each started fresh, imports and model load included:

* the competent user's script, ``benchmarks/user_score.py`` (rows sorted longest first, padded batches up to a
  64k-token budget, sdpa in bf16, the head and an fp32 logsumexp in 1024-position slices), run as its own process;
* ``dask-lm score`` (the CLI, its defaults), run as its own process: cold, as a user's first job;
* the same job a second time through ``score_parquet`` on the client of the in-process arms below (``warm``).

Each process arm prints its wall time and its time to the first scored row (for the user's script: its first
batch's sums on the host; for dask-lm: the first part file written), both from the moment the process started.
Then the in-process arms, run end to end, model loading and reading included, writing one result row per input row:

* arm B, dask-lm: ``score_parquet(ids_column=...)`` on a local cluster, once per worker count of ``--n-workers``
  (a comma-separated list, one GPU per worker; each count on a fresh cluster, closed before the next; 2 CPU workers
  by default on a CPU machine), dynamic micro-batches of ``--batch-tokens`` padded tokens, chunked logprobs. On
  each cluster the job runs cold (fresh worker processes) and then warm (the same workers again);
* arm A, plain HF (only with ``--plain-hf``): ``pandas.read_parquet`` of every file, padded batches of
  ``--hf-batch-size`` rows in data order, full-vocabulary float32 log_softmax + gather. A baseline nobody who
  knows the job runs (3.6x padding at the default lengths), kept as the second line it used to be the first of.

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
    python benchmarks/score.py --shape qwen2.5-0.5b             # GPU: the issue-26 job (8192 rows, ~4.4M tokens)
    python benchmarks/score.py --shape qwen2.5-1.5b --no-in-process   # GPU: the whole-process arms only
    python benchmarks/score.py --shape qwen2.5-0.5b --n-workers 1,2,4,8 --fresh-compile-cache
"""

from __future__ import annotations

import json
import os
import sys
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
from scaling import (
    N_WORKERS_HELP,
    add_efficiency,
    efficiency_header,
    mfu_columns,
    print_table,
    worker_counts,
)
from score_processes import cli_process, timed_process, user_process

CACHE_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def write_dataset(root: str, ids: torch.Tensor, lens: torch.Tensor, files: int, row_group: int | None) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = os.path.join(root, "data")
    os.makedirs(data)
    rows = [ids[i, : int(lens[i])].tolist() for i in range(ids.shape[0])]
    per = -(-len(rows) // files)
    for f in range(files):
        chunk = rows[f * per : (f + 1) * per]
        table = pa.table(
            {"id": list(range(f * per, f * per + len(chunk))), "ids": pa.array(chunk, pa.list_(pa.int32()))}
        )
        # row_group None: pyarrow's default (1Mi rows), i.e. one row group per file, as pandas / pyarrow write them
        pq.write_table(table, os.path.join(data, f"part-{f:03d}.parquet"), row_group_size=row_group)
    return data


def max_rel_diff(a: dict[int, float], b: dict[int, float]) -> float:
    return max(abs(a[i] - b[i]) / max(1.0, abs(b[i])) for i in b)


def run_hf(
    model_dir: str, data: str, out: str, dtype: torch.dtype, device: torch.device, batch_size: int
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
            batch = rows[s : s + batch_size]
            width = max(len(r) for r in batch)
            x = torch.zeros(len(batch), width, dtype=torch.int64)
            for i, r in enumerate(batch):
                x[i, : len(r)] = torch.as_tensor(r)
            x = x.to(device)
            logits = model(input_ids=x, use_cache=False).logits
            lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, x[:, 1:, None]).squeeze(-1)
            mask = (
                torch.arange(width - 1, device=device)[None, :]
                < torch.tensor([len(r) - 1 for r in batch], device=device)[:, None]
            )
            sums.extend((lp * mask).double().sum(1).tolist())
    pq.write_table(pa.table({"id": df["id"].tolist(), "sum_logprob": sums}), out)
    sync(device)
    return time.perf_counter() - t0, sums


@click.command()
@click.option("--shape", type=click.Choice(SHAPE_CHOICES), default="tiny", show_default=True)
@click.option("--num-rows", type=int, default=None, help="[default: 256 CPU, 8192 GPU]")
@click.option("--files", type=int, default=None, help="[default: 4 CPU, 8 GPU]")
@click.option(
    "--row-group",
    type=int,
    default=None,
    help="Rows per row group [default: 32 CPU; pyarrow's own (one row group per file) on a GPU].",
)
@click.option("--min-len", type=int, default=16, show_default=True)
@click.option("--max-len", type=int, default=None, help="[default: 512 CPU, 4096 GPU]")
@click.option("--median-len", type=int, default=None, help="[default: 64 CPU, 330 GPU (about 4.4M tokens)]")
@click.option("--sigma", type=float, default=1.0, show_default=True)
@click.option(
    "--batch-tokens",
    type=int,
    default=None,
    help="score_parquet's token budget in the in-process arms [default: the CLI's].",
)
@click.option("--hf-batch-size", type=int, default=16, show_default=True)
@click.option(
    "--n-workers",
    "n_workers_spec",
    default=None,
    help=f"{N_WORKERS_HELP} [default: all on a GPU machine, 2 on a CPU one].",
)
@click.option(
    "--compile/--no-compile",
    "compile_",
    default=None,
    help="score_parquet(compile=...) and the CLI's --compile/--no-compile [default: dask-lm's choice].",
)
@click.option("--again", is_flag=True, help="Also run the job on a second fresh cluster (on-disk compile cache warm).")
@click.option(
    "--fresh-compile-cache",
    is_flag=True,
    help="Give each worker count's workers their own empty Inductor / Triton cache directories, so that "
    "every count's cold job compiles from scratch.",
)
@click.option(
    "--processes/--no-processes",
    default=True,
    show_default=True,
    help="The whole-process arms: the competent user's script and the dask-lm CLI, each a fresh process.",
)
@click.option(
    "--in-process/--no-in-process",
    "in_process",
    default=True,
    show_default=True,
    help="The in-process arms: score_parquet cold and warm on clusters of each --n-workers count.",
)
@click.option(
    "--quick-cold",
    is_flag=True,
    help="The in-process arms' cold job scores the first input file only: "
    "it exists to make the second job warm (the whole-process CLI arm is the cold figure).",
)
@click.option("--plain-hf", is_flag=True, help="Also run the old 16-row, data-order plain HF loop in this process.")
def main(
    shape: str,
    num_rows: int | None,
    files: int | None,
    row_group: int | None,
    min_len: int,
    max_len: int | None,
    median_len: int | None,
    sigma: float,
    batch_tokens: int | None,
    hf_batch_size: int,
    n_workers_spec: str | None,
    compile_: bool | None,
    again: bool,
    fresh_compile_cache: bool,
    processes: bool,
    in_process: bool,
    quick_cold: bool,
    plain_hf: bool,
) -> None:
    import transformers

    import dask_lm
    from dask_lm.engine.cluster import count_gpus
    from dask_lm.engine.metrics import flops_per_sequence

    on_gpu = count_gpus() > 0
    num_rows = num_rows or (8192 if on_gpu else 256)
    files = files or (8 if on_gpu else 4)
    row_group = row_group or (None if on_gpu else 32)
    median_len = median_len or (330 if on_gpu else 64)
    max_len = max_len or (4096 if on_gpu else 512)
    precision = "bfloat16" if on_gpu else "float32"
    counts, _named = worker_counts(n_workers_spec, on_gpu=on_gpu, cpu_default=2)
    compile_flag = [] if compile_ is None else ["--compile" if compile_ else "--no-compile"]
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="dask-lm-bench-") as root:
        model_dir = build_model(shape, root, max_len)
        out["weights_gib"] = (
            sum(
                os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir) if f.endswith(".safetensors")
            )
            / GIB
        )
        cfg = transformers.AutoConfig.from_pretrained(model_dir)
        vocab = cfg.vocab_size
        ids, lens = make_rows(num_rows, min_len, max_len, median_len, sigma, vocab, 0, seed=0)
        data = write_dataset(root, ids, lens, files, row_group)
        useful = int(lens.sum())
        flops = sum(flops_per_sequence(cfg, int(n), training=False) for n in lens)  # forward, every row whole
        print(
            f"random {shape} ({precision}); {num_rows} rows in {files} files, {useful} tokens, forward "
            f"{flops / 1e12:.3f} TFLOP",
            flush=True,
        )
        out.update(
            {
                "shape": shape,
                "precision": precision,
                "rows": num_rows,
                "tokens": useful,
                "files": files,
                "row_group": row_group,
                "compile": compile_,
                "forward_tflop": flops / 1e12,
            }
        )

        user = cli = None
        if processes:  # first, while no cluster holds the GPU
            # one throw-away process first: the arms then find torch's and transformers' files in the page cache
            # alike (whichever ran first would otherwise pay the cold reads of the libraries for both)
            timed_process(
                [
                    sys.executable,
                    "-c",
                    "import torch, transformers, pyarrow.parquet; from transformers import AutoModelForCausalLM",
                ],
                "warming the page cache",
            )
            user = user_process(model_dir, data, os.path.join(root, "user.parquet"))
            print(
                f"user script (process): {user['seconds']:.2f}s, first batch at {user['first_row_seconds']:.2f}s; "
                "phases ended at " + ", ".join(f"{k} {v:.2f}s" for k, v in user["phases_at"].items()),
                flush=True,
            )
            cli = cli_process(model_dir, data, os.path.join(root, "out-cli"), compile_flag)
            print(
                f"dask-lm score (process): {cli['seconds']:.2f}s, first part at {cli['first_row_seconds']:.2f}s; "
                f"start phases {cli['start_phases']}; model load {cli['model_load']:.2f}s "
                f"{cli['model_load_phases']}, compile "
                f"{cli['compile']:.2f}s, scoring {cli['scoring']:.2f}s",
                flush=True,
            )
            cli["max_rel_sum_logprob_diff_vs_user"] = max_rel_diff(cli["sums"], user["sums"])

        arms: list[dict[str, Any]] = []
        if in_process:
            arms = in_process_arms(
                dask_lm, root, model_dir, data, counts, batch_tokens, compile_, again, fresh_compile_cache, quick_cold
            )
        device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
        if device.type == "cpu" and arms:
            torch.set_num_threads(min(a["threads"] for a in arms))
        peak_flops, peak_what = measured_peak(device)
        sec_a = sums = None
        if plain_hf:
            dtype = torch.bfloat16 if on_gpu else torch.float32
            sec_a, plain = run_hf(model_dir, data, os.path.join(root, "hf.parquet"), dtype, device, hf_batch_size)
            sums = dict(enumerate(plain))
            print(f"plain HF loop (16-row batches, data order): {sec_a:.2f}s", flush=True)

    out.update({"measured_peak_tflops": peak_flops / 1e12, "measured_peak_kind": peak_what})
    reference = user["sums"] if user else sums
    rows_out: list[tuple[str, float, float | None, str]] = []
    if user and cli:
        rows_out.append(("competent user script (process)", user["seconds"], user["first_row_seconds"], "1.00x"))
        rows_out.append(
            (
                "dask-lm score, cold (process)",
                cli["seconds"],
                cli["first_row_seconds"],
                f"{user['seconds'] / cli['seconds']:.2f}x",
            )
        )
        out["user_process"] = {k: v for k, v in user.items() if k != "sums"}
        out["cli_process"] = {k: v for k, v in cli.items() if k != "sums"}
        out["ratio_cold_vs_user"] = user["seconds"] / cli["seconds"]
    if arms:
        ref = arms[0]
        warm = ref["startup"]["warm"]
        rows_out.append(
            (
                f"score_parquet, 2nd job, same client (x{ref['workers']})",
                warm["total"],
                None,
                f"{user['seconds'] / warm['total']:.2f}x" if user else "-",
            )
        )
        if user:
            out["ratio_warm_vs_user"] = user["seconds"] / warm["total"]
        scoring = warm["total"] - warm["prepare"] - warm["model_load"] - warm["compile"]
        out["warm_peak_device_gib"] = warm.get("peak_device_gib")
        out["warm_scoring_phase"] = {
            "seconds": scoring,
            "tok_per_s": useful / scoring,
            "mfu_989": flops / scoring / H200_BF16_DENSE if on_gpu else None,
            "mfu_measured": flops / scoring / peak_flops,
        }
    if sec_a is not None:
        rows_out.append(
            (
                "plain HF loop, 16-row batches (in-process)",
                sec_a,
                None,
                f"{user['seconds'] / sec_a:.2f}x" if user else "1.00x",
            )
        )
        out["plain_hf_seconds"] = sec_a
    print(f"\n{'arm':<48}{'seconds':>9}{'first row s':>13}{'tok/s':>12}{'vs user':>9}")
    for name, sec, first, ratio in rows_out:
        print(f"{name:<48}{sec:>9.2f}{'-' if first is None else f'{first:.2f}':>13}{useful / sec:>12,.0f}{ratio:>9}")
    if out.get("warm_peak_device_gib") is not None:
        print(
            f"scoring replica, warm job: peak device memory {out['warm_peak_device_gib']:.2f} GiB, weights "
            f"{out['weights_gib']:.2f} GiB (+{out['warm_peak_device_gib'] - out['weights_gib']:.2f} GiB)"
        )
    if "warm_scoring_phase" in out:
        w = out["warm_scoring_phase"]
        mfu = f"{w['mfu_989']:.1%} of 989.5 TFLOP/s, " if w["mfu_989"] is not None else ""
        print(
            f"warm scoring phase: {w['seconds']:.2f}s, {w['tok_per_s']:,.0f} tok/s, {mfu}{w['mfu_measured']:.1%} "
            f"of the measured {peak_what} peak ({peak_flops / 1e12:.0f} TFLOP/s)"
        )
    if reference is not None and arms:
        out["max_rel_sum_logprob_diff_vs_reference"] = max_rel_diff(arms[0]["sums"], reference)
        print(
            f"max relative |sum_logprob| difference, score_parquet vs the "
            f"{'user script' if user else 'plain HF loop'}: {out['max_rel_sum_logprob_diff_vs_reference']:.2g}"
        )
    if arms:
        out["scaling"] = scaling_table(
            arms, useful, flops, device, peak_flops, peak_what, fresh_compile_cache, counts, reference
        )
    print(json.dumps(out))


def on_gpu_workers(client: Any) -> bool:
    from dask_lm.workers.tasks import rank_info

    return any(i.get("device") == "cuda" for i in client.run(rank_info).values())


def in_process_arms(
    dask_lm: Any,
    root: str,
    model_dir: str,
    data: str,
    counts: list[int],
    batch_tokens: int | None,
    compile_: bool | None,
    again: bool,
    fresh_compile_cache: bool,
    quick_cold: bool = False,
) -> list[dict[str, Any]]:
    """score_parquet cold, then warm (and cold_again with ``again``) on a fresh cluster per worker count."""
    import pyarrow.parquet as pq

    def job(client: Any, tag: str, run: str, startup: dict[str, dict[str, Any]]) -> Any:
        t0 = time.perf_counter()
        kw = {} if batch_tokens is None else {"batch_tokens": batch_tokens}
        source = sorted(os.path.join(data, f) for f in os.listdir(data))[0] if quick_cold and run == "cold" else data
        res = dask_lm.score_parquet(
            source,
            os.path.join(root, f"out-{tag}-{run}"),
            model=model_dir,
            client=client,
            ids_column="ids",
            id_column="id",
            progress=False,
            compile=compile_,
            **kw,
        )
        total = time.perf_counter() - t0
        startup[run] = {
            "total": total,
            "prepare": res.prepare_seconds,
            "model_load": res.model_load_seconds,
            "compile": res.compile_seconds,
            "scoring_after_startup": total - res.prepare_seconds - res.model_load_seconds - res.compile_seconds,
        }
        startup[run]["worker_phases"] = dict(res.phase_seconds)
        print(
            f"{run}: "
            + ", ".join(f"{k} {v:.2f}s" for k, v in startup[run].items() if isinstance(v, float))
            + "; worker time per phase: "
            + ", ".join(f"{k} {v:.2f}s" for k, v in res.phase_seconds.items()),
            flush=True,
        )
        # the scaling model's inputs: the job's wall time on the cluster and the worker time its phases account
        # for; the worker-seconds left over, per partition, are the per-task overhead
        startup[run]["job_seconds"] = res.seconds
        startup[run]["partitions"] = res.parts
        return res

    arms: list[dict[str, Any]] = []
    saved_env = {k: os.environ.get(k) for k in CACHE_VARS}
    for n in counts:  # each on fresh clusters of n workers, closed before the next
        print(f"--- dask-lm in this process, {n} worker(s) ---", flush=True)
        startup: dict[str, dict[str, Any]] = {}
        if fresh_compile_cache:  # the worker processes inherit this process's environment when they start
            for k in CACHE_VARS:
                os.environ[k] = os.path.join(root, f"cache-{n}", k.lower())
        # cold: the first job on fresh workers pays imports, CUDA initialisation, the model load and the
        # compilation; warm: the same job again on the same workers (what a user's second job on one client
        # sees); cold_again (--again): fresh worker processes on a machine that has run the job once
        try:
            for runs in [("cold", "warm")] + ([("cold_again",)] if again else []):
                client = dask_lm.connect(n_workers=n)
                try:
                    workers = len(client.scheduler_info(n_workers=-1)["workers"])
                    threads = min(client.run(torch.get_num_threads).values())
                    for run in runs:
                        if run == "warm":
                            client.run(_worker_reset_peak)
                        res = job(client, str(n), run, startup)
                        if run == "warm" and on_gpu_workers(client):
                            startup[run]["peak_device_gib"] = max(client.run(_worker_peak_bytes).values()) / GIB
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
        print(
            f"score_parquet ({workers} workers): cold {startup['cold']['total']:.2f}s, warm "
            f"{startup['warm']['total']:.2f}s",
            flush=True,
        )
        got: dict[int, float] = {}
        checked = os.path.join(root, f"out-{n}-{'warm' if quick_cold else 'cold'}")  # the whole job's output
        for f in sorted(os.listdir(checked)):
            if f.startswith("part-"):
                t = pq.read_table(os.path.join(checked, f), columns=["id", "sum_logprob"]).to_pydict()
                got.update(zip(t["id"], t["sum_logprob"]))
        arms.append(
            {
                "workers": workers,
                "requested": n,
                "threads": threads,
                "parts": res.parts,
                "startup": startup,
                "sums": got,
            }
        )
    return arms


def scaling_table(
    arms: list[dict[str, Any]],
    useful: int,
    flops: float,
    device: torch.device,
    peak_flops: float,
    peak_what: str,
    fresh_compile_cache: bool,
    counts: list[int],
    reference: dict[int, float] | None,
) -> list[dict[str, Any]]:
    scaling = []
    for a in arms:
        n, st = a["workers"], a["startup"]
        row: dict[str, Any] = {"workers": n, "partitions": a["parts"]}
        if reference is not None:
            row["max_rel_sum_logprob_diff"] = max_rel_diff(a["sums"], reference)
        for run in ("cold", "warm", "cold_again"):
            if run not in st:
                continue
            r = st[run]
            phases = sum(r["worker_phases"].values())
            busy = r["job_seconds"] - r["model_load"] - r["compile"]
            row.update(
                {
                    f"{run}_seconds": r["total"],
                    f"{run}_tok_per_s": useful / r["total"],
                    f"{run}_per_worker_tok_per_s": useful / r["total"] / n,
                    f"{run}_job_seconds": r["job_seconds"],
                    f"{run}_model_load_seconds": r["model_load"],
                    f"{run}_compile_seconds": r["compile"],
                    f"{run}_worker_phase_seconds": r["worker_phases"],
                    # worker-seconds of the job outside every phase (and outside the slowest load and compilation),
                    # per partition: scheduling, reading the row group, the task's bookkeeping, idle tail workers
                    f"{run}_task_overhead_seconds_per_partition": (n * busy - phases) / a["parts"],
                    f"{run}_phase_seconds_per_partition": phases / a["parts"],
                }
            )
        row["warm_mfu_989"] = flops / row["warm_seconds"] / H200_BF16_DENSE / n if device.type == "cuda" else None
        row["warm_mfu_measured"] = flops / row["warm_seconds"] / peak_flops / n
        scaling.append(row)
    n0 = add_efficiency(scaling, "cold_tok_per_s", "cold_efficiency")
    add_efficiency(scaling, "warm_tok_per_s", "warm_efficiency")
    eff = efficiency_header(n0)
    print_table(
        f"scaling: score_parquet end to end, {useful} tokens in {arms[0]['parts']} partitions, a fresh cluster per "
        f"worker count; cold = fresh workers, warm = the same job again on them",
        [
            ("workers", "workers", "{}"),
            ("cold s", "cold_seconds", "{:.2f}"),
            ("warm s", "warm_seconds", "{:.2f}"),
            ("cold tokens/s", "cold_tok_per_s", "{:,.0f}"),
            ("warm tokens/s", "warm_tok_per_s", "{:,.0f}"),
            ("cold per-worker tokens/s", "cold_per_worker_tok_per_s", "{:,.0f}"),
            ("warm per-worker tokens/s", "warm_per_worker_tok_per_s", "{:,.0f}"),
            *mfu_columns(device.type == "cuda", "warm_mfu_989", "warm_mfu_measured", peak_what, " warm"),
            (f"cold {eff}", "cold_efficiency", "{:.1%}"),
            (f"warm {eff}", "warm_efficiency", "{:.1%}"),
            ("cold task overhead/partition s", "cold_task_overhead_seconds_per_partition", "{:.3f}"),
            ("warm task overhead/partition s", "warm_task_overhead_seconds_per_partition", "{:.3f}"),
            ("warm phases/partition s", "warm_phase_seconds_per_partition", "{:.3f}"),
        ],
        scaling,
        [
            (
                "task overhead/partition = (N x (job seconds - slowest model load - slowest compile) - summed worker "
                "phase seconds) / partitions"
            )
        ]
        + (
            []
            if fresh_compile_cache or len(counts) == 1
            else [
                (
                    "the on-disk compile cache is shared: after the first count a cold job finds its kernels compiled "
                    "(--fresh-compile-cache gives each count its own)"
                )
            ]
        ),
    )
    return scaling


if __name__ == "__main__":  # Dask's LocalCluster spawns worker processes that re-import this module
    main()

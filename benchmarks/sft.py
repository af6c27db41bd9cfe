"""End-to-end SFT over parquet: ``dask_lm.sft.job.sft_parquet`` (what ``dask-lm sft`` runs) against a plain HF loop.

A benchmark, not a test: it prints numbers and asserts nothing about speed. It writes ``--rows`` text rows of
lognormal lengths (random words) as a parquet dataset, puts a tokenizer trained on the fly next to a random model of
``--shape``, and trains one epoch:

* dask-lm: ``sft_parquet`` on a local cluster (tokenizing on the workers, dynamic batching, compiled training
  layers on GPUs, a final checkpoint), timed end to end and inside ``Policy.train``;
* plain HF: ``benchmarks/train.py``'s loop (fp32 weights under bf16 autocast, fixed micro-batches, fused AdamW)
  over the same token rows in the same global batches, after the cluster is closed; its first step is a warm-up
  and is not timed (dask-lm's first step, and the compilation of its layers on a GPU, are).

FLOPs are NeMo RL's convention (``dask_lm.engine.metrics.flops_per_sequence``: forward + backward, real tokens);
MFU against the datasheet 989.5 TFLOP/s and the bf16 matmul peak measured in the same run.

Examples
--------
    python benchmarks/sft.py                              # CPU: tiny llama, fp32
    python benchmarks/sft.py --shape qwen2.5-0.5b         # GPU
"""

from __future__ import annotations

import json
import math
import os
import random
import tempfile
import time

import click
import torch
from common import H200_BF16_DENSE, SHAPE_CHOICES, build_model, measured_peak, sync  # benchmarks/ is on sys.path
from train import run_hf


def write_texts(path: str, rows: int, median_words: int, max_words: int, row_group: int, seed: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dask_lm.tiny import SAMPLE_TEXTS

    words = sorted({w for t in SAMPLE_TEXTS for w in t.split()})
    rng = random.Random(seed)
    texts = []
    for _ in range(rows):
        n = min(max_words, max(4, round(math.exp(rng.gauss(math.log(median_words), 0.8)))))
        texts.append(" ".join(rng.choice(words) for _ in range(n)))
    pq.write_table(pa.table({"text": texts}), path, row_group_size=row_group)


@click.command()
@click.option("--shape", type=click.Choice(SHAPE_CHOICES), default="tiny", show_default=True)
@click.option("--rows", type=int, default=None, help="Rows (one epoch) [default: 64 CPU, 2048 GPU].")
@click.option("--global-batch-size", type=int, default=None, help="[default: 16 CPU, 128 GPU]")
@click.option(
    "--micro-batch-size",
    type=int,
    default=8,
    show_default=True,
    help="sft's micro_batch_size (token budget = max_length x this) and the HF loop's batch rows.",
)
@click.option("--max-length", type=int, default=None, help="[default: 256 CPU, 2048 GPU]")
@click.option("--median-words", type=int, default=None, help="[default: 40 CPU, 200 GPU]")
@click.option("--n-workers", type=int, default=1, show_default=True)
def main(
    shape: str,
    rows: int | None,
    global_batch_size: int | None,
    micro_batch_size: int,
    max_length: int | None,
    median_words: int | None,
    n_workers: int,
) -> None:
    import transformers

    import dask_lm
    from dask_lm.engine.metrics import flops_per_sequence
    from dask_lm.sft.job import sft_parquet
    from dask_lm.tiny import train_tiny_tokenizer

    on_gpu = torch.cuda.is_available()
    rows = rows or (2048 if on_gpu else 64)
    gbs = global_batch_size or (128 if on_gpu else 16)
    max_length = max_length or (2048 if on_gpu else 256)
    median_words = median_words or (200 if on_gpu else 40)
    precision = "bfloat16" if on_gpu else "float32"
    dev = torch.device("cuda" if on_gpu else "cpu")
    peak, peak_how = measured_peak(dev)
    with tempfile.TemporaryDirectory(prefix="dask-lm-bench-") as root:
        model_dir = build_model(shape, root, max_length)
        train_tiny_tokenizer(model_dir)
        tok = transformers.AutoTokenizer.from_pretrained(model_dir)
        data = os.path.join(root, "sft.parquet")
        write_texts(data, rows, median_words, 4 * median_words, max(gbs, 64), seed=0)
        client = dask_lm.connect(n_workers=n_workers)
        try:
            t0 = time.perf_counter()
            res = sft_parquet(
                data,
                os.path.join(root, "out"),
                model=model_dir,
                client=client,
                text_column="text",
                global_batch_size=gbs,
                micro_batch_size=micro_batch_size,
                max_length=max_length,
                save_every=10**9,
                progress=False,
                truncate=True,
            )
            end_to_end = time.perf_counter() - t0
        finally:
            cluster = client.cluster
            client.close()
            cluster.close()
        # the same token rows, in global batches of gbs, for the HF loop (one extra leading step as its warm-up)
        import pyarrow.parquet as pq

        ids_rows = [ids[-max_length:] for ids in tok(pq.read_table(data)["text"].to_pylist())["input_ids"]]
        cfg = transformers.AutoConfig.from_pretrained(model_dir)
        flops = sum(flops_per_sequence(cfg, len(r)) for r in ids_rows)
        steps = []
        for s in [0] + list(range(0, len(ids_rows), gbs)):
            chunk = ids_rows[s : s + gbs]
            lens = torch.tensor([len(r) for r in chunk])
            x = torch.zeros(len(chunk), int(lens.max()), dtype=torch.int64)
            for i, r in enumerate(chunk):
                x[i, : len(r)] = torch.tensor(r)
            steps.append((x, lens))
        _losses, hf_seconds, _peak = run_hf(model_dir, precision, dev, steps, micro_batch_size, 1e-5)
        sync(dev)
    tokens = sum(len(r) for r in ids_rows)
    assert tokens == res.tokens, (tokens, res.tokens)  # both arms train the same rows
    hf_tokens = sum(int(lens.sum()) for _x, lens in steps[1:])

    def mfu(seconds: float) -> str:
        return f"{flops / seconds / H200_BF16_DENSE:.1%} ({flops / seconds / peak:.1%} of measured)"

    print(
        f"\n{shape} ({precision}), {rows} rows, {tokens} tokens, {res.steps} steps of {gbs} rows; peak matmul "
        f"{peak / 1e12:.0f} TFLOP/s ({peak_how})"
    )
    print(f"{'arm':<36}{'seconds':>9}{'tok/s':>11}  MFU vs 989.5 TFLOP/s")
    print(f"{'plain HF loop (steps only)':<36}{hf_seconds:>9.2f}{hf_tokens / hf_seconds:>11.0f}  {mfu(hf_seconds)}")
    print(
        f"{'dask-lm sft, Policy.train (all steps)':<36}{res.train_seconds:>9.2f}{tokens / res.train_seconds:>11.0f}  "
        f"{mfu(res.train_seconds)}"
    )
    print(
        f"{'dask-lm sft, end to end':<36}{end_to_end:>9.2f}{tokens / end_to_end:>11.0f}  {mfu(end_to_end)}   "
        f"(checkpoint {res.checkpoint_seconds:.1f} s)"
    )
    print(f"dask-lm / HF: {hf_seconds / res.train_seconds:.2f}x training, {hf_seconds / end_to_end:.2f}x end to end")
    print(
        json.dumps(
            {
                "shape": shape,
                "rows": rows,
                "tokens": tokens,
                "steps": res.steps,
                "hf_seconds": hf_seconds,
                "train_seconds": res.train_seconds,
                "end_to_end_seconds": end_to_end,
                "checkpoint_seconds": res.checkpoint_seconds,
                "flops": flops,
            }
        )
    )


if __name__ == "__main__":  # Dask's LocalCluster spawns worker processes that re-import this module
    main()

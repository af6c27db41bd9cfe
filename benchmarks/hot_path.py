"""The hot paths of a Policy and a scoring job, timed per call, to compare two versions of dask-lm on one machine.

Runs whichever ``dask_lm`` is importable (put another checkout first on ``PYTHONPATH`` to time it: the workers
inherit the variable), through the public API only, so one script times an older tree and this one alike:

- ``get_logprobs`` at 0.5B and 1.5B (2048 lognormal rows, packed micro-batches of 32k tokens, compiled on GPU):
  the median of 5 warm calls, and of those the slowest rank's time inside its method; the rest of the call is the
  driver's (encoding, sharding, scheduling, gathering);
- one ``train`` step at 1.5B, packed (median of 3 after a warm-up step), split the same way;
- ``score_parquet`` at 0.5B on 4096 rows: a warm job on the cluster of a cold one, with its worker phases;
- ``host``: a rank's host work on one such shard, from Dask's frames to every micro-batch's host layout (CPU).

Random models are built once per ``--models`` directory (bf16, on the GPU when there is one) and reused, so two
runs time the same weights. Prints one JSON line per arm and writes them all to ``--out``.

    python benchmarks/hot_path.py --models /tmp/models --out after.json
    PYTHONPATH=/path/to/old/checkout python benchmarks/hot_path.py --models /tmp/models --out before.json
    python benchmarks/hot_path.py --compare before.json after.json
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

import click
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import _worker_last_call_seconds, build_model, make_rows

LOGPROB_SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b")


def _model(models: str, shape: str, max_len: int) -> str:
    path = os.path.join(models, shape)
    return path if os.path.exists(os.path.join(path, "config.json")) else build_model(shape, models, max_len)


def _rows(
    model_dir: str, num_rows: int, median_len: int, max_len: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    import transformers

    vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
    return make_rows(num_rows, 16, max_len, median_len, 1.0, vocab, 0, seed)


def _tokenizer(root: str) -> Any:
    import transformers

    from dask_lm.tiny import train_tiny_tokenizer

    return transformers.AutoTokenizer.from_pretrained(train_tiny_tokenizer(os.path.join(root, "tok")))


def logprobs_arm(client: Any, model_dir: str, tokenizer: Any, calls: int, num_rows: int, max_len: int) -> dict:
    import dask_lm
    from dask_lm import BatchedDataDict

    ids, lens = _rows(model_dir, num_rows, 256, max_len)
    policy = dask_lm.Policy(
        client,
        {
            "model_name": model_dir,
            "precision": "bfloat16",
            "logprob_chunk_size": 4096,
            "max_total_sequence_length": max_len,
            "inference_mb_tokens": 32768,
        },
        tokenizer,
    )
    try:
        data = BatchedDataDict(input_ids=ids, input_lengths=lens)
        policy.get_logprobs(data)  # compiles and sizes the allocator: not timed
        walls, ranks = [], []
        for _ in range(calls):
            t0 = time.perf_counter()
            policy.get_logprobs(data)
            walls.append(time.perf_counter() - t0)
            ranks.append(max(client.run(_worker_last_call_seconds).values()))
    finally:
        policy.shutdown()
    return _summary(walls, ranks, int(lens.sum()))


def train_arm(client: Any, model_dir: str, tokenizer: Any, steps: int, rows: int, max_len: int) -> dict:
    import dask_lm
    from dask_lm import BatchedDataDict

    config = {
        "model_name": model_dir,
        "precision": "bfloat16",
        "max_total_sequence_length": max_len,
        "train_global_batch_size": rows,
        "train_micro_batch_size": 8,
        "max_grad_norm": 1.0,
        "optimizer": {
            "name": "torch.optim.AdamW",
            "kwargs": {"lr": 1e-5, **({"fused": True} if torch.cuda.is_available() else {})},
        },
        "sequence_packing": {"enabled": True, "train_mb_tokens": 16384, "logprob_mb_tokens": 16384},
    }
    policy = dask_lm.Policy(client, config, tokenizer, init_reference_model=False)
    walls, ranks, tokens = [], [], 0
    try:
        for i in range(steps + 1):
            ids, lens = _rows(model_dir, rows, 512, max_len, seed=i)
            mask = (torch.arange(ids.shape[1])[None, :] < lens[:, None]).float()
            data = BatchedDataDict(input_ids=ids, input_lengths=lens, token_mask=mask, sample_mask=torch.ones(rows))
            t0 = time.perf_counter()
            policy.train(data, dask_lm.NLLLoss())
            if i:  # step 0 compiles and creates the optimizer state
                walls.append(time.perf_counter() - t0)
                ranks.append(max(client.run(_worker_last_call_seconds).values()))
                tokens = int(lens.sum())
    finally:
        policy.shutdown()
    return _summary(walls, ranks, tokens)


def score_arm(client: Any, root: str, model_dir: str, num_rows: int, max_len: int) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    import dask_lm

    ids, lens = _rows(model_dir, num_rows, 330, max_len, seed=7)
    data = os.path.join(root, "data")
    os.makedirs(data)
    per_file = num_rows // 4
    for f in range(4):
        rows = range(f * per_file, (f + 1) * per_file)
        pq.write_table(
            pa.table({"id": list(rows), "ids": [ids[r, : int(lens[r])].tolist() for r in rows]}),
            os.path.join(data, f"part-{f}.parquet"),
        )
    out: dict[str, Any] = {}
    for run in ("cold", "warm"):
        t0 = time.perf_counter()
        res = dask_lm.score_parquet(
            data,
            os.path.join(root, f"out-{run}"),
            model=model_dir,
            client=client,
            ids_column="ids",
            id_column="id",
            progress=False,
        )
        out[run] = {"seconds": time.perf_counter() - t0, "worker_phases": dict(res.phase_seconds)}
    out["tokens"] = int(lens.sum())
    out["tok_per_s"] = out["tokens"] / out["warm"]["seconds"]
    return out


def host_arm(num_rows: int, repeats: int, mb_tokens: int = 32768) -> dict:
    """A rank's host work on one ``get_logprobs`` shard before its forwards: from the message as it arrives
    (Dask's frames) to every packed micro-batch's host layout. No model: the CPU only. Written for both layouts
    of the code: the shard decoded to padded tensors and each micro-batch packed from them (before), or its
    Arrow values and offsets sliced per micro-batch (after, :mod:`dask_lm.data.tokens`)."""
    from distributed.protocol import deserialize, serialize

    from dask_lm import BatchedDataDict
    from dask_lm.data.messages import Shard

    try:
        from dask_lm.model.inference import host_layout
    except ImportError:  # before issue 29's split
        from dask_lm.workers.inference import host_layout  # type: ignore[no-redef]
    ids, lens = make_rows(num_rows, 16, 2048, 256, 1.0, 151_000, 0, 0)
    bounds, start, used = [], 0, 0
    for r, n in enumerate(lens.tolist()):  # contiguous rows up to the token budget, as the packed plan cuts them
        if used + n > mb_tokens and r > start:
            bounds.append((start, r))
            start, used = r, 0
        used += n
    bounds.append((start, num_rows))
    batch = BatchedDataDict(input_ids=ids, input_lengths=lens)
    timings: dict[str, list[float]] = {"driver_encode_s": [], "rank_decode_and_layout_s": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        header, frames = serialize(Shard.of(batch, packed=True), serializers=("dask", "pickle"))
        timings["driver_encode_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        shard = deserialize(header, frames)
        if hasattr(shard, "tokens"):
            rows = shard.tokens()
            for s, e in bounds:
                host_layout(rows.slice(s, e), packed=True)
        else:
            data = shard.rows()
            for s, e in bounds:
                host_layout(data["input_ids"][s:e], data["input_lengths"][s:e], packed=True)
        timings["rank_decode_and_layout_s"].append(time.perf_counter() - t0)
    return {
        **{k: statistics.median(v) for k, v in timings.items()},
        "micro_batches": len(bounds),
        "tokens": int(lens.sum()),
        "rows": num_rows,
    }


def _summary(walls: list[float], ranks: list[float], tokens: int) -> dict:
    wall, rank = statistics.median(walls), statistics.median(ranks)
    return {
        "wall_s": wall,
        "rank_s": rank,
        "outside_rank_s": wall - rank,
        "tok_per_s": tokens / wall,
        "walls": walls,
        "ranks": ranks,
        "tokens": tokens,
    }


def compare(before_path: str, after_path: str) -> None:
    before, after = (json.loads(pathlib.Path(p).read_text()) for p in (before_path, after_path))
    print("| arm | figure | before | after | after / before |\n|---|---|---:|---:|---:|")
    for arm in after:
        if arm not in before or arm == "meta":
            continue
        b, a = before[arm], after[arm]
        figures = (
            ("wall_s", "rank_s", "outside_rank_s", "tok_per_s")
            if "wall_s" in a
            else ("warm_s", "tok_per_s")
            if "warm" in a
            else ("driver_encode_s", "rank_decode_and_layout_s")
        )
        if "warm" in a:
            b, a = {**b, "warm_s": b["warm"]["seconds"]}, {**a, "warm_s": a["warm"]["seconds"]}
        for k in figures:
            print(f"| {arm} | {k} | {b[k]:.3f} | {a[k]:.3f} | {a[k] / b[k]:.3f} |")


@click.command()
@click.option("--models", required=False, type=click.Path(file_okay=False), help="Where the random models live.")
@click.option("--out", type=click.Path(dir_okay=False), default=None)
@click.option("--calls", type=int, default=5, show_default=True)
@click.option("--rows", type=int, default=2048, show_default=True, help="get_logprobs rows per call.")
@click.option("--train-rows", type=int, default=256, show_default=True)
@click.option("--train-steps", type=int, default=3, show_default=True)
@click.option("--score-rows", type=int, default=4096, show_default=True)
@click.option("--arms", default="host,logprobs,train,score", show_default=True)
@click.option("--tiny", is_flag=True, help="Every arm on the CPU-sized tiny model (a smoke run of the script).")
@click.option("--compare", "compare_paths", nargs=2, default=None, help="BEFORE.json AFTER.json: print the table.")
def main(
    models: str | None,
    out: str | None,
    calls: int,
    rows: int,
    train_rows: int,
    train_steps: int,
    score_rows: int,
    arms: str,
    tiny: bool,
    compare_paths: tuple[str, str] | None,
) -> None:
    if compare_paths:
        compare(*compare_paths)
        return
    assert models, "--models is needed to run"
    import dask_lm

    os.makedirs(models, exist_ok=True)
    max_len = 2048

    def model(shape: str) -> str:
        return _model(models, "tiny" if tiny else shape, max_len)

    wanted = arms.split(",")
    results: dict[str, Any] = {
        "meta": {
            "dask_lm": os.path.dirname(dask_lm.__file__),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        }
    }
    if "host" in wanted:
        results["host"] = host_arm(rows, calls)
        print(json.dumps({"host": results["host"]}), flush=True)
    if wanted == ["host"]:
        _write(out, results)
        return
    with tempfile.TemporaryDirectory(prefix="dask-lm-hot-") as root:
        tokenizer = _tokenizer(root)
        client = dask_lm.connect(n_workers=1)
        try:
            if "logprobs" in wanted:
                for shape in LOGPROB_SHAPES:
                    results[f"logprobs {shape}"] = logprobs_arm(client, model(shape), tokenizer, calls, rows, max_len)
                    print(json.dumps({f"logprobs {shape}": results[f"logprobs {shape}"]}), flush=True)
            if "train" in wanted:
                results["train qwen2.5-1.5b packed"] = train_arm(
                    client, model("qwen2.5-1.5b"), tokenizer, train_steps, train_rows, max_len
                )
                print(json.dumps({"train": results["train qwen2.5-1.5b packed"]}), flush=True)
            if "score" in wanted:
                results["score qwen2.5-0.5b"] = score_arm(client, root, model("qwen2.5-0.5b"), score_rows, max_len)
                print(json.dumps({"score": results["score qwen2.5-0.5b"]}), flush=True)
        finally:
            cluster = client.cluster
            client.close()
            if cluster is not None:
                cluster.close()
    _write(out, results)


def _write(out: str | None, results: dict) -> None:
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

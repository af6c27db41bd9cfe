"""The two arms of benchmarks/train.py: the competent user's Hugging Face training loop (``run_hf``) and dask-lm's
``Policy.train`` on a local cluster (``run_dask``), each timed step by step."""

from __future__ import annotations

import time
from typing import Any

import torch
from common import (  # benchmarks/ is on sys.path when a script in it runs
    DriverBytes,
    _worker_last_call_seconds,
    _worker_peak_bytes,
    _worker_reset_peak,
    sync,
)


def run_hf(
    model_dir: str,
    precision: str,
    device: torch.device,
    steps: list[tuple[torch.Tensor, torch.Tensor]],
    batch_size: int,
    lr: float,
) -> tuple[list[float], float, int]:
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


def step_frame(ids: torch.Tensor, lens: torch.Tensor, root: str, parts: int) -> Any:
    """A step's rows as a Dask DataFrame read from parquet files (``parts`` of them) by the workers: ``input_ids``
    and ``token_mask`` as lists per row, ``sample_mask`` a number per row. Only the file paths reach the graph."""
    import os

    import dask.dataframe as dd
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(root, exist_ok=True)
    rows = [ids[i, :n].tolist() for i, n in enumerate(lens.tolist())]
    for p in range(parts):
        mine = rows[p::parts]
        table = pa.table(
            {
                "input_ids": pa.array(mine, pa.list_(pa.int64())),
                "token_mask": pa.array([[1.0] * len(r) for r in mine], pa.list_(pa.float32())),
                "sample_mask": pa.array([1.0] * len(mine), pa.float32()),
            }
        )
        pq.write_table(table, f"{root}/part-{p:03d}.parquet")
    return dd.read_parquet(root)


def run_dask(
    model_dir: str,
    precision: str,
    tokenizer: Any,
    steps: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    mode: str,
    n_workers: int,
    mb_tokens: int,
    max_len: int,
    lr: float,
    input_kind: str = "batch",
    scratch: str | None = None,
) -> dict[str, Any]:
    """Arm B: losses, seconds and the train() FLOP figures of the timed steps; ``steps[0]`` is the warm-up.
    ``input_kind``: a BatchedDataDict from this process, or a Dask DataFrame read from parquet by the workers
    (written under ``scratch``, one directory per step)."""
    import dask_lm
    from dask_lm import BatchedDataDict

    batching = (
        {
            "dynamic_batching": {
                "enabled": True,
                "train_mb_tokens": mb_tokens,
                "logprob_mb_tokens": mb_tokens,
                "sequence_length_round": 64,
            }
        }
        if mode == "dynamic"
        else {"sequence_packing": {"enabled": True, "train_mb_tokens": mb_tokens, "logprob_mb_tokens": mb_tokens}}
    )
    gbs = steps[0][0].shape[0]
    config = {
        "model_name": model_dir,
        "precision": precision,
        "logprob_chunk_size": 4096,
        "max_total_sequence_length": max_len,
        "train_global_batch_size": gbs,
        "train_micro_batch_size": 8,
        "max_grad_norm": 1.0,
        "optimizer": {
            "name": "torch.optim.AdamW",
            "kwargs": {"lr": lr, "fused": True} if torch.cuda.is_available() else {"lr": lr},
        },
        **batching,
    }
    client = dask_lm.connect(n_workers=n_workers)
    cluster = client.cluster
    losses, seconds, flops, per_call, threads, overhead = [], 0.0, 0.0, [], [], []
    try:
        policy = dask_lm.Policy(client, config, tokenizer, init_reference_model=False)
        for i, (ids, lens) in enumerate(steps):
            if input_kind == "dataframe":  # the rows go from the files to the workers, never through here
                # one file per worker, the rows dealt round-robin (so that a row's file says nothing of its rank)
                data = step_frame(ids, lens, f"{scratch}/step-{i}", parts=n_workers)
            else:
                mask = (torch.arange(ids.shape[1])[None, :] < lens[:, None]).float()
                data = BatchedDataDict(
                    input_ids=ids, input_lengths=lens, token_mask=mask, sample_mask=torch.ones(ids.shape[0])
                )
            if i == 1:
                threads.extend(client.run(_worker_reset_peak).values())
            t0 = time.perf_counter()
            with DriverBytes(client) as sent:
                out = policy.submit("train", data, dask_lm.NLLLoss()).result()  # = policy.train(data, ...)
            elapsed = time.perf_counter() - t0
            if i >= 1:
                losses.append(float(out["loss"][0]))
                seconds += elapsed
                flops += out.get("total_flops", 0.0)  # FLOP figures that cannot be known are left out
                per_call.append({k: out.get(k) for k in ("train_elapsed_seconds", "achieved_tflops", "mfu")})
                # outside the timing: the slowest rank's time inside its train() for this step; the rest of the
                # call's wall time is the driver's (sharding, scheduling, transfers, gathering the results)
                rank = max(client.run(_worker_last_call_seconds).values())
                overhead.append(
                    {
                        "seconds": elapsed,
                        "rank_seconds": rank,
                        "driver_overhead_seconds": elapsed - rank,
                        "driver_bytes": sent.total,
                        "tokens": int(lens.sum()),
                        "rows": int(lens.shape[0]),
                    }
                )
        peak = max(client.run(_worker_peak_bytes).values())
        policy.shutdown()
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    return {
        "losses": losses,
        "seconds": seconds,
        "flops": flops,
        "peak": peak,
        "per_call": per_call,
        "threads": min(threads) if threads else torch.get_num_threads(),
        "steps": overhead,
    }

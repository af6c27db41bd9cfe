"""fp32 master weights on one rank: the hand-written :class:`~dask_lm.workers.optim.MasterWeights` path against
FSDP2 over a one-member process group (torchtitan's way: ``fully_shard`` with ``MixedPrecisionPolicy`` even at
world size 1). A benchmark, not a test: it prints numbers and asserts nothing about speed.

Both arms are ``Trainer.train`` in this process on the same rows, from the same random bf16-compute / fp32
master initialisation (``skip_weight_load``, one seed), with AdamW and clipping at 1.0; the masters arm is what a
one-rank Policy runs today, the FSDP arm passes ``fsdp=True`` with a one-member group. It prints each arm's step
time, tokens/s and peak memory, and the largest loss difference between the arms over the timed steps (they
round differently: FSDP casts its fp32 shards to bf16 per forward, MasterWeights copies bf16 weights after each
step, so losses agree to bf16 rounding, not bit for bit).

Examples
--------
    python benchmarks/master_weights.py                         # CPU: tiny Qwen2, bf16 compute, a minute
    python benchmarks/master_weights.py --shape qwen2.5-0.5b    # GPU
    python benchmarks/master_weights.py --shape qwen2.5-1.5b --mode packed
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
import time
from typing import Any

import click
import torch
from common import GIB, SHAPE_CHOICES, SHAPES, make_rows, sync  # benchmarks/ is on sys.path
from profile_train import _shard


def _config(shape: str, root: str, mode: str, mb_tokens: int) -> Any:
    import transformers

    from dask_lm.config import PolicyConfig

    path = os.path.join(root, shape)
    dims = SHAPES.get(
        shape,
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 512,
        },
    )
    transformers.Qwen2Config(**dims, max_position_embeddings=4096, pad_token_id=0).save_pretrained(path)
    batching = (
        {"sequence_packing": {"enabled": True, "train_mb_tokens": mb_tokens}}
        if mode == "packed"
        else {"dynamic_batching": {"enabled": True, "train_mb_tokens": mb_tokens, "sequence_length_round": 64}}
    )
    return PolicyConfig.from_dict(
        {
            "model_name": path,
            "precision": "bfloat16",
            "max_total_sequence_length": 4096,
            "train_global_batch_size": 1,
            "train_micro_batch_size": 1,
            "max_grad_norm": 1.0,
            "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-5}},
            **batching,
        }
    )


def _one_member_group(dev: torch.device) -> Any:
    import torch.distributed as dist

    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
    return dist.group.WORLD


def _arm(
    name: str,
    cfg: Any,
    dev: torch.device,
    rows: torch.Tensor,
    lens: torch.Tensor,
    mode: str,
    mb_tokens: int,
    steps: int,
) -> dict[str, Any]:
    from dask_lm.losses import NLLLoss
    from dask_lm.workers.policy_worker import PolicyWorker
    from dask_lm.workers.rank_model import RankPlace

    fsdp = name == "fsdp"
    torch.manual_seed(0)
    worker = PolicyWorker(
        cfg,
        RankPlace(0, 1, _one_member_group(dev) if fsdp else None),
        pad_token_id=0,
        init_optimizer=True,
        init_reference_model=False,
        skip_weight_load=True,
        fsdp=fsdp,
    )
    shard, plan = _shard(cfg, rows, lens, mode, mb_tokens)
    loss_fn = NLLLoss()

    def step() -> float:
        out = worker.trainer.train(
            shard, plan, loss_fn, eval_mode=False, gbs=len(lens), mbs=len(lens), num_global_batches=1
        )
        return float(out.loss[0])

    step()  # warm-up: optimizer state, allocator, compiled kernels
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(steps):
        sync(dev)
        t0 = time.perf_counter()
        losses.append(step())
        sync(dev)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / GIB if dev.type == "cuda" else None
    worker.shutdown()  # frees the model, masters and optimizer state before the next arm builds its own
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "arm": name,
        "step_seconds": times,
        "losses": losses,
        "peak_gib": peak,
        "tok_per_s": int(lens.sum()) / min(times),
    }


@click.command()
@click.option("--shape", type=click.Choice(SHAPE_CHOICES), default="tiny", show_default=True)
@click.option("--mode", type=click.Choice(["dynamic", "packed"]), default="packed", show_default=True)
@click.option("--rows", type=int, default=None, help="Rows per step [default: 16 CPU, 128 GPU].")
@click.option("--steps", type=int, default=3, show_default=True, help="Timed steps per arm (after one warm-up).")
@click.option("--mb-tokens", type=int, default=None, help="Token budget [default: 1024 CPU, 16384 GPU].")
def main(shape: str, mode: str, rows: int | None, steps: int, mb_tokens: int | None) -> None:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    rows = rows or (128 if dev.type == "cuda" else 16)
    mb_tokens = mb_tokens or (16384 if dev.type == "cuda" else 1024)
    median, max_len = (512, 2048) if dev.type == "cuda" else (48, 256)
    with tempfile.TemporaryDirectory(prefix="dask-lm-masters-") as root:
        cfg = _config(shape, root, mode, mb_tokens)
        vocab = SHAPES.get(shape, {}).get("vocab_size", 512)
        ids, lens = make_rows(rows, 16, max_len, median, 0.8, vocab, 0, seed=0)
        results = [_arm(name, cfg, dev, ids, lens, mode, mb_tokens, steps) for name in ("masters", "fsdp")]
    tokens = int(lens.sum())
    print(f"\n{shape} {mode} on {dev.type}: {rows} rows, {tokens} tokens per step, bf16 compute, fp32 masters, AdamW")
    print(f"{'arm':<10}{'best step ms':>14}{'tok/s':>12}{'peak GiB':>10}")
    for r in results:
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(f"{r['arm']:<10}{min(r['step_seconds']) * 1e3:>14.1f}{r['tok_per_s']:>12,.0f}{peak:>10}")
    masters, fsdp = results
    diff = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(masters["losses"], fsdp["losses"]))
    memory = "" if masters["peak_gib"] is None else f", {fsdp['peak_gib'] - masters['peak_gib']:+.2f} GiB peak"
    print(
        f"FSDP at one rank / MasterWeights: {fsdp['tok_per_s'] / masters['tok_per_s']:.3f}x tokens/s{memory}; "
        f"largest relative loss difference {diff:.2e}"
    )
    print(json.dumps({"shape": shape, "mode": mode, "device": dev.type, "tokens": tokens, "arms": results}))


if __name__ == "__main__":
    main()

"""Where the time of a training step goes: dask-lm's worker path profiled in one process, without Dask.

A benchmark, not a test. It builds a random model of ``--shape`` on the GPU (bf16 compute, fp32 masters, AdamW:
``benchmarks/train.py``'s recipe), cuts ``--rows`` long-tailed rows into the micro-batches the driver would
(``--mode`` dynamic or packed, ``--mb-tokens``), then:

1. times ``Trainer.train`` (one optimizer step over all rows) a few times: tokens/s and MFU per step;
2. profiles one step with ``torch.profiler`` and prints each phase's kernel time and share of the wall time:
   the decoder forward, the head and loss, the backward (split into the decoder / head kernels and the fp32 master
   gradient accumulation), the gradient norm and clipping, the optimizer, the copy of the masters into the model,
   and the GPU's idle time (Python, launches and host syncs between kernels). The phases are the
   ``dask_lm.train.*`` ranges of ``dask_lm/workers/trainer.py``;
3. with ``--head-variants``, times the training head's implementations on one micro-batch (:func:`head_variants`).

Examples
--------
    python benchmarks/profile_train.py --shape qwen2.5-0.5b
    python benchmarks/profile_train.py --shape qwen2.5-1.5b --mode packed
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
from common import GIB, H200_BF16_DENSE, SHAPES, make_rows, measured_peak, sync  # benchmarks/ is on sys.path
from profile_forward import _kernel_sums

from dask_lm.data.messages import MicroBatchPlan


def _worker(shape: str, root: str, mode: str, mb_tokens: int, compile_: bool | None) -> Any:
    import transformers

    from dask_lm.config import PolicyConfig
    from dask_lm.workers.policy_worker import PolicyWorker
    from dask_lm.workers.rank_model import RankPlace

    path = os.path.join(root, shape)
    transformers.Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, pad_token_id=0).save_pretrained(path)
    batching = (
        {"sequence_packing": {"enabled": True, "train_mb_tokens": mb_tokens}}
        if mode == "packed"
        else {"dynamic_batching": {"enabled": True, "train_mb_tokens": mb_tokens, "sequence_length_round": 64}}
    )
    cfg = PolicyConfig.from_dict(
        {
            "model_name": path,
            "precision": "bfloat16",
            "max_total_sequence_length": 4096,
            "train_global_batch_size": 1,
            "train_micro_batch_size": 1,
            "max_grad_norm": 1.0,
            "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-5}},
            "train_compile": compile_,
            **batching,
        }
    )
    torch.manual_seed(0)
    return cfg, PolicyWorker(
        cfg,
        RankPlace(0, 1),
        pad_token_id=0,
        init_optimizer=True,
        init_reference_model=False,
        skip_weight_load=True,
    )


def _shard(cfg: Any, ids: torch.Tensor, lens: torch.Tensor, mode: str, mb_tokens: int) -> tuple[Any, MicroBatchPlan]:
    from dask_lm import BatchedDataDict

    mask = (torch.arange(ids.shape[1])[None, :] < lens[:, None]).float()
    data = BatchedDataDict(input_ids=ids, input_lengths=lens, token_mask=mask, sample_mask=torch.ones(len(lens)))
    args: dict[str, Any] = {
        "input_key": "input_ids",
        "input_lengths_key": "input_lengths",
        "max_tokens_per_microbatch": mb_tokens,
    }
    if mode == "packed":
        args.update(
            algorithm=cfg.sequence_packing.algorithm,
            sequence_length_pad_multiple=1,
            microbatch_order=cfg.sequence_packing.microbatch_order,
        )
        shards, _ = data.shard_by_batch_size(1, batch_size=len(lens), sequence_packing_args=args)
    else:
        args["sequence_length_round"] = 64
        shards, _ = data.shard_by_batch_size(1, batch_size=len(lens), dynamic_batching_args=args)
    shard = shards[0]
    return shard, MicroBatchPlan(micro_batch_indices=shard.micro_batch_indices, packed=mode == "packed")


def _category(ev: Any) -> str:
    """A kernel's phase: the innermost ``dask_lm.train.*`` range around its launch; kernels launched by autograd's
    thread are the backward (the fp32 master accumulation hook apart)."""
    chain = []
    p = ev
    while p is not None:
        chain.append(p.name)
        p = p.cpu_parent
    if any("AccumulateGrad" in n for n in chain) or any("_accumulate" in n for n in chain):
        return "backward: grads into fp32 masters"
    if any(n.startswith("autograd::engine::evaluate_function") for n in chain):
        return "backward"
    phase = next((n for n in chain if n.startswith("dask_lm.train.")), None)
    return phase[len("dask_lm.train.") :] if phase else "outside the step"


def idle_gaps(trace_path: str, min_us: float = 200.0, top: int = 12) -> list[tuple[str, float, int]]:
    """Where the GPU waits: the gaps of at least ``min_us`` between kernels of the exported chrome trace, each
    charged to the innermost host operation (CPU op, CUDA runtime call or ``record_function`` range) running at
    its midpoint. Returns ``(host op, total ms, gaps)`` for the ``top`` largest totals."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    host = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation", "cuda_driver")
    ]
    gaps, end = [], kernels[0][1] if kernels else 0.0
    for a, b in kernels[1:]:
        if a - end >= min_us:
            gaps.append((end, a))
        end = max(end, b)
    # one sweep over the host events in start order keeps the ones open at each gap's midpoint
    host.sort(key=lambda e: e["ts"])
    charged: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    active: list[dict] = []
    i = 0
    for a, b in gaps:
        mid = (a + b) / 2
        while i < len(host) and host[i]["ts"] <= mid:
            active.append(host[i])
            i += 1
        active = [e for e in active if e["ts"] + e["dur"] >= mid]
        name = min(active, key=lambda e: e["dur"])["name"] if active else "(no host op: Python)"
        charged[name][0] += (b - a) / 1e3
        charged[name][1] += 1
    return sorted(((k, v[0], int(v[1])) for k, v in charged.items()), key=lambda r: -r[1])[:top]


def profile_step(step: Any, trace: str | None = None) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    sync(torch.device("cuda"))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        sync(torch.device("cuda"))
        wall = time.perf_counter() - t0
    sums = _kernel_sums(prof, _category)
    res = dict(sums)
    res["GPU idle (launch / Python / host sync)"] = max(wall - sum(sums.values()), 0.0)
    res["_wall"] = wall
    if trace:
        prof.export_chrome_trace(trace)
        res["_gaps"] = idle_gaps(trace)  # type: ignore[assignment]
    return res


def head_variants(worker: Any, n: int, chunk: int) -> list[dict[str, Any]]:
    """The training head alone on ``n`` tokens (bf16 hidden states, the model's lm_head, a random per-token upstream
    gradient as a policy-gradient loss gives): forward + backward time, peak memory above the inputs, and the
    error of the values and of the hidden states' gradient on the first 1024 rows against float64.

    * ``checkpointed autograd``: each chunk's forward reruns in the backward (the path before linear_logprob.py);
    * ``linear_logprobs``: dask-lm's closed-form backward (model/linear_logprob.py);
    * ``liger fused linear CE``: liger-kernel's ``LigerFusedLinearCrossEntropyFunction`` with ``reduction="none"``
      (gradients deferred to the backward, the per-token upstream gradient folded in), when it is installed."""
    from torch.utils.checkpoint import checkpoint

    from dask_lm.model.linear_logprob import linear_logprobs

    weight = worker.model.get_output_embeddings().weight
    dev = weight.device
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = (torch.randn(n, weight.shape[1], device=dev, generator=g)).to(weight.dtype)
    targets = torch.randint(0, weight.shape[0], (n,), device=dev, generator=g)
    upstream = torch.randn(n, device=dev, generator=g)

    def chunk_lp(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        z = torch.nn.functional.linear(h, weight).float()
        return z.gather(1, t[:, None]).squeeze(1) - torch.logsumexp(z, -1)

    def checkpointed(h: torch.Tensor) -> torch.Tensor:
        return torch.cat(
            [
                checkpoint(chunk_lp, h[s : s + chunk], targets[s : s + chunk], use_reentrant=False)
                for s in range(0, n, chunk)
            ]
        )

    variants = {
        "checkpointed autograd": checkpointed,
        "linear_logprobs": lambda h: linear_logprobs(h, weight, None, targets, chunk_size=chunk),
        f"linear_logprobs, chunk {4 * chunk}": lambda h: linear_logprobs(
            h, weight, None, targets, chunk_size=4 * chunk
        ),
    }
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        def liger(h: torch.Tensor) -> torch.Tensor:
            out = LigerFusedLinearCrossEntropyFunction.apply(
                h, weight, targets, None, None, -100, 0.0, 0.0, "none", None, False, torch.float32
            )
            return -(out[0] if isinstance(out, tuple) else out)

        variants["liger fused linear CE (reduction none)"] = liger
    except ImportError:
        pass
    k = min(1024, n)
    h64 = hidden[:k].double().requires_grad_()
    ref = torch.log_softmax(h64 @ weight.double().t(), -1).gather(1, targets[:k, None]).squeeze(1)
    (ref_gh,) = torch.autograd.grad(ref, [h64], upstream[:k].double())
    del ref
    rows = []
    for name, fn in variants.items():
        h = hidden.detach().requires_grad_()
        weight.grad = None
        try:
            out = fn(h)
            out.backward(upstream)
        except Exception as e:
            rows.append({"variant": name, "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        sync(dev)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        times = []
        for _ in range(5):
            h = hidden.detach().requires_grad_()
            weight.grad = None
            sync(dev)
            t0 = time.perf_counter()
            out = fn(h)
            out.backward(upstream)
            sync(dev)
            times.append(time.perf_counter() - t0)
        rows.append(
            {
                "variant": name,
                "ms": min(times) * 1e3,
                "peak_gib_above": (torch.cuda.max_memory_allocated() - base) / GIB,
                "value_err": float(
                    (
                        out[:k].double()
                        - torch.log_softmax(hidden[:k].double() @ weight.double().t(), -1)
                        .gather(1, targets[:k, None])
                        .squeeze(1)
                    )
                    .abs()
                    .max()
                ),
                "grad_h_err": float((h.grad[:k].double() - ref_gh).abs().max()),
            }
        )
        weight.grad = None
    return rows


@click.command()
@click.option("--shape", type=click.Choice(list(SHAPES)), default="qwen2.5-0.5b", show_default=True)
@click.option("--mode", type=click.Choice(["dynamic", "packed"]), default="dynamic", show_default=True)
@click.option("--rows", type=int, default=128, show_default=True, help="Rows per optimizer step.")
@click.option("--median-len", type=int, default=512, show_default=True)
@click.option("--max-len", type=int, default=2048, show_default=True)
@click.option("--mb-tokens", type=int, default=16384, show_default=True)
@click.option("--steps", type=int, default=3, show_default=True, help="Timed steps (after a warm-up step).")
@click.option(
    "--compile/--no-compile",
    "compile_",
    default=None,
    help="policy.train_compile [default: its auto setting, compiled layers on a GPU].",
)
@click.option(
    "--trace",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the profiled step's chrome trace here and print where the GPU's idle gaps go.",
)
@click.option(
    "--head-variants",
    "head_variants_",
    is_flag=True,
    help="Also time the training head's implementations on one micro-batch of --mb-tokens tokens (head_variants).",
)
def main(
    shape: str,
    mode: str,
    rows: int,
    median_len: int,
    max_len: int,
    mb_tokens: int,
    steps: int,
    compile_: bool | None,
    head_variants_: bool,
    trace: str | None,
) -> None:
    from dask_lm.engine.metrics import flops_per_sequence
    from dask_lm.losses import NLLLoss

    dev = torch.device("cuda")
    peak, peak_how = measured_peak(dev)
    with tempfile.TemporaryDirectory(prefix="dask-lm-prof-") as root:
        cfg, worker = _worker(shape, root, mode, mb_tokens, compile_)
        hf_cfg = worker.model.config
        ids, lens = make_rows(rows, 16, max_len, median_len, 0.8, hf_cfg.vocab_size, 0, seed=0)
        shard, plan = _shard(cfg, ids, lens, mode, mb_tokens)
        loss = NLLLoss()

        def step() -> dict[str, Any]:
            return worker.trainer.train(shard, plan, loss, eval_mode=False, gbs=rows, mbs=rows, num_global_batches=1)

        step()  # warm-up: optimizer state, allocator, kernels
        times = []
        for _ in range(steps):
            sync(dev)
            t0 = time.perf_counter()
            step()
            sync(dev)
            times.append(time.perf_counter() - t0)
        torch.cuda.reset_peak_memory_stats()
        step()
        peak_mem = torch.cuda.max_memory_allocated() / GIB
        res = profile_step(step, trace)
        variants = head_variants(worker, mb_tokens, cfg.logprob_chunk_size or 1024) if head_variants_ else []
    tokens = int(lens.sum())
    flops = sum(flops_per_sequence(hf_cfg, int(n), training=True) for n in lens)
    best = min(times)
    mfu = flops / best / H200_BF16_DENSE
    n_mb = len(plan.micro_batch_indices[0])
    print(
        f"\n{shape} {mode}, {'compiled' if worker.rank_model.train_compile else 'eager'} layers, optimizer "
        f"{'fused' if worker.trainer.optimizer.defaults.get('fused') else 'foreach'}: {rows} rows, {tokens} tokens, "
        f"{n_mb} micro-batches of <= {mb_tokens} tokens; step "
        f"{best * 1e3:.0f} ms (best of {steps}), {tokens / best:,.0f} tok/s, MFU {mfu:.1%} of 989.5 TFLOP/s "
        f"({flops / best / peak:.1%} of the measured {peak / 1e12:.0f}, {peak_how}); peak {peak_mem:.1f} GiB"
    )
    wall = res["_wall"]
    print(f"profiled step: {wall * 1e3:.1f} ms wall")
    print(f"{'phase':<44}{'ms':>10}{'share':>9}")
    for k, v in sorted(((k, v) for k, v in res.items() if not k.startswith("_")), key=lambda kv: -kv[1]):
        print(f"{k:<44}{v * 1e3:>10.1f}{v / wall:>9.1%}")
    if res.get("_gaps"):
        print(f"\nGPU idle gaps >= 0.2 ms, by the host operation at their midpoint (trace: {trace}):")
        for name, ms, n in res["_gaps"]:
            print(f"{name[:60]:<62}{ms:>9.1f} ms{n:>6} gaps")
    if variants:
        print(f"\ntraining head alone, {mb_tokens} tokens, forward + backward (errors on 1024 rows vs float64):")
        print(f"{'variant':<42}{'ms':>9}{'GiB above':>11}{'value err':>12}{'grad h err':>12}")
        for v in variants:
            if "error" in v:
                print(f"{v['variant']:<42} failed: {v['error']}")
            else:
                print(
                    f"{v['variant']:<42}{v['ms']:>9.1f}{v['peak_gib_above']:>11.2f}{v['value_err']:>12.2e}"
                    f"{v['grad_h_err']:>12.2e}"
                )
    print(
        json.dumps(
            {
                "shape": shape,
                "mode": mode,
                "compiled": worker.rank_model.train_compile,
                "rows": rows,
                "head_variants": variants,
                "tokens": tokens,
                "micro_batches": n_mb,
                "step_seconds": times,
                "tok_per_s": tokens / best,
                "mfu": mfu,
                "peak_gib": peak_mem,
                "phases_ms": {k: v * 1e3 for k, v in res.items() if not k.startswith("_")},
                "profiled_wall_ms": wall * 1e3,
            }
        )
    )


if __name__ == "__main__":
    main()

"""Where the time of an inference forward goes: dask-lm's worker path profiled in one process, without Dask.

A benchmark, not a test. It builds a random model of ``--shape`` directly on the GPU, cuts the long-tailed rows of
``benchmarks/logprobs.py`` into the same micro-batches the driver would (packed or dynamic), then:

1. times ``RankModel.get_logprobs`` over all rows (the engine's compute without the cluster around it);
2. profiles a few micro-batches with ``torch.profiler`` and prints each phase's share of the wall time: the
   decoder, the output head split into its matmul / fp32 upcast / logsumexp / gather, the scatter to host
   memory, and the GPU's idle time (Python and launches between kernels);
3. with ``--variants``, measures the alternatives for the head (chunk sizes, fp32-output matmul, compiled
   fused logsumexp, liger-kernel's fused linear cross-entropy) and for the decoder (``torch.compile`` per layer,
   liger-kernel's RMSNorm / RoPE / SwiGLU) on the same micro-batch, each with its error against a float64 head.

Examples
--------
    python benchmarks/profile_forward.py --shape qwen2.5-0.5b --variants
    python benchmarks/profile_forward.py --shape qwen2.5-7b --num-rows 512 --mode dynamic
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import click
import torch
from common import GIB, H200_BF16_DENSE, SHAPES, make_rows, measured_peak, sync  # benchmarks/ is on sys.path
from logprobs import forward_flops

from dask_lm.data.messages import MicroBatchPlan


def _worker(shape: str, root: str, mb_tokens: int, mode: str, chunk: int) -> Any:
    import transformers

    from dask_lm.config import PolicyConfig
    from dask_lm.workers.rank_model import RankModel, RankPlace

    path = os.path.join(root, shape)
    transformers.Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, pad_token_id=0).save_pretrained(path)
    batching = (
        {"sequence_packing": {"enabled": True, "logprob_mb_tokens": mb_tokens}}
        if mode == "packed"
        else {"dynamic_batching": {"enabled": True, "logprob_mb_tokens": mb_tokens, "sequence_length_round": 64}}
    )
    cfg = PolicyConfig.from_dict(
        {
            "model_name": path,
            "precision": "bfloat16",
            "logprob_chunk_size": chunk,
            "max_total_sequence_length": 4096,
            **batching,
        }
    )
    torch.manual_seed(0)
    return cfg, RankModel(
        cfg,
        RankPlace(rank=0, world_size=1),
        pad_token_id=0,
        trainable=False,
        keep_reference=False,
        skip_weight_load=True,
    )


def _shard(
    cfg: Any, ids: torch.Tensor, lens: torch.Tensor, mode: str, budget: int | None = None
) -> tuple[Any, MicroBatchPlan]:
    from dask_lm import BatchedDataDict
    from dask_lm.data.tokens import TokenRows

    data = BatchedDataDict(input_ids=ids, input_lengths=lens)
    if mode == "packed":
        shards, _ = data.shard_by_batch_size(
            1,
            allow_uneven_shards=True,
            sequence_packing_args={
                "input_key": "input_ids",
                "input_lengths_key": "input_lengths",
                "max_tokens_per_microbatch": budget or cfg.sequence_packing.logprob_mb_tokens,
                "algorithm": cfg.sequence_packing.algorithm,
                "sequence_length_pad_multiple": 1,
                "microbatch_order": cfg.sequence_packing.microbatch_order,
            },
        )
    else:
        shards, _ = data.shard_by_batch_size(
            1,
            allow_uneven_shards=True,
            dynamic_batching_args={
                "input_key": "input_ids",
                "input_lengths_key": "input_lengths",
                "sequence_length_round": 64,
                "max_tokens_per_microbatch": cfg.dynamic_batching.logprob_mb_tokens,
            },
        )
    shard = shards[0]
    # a rank's inference rows as they arrive (dask_lm.data.tokens): ids and offsets, the micro-batches views of them
    rows = TokenRows.from_padded(shard["input_ids"], shard["input_lengths"])
    return rows, MicroBatchPlan(micro_batch_indices=shard.micro_batch_indices, packed=mode == "packed")


def _timed(fn: Callable[[], Any], reps: int = 3) -> tuple[float, Any]:
    out = fn()
    sync(torch.device("cuda"))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        sync(torch.device("cuda"))
        best = min(best, time.perf_counter() - t0)
    return best, out


# ----------------------------------------------------------------------------------------------- profile
_HEAD_OPS = {
    "aten::linear": "head matmul",
    "aten::mm": "head matmul",
    "aten::addmm": "head matmul",
    "aten::matmul": "head matmul",
    "aten::_to_copy": "head fp32 upcast",
    "aten::to": "head fp32 upcast",
    "aten::logsumexp": "head logsumexp",
    "aten::gather": "head gather",
    "aten::topk": "head topk",
    "aten::sub": "head logsumexp",
}


def _category(ev: Any) -> str:
    """A kernel's phase: the innermost ``dask_lm.*`` range around its launch (inference.py names them), and for
    the head the outermost aten op (or compiled region) below that range."""
    chain = []
    p = ev
    while p is not None:
        chain.append(p.name)
        p = p.cpu_parent
    chain.reverse()  # outermost first
    phases = [i for i, n in enumerate(chain) if n.startswith("dask_lm.")]
    if not phases:
        return "outside the pass"
    i = phases[-1]
    phase = chain[i][len("dask_lm.") :]
    if phase != "head":
        return phase
    top = next((n for n in chain[i + 1 :] if n.startswith("aten::") or "ompiled" in n), ev.name)
    if "ompiled" in top:
        return "head fused logsumexp (compiled)"
    return _HEAD_OPS.get(top, f"head other ({top})")


def profile_phases(worker: Any, shard: Any, plan: MicroBatchPlan, n_mb: int, topk: int) -> dict[str, float]:
    """Profile ``get_logprobs`` (or ``get_topk_logits``) over the first ``n_mb`` micro-batches; seconds per phase,
    the wall time, and the GPU's idle time (wall minus kernel time)."""
    from torch.profiler import ProfilerActivity, profile

    sub = dataclasses.replace(plan, micro_batch_indices=[plan.micro_batch_indices[0][:n_mb]])

    def body() -> None:
        if topk:
            worker.get_topk_logits(shard, sub, topk)
        else:
            worker.get_logprobs(shard, sub)

    body()  # warm-up
    sync(torch.device("cuda"))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        body()
        sync(torch.device("cuda"))
        wall = time.perf_counter() - t0
    sums = _kernel_sums(prof)
    busy = sum(sums.values())
    res = dict(sums)
    res["GPU idle (launch / Python / host sync)"] = max(wall - busy, 0.0)
    res["_wall"] = wall
    res["_tokens"] = float(sum(int(shard.lengths[s:e].sum()) for s, e in sub.micro_batch_indices[0]))
    return res


def _kernel_sums(prof: Any, category: Callable[[Any], str] = _category) -> dict[str, float]:
    """Kernel seconds per phase: each CPU event's kernels go to ``category(event)``."""
    sums: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CPU:
            continue
        for k in getattr(ev, "kernels", []):
            sums[category(ev)] += k.duration / 1e6
    return sums


def print_phases(res: dict[str, float], title: str) -> None:
    wall = res["_wall"]
    print(f"\n{title}: {res['_tokens']:.0f} tokens in {wall * 1e3:.1f} ms wall")
    print(f"{'phase':<44}{'ms':>10}{'share':>9}")
    for k, v in sorted(((k, v) for k, v in res.items() if not k.startswith("_")), key=lambda kv: -kv[1]):
        print(f"{k:<44}{v * 1e3:>10.1f}{v / wall:>9.1%}")


# ----------------------------------------------------------------------------------------------- head variants
def head_variants(worker: Any, shard: Any, plan: MicroBatchPlan) -> list[dict[str, Any]]:
    from dask_lm.model import fused
    from dask_lm.model.logprobs import next_token_logprobs, output_head

    mb = worker.plan_pass(shard, plan, None)[0]
    with torch.no_grad(), fused.use_compiled(worker.compile):
        hidden, layout = worker.forward_micro_batch(shard.slice(mb.start, mb.end), mb)
        valid = layout.targets_valid
        rows, cols = valid[:, 1:].nonzero(as_tuple=True)
        h = hidden[rows, cols].contiguous()
        tgt = layout.ids[rows, cols + 1]
        head = output_head(worker.model)
        w = head.weight
        n = h.shape[0]
        # float64 reference on a slice of the positions
        ref_n = min(n, 2048)
        ref_logits = h[:ref_n].double() @ w.double().t()
        ref = (ref_logits.gather(1, tgt[:ref_n, None])[:, 0] - torch.logsumexp(ref_logits, -1)).float()
        del ref_logits

        def err(lp: torch.Tensor) -> float:
            return float((lp[:ref_n] - ref).abs().max())

        results = []

        def record(name: str, fn: Callable[[], torch.Tensor]) -> None:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            try:
                t, lp = _timed(fn)
            except Exception as e:  # an unavailable variant is reported, not fatal
                print(f"  head {name}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                return
            peak = (torch.cuda.max_memory_allocated() - base) / GIB
            results.append(
                {"variant": name, "ms": t * 1e3, "tokens": n, "max_err_vs_fp64": err(lp), "peak_extra_gib": peak}
            )
            print(
                f"  head {name:<38} {t * 1e3:8.2f} ms / {n} tokens   err {err(lp):.2e}   peak +{peak:.2f} GiB",
                flush=True,
            )

        b_ids = layout.ids
        for c in (1024, 4096, 8192, 16384):
            record(
                f"library head, chunk {c}",
                lambda c=c: next_token_logprobs(hidden, b_ids, valid, head, chunk_size=c)[rows, cols + 1],
            )

        def fp32_out(c: int) -> torch.Tensor:
            out = torch.empty(n, dtype=torch.float32, device=h.device)
            for s in range(0, n, c):
                logits = torch.mm(h[s : s + c], w.t(), out_dtype=torch.float32)
                out[s : s + c] = logits.gather(1, tgt[s : s + c, None])[:, 0] - torch.logsumexp(logits, -1)
            return out

        for c in (4096, 8192):
            record(f"fp32-output matmul, chunk {c}", lambda c=c: fp32_out(c))

        @torch.compile(dynamic=True)
        def fused_lse(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            x = logits.float()
            return x.gather(1, t[:, None])[:, 0] - torch.logsumexp(x, -1)

        def compiled(c: int, fp32: bool) -> torch.Tensor:
            out = torch.empty(n, dtype=torch.float32, device=h.device)
            for s in range(0, n, c):
                logits = torch.mm(h[s : s + c], w.t(), out_dtype=torch.float32) if fp32 else h[s : s + c] @ w.t()
                out[s : s + c] = fused_lse(logits, tgt[s : s + c])
            return out

        for c in (4096, 8192):
            record(f"bf16 logits + compiled lse, chunk {c}", lambda c=c: compiled(c, False))
            record(f"fp32 logits + compiled lse, chunk {c}", lambda c=c: compiled(c, True))
        try:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

            record(
                "liger fused linear CE (reduction=none)",
                lambda: -liger_fused_linear_cross_entropy(h, w, tgt, reduction="none"),
            )
        except ImportError as e:
            print(f"  liger-kernel not importable: {e}")
        # top-k
        from dask_lm.model.logprobs import topk_logits

        allv = layout.valid
        for c in (1024, 4096):
            record(
                f"top-20 (library), chunk {c}",
                lambda c=c: topk_logits(hidden, allv, head, 20, chunk_size=c)[0][..., 0][rows, cols],
            )

        def topk_variant(c: int, segments: int) -> torch.Tensor:
            out = torch.empty(n, dtype=torch.float32, device=h.device)
            for s in range(0, n, c):
                logits = head(h[s : s + c])
                if segments:
                    v = logits.shape[1]
                    seg = v // segments
                    main = logits[:, : seg * segments].unflatten(1, (segments, seg))
                    tv, ti = torch.topk(main, 20, dim=-1)
                    ti = ti + torch.arange(segments, device=ti.device)[None, :, None] * seg
                    cand_v = torch.cat([tv.flatten(1), logits[:, seg * segments :]], 1)
                    cand_i = torch.cat(
                        [ti.flatten(1), torch.arange(seg * segments, v, device=ti.device).expand(logits.shape[0], -1)],
                        1,
                    )
                    top_v, pos = torch.topk(cand_v, 20, dim=-1)
                    out[s : s + c] = top_v[:, 0] + 0 * cand_i.gather(1, pos)[:, 0]
                else:
                    out[s : s + c] = torch.topk(logits, 20, dim=-1).values[:, 0]
            return out

        for segs in (0, 64, 256):
            record(f"top-20 of fp32 logits, {segs or 'one'} segment(s)", lambda segs=segs: topk_variant(4096, segs))
    return results


# ----------------------------------------------------------------------------------------------- decoder variants
def decoder_variants(worker: Any, shard: Any, plan: MicroBatchPlan) -> list[dict[str, Any]]:
    from dask_lm.model import fused

    mb = worker.plan_pass(shard, plan, None)[0]
    results = []
    tokens = int(shard.lengths[mb.start : mb.end].sum())
    with torch.no_grad():
        with fused.use_compiled(False):
            ref = worker.forward_micro_batch(shard.slice(mb.start, mb.end), mb)[0].float()

        def record(name: str, compiled: bool, first: float) -> None:
            def run() -> torch.Tensor:
                with fused.use_compiled(compiled):
                    return worker.forward_micro_batch(shard.slice(mb.start, mb.end), mb)[0]

            t, out = _timed(run)
            e = float((out.float() - ref).abs().max())
            results.append(
                {
                    "variant": name,
                    "ms": t * 1e3,
                    "tokens": tokens,
                    "first_call_s": first,
                    "max_abs_diff_hidden": e,
                    "ref_abs_max": float(ref.abs().max()),
                }
            )
            print(
                f"  decoder {name:<30} {t * 1e3:8.2f} ms / {tokens} tokens  first call {first:6.1f} s  "
                f"|dh| {e:.3g} (|h| max {float(ref.abs().max()):.3g})",
                flush=True,
            )

        record("eager", False, 0.0)
        if worker.compile:  # the worker compiled its layers at start (fused.compile_decoder_layers)
            record("torch.compile per layer", True, 0.0)
            mbs = worker.plan_pass(shard, plan, None)
            for other in (mbs[-1], mbs[len(mbs) // 2]):
                t0 = time.perf_counter()
                with fused.use_compiled(True):
                    worker.forward_micro_batch(shard.slice(other.start, other.end), other)
                sync(torch.device("cuda"))
                print(
                    f"  decoder compiled, another length ({int(shard.lengths[other.start : other.end].sum())} "
                    f"tokens): {time.perf_counter() - t0:.2f} s",
                    flush=True,
                )
        try:
            from liger_kernel.transformers import _apply_liger_kernel_to_instance

            _apply_liger_kernel_to_instance(
                model=worker.model,
                rope=True,
                rms_norm=True,
                swiglu=True,
                fused_linear_cross_entropy=False,
                cross_entropy=False,
            )
            record("liger rms_norm+rope+swiglu", False, 0.0)
        except Exception as e:
            print(f"  liger failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return results


@click.command()
@click.option("--shape", type=click.Choice(list(SHAPES)), default="qwen2.5-0.5b", show_default=True)
@click.option("--mode", type=click.Choice(["packed", "dynamic"]), default="packed", show_default=True)
@click.option("--num-rows", type=int, default=2048, show_default=True)
@click.option("--mb-tokens", type=int, default=32768, show_default=True)
@click.option("--chunk", type=int, default=4096, show_default=True, help="logprob_chunk_size")
@click.option("--profile-mbs", type=int, default=4, show_default=True, help="Micro-batches under the profiler.")
@click.option("--variants/--no-variants", default=False, show_default=True)
@click.option("--sweep", type=int, multiple=True, help="Also time packed micro-batches of these token budgets.")
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
def main(
    shape: str,
    mode: str,
    num_rows: int,
    mb_tokens: int,
    chunk: int,
    profile_mbs: int,
    variants: bool,
    sweep: tuple[int, ...],
    json_out: str | None,
) -> None:
    import transformers

    assert torch.cuda.is_available(), "profile_forward.py profiles the GPU path"
    cfg_hf = transformers.Qwen2Config(**SHAPES[shape])
    ids, lens = make_rows(num_rows, 16, 2048, 256, 1.0, cfg_hf.vocab_size, 0, 0)
    flops = forward_flops(cfg_hf, lens)
    peak, what = measured_peak(torch.device("cuda"))
    report: dict[str, Any] = {
        "shape": shape,
        "mode": mode,
        "rows": num_rows,
        "useful_tokens": int(lens.sum()),
        "mb_tokens": mb_tokens,
        "chunk": chunk,
        "measured_peak_tflops": peak / 1e12,
    }
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        cfg, worker = _worker(shape, root, mb_tokens, mode, chunk)
        shard, plan = _shard(cfg, ids, lens, mode)
        print(
            f"{shape} {mode}: built in {time.perf_counter() - t0:.1f}s; {num_rows} rows, {int(lens.sum())} "
            f"tokens, {len(plan.micro_batch_indices[0])} micro-batches of <= {mb_tokens} tokens",
            flush=True,
        )
        warm = dataclasses.replace(plan, micro_batch_indices=[[[0, 8]]]) if mode == "packed" else None
        t0 = time.perf_counter()
        worker.get_logprobs(
            shard, warm or dataclasses.replace(plan, micro_batch_indices=[plan.micro_batch_indices[0][:1]])
        )
        sync(torch.device("cuda"))
        print(f"first call (8 rows / one micro-batch; compiles): {time.perf_counter() - t0:.2f} s", flush=True)
        t0 = time.perf_counter()
        worker.get_logprobs(shard, plan)
        sync(torch.device("cuda"))
        print(f"first call over all rows: {time.perf_counter() - t0:.2f} s", flush=True)
        sec, _ = _timed(lambda: worker.get_logprobs(shard, plan), reps=2)
        tps = int(lens.sum()) / sec
        report.update(
            engine_seconds=sec,
            engine_tok_per_s=tps,
            engine_mfu_989=flops / sec / H200_BF16_DENSE,
            engine_mfu_measured=flops / sec / peak,
        )
        print(
            f"RankModel.get_logprobs, all rows: {sec:.3f} s = {tps:,.0f} tok/s, MFU {flops / sec / 989.5e12:.1%} "
            f"of 989.5 ({flops / sec / peak:.1%} of measured {what} {peak / 1e12:.0f})",
            flush=True,
        )
        base = torch.cuda.memory_allocated()
        for kind, fn in (
            ("logprobs", lambda: worker.get_logprobs(shard, plan)),
            ("top-20 logits", lambda: worker.get_topk_logits(shard, plan, 20)),
        ):
            torch.cuda.reset_peak_memory_stats()
            fn()
            extra = (torch.cuda.max_memory_allocated() - base) / GIB
            report[f"peak_gib_above_weights_{kind}"] = extra
            print(
                f"{kind}: peak {extra:.2f} GiB above the weights ({base / GIB:.2f} GiB), micro-batches of "
                f"<= {mb_tokens} tokens, logprob_chunk_size {chunk}",
                flush=True,
            )
        for budget in sweep:
            shard_b, plan_b = _shard(cfg, ids, lens, "packed", budget)
            sec_b, _ = _timed(lambda: worker.get_logprobs(shard_b, plan_b), reps=2)  # noqa: B023 (timed now)
            report[f"packed_{budget}_tok_per_s"] = int(lens.sum()) / sec_b
            print(
                f"packed, {budget}-token micro-batches: {int(lens.sum()) / sec_b:,.0f} tok/s, "
                f"MFU {flops / sec_b / H200_BF16_DENSE:.1%}",
                flush=True,
            )
        for topk in (0, 20):
            res = profile_phases(worker, shard, plan, profile_mbs, topk)
            print_phases(
                res, f"profile, {'logprobs' if not topk else 'top-20 logits'}, first {profile_mbs} micro-batches"
            )
            report[f"profile_top{topk}"] = res
        if variants:
            print("\nhead variants (first micro-batch):", flush=True)
            report["head_variants"] = head_variants(worker, shard, plan)
            print("\ndecoder variants (first micro-batch):", flush=True)
            report["decoder_variants"] = decoder_variants(worker, shard, plan)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

"""The scoring head's reduction, three ways, on one GPU: eager PyTorch, Inductor-compiled, liger-kernel's Triton kernel.

A benchmark, not a test. The head of a scoring micro-batch is, per 1024-row chunk, a float32 ``[1024, V]`` logits
matmul (``torch.mm(..., out_dtype=float32)``) and one reduction over it: each row's logsumexp, its target's logit
and whether the target is the argmax (:func:`dask_lm.model.fused.pick_minus_logsumexp_greedy`). This script times
a 32k-row micro-batch of that at a Qwen2.5 shape's hidden size and vocabulary, for:

- ``eager``: the plain PyTorch expression (``fused._pick_minus_lse_greedy``), what runs without a compiler;
- ``compiled``: that expression through ``torch.compile`` (dynamic shapes), what ``compile_head`` chose;
- ``liger``: :mod:`dask_lm.model.liger_head` (liger-kernel's kernel launched directly, no host syncs);
- ``matmul``: the logits matmul alone, the floor of the whole head.

Each arm's error against a float64 reference, its first call's seconds (compilation included) and, with
``--first-calls``, the first call in fresh processes that share a fresh on-disk cache (Triton's cache for liger,
Inductor's for compiled): what a new worker pays before its first row, cold and then warm.

Examples
--------
    python benchmarks/head_kernels.py --hidden 896
    python benchmarks/head_kernels.py --hidden 1536 --first-calls
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import click
import torch


def _inputs(rows: int, hidden: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    t = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    return h, w, t


def _arm(name: str) -> Any:
    from dask_lm.model import fused, liger_head

    if name == "eager":
        return fused._pick_minus_lse_greedy
    if name == "compiled":
        return torch.compile(fused._pick_minus_lse_greedy, dynamic=True, options=fused._options())
    if name == "liger":

        def liger(z: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            assert liger_head.available(z), "liger-kernel is not importable here"
            out = liger_head.pick_minus_lse_greedy(z, t)
            assert out is not None, "liger-kernel's kernel failed (see the warning above)"
            return out

        return liger
    if name == "matmul":
        return None
    raise ValueError(name)


def _head(fn: Any, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    lp = torch.empty(h.shape[0], device="cuda")
    hit = torch.empty(h.shape[0], device="cuda", dtype=torch.bool)
    for s in range(0, h.shape[0], chunk):
        z = torch.mm(h[s : s + chunk], w.t(), out_dtype=torch.float32)
        if fn is not None:
            lp[s : s + chunk], hit[s : s + chunk] = fn(z, t[s : s + chunk].clone())
    return lp, hit


def _first_call(name: str, rows: int, hidden: int, vocab: int, chunk: int) -> dict[str, float]:
    """In this (fresh) process: the import of the arm's library and its first call's seconds."""
    t0 = time.perf_counter()
    # what liger_head imports, or Inductor (importlib: an import statement here would make ``torch`` local)
    importlib.import_module("liger_kernel.ops.cross_entropy" if name == "liger" else "torch._inductor")
    imported = time.perf_counter() - t0
    h, w, t = _inputs(rows, hidden, vocab)
    torch.mm(h[:chunk], w.t(), out_dtype=torch.float32)  # cuBLAS's first call is not the arm's
    torch.cuda.synchronize()
    fn = _arm(name)
    t0 = time.perf_counter()
    _head(fn, h, w, t, chunk)
    torch.cuda.synchronize()
    return {"import_s": imported, "first_call_s": time.perf_counter() - t0}


@click.command()
@click.option("--hidden", type=int, default=896, show_default=True, help="896: Qwen2.5-0.5B, 1536: 1.5B.")
@click.option("--vocab", type=int, default=151936, show_default=True)
@click.option("--rows", type=int, default=32768, show_default=True, help="Rows of one micro-batch.")
@click.option("--chunk", type=int, default=1024, show_default=True, help="Rows per logits chunk.")
@click.option("--iters", type=int, default=20, show_default=True)
@click.option("--first-calls", is_flag=True, help="Also time the first call in fresh processes, cold and warm cache.")
@click.option("--first-call-of", type=click.Choice(["compiled", "liger"]), default=None, hidden=True)
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
def main(
    hidden: int,
    vocab: int,
    rows: int,
    chunk: int,
    iters: int,
    first_calls: bool,
    first_call_of: str | None,
    json_out: str | None,
) -> None:
    assert torch.cuda.is_available(), "head_kernels.py times GPU kernels"
    if first_call_of:
        print(json.dumps(_first_call(first_call_of, rows, hidden, vocab, chunk)))
        return
    res: dict[str, Any] = {"hidden": hidden, "vocab": vocab, "rows": rows, "chunk": chunk, "arms": {}}
    h, w, t = _inputs(rows, hidden, vocab)
    n = min(rows, 4096)  # the float64 reference on a slice
    z64 = h[:n].double() @ w.double().t()
    ref_lp = z64.gather(1, t[:n, None]).squeeze(1) - torch.logsumexp(z64, dim=-1)
    ref_hit = z64.argmax(-1) == t[:n]
    del z64
    flops = 2 * rows * hidden * vocab
    for name in ("matmul", "eager", "compiled", "liger"):
        fn = _arm(name)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        lp, hit = _head(fn, h, w, t, chunk)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        best = float("inf")
        for _ in range(iters):
            t0 = time.perf_counter()
            _head(fn, h, w, t, chunk)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        arm = {"first_call_s": first, "ms_per_micro_batch": best * 1e3, "tflops": flops / best / 1e12}
        if fn is not None:
            arm["max_abs_err_vs_fp64"] = float((lp[:n].double() - ref_lp).abs().max())
            arm["greedy_mismatches"] = int((hit[:n] != ref_hit).sum())
        res["arms"][name] = arm
        print(
            f"{name:>9}: {best * 1e3:8.2f} ms per {rows}-row micro-batch ({arm['tflops']:.0f} TFLOP/s of head "
            f"matmul), first call {first:.2f} s"
            + (
                f", |err| vs fp64 {arm['max_abs_err_vs_fp64']:.2e}, greedy mismatches {arm['greedy_mismatches']}"
                if fn is not None
                else ""
            ),
            flush=True,
        )
    if first_calls:
        res["first_calls"] = {}
        for name, cache_var in (("liger", "TRITON_CACHE_DIR"), ("compiled", "TORCHINDUCTOR_CACHE_DIR")):
            with tempfile.TemporaryDirectory(prefix="dask-lm-cache-") as cache:
                env = {**os.environ, cache_var: cache}
                if name == "compiled":  # Inductor's kernels are Triton kernels: keep both caches fresh together
                    env["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
                runs = []
                for _ in ("cold", "warm"):
                    out = subprocess.run(
                        [
                            sys.executable,
                            __file__,
                            "--hidden",
                            str(hidden),
                            "--vocab",
                            str(vocab),
                            "--rows",
                            str(rows),
                            "--chunk",
                            str(chunk),
                            "--first-call-of",
                            name,
                        ],
                        env=env,
                        capture_output=True,
                        text=True,
                    )
                    if out.returncode:
                        raise SystemExit(f"the first call of {name} failed in a fresh process:\n{out.stderr[-3000:]}")
                    runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
                res["first_calls"][name] = {"cold": runs[0], "warm": runs[1]}
                print(
                    f"{name:>9} in a fresh process: import {runs[0]['import_s']:.2f} s; first call "
                    f"{runs[0]['first_call_s']:.2f} s with a cold cache, {runs[1]['first_call_s']:.2f} s warm",
                    flush=True,
                )
    if json_out:
        with open(json_out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

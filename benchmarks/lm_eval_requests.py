"""lm-evaluation-harness request throughput: ``--model dask-lm`` (``dask_lm.harness.DaskLM``) against lm-eval's own
``HFLM`` on the same synthetic requests.

A benchmark, not a test: it prints numbers and asserts nothing about speed. The requests are what an evaluation
sends: ``loglikelihood`` requests shaped like a multiple-choice task (contexts of lognormal length, four short
continuations each) and ``generate_until`` requests (greedy, ``--gen-toks`` new tokens, a stop string the random
model rarely produces). The model is a random ``--shape`` (bf16 on a GPU) with a tokenizer trained on the spot, so
nothing is downloaded. The dask-lm arms run first, one fresh cluster per ``--n-workers`` entry; HFLM runs last, in
this process on the first GPU (or with as many CPU threads as one worker has), after every cluster is closed, so no
two arms share a device. Model loads are left out of every timing: each arm answers a few requests first.

Examples
--------
    python benchmarks/lm_eval_requests.py --shape tiny --requests 64             # CPU, about a minute
    python benchmarks/lm_eval_requests.py --shape qwen2.5-0.5b --n-workers 1,2   # GPU, bf16
"""

from __future__ import annotations

import json
import math
import os
import random
import tempfile
import time
from typing import Any

import click
from common import (  # benchmarks/ is on sys.path when a script runs
    SHAPE_CHOICES,
    _worker_reset_peak,
    build_model,
)

from dask_lm.tiny import SAMPLE_TEXTS


def make_requests(
    n_loglikelihood: int, n_generate: int, median_words: int, gen_toks: int, seed: int
) -> tuple[list[tuple[str, str]], list[tuple[str, dict[str, Any]]]]:
    """``(context, continuation)`` pairs (four choices per context) and ``(context, gen_kwargs)`` pairs, of words
    drawn from the tokenizer's training corpus (so each is a few tokens, not bytes)."""
    rng = random.Random(seed)
    words = sorted({w for t in SAMPLE_TEXTS for w in t.split()})

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(max(1, n)))

    def length() -> int:
        return round(math.exp(rng.gauss(math.log(median_words), 0.6)))

    pairs: list[tuple[str, str]] = []
    while len(pairs) < n_loglikelihood:
        context = "Question: " + text(length()) + "\nAnswer:"
        pairs.extend((context, " " + text(rng.randint(1, 4))) for _ in range(4))
    gen = {"until": ["\n\n"], "max_gen_toks": gen_toks, "do_sample": False}
    prompts = [("Question: " + text(length()) + "\nAnswer:", dict(gen)) for _ in range(n_generate)]
    return pairs[:n_loglikelihood], prompts


def instances(kind: str, args: list[tuple[Any, ...]]) -> list[Any]:
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def timed(lm: Any, ll: list[Any], gen: list[Any]) -> tuple[list[tuple[float, bool]], list[str], float, float]:
    """Warm up on a few requests of each kind (model loads, kernel choice), then time the full sets."""
    lm.loglikelihood(ll[: min(len(ll), 16)])
    if gen:
        lm.generate_until(gen[: min(len(gen), 4)])
    t0 = time.perf_counter()
    scores = lm.loglikelihood(ll)
    t_ll = time.perf_counter() - t0
    t0 = time.perf_counter()
    texts = lm.generate_until(gen) if gen else []
    return scores, texts, t_ll, time.perf_counter() - t0


@click.command()
@click.option(
    "--shape", type=click.Choice(SHAPE_CHOICES), default="tiny", show_default=True, help="Random model to build."
)
@click.option(
    "--requests",
    "n_requests",
    type=int,
    default=None,
    help="loglikelihood requests [default: 256 on CPU, 4096 on GPU].",
)
@click.option("--gen-requests", type=int, default=None, help="generate_until requests [default: 16 CPU, 256 GPU].")
@click.option("--gen-toks", type=int, default=None, help="max_gen_toks [default: 16 CPU, 64 GPU].")
@click.option(
    "--median-words", type=int, default=None, help="Median context length in words [default: 24 CPU, 160 GPU]."
)
@click.option("--hf-batch-size", type=int, default=16, show_default=True, help="HFLM's batch_size.")
@click.option("--batch-tokens", type=int, default=None, help="dask-lm's batch_tokens [default: 8192 CPU, 32768 GPU].")
@click.option("--n-workers", default="1,2", show_default=True, help="Comma-separated worker counts, one arm each.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Write the results as JSON here.")
def main(
    shape: str,
    n_requests: int | None,
    gen_requests: int | None,
    gen_toks: int | None,
    median_words: int | None,
    hf_batch_size: int,
    batch_tokens: int | None,
    n_workers: str,
    seed: int,
    out: str | None,
) -> None:
    import transformers

    import dask_lm
    from dask_lm.engine.cluster import count_gpus
    from dask_lm.tiny import train_tiny_tokenizer

    # counted through NVML, not torch.cuda: this process keeps no CUDA context while the clusters run
    on_gpu = count_gpus() > 0
    precision = "bfloat16" if on_gpu else "float32"
    n_requests = n_requests or (4096 if on_gpu else 256)
    gen_requests = gen_requests if gen_requests is not None else (256 if on_gpu else 16)
    gen_toks = gen_toks or (64 if on_gpu else 16)
    median_words = median_words or (160 if on_gpu else 24)
    batch_tokens = batch_tokens or (32768 if on_gpu else 8192)
    counts = [int(n) for n in n_workers.split(",") if n.strip()]
    pairs, prompts = make_requests(n_requests, gen_requests, median_words, gen_toks, seed)
    ll, gen = instances("loglikelihood", pairs), instances("generate_until", prompts)
    arms: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="dask-lm-bench-") as root:
        model_dir = build_model(shape, root, 4096)
        transformers.AutoTokenizer.from_pretrained(train_tiny_tokenizer(os.path.join(root, "tok"))).save_pretrained(
            model_dir
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        tokens = sum(len(tokenizer(c + x).input_ids) for c, x in pairs)
        print(
            f"random {shape} ({precision}); {len(pairs)} loglikelihood requests ({tokens} tokens), "
            f"{len(prompts)} generate_until requests of {gen_toks} new tokens",
            flush=True,
        )
        results: dict[str, tuple[list[tuple[float, bool]], list[str]]] = {}
        threads = 1
        from dask_lm.harness import DaskLM

        for n in counts:
            client = dask_lm.connect(n_workers=n)
            try:
                threads = min(client.run(_worker_reset_peak).values())
                lm = DaskLM(pretrained=model_dir, client=client, dtype=precision, batch_tokens=batch_tokens)
                scores, texts, t_ll, t_gen = timed(lm, ll, gen)
                lm.close()
            finally:
                cluster = client.cluster
                client.close()
                cluster.close()
            results[f"dask-lm x{n}"] = scores, texts
            arms[f"dask-lm x{n}"] = {"workers": n, "loglikelihood_seconds": t_ll, "generate_seconds": t_gen}
            print(f"dask-lm x{n}: loglikelihood {t_ll:.2f}s, generate_until {t_gen:.2f}s", flush=True)

        import torch
        from lm_eval.models.huggingface import HFLM

        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            # Dask starts CPU workers with OMP_NUM_THREADS=1: HFLM gets one worker's threads, so the ratio compares
            # engines, not core counts
            torch.set_num_threads(threads)
        hf = HFLM(pretrained=model_dir, device=device, dtype=precision, batch_size=hf_batch_size)
        scores, texts, t_ll, t_gen = timed(hf, ll, gen)
        results["hf"] = scores, texts
        arms["hf"] = {"workers": 1, "loglikelihood_seconds": t_ll, "generate_seconds": t_gen}
        print(f"HFLM (batch_size {hf_batch_size}): loglikelihood {t_ll:.2f}s, generate_until {t_gen:.2f}s", flush=True)

    ref_scores, ref_texts = results["hf"]
    print(
        f"\n{'arm':<14}{'loglikelihood req/s':>21}{'vs HF':>8}{'generate req/s':>16}{'vs HF':>8}"
        f"{'max |ll diff|':>15}{'same text':>11}"
    )
    for name, arm in arms.items():
        arm["loglikelihood_req_per_s"] = len(ll) / arm["loglikelihood_seconds"]
        arm["generate_req_per_s"] = len(gen) / arm["generate_seconds"] if gen else 0.0
        arm["loglikelihood_ratio_vs_hf"] = arms["hf"]["loglikelihood_seconds"] / arm["loglikelihood_seconds"]
        arm["generate_ratio_vs_hf"] = arms["hf"]["generate_seconds"] / arm["generate_seconds"] if gen else 0.0
        got_scores, got_texts = results[name]
        arm["max_abs_loglikelihood_diff"] = max(abs(a[0] - b[0]) for a, b in zip(got_scores, ref_scores))
        arm["same_generation_fraction"] = sum(a == b for a, b in zip(got_texts, ref_texts)) / len(gen) if gen else 1.0
        print(
            f"{name:<14}{arm['loglikelihood_req_per_s']:>21.1f}{arm['loglikelihood_ratio_vs_hf']:>7.2f}x"
            f"{arm['generate_req_per_s']:>16.2f}{arm['generate_ratio_vs_hf']:>7.2f}x"
            f"{arm['max_abs_loglikelihood_diff']:>15.3g}{arm['same_generation_fraction']:>11.0%}"
        )
    res = {
        "shape": shape,
        "precision": precision,
        "loglikelihood_requests": len(ll),
        "loglikelihood_tokens": tokens,
        "generate_requests": len(gen),
        "gen_toks": gen_toks,
        "hf_batch_size": hf_batch_size,
        "batch_tokens": batch_tokens,
        "torch_threads_per_worker": threads,
        "arms": arms,
    }
    print(json.dumps(res))
    if out:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":  # Dask's LocalCluster spawns worker processes that re-import this module
    main()

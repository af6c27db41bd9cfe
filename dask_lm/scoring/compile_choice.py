"""When compiling pays in a scoring job: each worker's decoder layers (``worth_compiling``) and its head's fused
reductions (``worth_compiling_head``), from the job's tokens per worker, against thresholds measured on an H200.

A module of its own because two steps of a job decide: the warm-up (:mod:`dask_lm.scoring.preload`) decides the
head's when it submits the replica preloads, and ``score_parquet`` (:mod:`dask_lm.scoring.job`), which imports the
warm-up, decides the layers' (and the head's again) once the cluster's workers are known.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dask_lm.io import parquet as pio

__all__ = [
    "COMPILE_MIN_TOKENS_PER_WORKER",
    "HEAD_COMPILE_MIN_TOKENS_PER_WORKER",
    "worth_compiling",
    "worth_compiling_head",
]

# Compiling the decoder layers costs a fresh worker 6.6 s and saves 2.1 s per 1.6M tokens at 0.5B on an H200
# (benchmarks/score.py --shape qwen2.5-0.5b, with and without --compile: model time 5.2 s against 7.3 s); less for
# larger models, whose forwards are less launch-bound. It pays from about 5M tokens per worker: compile from 8M.
COMPILE_MIN_TOKENS_PER_WORKER = 8_000_000


# The head's fused reductions alone (one small graph): 3.7 s per fresh worker process with Inductor's on-disk cache
# warm, 7.6 s cold, against about 1.3 us per token saved (the eager max / sub / exp / sum chain over [n, V] float32
# logits took 185 ms of a 117k-token span's 518 ms of GPU time at 0.5B; benchmarks/profile_score.py --profile on an
# H200). The 4.3M-token job's model phase went from 20.1 s to 17.1 s with it and the pipelined micro-batches
# together. In the whole job it did not pay: benchmarks/score.py --quick-cold at 0.5B with the head compiled from 4M
# tokens paid 6.0 s (cold CLI) and 5.3 s (second job) of compilation for 2-3 s less scoring (cold 50.2 s against the
# user's 46.4 s; second job 26.4 s, where it was 22.4 s). So the head compiles where the layers do, from 8M.
HEAD_COMPILE_MIN_TOKENS_PER_WORKER = COMPILE_MIN_TOKENS_PER_WORKER


def worth_compiling_head(tokens: float, workers: int) -> bool:
    """Whether a job of ``tokens`` (from the footers) is long enough per worker for compiling the head's reductions
    to pay (:data:`HEAD_COMPILE_MIN_TOKENS_PER_WORKER`)."""
    return tokens / max(workers, 1) >= HEAD_COMPILE_MIN_TOKENS_PER_WORKER


def worth_compiling(inputs: pio.ScoreInputs, ids_column: str | None, workers: int) -> bool:
    """Whether a job is long enough for compiling each worker's forward to pay: its tokens from the footers (an ids
    column's value count; about 4 bytes of text per token), per worker, against
    :data:`COMPILE_MIN_TOKENS_PER_WORKER`."""
    return sum(inputs.group_tokens) / max(workers, 1) >= COMPILE_MIN_TOKENS_PER_WORKER

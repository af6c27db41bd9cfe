"""Scoring's Dask task functions: what ``score_parquet`` (:mod:`dask_lm.scoring.job`) and its warm-up
(:mod:`dask_lm.scoring.preload`) submit to the workers (and ``release_scorers``, which the lm-eval engine runs
too, on its close). Each runs on whichever worker the scheduler picks (no SPMD chain, no rank) and imports the
scoring rank code (:mod:`dask_lm.scoring.scorer`) there, so the driver that imports this module pays for none of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dask_lm.data.messages import ScoreOptions
    from dask_lm.scoring.spans import SpanRows

__all__ = ["score_partition", "sampling_profiler_paused", "check_model_config", "preload_scorer", "release_scorers"]


def score_partition(span: SpanRows, opts: ScoreOptions, progress_id: str | None = None) -> dict[str, Any]:
    """``score_parquet``: score one span on this worker (:func:`dask_lm.scoring.scorer.score_partition`)."""
    from dask_lm import interface
    from dask_lm.scoring import scorer

    with interface.speaking(opts.interface):  # a bad row's message names options as the job's caller spells them
        return scorer.score_partition(span, opts, progress_id)


@contextlib.contextmanager
def sampling_profiler_paused() -> Iterator[None]:
    """This worker's statistical profiler paused for the block: a fresh worker's one-time imports of torch and
    transformers. Every 10 ms the profiler walks the stack of each thread running a task, on the event loop and
    under the GIL, and an import's stacks are deep: measured on a 2-core CPU machine, a worker's config check took
    8.3-10.0 s with it running and 4.7-5.1 s paused (a bare process: 4.9-5.8 s). The dashboard's profile misses only
    these imports. Outside a worker, or where the profiler is off (``distributed.worker.profile.enabled``), a no-op."""
    try:
        from distributed import get_worker

        worker = get_worker()
    except (ImportError, ValueError):
        yield
        return
    pc = worker.periodic_callbacks.get("profile")
    if pc is None or not pc.is_running():
        yield
        return
    worker.loop.add_callback(pc.stop)  # tornado's callbacks belong to the loop's thread: add_callback is thread-safe
    try:
        yield
    finally:
        worker.loop.add_callback(pc.start)


def check_model_config(model: str) -> dict[str, Any]:
    """``score_parquet``'s config check, on a worker: that its transformers loads ``model``'s config (``ValueError``
    naming the file otherwise), and the vocabulary size it states (:func:`dask_lm.io.modelcheck.config_vocab`);
    with when it began (wall clock) and how long torch's import and the rest took, for the job's start phases."""
    import time

    from dask_lm.workers import warm

    began, t0 = time.time(), time.perf_counter()
    with sampling_profiler_paused():
        # a worker warming up imports torch and transformers in its own thread: wait for them rather than import
        # them beside it (not for the rest of the warm-up: the check needs no modelling code)
        warm.wait(until="transformers")
        import torch  # noqa: F401 (timed: most of a fresh worker's start)

        t1 = time.perf_counter()
        from dask_lm.io.modelcheck import config_vocab

        vocab = config_vocab(model)
    return {"vocab": vocab, "began_at": began, "torch_import": t1 - t0, "config": time.perf_counter() - t1}


def preload_scorer(
    model: str, tokenizer: str, precision: str | None, compile: bool, compile_head: bool = False
) -> dict[str, Any]:
    """``score_parquet``: load this worker's replica while the driver checks
    (:func:`dask_lm.scoring.replicas.preload_replica`)."""
    with sampling_profiler_paused():  # the model's modeling module is imported here, once per worker process
        from dask_lm.scoring import replicas

        return replicas.preload_replica(model, tokenizer, precision, compile, compile_head)


def release_scorers(dask_worker: Any = None) -> int:
    """``score_parquet``'s end: free this worker's scoring replicas (run with ``client.run``)."""
    from dask_lm.scoring import replicas

    return replicas.release_scorers(dask_worker)

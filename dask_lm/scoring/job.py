"""Offline scoring of parquet datasets: ``score_parquet`` (the driver side of ``dask-lm score``).

The job: the rows are cut into spans of about ``task_tokens`` tokens (:mod:`dask_lm.scoring.spans`: a large row group
split, small ones merged), each row group read in its own Dask task (Arrow-backed pandas, each read naming its file
and row group when a page is damaged); each span is scored on whichever worker is free
(:func:`dask_lm.scoring.scorer.score_partition`, a model replica per worker) and written as ``part-NNNNN.parquet``,
atomically. ``_manifest.json`` (written first) pins the model and input files by content (path, size, SHA-256 of
every file that determines results: :mod:`dask_lm.io.fingerprint`), the options, the span plan and the dask-lm
version; ``_SUCCESS`` (written last) marks a complete output. ``resume=True`` skips the parts already there and
refuses, naming each difference, an output whose pins differ; on a complete output it returns at once, without a
cluster. A job holds a lock on its output directory (:mod:`dask_lm.jobs.folder`), so two jobs never write one output.

Nothing is written before every check has passed. What costs no more than a few small reads comes first, before
anything starts: the output folder, the model's config and weight files (:mod:`dask_lm.io.modelcheck`) and
``--topk`` against the vocabulary they state, the tokenizer's files, the input files' footers, columns and types, a
held lock, a resume's options. Then the cluster starts, and its workers load the model
(:class:`~dask_lm.jobs.start.ClusterStart`), while this process does the costly checks: the config through
transformers (on the first worker, before its load: :class:`~dask_lm.scoring.preload.Preload`), the content hashes
(and a resume's comparison of them), and for jobs up to 8M tokens every row (:mod:`dask_lm.scoring.prescan`: all
bad rows in one refusal); a refused job closes what it started. A bad row found while scoring (a larger job) fails
it with a message naming file, row and column, unless ``skip_bad_rows`` (then it is listed in ``_errors.parquet``).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from dask_lm.engine.progress import JobBar  # the standard library (tqdm once the bar shows)
from dask_lm.scoring.spec import ScoreSpec  # the standard library and the jobs' spec machinery

if TYPE_CHECKING:
    from dask_lm.scoring.result import ScoreResult

__all__ = ["score_parquet"]


def score_parquet(
    input: Any,
    output: str | os.PathLike[str],
    *,
    model: str | os.PathLike[str] | None = None,
    client: Any = None,
    text_column: str | None = None,
    ids_column: str | None = None,
    prompt_column: str | None = None,
    response_column: str | None = None,
    id_column: str | None = None,
    prompt_length_column: str | None = None,
    convention: str | None = None,
    topk: int | None = None,
    decode_topk: bool | None = None,
    max_length: int | None = None,
    truncate: bool | None = None,
    batch_tokens: int | None = None,
    precision: str | None = None,
    resume: bool = False,
    progress: bool = True,
    skip_bad_rows: bool | None = None,
    allow_nonfinite: bool | None = None,
    compile: bool | None = None,
    tokenizer: str | os.PathLike[str] | None = None,
    revision: str | None = None,
    overwrite: bool = False,
    performance_report: str | None = None,
    n_workers: int | None = None,
    scheduler_address: str | None = None,
    task_tokens: int | None = None,
) -> ScoreResult:
    """Score every row of a parquet dataset with ``model``; see the module docstring for the output.

    ``input`` is a parquet file, a directory of them, a glob, or a list. Exactly one of ``text_column``,
    ``ids_column`` or ``prompt_column`` + ``response_column`` says what to score. Text is tokenized in
    ``convention`` (:mod:`dask_lm.data.continuation`): ``"lm-eval"``, lm-evaluation-harness's (the response
    encoded in context, trailing prompt whitespace moved to it, one BOS at most, an empty prompt conditioned on
    BOS / EOS), or ``"separate"`` (prompt and response encoded apart, as ``dask-lm logprobs`` does). With
    ``ids_column``, ``prompt_length_column`` (integers) says how many leading ids of each row are context: only
    the rest is scored. ``topk``: the k likeliest tokens at each position, ``decode_topk``: their strings too.
    ``client`` is a Dask client (default: ``connect(scheduler_address,
    n_workers=n_workers)``, started at once, beside the checks, and closed here); its workers load the model while
    the checks run. The rows are cut into tasks (and part files) of about ``task_tokens`` tokens, estimated from
    the footers (default: about 1/32 of the job, within 16k-1M: :mod:`dask_lm.scoring.spans`): a large row group is
    split across workers, small ones are merged; ``task_tokens=0`` keeps one task per row group, as written.
    ``precision`` defaults to bfloat16 on GPU workers and float32 on CPU ones. On GPU workers rows are packed and,
    with ``compile`` the forward is compiled once per worker process (5-10 s, reported as
    ``ScoreResult.compile_seconds``); by default (``None``) only where the job is long enough for that to pay
    (:func:`~dask_lm.scoring.compile_choice.worth_compiling`).
    An output that already holds a job is refused unless ``resume`` (finish it with the same pins; a finished one
    returns its summary at once, without a cluster) or ``overwrite`` (delete that job's files and score again);
    files dask-lm did not write are never deleted.
    With ``resume``, what is not given (``None``) is the manifest's, ``input`` and ``model`` too
    (:mod:`dask_lm.jobs.resume`: ``score_parquet(None, output, resume=True)``); a given option that differs is
    refused, naming it. Else ``model`` is required, and the defaults are ``convention="lm-eval"``, ``topk=0``, and
    ``False`` for ``decode_topk``, ``truncate``, ``skip_bad_rows`` and ``allow_nonfinite``.
    Raises ``ValueError`` for bad usage or input (damaged model files, a changed input on ``resume``, an output
    another job holds), before anything is written (a cluster this call started is closed again).
    """
    started, started_at = time.perf_counter(), time.time()
    given = ScoreSpec.given(locals())
    # the bar from the first second, saying what the job waits for at each step of its start: shown before the
    # job's machinery is imported (distributed and pyarrow: a second or more; tests/test_job_imports.py)
    bar = JobBar.for_job("scoring", "row", "checking the output, the model and the inputs", enabled=progress)
    try:
        from dask_lm.scoring import run  # lazy: distributed and pyarrow load once the bar shows
    except BaseException:
        bar.close()
        raise
    return run.run(
        given,
        output,
        client=client,
        resume=resume,
        overwrite=overwrite,
        revision=revision,
        progress=progress,
        performance_report=performance_report,
        n_workers=n_workers,
        scheduler_address=scheduler_address,
        started=started,
        started_at=started_at,
        bar=bar,
    )

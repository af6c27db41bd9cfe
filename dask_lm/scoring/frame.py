"""``dask_lm.score``: a Dask DataFrame in, a lazy Dask DataFrame of the same rows with their scores out.

The shape Dask users know from dask-ml's ``ParallelPostFit`` and ``xgboost.dask.predict``: the output's type
follows the input's. A Dask DataFrame gives a lazy one, built with ``map_partitions(..., meta=)``, so that it
composes with what comes before (a filter, a join) and after (``groupby``, ``to_parquet``, ``persist``,
``dask.compute`` of several); each partition is scored on the worker that holds it, with that worker's cached
model replica (:func:`dask_lm.scoring.partitions.score_frame`). A pandas DataFrame, a pandas Series of texts or a
list of texts gives a pandas DataFrame, computed on the cluster here.

The rows are scored by the code that scores ``score_parquet``'s part files
(:func:`dask_lm.scoring.scorer.score_rows`): the same columns, tokenization, length, bad-row, empty-row and
non-finite rules. What the file job adds on top (manifest, resume, exactly-once part files) belongs to files;
a collection's partitions are recomputed by Dask from their lineage instead.

The checks that cost a few small reads run when ``score`` is called, before any graph is built: the options, the
columns against the input's (a Dask DataFrame's ``meta``), the model's config and weight files and its
vocabulary against ``topk``, the tokenizer's files.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, cast

from dask_lm.data.continuation import Convention
from dask_lm.data.messages import ScoreOptions
from dask_lm.engine import cluster
from dask_lm.interface import current, opt, warn
from dask_lm.io import hub
from dask_lm.io.parquet import output_schema_columns
from dask_lm.jobs.spec import precision_name
from dask_lm.scoring.checks import check_score_model
from dask_lm.scoring.partitions import score_frame
from dask_lm.scoring.spec import ROW_COLUMNS, check_score_options

__all__ = ["score", "output_meta"]

# the key prefix of the scoring tasks, as the dashboard's task stream and progress bars show them
TOKEN = "dask-lm-score"

# A pandas input is cut into a partition per worker, or more where it is long: a partition's rows and results are
# held whole by its task, and smaller ones keep the workers evenly busy to the end
PANDAS_PARTITION_ROWS = 8192


def score(
    data: Any,
    *,
    model: str | os.PathLike[str],
    tokenizer: str | os.PathLike[str] | None = None,
    text_column: str | None = None,
    ids_column: str | None = None,
    prompt_column: str | None = None,
    response_column: str | None = None,
    prompt_length_column: str | None = None,
    convention: str = "lm-eval",
    topk: int = 0,
    decode_topk: bool = False,
    max_length: int | None = None,
    truncate: bool = False,
    batch_tokens: int | None = None,
    precision: str = "auto",
    skip_bad_rows: bool = False,
    allow_nonfinite: bool = False,
    compile: bool = False,
    client: Any = None,
) -> Any:
    """Score every row of ``data`` with ``model``: the input's rows with the columns ``score_parquet`` writes.

    ``data`` is a ``dask.dataframe.DataFrame`` (the result is a lazy ``dask.dataframe.DataFrame``, nothing is
    computed here), or a ``pandas.DataFrame`` (the result is a ``pandas.DataFrame``, computed on the cluster:
    ``client``, else the current default client, else a local cluster started with :func:`dask_lm.connect` and
    closed before returning). A list of strings, or a pandas Series of them, is a frame with one column ``text``,
    scored as text.

    The result keeps every input column and the input's index (a join or a groupby on it works afterwards), and
    adds ``num_tokens``, ``prompt_tokens``, ``num_scored``, ``truncated``, ``logprobs``, ``sum_logprob``,
    ``mean_logprob``, ``perplexity``, ``is_greedy`` (and ``topk_ids``, ``topk_logprobs`` with ``topk``,
    ``topk_tokens`` with ``decode_topk``), as Arrow-backed pandas columns (``pd.ArrowDtype``); the
    :doc:`output reference <../reference/output>` describes each. A Dask result's ``meta`` declares exactly these
    columns and dtypes. An input column named like one of them is refused.

    Exactly one of ``text_column``, ``ids_column`` (token-id lists, with ``prompt_length_column`` the number of
    leading ids that are context) or ``prompt_column`` + ``response_column`` (only the response is scored) says
    what to score; the other options are ``score_parquet``'s. ``precision`` ``"auto"`` is bfloat16 on GPU workers
    and float32 on CPU ones, decided by each worker. ``compile`` compiles each worker's forward once (it pays on
    long jobs only).

    ``client``: for a pandas input, the cluster to compute on (a ``distributed.Client``, a Dask cluster or a
    scheduler address); for a Dask DataFrame, the ``distributed.Client`` whose workers are readied for it at once
    (default: the current client; a worker that was not, installs what holds its replica with its first
    partition). A Dask result is computed wherever the caller computes it, on a Dask cluster's workers: dask's
    local schedulers are refused, as they would load the model in this process.

    A row that cannot be scored faithfully (a null or non-string text, a token id outside the vocabulary, a row
    longer than the model's positions or ``max_length`` without ``truncate``) raises
    :class:`~dask_lm.errors.BadRowError` when its partition is computed, naming the partition, the row's position in
    it, its index label and the column. With ``skip_bad_rows=True`` such rows are left out of the result instead,
    and a ``UserWarning`` says how many were dropped and why the first one was: for a pandas result, here, once,
    with the total; for a Dask result, per partition as it is computed, from its worker (``distributed.warn``: the
    clients show it too). Rows with nothing to score are kept, with ``num_scored`` 0 and null sums. Non-finite
    logprobs raise :class:`~dask_lm.errors.NonFiniteError` unless ``allow_nonfinite``.

    Raises ``ValueError`` for bad usage (options, a missing or clashing column, damaged model files) before any
    graph is built.

    Examples
    --------
    >>> import dask.dataframe as dd
    >>> ddf = dd.read_parquet("data/", dtype_backend="pyarrow")
    >>> scored = dask_lm.score(ddf[ddf.lang == "en"], model="Qwen/Qwen2.5-0.5B", text_column="text")
    >>> scored.groupby("source").perplexity.mean().compute()
    >>> dask_lm.score(["a first text", "and a second"], model="Qwen/Qwen2.5-0.5B")  # a pandas DataFrame
    """
    import dask.dataframe as dd
    import pandas as pd

    if isinstance(data, (list, tuple, pd.Series, dd.Series)):
        texts = data if isinstance(data, (pd.Series, dd.Series)) else pd.Series(list(data))
        data = texts.rename("text").to_frame()
        if not any((text_column, ids_column, prompt_column, response_column)):
            text_column = "text"
    if not isinstance(data, (pd.DataFrame, dd.DataFrame)):
        raise ValueError(
            f"dask_lm.score takes a dask or pandas DataFrame, a pandas Series or a list of texts; got "
            f"{type(data).__name__}"
        )
    # the options as asked; _options checks them and resolves the model, the tokenizer and the precision
    asked = ScoreOptions(
        model="",
        tokenizer="",
        precision=precision,
        output="",  # the file job's folder: a collection has none (score_frame returns its rows)
        text_column=text_column,
        ids_column=ids_column,
        prompt_column=prompt_column,
        response_column=response_column,
        prompt_length_column=prompt_length_column,
        convention=cast(Convention, convention),
        topk=topk,
        decode_topk=decode_topk,
        max_length=max_length,
        truncate=truncate,
        batch_tokens=batch_tokens,
        skip_bad_rows=skip_bad_rows,
        allow_nonfinite=allow_nonfinite,
        compile=compile,
        compile_head=compile,
        interface=current(),
    )
    opts = _options(data.columns, asked, model=model, tokenizer=tokenizer)
    if isinstance(data, dd.DataFrame):
        from distributed import Client

        if client is not None and not isinstance(client, Client):
            raise ValueError(
                f"for a Dask DataFrame, {opt('client')} is a distributed.Client (the frame is computed "
                f"where you compute it), got {type(client).__name__}"
            )
        known = _known_client(client)
        if known is not None:  # else each worker installs it with its first partition
            _register_state(known)
        return data.map_partitions(
            score_frame, opts, warn_dropped=True, meta=output_meta(data._meta, opts), token=TOKEN
        )
    return _score_pandas(data, opts, client)


def output_meta(meta: Any, opts: ScoreOptions) -> Any:
    """The result's ``meta``: the input's columns (``meta``, an empty pandas frame) with the score columns that
    ``opts`` adds, as ``pd.ArrowDtype`` (:func:`dask_lm.io.parquet.output_schema_columns`), in that order."""
    import pandas as pd

    out = meta.iloc[:0].copy()
    for name, type_ in output_schema_columns(opts.topk, opts.decode_topk):
        out[name] = pd.array([], dtype=pd.ArrowDtype(type_))
    return out


def _options(columns: Any, asked: ScoreOptions, *, model: Any, tokenizer: Any) -> ScoreOptions:
    """The cheap checks (``score_parquet``'s own: options, model files, tokenizer files), and the columns against
    ``columns``, the input's; the options the partitions are scored with: ``asked`` with the model's and the
    tokenizer's paths, the convention and the precision as checked."""
    conv = check_score_options(asked)
    fixed_precision = precision_name(asked.precision)  # None: each worker's own (bf16 on a GPU, fp32 elsewhere)
    have = list(columns)
    for key in ROW_COLUMNS:
        name = getattr(asked, key)
        if name is not None and name not in have:
            raise ValueError(f"{opt(key, name)}: the data has no column {name!r}; its columns are {have}")
    added = [name for name, _ in output_schema_columns(asked.topk, asked.decode_topk)]
    clash = [c for c in have if c in added]
    if clash:
        raise ValueError(
            f"the data's column {clash[0]!r} has the name of a column dask_lm.score adds ({added}); "
            f"rename it first, e.g. data.rename(columns={{{clash[0]!r}: {clash[0] + '_in'!r}}})"
        )
    path = hub.resolve_model(model).path
    _info, tok = check_score_model(
        path, topk=asked.topk, tokenizer=tokenizer, ids_column=asked.ids_column, decode_topk=asked.decode_topk
    )
    return dataclasses.replace(asked, model=path, tokenizer=tok, precision=fixed_precision or "auto", convention=conv)


def _known_client(client: Any) -> Any:
    """``client`` as given, else the current default client, else ``None`` (no cluster yet)."""
    if client is not None:
        return client
    from distributed import default_client

    try:
        return default_client()
    except ValueError:
        return None


def _register_state(client: Any) -> None:
    """The workers' dask-lm plugin, which holds their replicas and frees those left idle (idempotent)."""
    from dask_lm.workers.state import PLUGIN_NAME, DaskLMWorkerState

    client.register_plugin(DaskLMWorkerState(), name=PLUGIN_NAME)


def _score_pandas(pdf: Any, opts: ScoreOptions, client: Any) -> Any:
    """A pandas frame scored on the cluster, cut into a partition per worker (or per :data:`PANDAS_PARTITION_ROWS`
    rows, where that is more); pandas back, in the input's order."""
    import dask
    import dask.dataframe as dd

    from dask_lm.engine.worker_group import scheduler_info

    given = _known_client(client)
    opened = None
    if given is None:
        given = opened = cluster.connect()
    try:
        dask_client = cluster.as_client(given)
        if dask_client is not given:  # a cluster object or an address: the client made for it is closed here
            opened = dask_client
        _register_state(dask_client)
        workers = len(scheduler_info(dask_client)["workers"])
        # the rows as given: Dask would turn object columns into strings, a column of token-id lists included
        with dask.config.set({"dataframe.convert-string": False}):
            parts = min(len(pdf), max(workers, -(-len(pdf) // PANDAS_PARTITION_ROWS)))
            ddf = dd.from_pandas(pdf, npartitions=max(parts, 1), sort=False)
        # the workers warn nothing: the total is said once, here
        lazy = ddf.map_partitions(score_frame, opts, warn_dropped=False, meta=output_meta(ddf._meta, opts), token=TOKEN)
        out = dask_client.compute(lazy).result()
    finally:
        if opened is not None:
            cluster.close(opened)
    dropped = len(pdf) - len(out)
    if dropped:
        warn(
            f"dask_lm.score: {dropped} bad row{'s' * (dropped != 1)} of {len(pdf)} left out "
            f"({opt('skip_bad_rows', True)}); without it "
            "the first raises BadRowError, naming its row and why"
        )
    return out

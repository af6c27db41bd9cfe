"""The worker half of ``dask_lm.score``: one partition of the caller's Dask DataFrame in, the same rows with their
score columns out.

:func:`score_frame` is what ``map_partitions`` runs, on the worker that holds the partition. It scores through
the same code as ``score_parquet``'s file job (:func:`dask_lm.scoring.scorer.score_rows`, with this worker's
cached replica), and returns the kept rows with all their input columns, their index labels, and the score
columns as Arrow-backed pandas columns (``pd.ArrowDtype``): the frame the driver declared as ``meta``
(:func:`dask_lm.scoring.frame.output_meta`). Nothing here imports torch until a partition is scored, so the
driver can import this module to build the graph.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from dask_lm.data.messages import ScoreOptions

__all__ = ["score_frame", "ensure_worker_state"]


def ensure_worker_state() -> None:
    """This worker's dask-lm plugin, which holds its replicas: registered by ``dask_lm.score`` where it knew the
    client, and installed here on a worker without it (a lazy frame computed later on another client, or a worker
    that joined since). Outside a Dask worker (dask's local schedulers) there is no worker to hold a replica, and
    the model must not load in the driver: a ``RuntimeError`` says how to compute the frame."""
    from distributed import get_worker
    from distributed.utils import sync

    from dask_lm.workers.state import PLUGIN_NAME, DaskLMWorkerState

    try:
        worker = get_worker()
    except ValueError:
        raise RuntimeError(
            "dask_lm.score's frame is computed on a Dask cluster's workers, which hold the model: "
            "connect a client first (client = dask_lm.connect(), or distributed.Client(address)), "
            "then .compute() / .persist() it; dask's local schedulers would load the model here, in "
            "the driver"
        ) from None
    if PLUGIN_NAME not in worker.plugins:
        # on the worker's event loop, as a registered plugin's setup runs (it starts the lease check there)
        sync(worker.loop, worker.plugin_add, plugin=DaskLMWorkerState(), name=PLUGIN_NAME)


def score_frame(pdf: Any, opts: ScoreOptions, warn_dropped: bool = True, partition_info: Any = None) -> Any:
    """Score the rows of ``pdf`` (one partition) for ``opts``; dask passes ``partition_info``, whose number names
    the partition in a bad row's message (with the row's position in it and its index label).

    Bad rows raise :class:`~dask_lm.errors.BadRowError`, or with ``skip_bad_rows`` are left out of the result; with
    ``warn_dropped`` a warning (:func:`distributed.warn`, shown by the clients too) says how many and why."""
    import pandas as pd

    from dask_lm import interface
    from dask_lm.scoring import scorer
    from dask_lm.scoring.replicas import auto_precision

    number = partition_info["number"] if partition_info else 0
    where = f"partition {number}"
    ensure_worker_state()
    with interface.speaking(opts.interface):  # messages name options as the caller spells them
        opts = replace(opts, precision=auto_precision(opts.precision))
        fix = (
            f"fix the data, or pass {interface.opt('skip_bad_rows', True)} to leave bad rows out of the result "
            "(a warning says how many)"
        )
        got = scorer.score_rows([(pdf, 0)], opts, where=where, bad_fix=fix, labels=list(pdf.index))
        if got.bad and warn_dropped:
            from distributed import warn

            n = len(got.bad)
            warn(
                f"dask_lm.score: {n} bad row{'s' * (n != 1)} of {where} left out "
                f"({interface.opt('skip_bad_rows', True)}); the first: {got.errors[0]}"
            )
    out = pdf.iloc[got.keep]  # a new frame (copy-on-write): the caller's partition is not changed
    for name in got.table.column_names:
        # by position, never aligned on the index: the input's labels may repeat
        out[name] = pd.arrays.ArrowExtensionArray(got.table.column(name))
    return out

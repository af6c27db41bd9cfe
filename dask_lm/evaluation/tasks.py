"""lm-eval's Dask task functions: what the request engine (:mod:`dask_lm.evaluation.engine`) submits for the
lm-evaluation-harness model class (:mod:`dask_lm.harness`). Each runs on whichever worker is free and imports the
rank half (:mod:`dask_lm.evaluation.requests`) there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dask_lm.data.messages import ScoreOptions

__all__ = ["loglikelihood_requests", "generate_requests"]


def loglikelihood_requests(
    ids: list[list[int]], starts: list[int], opts: ScoreOptions, names: list[int] | None = None
) -> list[tuple[float, bool]]:
    """The lm-eval model class's loglikelihood requests: score rows on this worker
    (:func:`dask_lm.evaluation.requests.loglikelihood_rows`)."""
    from dask_lm.evaluation import requests

    return requests.loglikelihood_rows(ids, starts, opts, names)


def generate_requests(
    contexts: list[list[int]], gen: dict[str, Any], opts: ScoreOptions, names: list[int] | None = None
) -> list[list[int]]:
    """The lm-eval model class's generate_until requests: generate after rows on this worker
    (:func:`dask_lm.evaluation.requests.generate_rows`)."""
    from dask_lm.evaluation import requests

    return requests.generate_rows(contexts, gen, opts, names)

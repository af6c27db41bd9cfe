"""Progress events from the ranks to the driver's bars (:mod:`dask_lm.engine.progress` reads them).

The lowest rank-side module that training, refit and scoring all report through: it imports nothing of dask-lm,
so that no rank module has to import the task entry points (:mod:`dask_lm.workers.tasks`) to move a bar.
"""

from __future__ import annotations

__all__ = ["report_progress"]


def report_progress(progress_id: str | None, done: int, part: int | None = None) -> None:
    """Move the driver's progress bar for call ``progress_id`` to ``done`` (a Dask event; see engine/progress.py);
    with ``part``, ``done`` counts the rows of that part of a job (:class:`~dask_lm.engine.progress.JobBar`)."""
    if progress_id is None:
        return
    from distributed import get_worker

    msg = (
        {"id": progress_id, "done": int(done)}
        if part is None
        else {"id": progress_id, "done": int(done), "part": int(part)}
    )
    try:
        get_worker().log_event("dask-lm-progress", msg)
    except ValueError:  # not on a worker (direct calls in tests)
        pass

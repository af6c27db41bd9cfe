"""The Dask preload of a local cluster's worker processes (``connect()`` passes it): they ignore SIGINT, do not
log the failures of dask-lm's own tasks, and warm up in the background (:mod:`dask_lm.workers.warm`).

A terminal sends Ctrl-C's SIGINT to its whole foreground process group: the driver and, on a local cluster, every
worker process it spawned. Each worker then printed its own ``KeyboardInterrupt`` traceback (25 lines a worker)
over the driver's cleanup. The driver is the one that decides: it cancels the job and closes the cluster, which
stops the workers through their nannies (SIGTERM and the close RPC, not SIGINT). Ignoring SIGINT in the workers
leaves that to it. Until this preload runs the worker process is importing its modules, seconds on a busy machine:
it starts with SIGINT blocked (:func:`dask_lm.engine.cluster.spawning_without_sigint` blocks it in the driver's
threads that spawn workers, and the mask is inherited), so a Ctrl-C then stays pending; here it is ignored, which
drops a pending one, and unblocked. Workers of an attached cluster (``dask worker``) load no preload of ours and keep
Dask's own handling.

A failed task is logged by its worker (``distributed.worker - ERROR - Compute Failed``, with the task's repr and
its traceback) to the terminal the local cluster shares with the driver, in the middle of the progress bar; and
the same error reaches the caller, whom Dask gives every failed task's exception. For dask-lm's own tasks the
caller is dask-lm, which says it once, as the error (a bad row: one line naming file, row and column). So that
record is dropped for tasks whose function is dask-lm's; a failure of the user's own tasks on the same cluster,
and every other record of the worker (memory, lost peers, an unresponsive event loop), is logged as Dask does.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

__all__ = ["dask_setup"]


def dask_setup(worker: Any) -> None:
    """Called by Dask in the worker process as the worker starts."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # what later threads and subprocesses inherit
    logging.getLogger("distributed.worker").addFilter(_OwnFailures(worker))
    from dask_lm.workers import warm

    warm.start(worker)  # imports and the CUDA context in the background, once it has registered (warm.py says why)


class _OwnFailures(logging.Filter):
    """Drops the worker's "Compute Failed" record of a task whose function is dask-lm's (the job reports it)."""

    def __init__(self, worker: Any) -> None:
        super().__init__()
        self.worker = worker

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Compute Failed") or not record.args:
            return True
        key = record.args[0] if isinstance(record.args, tuple) else None
        try:
            func = self.worker.state.tasks[key].run_spec.func
        except Exception:
            return True
        return not str(getattr(func, "__module__", "") or "").startswith("dask_lm.")

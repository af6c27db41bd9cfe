"""A clean, fast end for the worker processes of dask-lm's own local clusters.

A worker process that imported torch and transformers takes seconds to exit once its worker has closed: the
interpreter unloads their modules one by one (about 2 s on a busy 2-core machine). Its nanny waits 4 s, then kills
it and logs ``distributed.nanny - WARNING - Worker process still alive after 4.0 seconds, killing`` on the
terminal the local cluster shares with the driver, the last thing a user's script printed. Such a worker has
nothing left to do once closed (its results are written or sent, its replicas and policies freed by the close), so
it ends with ``os._exit`` as soon as the interpreter's exit begins: the first of its ``atexit`` handlers, as it is
registered last (:func:`exit_once_closed`).

Only workers of a cluster that dask-lm started (``connect()``, a job's own cluster: :func:`owned_by_dask_lm`)
end this way; the workers of a cluster the user runs keep their interpreter's usual exit.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from typing import Any

__all__ = ["exit_once_closed", "owned_by_dask_lm", "PRELOAD"]

PRELOAD = "dask_lm.workers.preload"
"""The preload ``connect()`` gives the workers of the local clusters it starts: what marks them as dask-lm's."""


def owned_by_dask_lm(worker: Any) -> bool:
    """Whether ``worker`` belongs to a local cluster that dask-lm started (it runs dask-lm's preload)."""
    return any(getattr(p, "name", None) == PRELOAD for p in getattr(worker, "preloads", None) or ())


def _leave() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def exit_once_closed() -> None:
    """In a worker process about to close: end it at once when the interpreter's exit begins (``os._exit``, its
    output flushed), instead of after unloading every module. Registered last, it runs first of the ``atexit``
    handlers; the others are for a process that lives on (caches, child processes: a closed worker has none)."""
    atexit.unregister(_leave)  # once, however often asked
    atexit.register(_leave)

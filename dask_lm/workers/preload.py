"""The Dask preload of a local cluster's worker processes (``connect()`` passes it): they ignore SIGINT.

A terminal sends Ctrl-C's SIGINT to its whole foreground process group: the driver and, on a local cluster, every
worker process it spawned. Each worker then printed its own ``KeyboardInterrupt`` traceback (25 lines a worker)
over the driver's cleanup. The driver is the one that decides: it cancels the job and closes the cluster, which
stops the workers through their nannies (SIGTERM and the close RPC, not SIGINT). Ignoring SIGINT in the workers
leaves that to it. A blocked signal mask would not carry over: ``multiprocessing``'s spawn clears it in the child,
so the disposition is set here, in the worker process, before its worker starts. Workers of an attached cluster
(``dask worker``) load no preload of ours and keep Dask's own handling.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

__all__ = ["dask_setup"]


def dask_setup(worker: Any) -> None:
    """Called by Dask in the worker process as the worker starts."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)

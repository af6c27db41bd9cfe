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

The fast exit keeps the process's exit status, which its nanny reads: ``atexit`` handlers are not told it, so it is
taken from where it comes from. A worker process (``multiprocessing``'s spawn) ends by ``sys.exit(code)``: the main
thread's ``sys.exit`` is wrapped to note its status, and an uncaught exception (status 1) leaves ``sys.last_type``
set. An exit whose status is not known that way (a ``raise SystemExit(3)`` of its own, ``sys.exit("message")``,
the end of a script) is left to the interpreter, which knows it.

A task still running as its worker closes (a preload of the model that the job, done with its rows, no longer needs)
has its execution cancelled, which distributed logs as ``Async instruction for ... ended with CancelledError``
(a WARNING, ``distributed.worker.state_machine``); that one message is dropped in a worker that
:func:`exit_once_closed` prepared for its close, where a cancelled task is the close's doing.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from typing import Any, NoReturn

__all__ = ["exit_once_closed", "owned_by_dask_lm", "PRELOAD"]

PRELOAD = "dask_lm.workers.preload"
"""The preload ``connect()`` gives the workers of the local clusters it starts: what marks them as dask-lm's."""


def owned_by_dask_lm(worker: Any) -> bool:
    """Whether ``worker`` belongs to a local cluster that dask-lm started (it runs dask-lm's preload)."""
    return any(getattr(p, "name", None) == PRELOAD for p in getattr(worker, "preloads", None) or ())


_exit_status: int | None = None  # what the main thread's last sys.exit asked for (None: not asked, or not a number)
_sys_exit = sys.exit


def _noting_exit(status: str | int | None = None) -> NoReturn:
    """``sys.exit``, noting the status it asks for when the main thread asks (another thread's ends that thread)."""
    global _exit_status
    if threading.current_thread() is threading.main_thread():
        # a string or other object is printed by the interpreter as it exits: its exit, not this module's
        _exit_status = 0 if status is None else status if isinstance(status, int) else None
    _sys_exit(status)


def _status() -> int | None:
    """The status the interpreter is exiting with, where known (the module docstring says how)."""
    if getattr(sys, "last_type", None) is not None:  # set by the interpreter for an uncaught exception, status 1
        return 1
    return _exit_status


def _leave() -> None:
    status = _status()
    if status is None:  # not known: the interpreter's usual exit keeps it
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


class _CancelledByTheClose(logging.Filter):
    """Drops distributed's WARNING about a task whose execution the worker's close cancelled."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().endswith("ended with CancelledError")


_CANCELLED_BY_THE_CLOSE = _CancelledByTheClose()


def exit_once_closed() -> None:
    """In a worker process about to close: end it at once when the interpreter's exit begins (``os._exit``, its
    output flushed, its exit status kept), instead of after unloading every module, and without a WARNING for a
    task its close cancels. Registered last, it runs first
    of the ``atexit`` handlers; the others are for a process that lives on (caches, child processes: a closed
    worker has none)."""
    sys.exit = _noting_exit  # the status of the exit to come (a worker process's ends by sys.exit)
    # a task still running is the close's to cancel (the module docstring says which); added once, however often
    logging.getLogger("distributed.worker.state_machine").addFilter(_CANCELLED_BY_THE_CLOSE)
    atexit.unregister(_leave)  # once, however often asked
    atexit.register(_leave)

"""A job's cluster and precision: the cluster started beside the driver's checks (:class:`ClusterStart`), the
client and progress bar for the job's run (:func:`running`), and the precision the workers' devices decide
(:func:`worker_precision`) when ``--precision`` leaves it automatic.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from dask_lm.engine.progress import JobBar

__all__ = ["ClusterStart", "in_thread", "running", "wait_for_workers", "worker_precision"]


def wait_for_workers(client: Any, bar: JobBar | None = None) -> None:
    """Return once the scheduler has a worker: a job may be started against a scheduler whose workers come later
    (``dask worker`` processes still starting, an adaptive cluster scaled to zero). ``bar`` says so meanwhile. No
    timeout: the job cannot run without a worker, and the caller stops it (Ctrl-C) if none will come."""
    from dask_lm.engine.worker_group import scheduler_info

    if scheduler_info(client)["workers"]:
        return
    if bar is not None:
        address = getattr(getattr(client, "scheduler", None), "address", None)
        bar.wait(f"waiting for workers to join the scheduler{f' at {address}' if address else ''}")
    client.wait_for_workers(1)


def worker_precision(client: Any, bar: JobBar | None = None) -> str:
    """An automatic precision: bfloat16 when a worker has a GPU, else float32 (asked of the workers there are,
    once there is one: :func:`wait_for_workers`)."""
    from dask_lm.workers.tasks import rank_info

    while True:
        wait_for_workers(client, bar)
        # a worker that leaves while asked (retired, scaled down) answers with its connection's error: not counted
        infos = {w: i for w, i in client.run(rank_info, on_error="return").items() if not isinstance(i, OSError)}
        for i in infos.values():
            if isinstance(i, BaseException):
                raise i
        if infos:
            break
    return "bfloat16" if any(i.get("device") == "cuda" for i in infos.values()) else "float32"


class ClusterStart:
    """The job's cluster, started (or reached) in a background thread as soon as the job knows it will run, so
    that starting worker processes, their imports and whatever ``warm`` submits to them (a model load) overlap
    the driver's checks and fingerprints. Nothing here writes to the output: a job refused by a later check
    calls :meth:`close`, which closes what was opened and cancels the warm-up.

    ``client`` is used as given (a Client, a Dask cluster or a scheduler address:
    :func:`~dask_lm.engine.cluster.as_client`); without one, ``connect(scheduler_address, n_workers=n_workers)``
    attaches to a scheduler or starts a local cluster. ``warm(client)`` returns the futures it submitted. With
    ``eager=False`` nothing starts until :meth:`result` is called."""

    def __init__(
        self,
        client: Any,
        *,
        scheduler_address: str | None,
        n_workers: int | None,
        warm: Callable[[Any], list[Any]] | None = None,
        eager: bool = True,
    ) -> None:
        import threading

        remote = scheduler_address or os.environ.get("DASK_SCHEDULER_ADDRESS")
        self.waiting = (
            "asking the workers about their devices"
            if client is not None
            else "connecting to the cluster"
            if remote
            else "starting a local cluster"
        )
        self._given, self._address, self._n_workers, self._warm = client, scheduler_address, n_workers, warm
        self.client: Any = None
        self.opened: Any = None  # what this start opened, and so closes
        self.warm_futures: list[Any] = []
        self.seconds = 0.0  # the start itself: processes spawned and registered, or the scheduler reached
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._start, name="dask-lm-cluster-start", daemon=True)
        if eager:  # else only when result() asks (a job that may turn out to need no cluster)
            self._thread.start()

    def _start(self) -> None:
        import time

        from dask_lm.engine import cluster

        t0 = time.perf_counter()
        try:
            if self._given is None:
                self.opened = self.client = cluster.connect(self._address, n_workers=self._n_workers)
            else:
                self.client = cluster.as_client(self._given)
                self.opened = self.client if self.client is not self._given else None
            self.seconds = time.perf_counter() - t0
            if self._warm is not None:
                self.warm_futures = self._warm(self.client)
        except BaseException as e:  # re-raised in the driver's thread by result()
            self._error = e

    def result(self) -> Any:
        """The client, once started (re-raising what the start raised)."""
        if self._thread.ident is None:
            self._thread.start()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.client

    def close(self, *, interrupted: bool = False) -> None:
        """The job will not run: cancel the warm-up and close what this start opened (a given client stays).
        ``interrupted`` (Ctrl-C, SIGTERM): a local cluster's worker processes are killed first rather than
        drained (a graceful close takes 3-4 s), as what they hold is written already or lost anyway: every part
        is written under a temporary name and renamed, so a killed task leaves only debris that resume removes."""
        from dask_lm.engine import cluster

        if self._thread.ident is None:  # never started
            return
        self._thread.join()
        with contextlib.suppress(Exception):
            if self.warm_futures:
                self.client.cancel(self.warm_futures)
            if self.opened is not None:
                if interrupted:
                    cluster.kill_local_workers(self.opened)
                cluster.close(self.opened)
                self.opened = None


def in_thread(fn: Any, *args: Any) -> Future[Any]:
    """``fn(*args)`` in a daemon thread, as a future: a check the job no longer waits for (a Ctrl-C, a refusal
    by the other check) does not hold the process's exit, as a pool's threads would (an import of transformers
    cannot be interrupted, and the interpreter joins a ThreadPoolExecutor's threads at exit)."""
    fut: Future[Any] = Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # re-raised in the driver's thread by result()
            fut.set_exception(e)

    threading.Thread(target=run, name="dask-lm-check", daemon=True).start()
    return fut


@contextlib.contextmanager
def running(start: ClusterStart, *, total: int, desc: str, unit: str, progress: bool) -> Iterator[tuple[Any, JobBar]]:
    """The job's Dask client (from ``start``) and progress bar (:class:`~dask_lm.engine.progress.JobBar`) for
    the block. What ``start`` opened is closed when the block ends, the local cluster included; a client the
    caller gave stays open."""
    bar = JobBar(total, desc, unit, start.waiting, enabled=progress)
    try:
        client = start.result()
        if getattr(client, "dashboard_link", None):
            bar.write(f"dask-lm: watch the job on the Dask dashboard at {client.dashboard_link}")
        yield client, bar
    except KeyboardInterrupt:  # Ctrl-C / SIGTERM: a local cluster's workers are stopped at once, not drained
        bar.close()
        start.close(interrupted=True)
        raise
    finally:
        bar.close()
        start.close()

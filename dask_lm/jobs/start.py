"""A job's cluster and precision: the cluster started beside the driver's checks (:class:`ClusterStart`), the
client and progress bar for the job's run (:func:`running`), and the precision the workers' devices decide
(:func:`worker_precision`) when ``--precision`` leaves it automatic.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from dask_lm.engine.progress import JobBar

__all__ = [
    "ClusterStart",
    "in_thread",
    "running",
    "wait_for_checks",
    "wait_for_workers",
    "worker_precision",
]


# How long a cluster's start waits for the driver's check that goes before it (ClusterStart's warm_after)
WARM_AFTER_S = 3.0


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
    ``warm_after`` the start waits for it to be set (the driver's own short check first), or :data:`WARM_AFTER_S`,
    whichever comes first. With
    ``eager=False`` nothing starts until :meth:`result` is called."""

    def __init__(
        self,
        client: Any,
        *,
        scheduler_address: str | None,
        n_workers: int | None,
        warm: Callable[[Any], list[Any]] | None = None,
        eager: bool = True,
        warm_after: threading.Event | None = None,
    ) -> None:
        remote = scheduler_address or os.environ.get("DASK_SCHEDULER_ADDRESS")
        self.waiting = (
            "asking the workers about their devices"
            if client is not None
            else "connecting to the cluster"
            if remote
            else "starting a local cluster"
        )
        self._given, self._address, self._n_workers, self._warm = client, scheduler_address, n_workers, warm
        self._warm_after = warm_after
        self.client: Any = None
        self.opened: Any = None  # what this start opened, and so closes
        self.warm_futures: list[Any] = []
        self.seconds = 0.0  # the start itself: processes spawned and registered, or the scheduler reached
        # when the start itself began and ended (time.time(); None until then): an interval that may overlap the
        # driver's checks, reported apart from them (ScoreResult.start_phases' cluster_began / cluster_up)
        self.began_at: float | None = None
        self.up_at: float | None = None
        self.up = threading.Event()  # the start itself is over (the client is there, or its error)
        self._error: BaseException | None = None
        self._closing = threading.Lock()
        self._abandoned = False  # the job ended while the start ran: the start thread closes what it opened
        self._starting = False  # the start itself is under way (past warm_after)
        self._thread = threading.Thread(target=self._start, name="dask-lm-cluster-start", daemon=True)
        if eager:  # else only when result() asks (a job that may turn out to need no cluster)
            self._thread.start()

    def _start(self) -> None:
        import time

        from dask_lm.engine import cluster

        if self._warm_after is not None:
            # the driver's own check first (the rows: a second or two of CPU, mostly importing transformers), then
            # the cluster's start and the workers' imports of torch, which would take the CPU (and this process's
            # GIL: the scheduler and the nannies run here) from it: not waited for past WARM_AFTER_S, where the
            # check is a large job's and the start must overlap it
            self._warm_after.wait(WARM_AFTER_S)
        with self._closing:
            if self._abandoned:  # refused meanwhile (the rows): no cluster to start
                self.up.set()
                return
            self._starting = True
        t0, self.began_at = time.perf_counter(), time.time()
        try:
            if self._given is None:
                client = cluster.connect(self._address, n_workers=self._n_workers)
            else:
                client = cluster.as_client(self._given)
            with self._closing:
                self.client = client
                self.opened = client if client is not self._given else None
                self.seconds = time.perf_counter() - t0
                self.up_at = time.time()
                self.up.set()
                abandoned = self._abandoned
            with self._closing:
                abandoned = self._abandoned
            if abandoned:  # refused while this ran: nothing to warm up, and no one else to close it
                self._close_opened()
            elif self._warm is not None:
                self.warm_futures = self._warm(self.client)
        except BaseException as e:  # re-raised in the driver's thread by result()
            self._error = e
        finally:
            self.up.set()

    @property
    def abandoned(self) -> bool:
        """The job ended before the start did (:meth:`close`): what waits for the cluster need not."""
        return self._abandoned

    def phase(self) -> str | None:
        """What the start is doing, for the job's bar; ``None`` once the cluster is there."""
        held = self._warm_after is not None and not self._warm_after.is_set() and not self._starting
        return None if self.up.is_set() or held or self._thread.ident is None else self.waiting

    def result(self) -> Any:
        """The client, once started (re-raising what the start raised)."""
        if self._thread.ident is None:
            self._thread.start()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.client

    def close(self, *, interrupted: bool = False) -> None:
        """The job is over, or will not run: cancel the warm-up and close what this start opened (a given client
        stays). A start still under way is not waited for: a job refused by a check that came first says so at
        once, and the start thread closes the cluster once it is up (before this process exits).
        ``interrupted`` (Ctrl-C, SIGTERM): a local cluster's worker processes are killed first rather than
        drained (a graceful close takes 3-4 s), as what they hold is written already or lost anyway: every part
        is written under a temporary name and renamed, so a killed task leaves only debris that resume removes."""
        if self._thread.ident is None:  # never started
            return
        with self._closing:
            if not self.up.is_set():
                self._abandoned = True
                if self._warm_after is not None:  # a start still waiting for it need not wait any longer
                    self._warm_after.set()
                atexit.register(self._thread.join)  # the interpreter's exit waits for that close
                return
        self._thread.join()
        self._close_opened(interrupted=interrupted)

    def _close_opened(self, *, interrupted: bool = False) -> None:
        from dask_lm.engine import cluster
        from dask_lm.workers.clean_exit import exit_once_closed

        with contextlib.suppress(Exception):
            if self.warm_futures:
                self.client.cancel(self.warm_futures)
                self.warm_futures = []
            if self.opened is not None:
                if interrupted:
                    cluster.kill_local_workers(self.opened)
                elif getattr(self.opened, "_dask_lm_owns_cluster", False):
                    # a local cluster of this job's own: its workers leave once closed, without the seconds an
                    # interpreter takes to unload torch (past the nanny's 4 s it kills them, with a WARNING)
                    self.opened.run(exit_once_closed, on_error="ignore")  # dask_lm.workers.clean_exit
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


def wait_for_checks(
    checks: dict[str, Future[Any] | None], start: ClusterStart, bar: JobBar, *, on_workers: tuple[str, ...] = ()
) -> None:
    """Wait for the job's checks that run beside its cluster's start (``checks``: what the bar calls each, and its
    future; ``None`` for one the job does not run), saying on ``bar`` what is under way as it changes: the start
    while it lasts, then the checks (those named in ``on_workers`` only once there are workers to run them). The
    first refusal is raised as soon as it is known, whichever check it comes from (a bad row does not wait for the
    workers' imports); the checks still running are left to end on their own."""
    from concurrent.futures import FIRST_COMPLETED, wait

    pending = {name: f for name, f in checks.items() if f is not None}
    while True:
        for name, f in list(pending.items()):
            if f.done():
                error = f.exception()
                if error is not None:
                    raise error
                del pending[name]
        if not pending:
            return
        starting = start.phase()
        shown = [starting] if starting else []
        shown += [name for name in pending if start.up.is_set() or name not in on_workers]
        bar.wait(", ".join(shown))
        # a refresh of the bar's words, not a synchronisation: each pass looks at every future again
        wait(list(pending.values()), timeout=0.25, return_when=FIRST_COMPLETED)


@contextlib.contextmanager
def running(
    start: ClusterStart, *, total: int, desc: str, unit: str, progress: bool, bar: JobBar | None = None
) -> Iterator[tuple[Any, JobBar]]:
    """The job's Dask client (from ``start``) and progress bar (:class:`~dask_lm.engine.progress.JobBar`; ``bar``,
    the one the job showed from its start, or a new one) for the block. What ``start`` opened is closed when the
    block ends, the local cluster included; a client the caller gave stays open."""
    if bar is None:
        bar = JobBar(total, desc, unit, start.waiting, enabled=progress)
    else:
        bar.wait(start.phase() or "asking the workers about their devices", total=total)
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

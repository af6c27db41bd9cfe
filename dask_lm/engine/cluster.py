"""``connect()``: attach to a Dask scheduler, or start a local cluster with one worker per GPU (or CPU rank).

The driver never initialises CUDA: GPUs are counted through NVML (``nvidia-smi``'s library) when it is
installed, else through ``CUDA_VISIBLE_DEVICES`` / ``/proc/driver/nvidia``, never through ``torch.cuda``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Literal

from distributed import Client

from dask_lm.interface import current, opt

__all__ = ["connect", "close", "count_gpus", "as_client", "performance_report", "lost_scheduler"]

logger = logging.getLogger("dask_lm")

ClusterKind = Literal["auto", "cuda", "cpu"]


def count_gpus() -> int:
    """GPUs visible to this machine, without creating a CUDA context."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library or no driver: count device nodes instead
        pass
    gpus_dir = "/proc/driver/nvidia/gpus"
    return len(os.listdir(gpus_dir)) if os.path.isdir(gpus_dir) else 0


def _name(key: str) -> str:
    """An argument's name in a message: ``--n-workers`` to the CLI's user, `` `n_workers` `` to a Python caller."""
    return opt(key) if current() == "cli" else f"`{key}`"


def _scheduler_file(address: str) -> bool:
    return address.endswith(".json") and os.path.exists(address)


def connect(
    address: str | None = None,
    *,
    n_workers: int | None = None,
    cluster: ClusterKind = "auto",
    memory_limit: str | float | None = "auto",
    host: str = "127.0.0.1",
    dashboard_address: str | None = None,
    **cluster_kwargs: Any,
) -> Client:
    """A ``distributed.Client`` for dask-lm work.

    Parameters
    ----------
    address:
        A scheduler address (``tcp://host:8786``) or a scheduler file (``scheduler.json``). Without one,
        ``DASK_SCHEDULER_ADDRESS`` is used when set, else the warm local cluster of ``dask-lm cluster start`` when
        one runs (``DASK_LM_WARM_CLUSTER=0``: never; an option below it cannot honour is a ``ValueError``). An
        existing cluster is attached to and never closed.
    n_workers:
        For a local cluster: workers to start (default: one per GPU, or 2 on a CPU machine).
    cluster:
        ``"auto"`` starts ``dask_cuda.LocalCUDACluster`` when GPUs are present, else a CPU ``LocalCluster``;
        ``"cuda"`` / ``"cpu"`` force one.
    cluster_kwargs:
        Passed to the local cluster (``LocalCluster`` / ``LocalCUDACluster``). With ``DASK_LM_QUIET_WORKERS=1``
        (what the ``dask-lm`` command sets without ``--verbose``) its workers log only critical records.
    host:
        For a local cluster: the interface every listener binds to — scheduler, workers, nannies, the dashboard,
        and the ranks' torch.distributed store and collectives. Loopback by default, so nothing on the network
        can reach a local cluster (Dask's own protocol unpickles what it receives); pass another address only
        behind a firewall or with Dask's TLS security (``security=...``).
    dashboard_address:
        Where the dashboard listens (default: a free port on ``host``).

    Examples
    --------
    >>> client = connect()                       # local: one worker per GPU, or 2 CPU workers
    >>> client = connect("tcp://10.0.0.5:8786")  # a SLURM / Kubernetes / gateway scheduler
    """
    if cluster not in ("auto", "cuda", "cpu"):
        raise ValueError(f"`cluster` must be 'auto', 'cuda' or 'cpu', got {cluster!r}")
    address = address or os.environ.get("DASK_SCHEDULER_ADDRESS") or None
    if address:
        if _scheduler_file(address):
            return Client(scheduler_file=address)
        if address.endswith(".json"):
            raise ValueError(f"scheduler file {address!r} does not exist")
        return Client(address)
    if n_workers is not None and n_workers < 1:
        raise ValueError(f"{_name('n_workers')} must be >= 1, got {n_workers}")
    from dask_lm.engine import warm_cluster  # the standard library only

    asked = warm_cluster.Asked(n_workers, cluster, memory_limit, host, dashboard_address, tuple(cluster_kwargs))
    warm = warm_cluster.attach(asked, _name)  # `dask-lm cluster start`'s, where one runs: never closed from here
    if warm is not None:
        return warm
    gpus = count_gpus()
    use_cuda = cluster == "cuda" or (cluster == "auto" and gpus > 0)
    if dashboard_address is None:
        dashboard_address = f"[{host}]:0" if ":" in host else f"{host}:0"
    if os.environ.get("DASK_LM_QUIET_WORKERS") == "1":
        # the CLI without --verbose: a failed task's error reaches the driver, which prints it as one line; the
        # workers' own "Compute Failed" record with its traceback would come first and bury it
        cluster_kwargs.setdefault("silence_logs", logging.CRITICAL)
    # the workers leave a terminal's Ctrl-C to this process, which closes them (dask_lm/workers/preload.py)
    given = cluster_kwargs.get("preload") or []
    cluster_kwargs["preload"] = [*([given] if isinstance(given, str) else given), "dask_lm.workers.preload"]
    if use_cuda:
        if gpus == 0:
            raise ValueError("cluster='cuda' but no GPU is visible on this machine; use cluster='cpu'")
        try:
            from dask_cuda import LocalCUDACluster
        except ImportError as e:
            raise ValueError(
                "GPUs are present but dask-cuda is not installed: `pip install 'dask-lm[cuda]'`, or pass cluster='cpu'"
            ) from e
        n = n_workers or gpus
        if n > gpus:
            raise ValueError(f"{opt('n_workers', n)} but only {gpus} GPUs are visible: one worker per GPU")
        devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        visible = devices.split(",")[:n] if devices else list(range(n))
        # model weights and pinned buffers are unmanaged memory: Dask's pause / terminate thresholds would
        # stall an SPMD group or kill a rank mid-collective, so GPU workers get no host memory limit
        with spawning_without_sigint():
            lc = LocalCUDACluster(
                CUDA_VISIBLE_DEVICES=visible,
                threads_per_worker=1,
                memory_limit=0,
                dashboard_address=dashboard_address,
                host=host,
                **cluster_kwargs,
            )
    else:
        from distributed import LocalCluster

        with spawning_without_sigint():
            lc = LocalCluster(
                n_workers=n_workers or 2,
                threads_per_worker=1,
                processes=True,
                host=host,
                dashboard_address=dashboard_address,
                memory_limit=memory_limit,
                **cluster_kwargs,
            )
    client = Client(lc)
    client._dask_lm_owns_cluster = True  # type: ignore[attr-defined]
    _close_at_exit(client)
    # `client.close()` (and `with connect() as client:`) then closes this cluster too, as it does for the cluster
    # a bare `Client()` starts: a script that closes its client does not leave worker processes for the
    # interpreter's exit to kill ("Worker process still alive after 4 seconds, killing")
    client._start_arg = None
    return client


def _close_at_exit(client: Client) -> None:
    """At the interpreter's exit, close ``client`` and then the local cluster it owns, if the script did not.

    distributed's own exit hook closes the cluster alone, while the client still holds the script's futures (a
    PolicyFuture kept in a variable): the scheduler then warns that removing each worker "caused the cluster to lose
    already computed task(s)", the last lines the script prints. Registered after distributed's hook, this runs
    before it (``atexit`` is last in, first out). A weak reference: a client closed and dropped earlier is not kept
    alive by the registration."""
    ref = weakref.ref(client)

    def close_now() -> None:
        c = ref()
        if c is not None and c.status not in ("closed", "closing"):
            with contextlib.suppress(Exception):
                close(c)

    atexit.register(close_now)


@contextlib.contextmanager
def spawning_without_sigint() -> Iterator[None]:
    """For the block, SIGINT is blocked in this thread, and so in the threads it starts (the cluster's event loop, and
    the threads its nannies spawn worker processes from, now and when they restart one): a worker process starts
    with SIGINT blocked, from its first instruction, until its preload ignores it (dask_lm/workers/preload.py). A
    terminal's Ctrl-C reaches the whole process group: without this, a worker still importing its modules dies of it
    with a ``KeyboardInterrupt`` traceback of its own. The blocked mask is inherited across ``fork`` and ``exec``,
    unlike a Python handler; ignoring SIGINT instead would be process-wide, and so lose the driver's Ctrl-C.

    Only off the main thread (where jobs start their cluster: :class:`dask_lm.jobs.start.ClusterStart`): the main
    thread must stay interruptible, and a blocked signal goes to another thread or waits. The resource tracker is
    started first, because starting it unblocks SIGINT in the calling thread (``multiprocessing.resource_tracker``)."""
    if threading.current_thread() is threading.main_thread():
        yield
        return
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def as_client(cluster: Any) -> Client:
    """A Client for what a user passed as ``cluster``: a Client, a Dask cluster object or a scheduler address."""
    if isinstance(cluster, Client):
        return cluster
    if isinstance(cluster, str):
        return connect(cluster)
    if cluster is None:
        from distributed import get_client

        try:
            return get_client()
        except ValueError:
            raise ValueError("no Dask client: pass `cluster=dask_lm.connect()` (or a scheduler address)") from None
    if hasattr(cluster, "scheduler_address"):
        return Client(cluster)
    raise ValueError(
        f"`cluster` must be a distributed.Client, a Dask cluster or a scheduler address, got {type(cluster).__name__}"
    )


def kill_local_workers(client: Client) -> int:
    """SIGKILL the worker processes of a local cluster that ``connect`` started (an attached cluster's are never
    touched); how many. For an interrupted job: its nannies then close at once instead of draining them."""
    cluster = client.cluster if getattr(client, "_dask_lm_owns_cluster", False) else None
    if cluster is not None:
        # the scheduler and the nannies live in this process: with their workers gone they log each closed comm,
        # with a traceback, between the interrupt and the exit; the one line the interrupt prints says what matters
        _silence("distributed", "tornado")
    killed = 0
    for nanny in list(getattr(cluster, "workers", {}).values()):
        pid = getattr(getattr(nanny, "process", None), "pid", None)
        if isinstance(pid, int):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
    return killed


def scheduler_address_of(client: Any) -> str | None:
    """The address of the scheduler ``client`` is connected to (``None`` once it has closed)."""
    address = getattr(getattr(client, "scheduler", None), "address", None)
    return address if isinstance(address, str) else None


def lost_scheduler(client: Any, error: BaseException, address: str | None = None) -> str | None:
    """The address of the scheduler whose loss caused a job's ``error`` (killed, its machine or the network to it
    gone), else ``None``. Dask then cancels the client's futures ("scheduler-connection-lost"), or a call fails on
    the closed connection, and the client tries to reconnect. Where the connection error alone cannot tell (a
    worker's comm closes too when a worker dies), the scheduler's port is tried. ``address`` is the scheduler's as
    the job first connected: a client that has given up reconnecting (a loaded machine can take that long to raise)
    has closed and no longer knows it. Once lost, the distributed client's own log of it (a traceback, as it gives up
    reconnecting) is silenced: the job says it once, on one line."""
    from distributed.client import FutureCancelledError

    address = scheduler_address_of(client) or address
    if address is None or not isinstance(error, (FutureCancelledError, OSError)):
        return None
    if not (
        (isinstance(error, FutureCancelledError) and error.reason == "scheduler-connection-lost")
        or getattr(client, "status", "running") != "running"
        or not _reachable(address)
    ):
        return None
    _silence("distributed", "tornado")
    return address


@contextlib.contextmanager
def quiet_while_reconnecting(client: Any) -> Iterator[None]:
    """While the block runs, the distributed client's own log of a lost scheduler connection (its reconnect attempts
    and their tracebacks, from its event loop's thread) is dropped: a job waiting for a result from a lost scheduler
    can be told so only when its call times out, and says it then, once, on one line (:func:`lost_scheduler`).
    What the client logs while connected passes."""

    class _Reconnecting(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return getattr(client, "status", "running") == "running"

    logger = logging.getLogger("distributed.client")
    quiet = _Reconnecting()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _reachable(address: str) -> bool:
    """Whether something accepts a connection at a scheduler's ``address`` (any other kind than tcp / tls counts
    as reachable: there is no port to try)."""
    import socket

    from distributed.comm import get_address_host_port

    try:
        host, port = get_address_host_port(address)
    except (ValueError, NotImplementedError):
        return True
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


def _silence(*prefixes: str) -> None:
    """Quiet this process's loggers under ``prefixes``: every existing one disabled (a logger's ``disabled`` and
    level do not reach children that set their own level, as distributed's config does), and the prefixes' levels
    above CRITICAL for the loggers created later, which inherit them."""
    names = [n for n in logging.root.manager.loggerDict if any(n == p or n.startswith(p + ".") for p in prefixes)]
    for name in names:
        logging.getLogger(name).disabled = True
    for prefix in prefixes:
        logging.getLogger(prefix).setLevel(logging.CRITICAL + 1)


def close(client: Client) -> None:
    """Close ``client``, and its cluster too when ``connect`` started that cluster (an attached one stays up).
    ``client.close()`` does the same for a client of ``connect``; this also takes a client made elsewhere."""
    cluster = client.cluster if getattr(client, "_dask_lm_owns_cluster", False) else None
    client.close()
    if cluster is not None:
        cluster.close()


def _sizeof_log_level(level: int) -> int:
    """Set the ``distributed.sizeof`` logger's level in this process; the level it had."""
    log = logging.getLogger("distributed.sizeof")
    before = log.level
    log.setLevel(level)
    return before


@contextlib.contextmanager
def performance_report(client: Any, filename: str) -> Any:
    """Dask's performance report, without the warnings it causes: the profiles the workers send for it are nested
    deeper than ``dask.sizeof`` recurses, so every worker logs "Sizeof calculation for object of type 'dict'
    failed" (distributed's ``comm.utils.to_frames`` then just serialises the message off the event loop). The
    workers' ``distributed.sizeof`` logger is quieted for the report's duration and restored after."""
    import distributed

    before = client.run(_sizeof_log_level, logging.ERROR)
    try:
        with distributed.performance_report(filename=filename):
            yield
    finally:
        for address, level in before.items():
            with contextlib.suppress(Exception):  # a worker that left since
                client.run(_sizeof_log_level, level, workers=[address])

"""The background process of ``dask-lm cluster start`` (:mod:`dask_lm.engine.warm_cluster`): the local cluster
``connect()`` starts, its scheduler file in the warm cluster's folder, the record written once its workers have
registered; it runs until SIGTERM / SIGINT / SIGHUP, or until its scheduler goes, then closes it all and removes
the files. The record, which ``dask-lm cluster start`` waits for, is written once the workers have registered and
their warm-up has ended.

    python -m dask_lm.engine.warm_server --cluster auto --memory-limit auto [--n-workers N]
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any

from dask_lm.engine import cluster as clusters
from dask_lm.engine import warm_cluster

__all__ = ["serve"]

WARM_UP_S = 300.0  # a warm-up not over by then (a stuck import, a GPU that hangs) does not hold the start longer


def serve(*, n_workers: int | None, cluster: str, memory_limit: str) -> None:
    """The server: the local cluster ``connect()`` starts, its scheduler file in the folder, its record once the
    workers are up; until SIGTERM / SIGINT / SIGHUP, or until its scheduler goes. Then closes it all."""
    from dask_lm.workers.clean_exit import exit_once_closed

    os.environ["DASK_LM_WARM_CLUSTER"] = "0"  # the connect() below starts the cluster, never finds one
    path = warm_cluster.checked_folder(create=True)
    assert path is not None
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stopping.set())
    gpus = clusters.count_gpus()
    kind: clusters.ClusterKind = "cuda" if cluster == "cuda" or (cluster == "auto" and gpus > 0) else "cpu"
    client = clusters.connect(
        n_workers=n_workers,
        cluster=kind,
        memory_limit=memory_limit,
        scheduler_kwargs={"scheduler_file": os.path.join(path, warm_cluster.SCHEDULER_FILE)},
    )
    try:
        expected = n_workers or (gpus if kind == "cuda" else 2)
        client.wait_for_workers(expected)
        _wait_for_warm_up(client)
        warm_cluster.write_json(
            os.path.join(path, warm_cluster.RECORD),
            {
                "pid": os.getpid(),
                "kind": kind,
                "n_workers": len(client.scheduler_info(n_workers=-1)["workers"]),
                "memory_limit": str(memory_limit),
                "started_at": time.time(),
                "dashboard": client.dashboard_link,
            },
        )
        print(f"warm local cluster up at {clusters.scheduler_address_of(client)}", flush=True)
        while not stopping.wait(1.0) and client.status == "running":
            pass
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, warm_cluster.RECORD))  # first: no one attaches to what is closing
        with contextlib.suppress(Exception):
            client.run(exit_once_closed, on_error="ignore")  # its workers end without unloading torch
        clusters.close(client)
        warm_cluster.remove_files(path)
        print("warm local cluster stopped", flush=True)


def _wait_for_warm_up(client: Any, timeout: float = WARM_UP_S) -> None:
    """Until every worker's warm-up (imports, CUDA context: :mod:`dask_lm.workers.warm`) has ended, or ``timeout``:
    the first job after ``dask-lm cluster start`` then finds them done (19 s for a CPU demo job on workers still
    warming up, 6.6 s on warm ones). Asked every half second rather than waited for inside ``client.run``, which
    would hold each worker's event loop meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = client.run(warm_cluster.holdings, on_error="return").values()
        if all(isinstance(h, dict) and h["warm"] for h in held):
            return
        time.sleep(0.5)


def _main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m dask_lm.engine.warm_server", description="dask-lm cluster start's background process"
    )
    parser.add_argument("--n-workers", type=int, default=None)
    parser.add_argument("--cluster", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--memory-limit", default="auto")
    args = parser.parse_args(argv)
    serve(n_workers=args.n_workers, cluster=args.cluster, memory_limit=args.memory_limit)


if __name__ == "__main__":
    _main(sys.argv[1:])

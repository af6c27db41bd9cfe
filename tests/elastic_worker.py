"""A Dask worker preload for tests/test_elastic.py (``dask worker --preload elastic_worker``): it orders one
worker's partitions against another's, through files, so that a worker joins or retires while the job is surely
still running, with no sleep to tune and no timed assertion.

Set in the worker's environment (each optional):

- ``ELASTIC_MARK``: a file this worker creates as each partition begins (the test and other workers wait for it);
- ``ELASTIC_WAIT_FOR``: a file this worker's partitions after its first wait for (another worker's mark);
- ``ELASTIC_HOLD``: ``1``: each partition waits until this worker is retiring (``client.retire_workers``), then
  goes on, as a partition running when its worker is retired does.

Every wait gives up after :data:`WAIT_S` with an error, which fails the job, and so the test, instead of hanging it.
The hook is :func:`dask_lm.workers.scorer.score_rows`, which ``score_parquet``'s parts and ``dask_lm.score``'s
partitions both go through (looked up on the module at each call)."""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any

WAIT_S = 120.0

_lock = threading.Lock()
_begun = 0  # partitions this worker began


def _wait(what: str, ready: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"elastic_worker: waited {WAIT_S:.0f} s for {what}")
        time.sleep(0.05)


def dask_setup(worker: Any) -> None:
    from distributed.core import Status

    from dask_lm.workers import scorer

    original = scorer.score_rows

    @functools.wraps(original)
    def score_rows(*args: Any, **kwargs: Any) -> Any:
        global _begun
        with _lock:
            first = _begun == 0
            _begun += 1
        mark = os.environ.get("ELASTIC_MARK")
        if mark:
            with open(mark, "a") as f:
                f.write(f"{worker.address}\n")
        other = os.environ.get("ELASTIC_WAIT_FOR")
        if other and not first:
            _wait(other, lambda: os.path.exists(other))
        if os.environ.get("ELASTIC_HOLD") == "1":
            _wait("this worker's retirement", lambda: worker.status != Status.running)
        return original(*args, **kwargs)

    scorer.score_rows = score_rows

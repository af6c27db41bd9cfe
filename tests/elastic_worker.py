"""A Dask worker preload for tests/test_elastic.py (``dask worker --preload elastic_worker``): it orders one
worker's partitions against another's, through files, so that a worker joins or retires while the job is surely
still running, with no sleep to tune and no timed assertion.

``ELASTIC_CONFIG`` in the worker's environment names a JSON file, read as each partition begins (so a test can
re-arm a worker that outlives it), with the keys (each optional):

- ``mark``: a file this worker appends its address to as each partition begins (the test and other workers wait
  for it);
- ``wait_for``: a file this worker's partitions wait for, all but the first since the file's settings changed
  (another worker's mark);
- ``distinct``: with ``mark``, this worker's partitions after its first wait until ``mark`` lists that many
  workers (one that an adaptive cluster started has begun a partition);
- ``hold``: true: each partition waits until this worker is retiring (``client.retire_workers``), then goes on,
  as a partition running when its worker is retired does.

Every wait gives up after :data:`WAIT_S` with an error, which fails the job, and so the test, instead of hanging it.
The hook is :func:`dask_lm.scoring.scorer.score_rows`, which ``score_parquet``'s parts and ``dask_lm.score``'s
partitions both go through (looked up on the module at each call)."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import threading
import time
from typing import Any

from distributed import WorkerPlugin

WAIT_S = 120.0

_lock = threading.Lock()
_begun: dict[str, int] = {}  # partitions each worker began, by the settings in force


def _wait(what: str, ready: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"elastic_worker: waited {WAIT_S:.0f} s for {what}")
        time.sleep(0.05)


def _settings() -> dict[str, Any]:
    try:
        with open(os.environ["ELASTIC_CONFIG"]) as f:
            return dict(json.load(f))
    except (KeyError, FileNotFoundError):
        return {}


def dask_setup(worker: Any) -> None:
    """Wrap :func:`dask_lm.scoring.scorer.score_rows` once per process (in-process workers share the module); the
    wrapper acts for the worker running the partition."""
    from distributed import get_worker
    from distributed.core import Status

    from dask_lm.scoring import scorer

    if getattr(scorer.score_rows, "_elastic", False):
        return
    original = scorer.score_rows

    @functools.wraps(original)
    def score_rows(*args: Any, **kwargs: Any) -> Any:
        me = get_worker()
        cfg = _settings()
        key = me.address + json.dumps(cfg, sort_keys=True)
        with _lock:
            first = _begun.get(key, 0) == 0
            _begun[key] = _begun.get(key, 0) + 1
        if cfg.get("mark"):
            with open(cfg["mark"], "a") as f:
                f.write(f"{me.address}\n")
        other = cfg.get("wait_for")
        if other and not first:
            _wait(other, lambda: os.path.exists(other))
        if cfg.get("distinct") and not first:
            _wait(
                f"{cfg['distinct']} workers in {cfg['mark']}",
                lambda: len(set(pathlib.Path(cfg["mark"]).read_text().split())) >= int(cfg["distinct"]),
            )
        if cfg.get("hold"):
            _wait("this worker's retirement", lambda: me.status != Status.running)
        return original(*args, **kwargs)

    score_rows._elastic = True  # type: ignore[attr-defined]
    scorer.score_rows = score_rows


def hold_until_retiring(mark: str) -> str:
    """A task that keeps its worker's one thread busy until the worker is retiring (what runs after it waits),
    appending the worker's address to ``mark`` as it begins."""
    from distributed import get_worker
    from distributed.core import Status

    worker = get_worker()
    with open(mark, "a") as f:
        f.write(f"{worker.address}\n")
    _wait("this worker's retirement", lambda: worker.status != Status.running)
    return str(worker.address)


class Gate(WorkerPlugin):
    """The same hook as a worker plugin (``client.register_plugin(Gate())``), for the workers of a cluster whose
    worker processes this test does not start itself (an adaptive LocalCluster's)."""

    def setup(self, worker: Any) -> None:
        dask_setup(worker)

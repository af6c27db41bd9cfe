"""The warm-up a scoring job's cluster start submits (:class:`Preload`, handed to
:class:`~dask_lm.jobs.start.ClusterStart` as ``warm``): the model's config check on the first worker, then one
replica preload per worker, each loosely pinned (``allow_other_workers``), and the config check asked again of a
worker there is when its own worker left before answering.

``score_parquet`` (:mod:`dask_lm.scoring.job`) makes it before the cluster starts and waits for the config
check's verdict (:meth:`Preload.check_config`) beside its own costly checks.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from dask_lm.io import modelcheck
from dask_lm.scoring.compile_choice import worth_compiling_head

if TYPE_CHECKING:
    from dask_lm.jobs.start import ClusterStart

__all__ = ["Preload", "CONFIG_CHECK_WAIT_S", "CONFIG_RECHECK_S"]

# How long the driver waits for a worker's config check before it checks itself (a fresh worker answers in 8-18 s,
# most of it its imports of torch and transformers; one still running another job's task may take much longer)
CONFIG_CHECK_WAIT_S = 60.0
# How often the driver, while it waits, looks whether the check's worker is still there (one scheduler round trip)
CONFIG_RECHECK_S = 2.0


class Preload:
    """The warm-up :class:`~dask_lm.jobs.start.ClusterStart` submits: the config check on the first worker, then
    one replica load per worker there is, each on its worker. Neither is pinned hard (``allow_other_workers``): a
    worker retired before its task ran hands it to another, where a preload finds the replica loaded, rather than
    leaving it to wait for a worker that is gone (the config check's would cost :data:`CONFIG_CHECK_WAIT_S`). A
    worker that joins later gets no preload: its first partition loads its replica (:mod:`dask_lm.scoring.replicas`).

    The config check runs where the model will load, through the workers' transformers: the driver then imports
    neither transformers nor torch for it (4-10 s of imports it had done beside the workers' start, which made it
    the last of the checks to end), and a worker with another transformers than the driver's is the one asked. It
    goes first on its worker (one thread), whose load needs the same imports next. Without workers yet (an attached
    cluster whose workers are still to come) the driver checks itself.

    An automatic ``compile`` of the layers is decided once the job's size is known: the replica is compiled then,
    if at all; the head's (:func:`~dask_lm.scoring.compile_choice.worth_compiling_head`) here, from the job's
    ``tokens`` and the workers there are. A refused job cancels these; one already loading on an attached cluster
    ends as an idle replica, which the workers' lease check frees (``DASK_LM_REPLICA_IDLE_S``, 120 s)."""

    def __init__(self, model: str, tokenizer: str, precision: str | None, compile: bool | None, tokens: float) -> None:
        self.model, self.tokenizer, self.precision, self.compile, self.tokens = (
            model,
            tokenizer,
            precision,
            compile,
            tokens,
        )
        self.config: Any = None  # the check's future, once submitted (None: no worker to ask)
        self.asked: str | None = None  # the worker it was submitted to

    def __call__(self, client: Any) -> list[Any]:
        from dask_lm.engine.worker_group import scheduler_info
        from dask_lm.scoring.tasks import preload_scorer

        tag = uuid.uuid4().hex[:8]
        workers = list(scheduler_info(client)["workers"])
        if workers:
            self.config = self._ask(client, workers[0], f"dask-lm-config-{tag}")
        head = bool(self.compile) if self.compile is not None else worth_compiling_head(self.tokens, len(workers))
        return [
            client.submit(
                preload_scorer,
                self.model,
                self.tokenizer,
                self.precision,
                bool(self.compile),
                head,
                workers=[w],
                allow_other_workers=True,
                pure=False,
                key=f"dask-lm-preload-{tag}-{i}",
            )
            for i, w in enumerate(workers)
        ]

    def check_config(self, start: ClusterStart) -> dict[str, Any]:
        """The config check's verdict: the worker's, once the cluster is up (its error re-raised here), or this
        process's where no worker was there to ask; with its timings where a worker answered."""
        from distributed import wait

        try:
            start.result()
        except Exception:  # the start's own error is raised where the job needs the cluster, after the checks
            self.config = None
        if start.abandoned:  # the job was refused by another check meanwhile: no verdict is waited for
            return {}
        deadline = time.monotonic() + CONFIG_CHECK_WAIT_S
        while self.config is not None and not self.config.done():
            left = deadline - time.monotonic()
            if left <= 0:  # its worker is busy (another job's task): not worth waiting longer for
                self.config.cancel()
                self.config = None
                break
            try:
                wait(self.config, timeout=min(CONFIG_RECHECK_S, left))
            except TimeoutError:
                self._ask_again_if_gone()
        if self.config is None:
            return {"vocab": modelcheck.config_vocab(self.model)}
        got: dict[str, Any] = self.config.result()
        got["checked_at"] = time.time()
        return got

    def _ask(self, client: Any, worker: str, key: str) -> Any:
        from dask_lm.scoring.tasks import check_model_config

        self.asked = worker
        return client.submit(
            check_model_config, self.model, workers=[worker], allow_other_workers=True, pure=False, key=key, priority=1
        )

    def _ask_again_if_gone(self) -> None:
        """The check's worker left before answering (retired, lost): ask a worker there is now. The scheduler
        should hand a loosely pinned task on by itself, and mostly does; but in CI runs (distributed 2026.8) a
        check queued on a worker retired while it was busy was never run elsewhere, and the job waited out the
        whole timeout. Asking again costs one small task; the first answer, if it ever comes, is dropped."""
        from dask_lm.engine.worker_group import scheduler_info

        client = self.config.client
        workers = list(scheduler_info(client)["workers"])
        if not workers or self.asked in workers:
            return
        self.config.cancel()
        self.config = self._ask(client, workers[0], f"dask-lm-config-again-{uuid.uuid4().hex[:8]}")

"""Freeing a Policy on its ranks (``Policy.shutdown``, its finalizer and ``__exit__``): every rank that still holds
it lets go, a lost or busy one is said in a warning, and the lease is released so that ranks the driver cannot
reach free it themselves (:mod:`dask_lm.workers.lease`)."""

from __future__ import annotations

import logging

from distributed import wait

from dask_lm.engine.worker_group import WorkerGroup
from dask_lm.workers import tasks

__all__ = ["SHUTDOWN_TIMEOUT_S", "shutdown_quietly"]

logger = logging.getLogger("dask_lm")

SHUTDOWN_TIMEOUT_S = 30.0


def shutdown_quietly(group: WorkerGroup, raise_errors: bool = False) -> bool:
    """Free the Policy on every rank that still holds it. A rank whose worker is gone holds nothing (it is skipped
    with a warning); a rank stuck in a collective frees the Policy when that collective times out, or when the
    lease released here tells it the driver let go."""
    try:
        if group.client.status not in ("running", "connecting") or group.client.asynchronous:
            # a closed client, or a finalizer run by the garbage collector on the client's own event loop (which
            # must not block on it): the lease released below frees the ranks (see dask_lm.workers.lease)
            return False
        lost = set(group.lost_ranks())
        if lost:
            logger.warning(
                "policy %s: workers %s are gone (their share of the Policy went with them); shutting down "
                "the other ranks",
                group.policy_id,
                [group.names[r] for r in sorted(lost)],
            )
        # not chained: a failed earlier call must not stop the clean-up (one task thread per worker keeps order)
        futs = group.submit(
            tasks.shutdown_policy,
            group.policy_id,
            key_name="shutdown",
            chain=False,
            ranks=[r for r in range(group.world_size) if r not in lost],
            orphaned=bool(lost),
        )
        try:
            wait(futs, timeout=SHUTDOWN_TIMEOUT_S)
        except TimeoutError:
            pass
        busy = [f for f in futs if f.status == "pending"]
        if busy:
            logger.warning(
                "policy %s: %d rank(s) did not shut down within %.0f s (busy in a call, e.g. a collective "
                "waiting for a lost peer); they free the Policy when that call ends",
                group.policy_id,
                len(busy),
                SHUTDOWN_TIMEOUT_S,
            )
        failed = [f for f in futs if f.status == "error"]
        if failed and raise_errors:
            group.gather(failed, what="shutdown")
        return not (lost or busy or failed)
    except Exception:
        if raise_errors:
            raise
        logger.warning("shutting down policy %s failed", group.policy_id, exc_info=True)
        return False
    finally:
        group.release_lease()

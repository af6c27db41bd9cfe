"""Leases: a Policy's ranks live only as long as the driver that created it.

A Policy's state on a worker (model, optimizer, process groups) is owned by a driver that may die without a word
(SIGKILL, a lost notebook kernel, a node gone). The driver holds a *lease*: one tiny Dask future under the key
``dask-lm-lease-<policy id>``. Dask releases every key a client wants the moment that client disconnects, so the
scheduler forgetting the key is the signal that the driver is gone — within the scheduler's own view of the
client, not a clock of ours. A restart of the worker that happens to hold the token keeps the key (the scheduler
recomputes a wanted key), so only the driver's end ends a lease.

Workers check the leases of the policies they hold every ``DASK_LM_LEASE_CHECK_S`` seconds (default 5) on their
event loop, and once more, synchronously, before a new Policy loads (so a new Policy never waits on ranks that
belong to a dead one). An orphaned policy is torn down: model and optimizer freed, its process groups destroyed,
and the world group with them once no policy uses it.

Scoring jobs hold no process group, only a model replica per worker: a replica that no partition has used for
``DASK_LM_REPLICA_IDLE_S`` seconds (default 120) is freed by the same check, so a scoring job whose driver died
gives its device memory back too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dask_lm.workers.state import DaskLMWorkerState

__all__ = [
    "incarnation",
    "lease_key",
    "lease_token",
    "check_interval_s",
    "orphaned_policies",
    "reap",
    "reap_now",
    "release_idle_scorers",
]

logger = logging.getLogger("dask_lm.worker")
LEASE_PREFIX = "dask-lm-lease-"


def incarnation(address: str, local_directory: str) -> str:
    """One worker *process*: a nanny restart keeps the name (and Dask's id, which is the name) but never both the
    address and the scratch directory. The driver reads these from the scheduler, the worker from itself."""
    return f"{address}|{local_directory}"


def lease_key(policy_id: str) -> str:
    return f"{LEASE_PREFIX}{policy_id}"


def lease_token(policy_id: str) -> str:
    """The lease's task: its result only has to exist while the driver wants it."""
    return policy_id


def check_interval_s() -> float:
    return float(os.environ.get("DASK_LM_LEASE_CHECK_S", "5"))


async def orphaned_policies(worker: Any, policy_ids: Iterable[str]) -> list[str]:
    """The policies among ``policy_ids`` whose lease key the scheduler no longer knows."""
    ids = list(policy_ids)
    if not ids:
        return []
    status = await worker.scheduler.get_task_status(keys=[lease_key(p) for p in ids])
    return [p for p in ids if status.get(lease_key(p)) in (None, "forgotten")]


def _busy(worker: Any, policy_id: str) -> bool:
    """A task of this policy is running on the worker: tearing it down under that task would pull the model out
    from under a forward; its collective timeout ends it, and the next check reaps."""
    return any(policy_id in str(ts.key) for ts in worker.state.executing)


async def reap(worker: Any, state: DaskLMWorkerState) -> list[str]:
    """Tear down every idle policy of ``state`` whose driver is gone (the periodic check)."""
    import asyncio

    try:
        dead = await orphaned_policies(worker, list(state.policies))
    except Exception:  # the scheduler is away: a lease cannot be judged, keep everything
        logger.debug("lease check failed", exc_info=True)
        return []
    done = []
    for policy_id in dead:
        if _busy(worker, policy_id):
            continue
        logger.warning(
            "policy %s lost its driver (lease %s is gone): freeing its model and process groups",
            policy_id,
            lease_key(policy_id),
        )
        # off the event loop: freeing a model and destroying process groups can take a while
        await asyncio.to_thread(state.shutdown_policy, policy_id, True)
        done.append(policy_id)
    return done


def reap_now(state: DaskLMWorkerState) -> list[str]:
    """The same check from a task thread (before a new Policy joins a process group): orphans are torn down
    synchronously, here, so the new Policy never pairs with their ranks."""
    from distributed import get_worker
    from distributed.utils import sync

    if not state.policies:
        return []
    worker = get_worker()
    dead = sync(worker.loop, orphaned_policies, worker, list(state.policies))
    for policy_id in dead:
        logger.warning("policy %s lost its driver: freeing it before a new Policy loads", policy_id)
        state.shutdown_policy(policy_id, orphaned=True)
    return dead


async def release_idle_scorers(worker: Any) -> int:
    """Free scoring replicas left idle (a finished job frees its own; a dead driver's job cannot)."""
    import asyncio
    import sys

    scorer = sys.modules.get("dask_lm.scoring.replicas")  # never imported: no replica to free, and no torch import
    if scorer is None or any(str(ts.key).startswith("score_partition") for ts in worker.state.executing):
        return 0
    return await asyncio.to_thread(
        scorer.release_idle, float(os.environ.get("DASK_LM_REPLICA_IDLE_S", "120")), dask_worker=worker
    )

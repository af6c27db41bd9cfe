"""Worker-side state: the WorkerPlugin that holds each rank's policies and the process group they share.

The plugin is light on purpose: ``setup`` runs on the worker's event loop, so it only creates empty
containers. Heavy work (model load, ``init_process_group``) runs in pinned tasks on the task thread, where it
shows on the dashboard. A worker restarted by its nanny gets the plugin again with *empty* state, which is how a
Policy notices that a rank lost its model.

torch.distributed allows one default process group per process. dask-lm initialises it once per worker over
the ranks of the first multi-rank Policy and gives every Policy its own sub-group (its own communicator), so a
policy and a reward model on the same workers run collectives side by side without pairing up by mistake.
The default group is torn down when the last Policy on the worker shuts down, or when the driver of the last one
dies (see :mod:`dask_lm.workers.lease`). The world group remembers the Dask *ids* of its members (a restarted
worker keeps its name but gets a new id), so a group that spans a restarted worker is never joined again.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from distributed import WorkerPlugin, get_worker

if TYPE_CHECKING:
    from dask_lm.workers.policy_worker import PolicyWorker

__all__ = ["PLUGIN_NAME", "DaskLMWorkerState", "get_state", "record_call", "join_process_group", "leave_process_group"]

PLUGIN_NAME = "dask-lm"
logger = logging.getLogger("dask_lm.worker")


class DaskLMWorkerState(WorkerPlugin):
    """Holds this worker's :class:`PolicyWorker` objects, keyed by policy id, and the world process group."""

    name = PLUGIN_NAME
    idempotent = True  # registering again (a second Policy) keeps the state that is already there

    def __init__(self) -> None:
        self.policies: dict[str, PolicyWorker] = {}
        self.world_members: tuple[str, ...] | None = None
        self.world_ids: tuple[str, ...] | None = None
        self.world_users: set[str] = set()
        self.groups: dict[str, Any] = {}
        self.cpu_groups: dict[str, Any] = {}
        self.last_call: dict[str, Any] = {}
        # offline scoring's model replicas by (model, tokenizer, precision, compile): see dask_lm.scoring.scorer
        self.scorers: dict[tuple, Any] = {}
        # the task thread (loads, calls, shutdowns) and the lease check (a worker thread) both tear policies down
        self.lock = threading.RLock()
        self._reaper: Any = None

    # the plugin travels to the workers pickled, as a fresh, empty instance (locks and callbacks do not pickle)
    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, _state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def setup(self, worker: Any) -> None:
        from tornado.ioloop import PeriodicCallback

        from dask_lm.workers import lease

        self.policies = {}
        self.world_members = None
        self.world_ids = None
        self.world_users = set()
        self.groups = {}
        self.cpu_groups = {}
        self.last_call = {"tokens": 0, "seconds": 0.0}
        self.lock = threading.RLock()

        async def check_leases() -> None:
            if self.policies:
                await lease.reap(worker, self)
            await lease.release_idle_scorers(worker)

        self._reaper = PeriodicCallback(check_leases, lease.check_interval_s() * 1000)
        self._reaper.start()
        # numeric gauges become extra columns of the dashboard's Workers table
        worker.metrics["dask_lm_policies"] = lambda w: len(self.policies)
        worker.metrics["dask_lm_tokens_per_s"] = lambda w: (
            self.last_call["tokens"] / self.last_call["seconds"] if self.last_call["seconds"] else 0.0
        )
        worker.metrics["dask_lm_device_mem_gib"] = lambda w: _device_memory_gib(self)

    def teardown(self, worker: Any) -> None:
        from dask_lm.workers.clean_exit import exit_once_closed, owned_by_dask_lm

        if owned_by_dask_lm(worker):  # a local cluster's worker ends at once, not seconds later (clean_exit.py)
            exit_once_closed()
        if self._reaper is not None:
            self._reaper.stop()
        for policy_id in list(self.policies):
            try:
                self.shutdown_policy(policy_id)
            except Exception:  # teardown must not raise into the worker's close path
                logger.exception("shutting down policy %s", policy_id)

    def shutdown_policy(self, policy_id: str, orphaned: bool = False) -> bool:
        """Free ``policy_id`` here; ``orphaned`` (its driver or a peer is gone): without any collective."""
        with self.lock:
            pw = self.policies.pop(policy_id, None)
            try:
                if pw is not None:
                    pw.shutdown(orphaned=orphaned)
                    del pw
            finally:
                leave_process_group(self, policy_id)
        gc.collect()
        from dask_lm.model import device

        device.empty_cache()
        return True


def _device_memory_gib(state: DaskLMWorkerState) -> float:
    """Memory this worker's ranks hold on their device (GPU memory allocated, or the process RSS on CPU), for the
    Workers table; 0 while no Policy is loaded, so the heartbeat never starts CUDA by itself."""
    if not state.policies:
        return 0.0
    from dask_lm.model import device

    return device.memory_in_use_bytes() / 2**30


def get_state() -> DaskLMWorkerState:
    """The plugin of the worker running the current task; an actionable error elsewhere."""
    try:
        worker = get_worker()
    except ValueError:
        raise RuntimeError("dask_lm worker state is only available inside a task on a Dask worker") from None
    plugin = worker.plugins.get(PLUGIN_NAME)
    if plugin is None:
        raise RuntimeError(
            f"worker {worker.name} has no dask-lm plugin: it was restarted or joined after the "
            "Policy was created; shut the Policy down and create it again"
        )
    return plugin  # type: ignore[return-value]


def record_call(tokens: int, start: float) -> None:
    """A rank's call over ``tokens`` real tokens that began at ``start`` (``time.perf_counter()``): its tokens and
    seconds for the Workers table's tokens/s gauge, and its token count on the task. Outside a Dask worker (a
    benchmark building a rank in-process), nothing."""
    try:
        st = get_state()
    except RuntimeError:
        return
    st.last_call = {"tokens": tokens, "seconds": time.perf_counter() - start}
    # a token count on the task: the dashboard's fine performance metrics sum it per span (per Policy call)
    from distributed.metrics import context_meter

    context_meter.digest_metric("tokens", tokens, "count")


def join_process_group(
    state: DaskLMWorkerState,
    policy_id: str,
    *,
    members: tuple[str, ...],
    member_ids: tuple[str, ...],
    rank: int,
    master_addr: str,
    master_port: int,
    backend: str,
    timeout_s: float,
) -> Any:
    """Initialise the world group on first use, then make a sub-group for ``policy_id`` over all members.

    Every member calls this in the same order (the driver holds a cluster-wide lock while it creates a
    Policy), which ``new_group`` requires. ``member_ids`` are the members' Dask worker ids: a world group made
    with a worker that has since restarted is stale (its peer is gone) and is rebuilt, or refused while a live
    Policy still uses it.
    """
    import torch
    import torch.distributed as dist

    from dask_lm.comm import rendezvous

    timeout = timedelta(seconds=timeout_s)
    if dist.is_initialized() and not state.world_users:
        # left over by a join that failed half-way (the last user's shutdown destroys it otherwise): its peers may
        # have rebuilt theirs, so it is never reused
        dist.destroy_process_group()
        state.world_members = state.world_ids = None
    if dist.is_initialized() and state.world_members == members and state.world_ids != member_ids:
        if state.world_users:
            raise RuntimeError(
                f"this worker's process group spans workers {list(members)} as they were before one of them "
                f"restarted, and policies {sorted(state.world_users)} still use it; shut those Policies down (their "
                "ranks are lost) and create this one again"
            )
        dist.destroy_process_group()
        state.world_members = state.world_ids = None
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = torch.device("cuda", 0)
        rendezvous.pin_interfaces(rendezvous.worker_host())
        store = rendezvous.create_store(
            master_addr, master_port, len(members), is_master=rank == 0, timeout_s=timeout_s
        )
        dist.init_process_group(backend, store=store, rank=rank, world_size=len(members), timeout=timeout, **kwargs)
        state.world_members = members
        state.world_ids = member_ids
    elif state.world_members != members:
        raise RuntimeError(
            f"this worker is already in a process group over workers {list(state.world_members or ())} "
            f"(policies {sorted(state.world_users)}); a Policy over {list(members)} cannot join it. Use the same "
            "workers for Policies that run side by side, or shut the others down first"
        )
    assert dist.get_rank() == rank, f"rank mismatch: world rank {dist.get_rank()} vs policy rank {rank}"
    group = dist.new_group(ranks=list(range(len(members))), timeout=timeout, backend=backend)
    state.world_users.add(policy_id)
    state.groups[policy_id] = group
    # host-side collectives (checkpoint agreement, async saves in a background thread) get their own gloo group,
    # so they never share a communicator with the training collectives that run meanwhile
    state.cpu_groups[policy_id] = dist.new_group(ranks=list(range(len(members))), timeout=timeout, backend="gloo")
    return group


def leave_process_group(state: DaskLMWorkerState, policy_id: str) -> None:
    import torch.distributed as dist

    for groups in (state.cpu_groups, state.groups):
        group = groups.pop(policy_id, None)
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)
    state.world_users.discard(policy_id)
    if not state.world_users and dist.is_initialized():
        dist.destroy_process_group()
        state.world_members = state.world_ids = None

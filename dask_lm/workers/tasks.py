"""The functions the driver submits as pinned Dask tasks. Each runs on one rank's worker.

The first argument of every SPMD task is that rank's previous SPMD future (resolved to its result by Dask and
ignored here): chaining makes each rank run collective calls in the order the driver issued them, which is what
keeps two all-gathers from pairing up across different calls. A chained call runs inside :func:`link`, which also
waits for the worker's previous task of any other Policy (:mod:`dask_lm.engine.worker_order`).

Scoring's tasks are in :mod:`dask_lm.scoring.tasks`, lm-eval's in :mod:`dask_lm.evaluation.tasks`: each subsystem
keeps both its halves in its own package.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask_lm.errors import PeerFailedError

if TYPE_CHECKING:
    from dask_lm.data.messages import Join, Request

__all__ = [
    "find_free_port",
    "rank_info",
    "init_policy",
    "serve",
    "settled",
    "unwrap",
    "link",
    "result_of",
    "zmq_address",
    "profiler",
    "shutdown_policy",
    "Failed",
    "PeerFailedError",
    "combine",
    "warnings_of",
    "prepare_rows",
    "row_lengths",
    "cut_rows",
    "assemble_rows",
    "rank_frame",
]


def find_free_port(_prev: Any = None) -> tuple[str, int]:
    """A TCP port free on this worker's address, for the torch.distributed rendezvous (rank 0 hosts the store
    there, on that address only)."""
    from dask_lm.comm import rendezvous

    host = rendezvous.worker_host()
    return host, rendezvous.find_free_port(host)


def rank_info(_prev: Any = None) -> dict[str, Any]:
    from dask_lm.model import device

    info = device.device_info()
    info["free_memory_bytes"] = device.free_memory_bytes()
    return info


def init_policy(
    _prev: Any,
    policy_id: str,
    cfg_dict: dict[str, Any],
    *,
    rank: int,
    members: tuple[str, ...],
    member_ids: tuple[str, ...],
    master: tuple[str, int] | None,
    pad_token_id: int,
    extension_fqn: str | None,
    options: dict[str, Any],
) -> dict[str, Any]:
    """Free policies whose driver died, join the process group (when there is more than one rank), then build
    this rank's PolicyWorker."""
    from dask_lm.workers import warm

    began = time.time()
    # the worker's warm-up imports what a rank needs and makes the CUDA context: wait for that rather than do it
    # beside it. Its last step, the compiler's imports, runs on beside the model's load (the load needs none of it;
    # the rank's background compile, which does, starts after the load)
    warm.wait(until="device")
    waited = time.time() - began
    from dask_lm.config import PolicyConfig
    from dask_lm.config.optim import resolve_class
    from dask_lm.model import device
    from dask_lm.model.hf import check_policy_model, rank_config
    from dask_lm.workers import lease
    from dask_lm.workers.policy_worker import PolicyWorker
    from dask_lm.workers.rank_model import RankPlace
    from dask_lm.workers.state import get_state, join_process_group

    state = get_state()
    with state.lock:
        me = _incarnation()
        if me != member_ids[rank]:
            # this task outlived the worker it was meant for (a restart under the same name): a model loaded here
            # would wait on a process group whose other ranks moved on
            raise RuntimeError(
                f"rank {rank} was planned on a worker that has since restarted ({member_ids[rank]}, now "
                f"{me}); create the Policy again"
            )
        lease.reap_now(state)
        if policy_id in state.policies:  # a retried init on the same worker; should not happen with retries=0
            state.shutdown_policy(policy_id)
        with warnings.catch_warnings():  # the driver warned at the user's Policy(...) call already: not once per rank
            warnings.simplefilter("ignore", UserWarning)
            cfg = PolicyConfig.from_dict(cfg_dict)
        env = cfg.dtensor_cfg.env_vars or {}
        if env:
            import os

            os.environ.update({str(k): str(v) for k, v in env.items()})
        # the model's class against the config, before the join and before any weight is read: a refusal here is a
        # ValueError the driver raises as it is, the same on every rank (model/hf.py says why it is asked here)
        check_policy_model(rank_config(cfg, pad_token_id), cfg, world_size=len(members))
        cls: type = PolicyWorker
        if extension_fqn:  # before the join: a bad name must not leave a process group behind
            ext = resolve_class(extension_fqn, "worker_extension_cls_fqn")
            cls = type(f"{ext.__name__}PolicyWorker", (ext, PolicyWorker), {})
        group = None
        if len(members) > 1:
            assert master is not None
            group = join_process_group(
                state,
                policy_id,
                members=members,
                member_ids=member_ids,
                rank=rank,
                master_addr=master[0],
                master_port=master[1],
                backend=device.collective_backend(),
                timeout_s=cfg.collective_timeout_s,
            )
        try:
            worker = cls(
                cfg,
                RankPlace(rank, len(members), group, state.cpu_groups.get(policy_id)),
                pad_token_id=pad_token_id,
                **options,
            )
        except BaseException:
            state.shutdown_policy(policy_id)
            raise
        state.policies[policy_id] = worker
        info = _worker_info(worker, rank)
        info["start"] = {
            "warm_up": warm.report(),
            "task_began_at": began,
            "waited_for_warm_up": waited,
            "build": dict(worker.rank_model.start_phases),
            "ready_at": time.time(),
        }
        return info


def _worker_info(worker: Any, rank: int) -> dict[str, Any]:
    """What the driver learns of a rank's new PolicyWorker."""
    from dask_lm.model import device

    model = worker.rank_model
    info = device.device_info()
    info["rank"] = rank
    info["model_dtype"] = str(model.dtype).replace("torch.", "")
    info["num_parameters"] = sum(p.numel() for p in model.model.parameters())  # DTensor numel is global
    # packed micro-batches pay only through the varlen kernel: the driver packs by itself only where every rank has it
    info["varlen"] = bool(model.varlen)
    info["compiled"] = bool(model.compile)
    info["train_compiled"] = bool(model.train_compile)
    info["reshard_after_forward"] = model.reshard_after_forward  # None: no FSDP (one rank)
    return info


def _incarnation() -> str:
    """This worker process as the driver's WorkerGroup names it."""
    from distributed import get_worker

    from dask_lm.workers.lease import incarnation

    worker = get_worker()
    return incarnation(worker.address, worker.local_directory)


def _policy(policy_id: str) -> Any:
    from dask_lm.workers.state import get_state

    state = get_state()
    worker = state.policies.get(policy_id)
    if worker is None:
        raise RuntimeError(
            f"policy {policy_id} is not loaded on this worker: the worker restarted or the Policy was "
            "shut down. Create the Policy again (and reload its last checkpoint)"
        )
    return worker


def serve(_prev: Any, policy_id: str, request: Request) -> Any:
    """Answer one request of :mod:`dask_lm.data.messages` with this rank's PolicyWorker, through the endpoint
    table (:data:`dask_lm.workers.endpoints.ENDPOINTS`)."""
    from dask_lm import interface
    from dask_lm.workers.endpoints import handle

    # dask-lm's warnings go back with the answer, to be raised at the user's call once for all ranks (a warning
    # printed here would land in the worker's log, or in the middle of the driver's progress bar)
    warned: list[tuple[type[Warning], str]] = []
    with interface.caught(warned):
        result = handle(_policy(policy_id), request)
    return interface.Warned(result, tuple(warned)) if warned else result


def combine(how: Join, *answers: Any) -> Any:
    """A PolicyFuture's key: the ranks' answers to one call joined into its result
    (:func:`dask_lm.workers.combine.combine`); their warnings go apart (:func:`warnings_of`)."""
    from dask_lm import interface
    from dask_lm.workers.combine import combine as join

    return join(how, [interface.strip(a)[0] for a in answers])


def rank_frame(answer: Any, **kwargs: Any) -> Any:
    """One rank's answer as a pandas partition, left on its worker (:func:`dask_lm.workers.combine.rank_frame`)."""
    from dask_lm import interface
    from dask_lm.workers.combine import rank_frame as frame

    return frame(interface.strip(answer)[0], **kwargs)


def warnings_of(*answers: Any) -> list[tuple[type[Warning], str]]:
    """The distinct warnings the ranks raised in one call, for ``PolicyFuture.result()`` to raise again."""
    from dask_lm import interface

    seen: list[tuple[type[Warning], str]] = []
    for a in answers:
        seen += [w for w in interface.strip(a)[1] if w not in seen]
    return seen


def prepare_rows(value: Any, **kwargs: Any) -> Any:
    """A partition (or a future's batch) checked and made a batch where it lives
    (:func:`dask_lm.workers.dataflow.prepare`)."""
    from dask_lm.workers import dataflow

    return dataflow.prepare(value, **kwargs)


def row_lengths(batch: Any) -> Any:
    """A prepared partition's row lengths and width (:func:`dask_lm.workers.dataflow.lengths`)."""
    from dask_lm.workers import dataflow

    return dataflow.lengths(batch)


def cut_rows(batch: Any, rows: list[int]) -> Any:
    """One rank's rows of a prepared partition (:func:`dask_lm.workers.dataflow.cut`)."""
    from dask_lm.workers import dataflow

    return dataflow.cut(batch, rows)


def assemble_rows(*pieces: Any, **kwargs: Any) -> Any:
    """A rank's request from its pieces, on its worker (:func:`dask_lm.workers.dataflow.assemble`)."""
    from dask_lm.workers import dataflow

    return dataflow.assemble(*pieces, **kwargs)


class Failed:
    """A failed call, returned as a value, so that the tasks chained after it still run. ``contagious``: the same
    Policy's next call on the rank fails with it too (what Dask does to the dependent of a failed task), since
    that rank's state may be half-way through the failed call; a ``settle=True`` call's failure is not."""

    def __init__(self, error: BaseException, contagious: bool = False) -> None:
        # without its traceback: the frames would keep the failed call's buffers (refit buckets) alive
        self.error = error.with_traceback(None)
        self.contagious = contagious


def settled(_prev: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(_prev, *args, **kwargs)`` whose failure is a :class:`Failed` value (for futures handed to the caller,
    see :func:`unwrap`): Dask fails every task that depends on a failed one, and the rank's next call does."""
    try:
        return fn(_prev, *args, **kwargs)
    except Exception as e:
        return Failed(e)


def link(
    _prev: Any, _after: Any, fn: Callable[..., Any], contagious: bool, policy_id: str, /, *args: Any, **kwargs: Any
) -> Any:
    """A chained rank task of ``policy_id``: ``fn(_prev, *args, **kwargs)``, its failure returned as a
    :class:`Failed` value.

    ``_prev`` is the same Policy's previous call on this rank (its value: the answer, or a Failed); ``_after`` the
    worker's previous task of another Policy, a dependency only for the order (:mod:`dask_lm.engine.worker_order`),
    whose failure is none of this call's business. A contagious failure of ``_prev`` is this call's failure, as
    when the tasks depended on each other directly."""
    from dask_lm.workers.occupancy import note_policy

    note_policy(policy_id)  # the watchdog's view of this worker names the Policy (dask_lm.engine.stuck)
    if isinstance(_prev, Failed) and _prev.contagious:
        return _prev
    try:
        return fn(_prev, *args, **kwargs)
    except Exception as e:
        return Failed(e, contagious)


def result_of(value: Any, settle: bool) -> Any:
    """What the caller sees of a :func:`link`: its answer, or the rank's error raised. ``settle``: as
    :func:`unwrap` (the warnings shown here, the plain value returned); else the answer as the rank gave it, its
    warnings still attached for the driver to raise at the user's call."""
    if isinstance(value, Failed):
        raise value.error
    return unwrap(value) if settle else value


def unwrap(result: Any) -> Any:
    """The caller's view of a settled call: its result, or its error raised again."""
    from dask_lm import interface

    if isinstance(result, Failed):
        raise result.error
    value, warned = interface.strip(result)
    for category, text in warned:  # a future the caller gathers itself: shown where it ran, as other warnings are
        warnings.warn(text, category, stacklevel=2)
    return value


def zmq_address(_prev: Any, policy_id: str) -> str:
    """``Policy.get_zmq_addresses()``: bind this rank's socket (once) and return its address."""
    from dask_lm.refit.zmq_endpoint import bind

    return bind(_policy(policy_id).refitter).address


def profiler(_prev: Any, start: bool) -> bool:
    """Start or stop this rank's device profiler (``Policy.start_gpu_profiling`` / ``stop_gpu_profiling``)."""
    from dask_lm.model import device

    (device.start_profiler if start else device.stop_profiler)()
    return True


def shutdown_policy(_prev: Any, policy_id: str, orphaned: bool = False) -> bool:
    """``orphaned``: a peer rank is gone, so the shutdown must not wait on a collective."""
    from dask_lm.workers.state import get_state

    try:
        state = get_state()
    except RuntimeError:
        return False
    return state.shutdown_policy(policy_id, orphaned=orphaned)

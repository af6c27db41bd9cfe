"""The rank's endpoint table: which code answers each request type of :mod:`dask_lm.data.messages`.

:func:`dask_lm.workers.tasks.serve` looks the request's type up in :data:`ENDPOINTS` and calls the handler with
this rank's :class:`~dask_lm.workers.policy_worker.PolicyWorker`. Every path from the driver to a rank's code is
one entry here, so it can be followed by type; nothing is looked up by a method name the driver sends, except
:class:`~dask_lm.data.messages.ExtensionCall` (``run_all_workers_*``), which is held to the public methods of the
user's extension class and the allow-list :data:`EXTENSION_BASE_METHODS`.

A handler calls the component that does the work (the model's passes, the trainer, the checkpointer, the
refitter, generation) directly. The argument-free calls (:data:`~dask_lm.data.messages.ACTIONS`) go through the
worker's methods instead: they are also the base methods a worker extension class calls or overrides by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dask_lm.data.messages import (
    ACTIONS,
    ActionRequest,
    BroadcastRefitRequest,
    CollectiveInitRequest,
    ExtensionCall,
    ForwardOutput,
    ForwardRequest,
    FullLogitsRequest,
    GenerateRequest,
    HttpRefitRequest,
    QKVCalibrationRequest,
    ReshardRefitRequest,
    SaveRequest,
    TrainRequest,
    TrainResult,
    WeightSwapRequest,
    ZmqRefitRequest,
)
from dask_lm.workers import generation, qkv_calibration
from dask_lm.workers.policy_worker import PolicyWorker

__all__ = ["ENDPOINTS", "EXTENSION_BASE_METHODS", "handle"]


# ------------------------------------------------------------------------------------------- forward passes
def _forward(worker: PolicyWorker, req: ForwardRequest) -> ForwardOutput:
    # the ids as they arrived (values + offsets): no padded [B, S] tensor is made for an inference pass
    rows, plan = req.shard.tokens(), req.shard.plan
    if req.head == "score":
        return ForwardOutput(worker.rank_model.score(rows, plan))
    if req.head == "topk":
        assert req.k is not None, "the driver checks k"
        return ForwardOutput(worker.rank_model.get_topk_logits(rows, plan, req.k, req.micro_batch_size))
    return ForwardOutput(
        worker.rank_model.get_logprobs(rows, plan, req.micro_batch_size, reference=req.head == "reference_logprobs")
    )


def _full_logits(worker: PolicyWorker, req: FullLogitsRequest) -> dict[str, Any]:
    return worker.full_logits.export(req.shard.tokens(), req.micro_batch_size)


def _qkv_calibration(worker: PolicyWorker, req: QKVCalibrationRequest) -> dict[int, dict[str, float]]:
    return qkv_calibration.calibrate(
        worker.rank_model, req.shard.tokens(), req.micro_batch_size, req.percentile, req.include_q
    )


def _generate(worker: PolicyWorker, req: GenerateRequest) -> ForwardOutput:
    return ForwardOutput(
        generation.generate_batch(worker.rank_model, req.shard.rows(), greedy=req.greedy, seed=req.seed)
    )


# ------------------------------------------------------------------------------------------- training, checkpoints
def _train(worker: PolicyWorker, req: TrainRequest) -> TrainResult:
    return worker.trainer.train(
        req.shard.rows(),
        req.shard.plan,
        req.loss_fn,
        eval_mode=req.eval_mode,
        gbs=req.gbs,
        mbs=req.mbs,
        num_global_batches=req.num_global_batches,
        progress_id=req.progress_id,
    )


def _save(worker: PolicyWorker, req: SaveRequest) -> Any:
    return worker.checkpointer.save(req)


# ------------------------------------------------------------------------------------------- argument-free calls
# through the worker's methods: an extension class that overrides one (they are EXTENSION_BASE_METHODS) gets the call
_ACTIONS: dict[str, Callable[[PolicyWorker], Any]] = {
    "prepare_for_training": lambda w: w.prepare_for_training(),
    "finish_training": lambda w: w.finish_training(),
    "prepare_for_lp_inference": lambda w: w.prepare_for_lp_inference(),
    "finish_inference": lambda w: w.finish_inference(),
    "prepare_for_generation": lambda w: w.prepare_for_generation(),
    "finish_generation": lambda w: w.finish_generation(),
    "invalidate_kv_cache": lambda w: w.invalidate_kv_cache(),
    "offload_before_refit": lambda w: w.offload_before_refit(),
    "offload_after_refit": lambda w: w.offload_after_refit(),
    "offload_to_cpu": lambda w: w.offload_to_cpu(),
    "prepare_refit_info": lambda w: w.prepare_refit_info(),
    "report_device_id": lambda w: w.report_device_id(),
    "finalize_async_save": lambda w: w.finalize_async_save(),
    "release_ipc_buffer": lambda w: w.release_ipc_buffer(),
}
assert set(_ACTIONS) == set(ACTIONS), "the action list and the table disagree"


def _action(worker: PolicyWorker, req: ActionRequest) -> Any:
    return _ACTIONS[req.action](worker)


# ------------------------------------------------------------------------------------------- refit
def _refit_http(worker: PolicyWorker, req: HttpRefitRequest) -> dict[str, Any]:
    return worker.refitter.stream_via_http(
        list(req.urls),
        layout=req.layout,
        buffer_size_bytes=req.buffer_size_bytes,
        weight_version=req.weight_version,
        timeout_s=req.timeout_s,
        transport=req.transport,
        progress_id=req.progress_id,
    )


def _refit_zmq(worker: PolicyWorker, req: ZmqRefitRequest) -> dict[str, Any]:
    return worker.refitter.stream_via_zmq(
        buffer_size_bytes=req.buffer_size_bytes, timeout_s=req.timeout_s, progress_id=req.progress_id
    )


def _refit_broadcast(worker: PolicyWorker, req: BroadcastRefitRequest) -> dict[str, Any]:
    return worker.refitter.broadcast(buffer_size_bytes=req.buffer_size_bytes, progress_id=req.progress_id)


def _refit_reshard(worker: PolicyWorker, req: ReshardRefitRequest) -> dict[str, Any]:
    return worker.refitter.reshard(req.plan)


def _collective_init(worker: PolicyWorker, req: CollectiveInitRequest) -> bool:
    return worker.refitter.init_collective(req)


def _swap(worker: PolicyWorker, req: WeightSwapRequest) -> bool:
    worker.refitter.swap(req.is_source)
    return True  # NeMo RL's ranks answer True


# ------------------------------------------------------------------------------------------- extensions
# base-worker methods that NeMo RL code reaches through run_all_workers_*: the ones that take no rows
EXTENSION_BASE_METHODS: frozenset[str] = frozenset(ACTIONS)


def _extension_method(worker: PolicyWorker, name: str) -> Callable[..., Any]:
    # the extension class (and its own bases) come before PolicyWorker in the combined class's MRO
    mro = type(worker).__mro__
    extension = mro[: mro.index(PolicyWorker)]
    if not name.startswith("_") and (
        name in EXTENSION_BASE_METHODS or any(callable(vars(c).get(name)) for c in extension)
    ):
        method: Callable[..., Any] = getattr(worker, name)
        return method
    ext = [c.__name__ for c in type(worker).__mro__[1:] if c not in (PolicyWorker, object)]
    where = f"the worker extension class {ext[0]}" if ext else "a worker extension (none is set)"
    raise ValueError(
        f"run_all_workers_*: {name!r} is neither a public method of {where} nor one of the base "
        f"worker's methods that take no rows ({sorted(EXTENSION_BASE_METHODS)}); define it on the class "
        "passed as `worker_extension_cls_fqn`"
    )


def _extension(worker: PolicyWorker, call: ExtensionCall) -> Any:
    return _extension_method(worker, call.method)(*call.args, **call.kwargs)


ENDPOINTS: dict[type, Callable[[PolicyWorker, Any], Any]] = {
    ForwardRequest: _forward,
    FullLogitsRequest: _full_logits,
    QKVCalibrationRequest: _qkv_calibration,
    GenerateRequest: _generate,
    TrainRequest: _train,
    SaveRequest: _save,
    ActionRequest: _action,
    HttpRefitRequest: _refit_http,
    ZmqRefitRequest: _refit_zmq,
    BroadcastRefitRequest: _refit_broadcast,
    ReshardRefitRequest: _refit_reshard,
    CollectiveInitRequest: _collective_init,
    WeightSwapRequest: _swap,
    ExtensionCall: _extension,
}


def handle(worker: PolicyWorker, request: Any) -> Any:
    handler = ENDPOINTS.get(type(request))
    if handler is None:  # a driver of another dask-lm version, or a stray object
        raise TypeError(
            f"this rank has no endpoint for {type(request).__name__}; the driver and the workers must "
            "run the same dask-lm version"
        )
    return handler(worker, request)

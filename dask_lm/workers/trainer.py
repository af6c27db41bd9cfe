"""The worker half of ``Policy.train``: global batches, micro-batches, globally normalised losses, one step each.

Semantics are NeMo RL's (research note section 5), so a GRPO, SFT or DPO loop written for it behaves the same:

* The shard holds ``num_global_batches`` local batches. For each: count the valid sequences and tokens of the
  *whole* global batch (an all-reduce over ranks), zero the gradients, run every micro-batch forward (and
  backward unless ``eval_mode``), clip by the total gradient norm, step the optimizer once.
* Losses divide by those global counts, so summing micro-batches and ranks gives exactly the global-batch mean:
  the update does not depend on micro-batch size, batching mode or rank count. FSDP averages gradients over
  ranks, so each micro-batch's loss is multiplied by the rank count before ``backward``.
* Every rank runs the same number of forwards and backwards (each all-gathers and reduce-scatters parameters):
  a rank with fewer micro-batches runs dummy ones whose loss is zero but which touch every parameter.
* The scheduler steps once per ``train()`` call; ``eval_mode`` runs forwards only and changes nothing.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import record_function

from dask_lm.losses.base import deferred_metrics
from dask_lm.workers import device, fused, varlen
from dask_lm.workers.forward import MicroBatch, final_hidden_states, pad_with_dummies, plan_micro_batches
from dask_lm.workers.logprobs import next_token_logprobs_train, output_head
from dask_lm.workers.loss_inputs import loss_inputs_from_hidden
from dask_lm.workers.tasks import report_progress

if TYPE_CHECKING:
    from dask_lm.data.batch import BatchedDataDict
    from dask_lm.workers.policy_worker import PolicyWorker

__all__ = ["train"]


def _all_reduce(worker: PolicyWorker, values: list[float], op: str = "sum") -> list[float]:
    if not worker.fsdp:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=worker.device)
    reduce_op = torch.distributed.ReduceOp.SUM if op == "sum" else torch.distributed.ReduceOp.MAX
    torch.distributed.all_reduce(t, op=reduce_op, group=worker.group)
    return t.tolist()


def _valid_counts(batch: BatchedDataDict) -> tuple[float, float]:
    """This rank's valid sequences and tokens: sum(sample_mask) and sum(token_mask[:, 1:] * sample_mask)."""
    sample_mask = batch["sample_mask"].to(torch.float64)
    seqs = float(sample_mask.sum())
    if "token_mask" in batch:
        toks = float((batch["token_mask"][:, 1:].to(torch.float64) * sample_mask[:, None]).sum())
    else:
        toks = float((batch["input_lengths"].to(torch.float64).clamp(min=1) - 1).mul(sample_mask).sum())
    return seqs, toks


def _micro_batch_data(batch: BatchedDataDict, mb: MicroBatch, width: int) -> BatchedDataDict:
    """Rows of one micro-batch, per-token tensors cut to the micro-batch's longest row (what the logprobs span)."""
    data = batch.slice(mb.start, mb.end)
    full = batch["input_ids"].shape[1]
    for key, value in list(data.items()):
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == full:
            data[key] = value[:, :width]
    return data


def _forward(worker: PolicyWorker, batch: BatchedDataDict, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, Any]]:
    """The micro-batch's forward, through the compiled layers when ``train_compile``. A single rank whose
    compilation fails falls back to eager with a warning; an FSDP rank cannot (re-running the forward would issue
    its all-gathers twice and desynchronise the group's collectives), so it fails with the fix instead."""
    if not (worker.train_compile and worker.fsdp):
        out, worker.train_compile = fused.call(worker.train_compile, lambda: worker._forward(batch, mb),
                                               "this rank's training forward")
        return out
    try:
        with fused.use_compiled(True):
            return worker._forward(batch, mb)
    except fused.compile_errors() as e:
        raise RuntimeError(f"compiling the training forward failed on rank {worker.rank} ({type(e).__name__}: "
                           f"{e}); set policy.train_compile: false (or DASK_LM_COMPILE=0) to train eagerly") from e


def _backward(loss: torch.Tensor) -> None:
    """``loss.backward()``. The compiled layers' backward is generated at its first call; a failure there cannot fall
    back the way the forward does (gradients may be half accumulated), so it says how to turn compiling off."""
    try:
        loss.backward()
    except fused.compile_errors() as e:
        raise RuntimeError(f"compiling the training backward failed ({type(e).__name__}: {e}); set "
                           "policy.train_compile: false (or DASK_LM_COMPILE=0) to train eagerly") from e


def _upload(data: BatchedDataDict, where: torch.device) -> BatchedDataDict:
    """``data`` with its tensors on ``where``, copied without making the host wait (:func:`device.upload`)."""
    for key, value in list(data.items()):
        if isinstance(value, torch.Tensor):
            data[key] = device.upload(value.contiguous(), where)
    return data


def _to_number(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return value.detach().cpu().tolist()
        # a count from integer masks stays an int (_record divides only floats by the number of global batches)
        return value.detach().item() if not value.is_floating_point() else value.detach().float().item()
    return value


def _grad_norm(worker: PolicyWorker, params: list[torch.Tensor]) -> float:
    """Total L2 norm of all gradients across ranks, in fp64 from fp32 squares of each rank's shard."""
    local = torch.zeros((), dtype=torch.float64, device=worker.device)
    for p in params:
        g = p.grad
        if g is None:
            continue
        g = g.to_local() if hasattr(g, "to_local") else g
        local += g.detach().float().pow(2).sum().to(torch.float64)
    total = _all_reduce(worker, [float(local)])[0]
    return math.sqrt(total) if math.isfinite(total) else total


def _clip_and_step(worker: PolicyWorker) -> tuple[float, bool]:
    params = worker.trainable_parameters()
    with record_function("dask_lm.train.grad_norm"):
        norm = _grad_norm(worker, params)
    if not math.isfinite(norm):
        # stepping on inf / NaN gradients would write NaN into every weight; skip the step (NeMo RL steps anyway)
        warnings.warn(f"gradient norm is {norm}: skipping this optimizer step", RuntimeWarning, stacklevel=2)
        worker.optimizer.zero_grad(set_to_none=True)
        return norm, False
    max_norm = worker.cfg.max_grad_norm
    if max_norm is not None:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            grads = [p.grad for p in params if p.grad is not None]
            torch._foreach_mul_(grads, coef)
    with record_function("dask_lm.train.optimizer"):
        worker.optimizer.step()
    if worker.masters is not None:
        with record_function("dask_lm.train.masters_to_model"):
            worker.masters.copy_to_model()
    return norm, True


def _run_dummy(worker: PolicyWorker, backward: bool) -> None:
    """A two-pad-token forward (and backward) whose loss is 0 but reaches every parameter, so the collectives of
    FSDP pair up with the ranks that still have real micro-batches."""
    ids = torch.full((1, 2), worker.pad_token_id, dtype=torch.int64, device=worker.device)
    hidden = final_hidden_states(worker.model, ids)
    lp = next_token_logprobs_train(hidden, ids, torch.ones_like(ids, dtype=torch.bool), output_head(worker.model),
                                   chunk_size=None)
    if backward:
        (lp.sum() * 0.0).backward()


def train(worker: PolicyWorker, data: BatchedDataDict, meta: dict[str, Any], loss_fn: Any, *, eval_mode: bool,
          gbs: int, mbs: int, num_global_batches: int, progress_id: str | None = None) -> dict[str, Any]:
    if not eval_mode:
        worker.ensure_optimizer()
    worker.place_for_training(optimizer=not eval_mode)
    model = worker.model
    model.train(not eval_mode)
    dp = worker.world_size
    packed = bool(meta.get("packed"))
    checkpointing = worker.cfg.dtensor_cfg.activation_checkpointing
    local_gbs = gbs // dp
    losses: list[float] = []
    metrics: dict[str, list[Any]] = {}
    norms: list[float] = []
    device.synchronize()
    start = time.perf_counter()
    grad_ctx = torch.no_grad() if eval_mode else torch.enable_grad()
    try:
        with grad_ctx:
            for gb in range(num_global_batches):
                batch = data.get_batch(gb, None if packed else local_gbs)
                gvs, gvt = _all_reduce(worker, list(_valid_counts(batch)))
                global_valid_seqs = torch.tensor(gvs, dtype=torch.float32, device=worker.device)
                global_valid_toks = torch.tensor(gvt, dtype=torch.float32, device=worker.device)
                plan = plan_micro_batches(batch.size, mbs=mbs, micro_batch_indices=batch.micro_batch_indices,
                                          packed=packed)
                count = int(_all_reduce(worker, [float(len(plan))], op="max")[0])
                plan = pad_with_dummies(plan, count)
                if not eval_mode:
                    worker.optimizer.zero_grad(set_to_none=True)
                gb_loss = torch.zeros((), dtype=torch.float64, device=worker.device)
                pending: list[dict[str, Any]] = []
                for mb in plan:
                    if mb.dummy or mb.end == mb.start:
                        _run_dummy(worker, backward=not eval_mode)
                        continue
                    # the record_function ranges name the phases in a torch.profiler trace
                    # (benchmarks/profile_train.py); backward kernels run on autograd's own thread
                    with record_function("dask_lm.train.forward"):
                        hidden, info = _forward(worker, batch, mb)
                    with record_function("dask_lm.train.head_and_loss"):
                        width = info["layout"].width  # the longest row, known on the host (no wait on the GPU)
                        # through page-locked memory: a pageable copy would make the host wait for the GPU to
                        # drain before every micro-batch; cut to the micro-batch's rows and width first, so that
                        # large per-token inputs (a teacher's top-k) are never on the device whole
                        mb_data = _upload(_micro_batch_data(batch, mb, width), worker.device)
                        inputs = loss_inputs_from_hidden(worker, hidden, info, mb_data, loss_fn)
                        with deferred_metrics():  # tensors, read back after the step, not one sync each
                            loss, mb_metrics = loss_fn(mb_data, global_valid_seqs, global_valid_toks, **inputs)
                        loss = torch.as_tensor(loss, device=worker.device)
                    if not eval_mode:
                        # + 0 x the inputs: every parameter gets a gradient on every rank even when a custom loss
                        # is constant for this micro-batch, so FSDP's reduce-scatters still pair up across ranks
                        # activation checkpointing recomputes each layer in the backward, where Hugging Face looks
                        # the attention implementation up again: a packed row must still find the varlen kernel
                        # there (under sdpa it would attend across its sequences)
                        recompute_packed = mb.packed and worker.varlen and checkpointing
                        with record_function("dask_lm.train.backward"), (
                                varlen.packed_attention(model) if recompute_packed else contextlib.nullcontext()):
                            anchor = sum(v.sum() for v in inputs.values() if isinstance(v, torch.Tensor))
                            _backward((loss + 0.0 * anchor) * (dp if worker.fsdp else 1))
                    gb_loss += loss.detach().double().sum()
                    pending.append(mb_metrics)
                if not eval_mode:
                    with record_function("dask_lm.train.step"):
                        norm, _stepped = _clip_and_step(worker)
                    norms.append(norm)
                # read back once per global batch, after the step is queued, not once per micro-batch
                for mb_metrics in pending:
                    if float(_to_number(mb_metrics.get("num_valid_samples", 1))) > 0:
                        _record(metrics, mb_metrics, num_global_batches, worker, gvs, gvt)
                losses.append(float(gb_loss))
                if worker.rank == 0:
                    report_progress(progress_id, gb + 1)
        if not eval_mode:
            worker.optimizer.zero_grad(set_to_none=True)
            worker.scheduler.step()
    finally:
        model.eval()
        worker._finish_pass()
    device.synchronize()
    elapsed = time.perf_counter() - start
    total = torch.tensor(_all_reduce(worker, losses) if losses else [], dtype=torch.float32)
    # no empty_cache here: the next step's activations would come from fresh cudaMallocs (profiled on an H200:
    # 15-70 ms of idle GPU a step, 234 allocations for 0.5B packed); offload_before_refit / offload_to_cpu give
    # the cached memory back when something else needs the GPU
    info_dev = device.device_info()
    return {"loss": total, "grad_norm": torch.tensor([norms[-1]], dtype=torch.float32) if norms else None,
            "grad_norms": norms, "all_mb_metrics": metrics, "train_elapsed_seconds": elapsed, "rank": worker.rank,
            "gpu_name": info_dev.get("gpu_name"), "model_dtype": str(worker.dtype).replace("torch.", ""),
            "num_tokens": int(data["input_lengths"].sum()) if data.size else 0}


def _record(metrics: dict[str, list[Any]], mb_metrics: dict[str, Any], num_global_batches: int,
            worker: PolicyWorker, gvs: float, gvt: float) -> None:
    """NeMo RL's bookkeeping: every metric but extrema is divided by the number of global batches, so the
    driver's sum over micro-batches is the mean over optimizer steps; lr and the global counts are added."""
    for key, value in mb_metrics.items():
        v = _to_number(value)
        if isinstance(v, float) and "_min" not in key and "_max" not in key:
            v = v / num_global_batches
        metrics.setdefault(key, []).append(v)
    if worker.optimizer is not None:
        metrics.setdefault("lr", []).append(float(worker.optimizer.param_groups[0]["lr"]))
    metrics.setdefault("global_valid_seqs", []).append(gvs)
    metrics.setdefault("global_valid_toks", []).append(gvt)

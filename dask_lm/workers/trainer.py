"""The trainer of a rank (optimizer, LR scheduler, fp32 masters) and the worker half of ``Policy.train``.

``Policy.train`` runs global batches of micro-batches with globally normalised losses, one optimizer step each.

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
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.profiler import record_function

from dask_lm.comm import collectives
from dask_lm.comm.progress import report_progress
from dask_lm.data.messages import TrainResult
from dask_lm.losses.base import deferred_metrics
from dask_lm.model import device, fused, varlen
from dask_lm.model.forward import MicroBatch, final_hidden_states, pad_with_dummies, plan_micro_batches
from dask_lm.model.logprobs import next_token_logprobs_train, output_head
from dask_lm.model.loss_inputs import loss_inputs_from_hidden
from dask_lm.workers.optim import MasterWeights, build_optimizer, build_scheduler
from dask_lm.workers.state import record_call

if TYPE_CHECKING:
    from dask_lm.config import PolicyConfig
    from dask_lm.data.batch import BatchedDataDict
    from dask_lm.data.messages import MicroBatchPlan
    from dask_lm.model.inference import ForwardLayout

__all__ = ["Trainer", "TrainingHost"]


class TrainingHost(Protocol):
    """What the trainer reads of the rank's model (:class:`~dask_lm.workers.rank_model.RankModel`), given to it when
    it is made."""

    cfg: PolicyConfig
    model: torch.nn.Module
    masters: MasterWeights | None  # a single low-precision rank's fp32 copies; None under FSDP or in fp32
    device: torch.device
    dtype: torch.dtype
    rank: int
    world_size: int
    fsdp: bool
    group: Any  # the ranks' process group; None on a one-rank policy
    pad_token_id: int
    varlen: bool

    @property
    def temperature(self) -> float: ...

    def ensure_on_device(self) -> None: ...

    def training_forward(self, data: BatchedDataDict, mb: MicroBatch) -> tuple[torch.Tensor, ForwardLayout | None]: ...

    def end_pass(self) -> None: ...


class Trainer:
    """The optimizer side of one rank: the optimizer, its LR scheduler and, for a low-precision policy on one rank,
    the fp32 master weights it steps (:class:`~dask_lm.workers.optim.MasterWeights`; under FSDP the fp32 shards
    are the model's own parameters). Runs ``Policy.train`` on the rank (:meth:`train`) over the model it is given
    when it is made (its forward, its placement on the device, its group)."""

    def __init__(self, host: TrainingHost, *, trainable: bool) -> None:
        self.host = host
        self.cfg = host.cfg
        self.model = host.model
        self.masters = host.masters
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        if trainable:
            params = self.masters.parameters() if self.masters else self.model.parameters()
            self.optimizer = build_optimizer(params, self.cfg)
            self.scheduler = build_scheduler(self.optimizer, self.cfg)

    def ensure_optimizer(self) -> None:
        if self.optimizer is None:
            raise ValueError(
                "this Policy has no optimizer: it was created with init_optimizer=False (or "
                "`policy.optimizer: null`); create it with init_optimizer=True to train or save "
                "optimizer state"
            )

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer updates: the fp32 masters, or the (FSDP-sharded) model parameters."""
        if self.masters is not None:
            return self.masters.parameters()
        return [p for p in self.model.parameters() if p.requires_grad]

    def param_names(self) -> dict[int, str]:
        """``{id(parameter): name}`` of what the optimizer holds (the names checkpoints key its state by)."""
        named = self.masters.named_parameters() if self.masters is not None else dict(self.model.named_parameters())
        return {id(p): n for n, p in named.items()}

    def move_to(self, where: str | torch.device) -> None:
        """Optimizer state and fp32 masters to ``where`` (host memory around refits and inference)."""
        if self.masters is not None:
            self.masters.to(where)
        if self.optimizer is None:
            return
        for state in self.optimizer.state.values():
            for k, v in state.items():
                # Adam's `step` stays on the host, where the non-capturable optimizers expect it
                if isinstance(v, torch.Tensor) and k != "step":
                    state[k] = v.to(where, non_blocking=True)
        device.synchronize()

    def close(self) -> None:
        if self.masters is not None:
            self.masters.remove()
        self.masters = None
        self.scheduler = None
        self.optimizer = None
        self.model = None  # type: ignore[assignment]

    # ----------------------------------------------------------------------------------------- one call
    def train(
        self,
        data: BatchedDataDict,
        plan: MicroBatchPlan,
        loss_fn: Any,
        *,
        eval_mode: bool,
        gbs: int,
        mbs: int,
        num_global_batches: int,
        progress_id: str | None = None,
    ) -> TrainResult:
        called = time.perf_counter()
        host = self.host
        if not eval_mode:
            self.ensure_optimizer()
        host.ensure_on_device()
        if not eval_mode:
            self.move_to(host.device)
        model = host.model
        model.train(not eval_mode)
        dp = host.world_size
        group, where = host.group, host.device
        packed = plan.packed
        checkpointing = host.cfg.dtensor_cfg.activation_checkpointing
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
                    start_row, end_row, chunk = plan.global_batch(gb, local_gbs)
                    batch = data.slice(start_row, end_row)
                    gvs, gvt = collectives.sum_over_ranks(_valid_counts(batch), group, where=where)
                    global_valid_seqs = torch.tensor(gvs, dtype=torch.float32, device=where)
                    global_valid_toks = torch.tensor(gvt, dtype=torch.float32, device=where)
                    mb_plan = plan_micro_batches(batch.size, mbs=mbs, micro_batch_indices=chunk, packed=packed)
                    count = collectives.max_over_ranks([len(mb_plan)], group, where=where)[0]
                    mb_plan = pad_with_dummies(mb_plan, count)
                    if not eval_mode:
                        assert self.optimizer is not None  # ensure_optimizer() above
                        self.optimizer.zero_grad(set_to_none=True)
                    gb_loss = torch.zeros((), dtype=torch.float64, device=where)
                    pending: list[dict[str, Any]] = []
                    for mb in mb_plan:
                        if mb.dummy or mb.end == mb.start:
                            _run_dummy(host, backward=not eval_mode)
                            continue
                        # the record_function ranges name the phases in a torch.profiler trace
                        # (benchmarks/profile_train.py); backward kernels run on autograd's own thread
                        with record_function("dask_lm.train.forward"):
                            hidden, layout = host.training_forward(batch, mb)
                        assert layout is not None, "a micro-batch with rows has a layout"
                        with record_function("dask_lm.train.head_and_loss"):
                            width = layout.host.width  # the longest row, known on the host (no wait on the GPU)
                            # through page-locked memory: a pageable copy would make the host wait for the GPU to
                            # drain before every micro-batch; cut to the micro-batch's rows and width first, so
                            # that large per-token inputs (a teacher's top-k) are never on the device whole
                            mb_data = _upload(_micro_batch_data(batch, mb, width), where)
                            inputs = loss_inputs_from_hidden(host, hidden, layout, mb_data, loss_fn)
                            # by keyword, as NeMo RL's workers call a loss: its losses list their input first
                            with deferred_metrics():  # tensors, read back after the step, not one sync each
                                loss, mb_metrics = loss_fn(
                                    data=mb_data,
                                    global_valid_seqs=global_valid_seqs,
                                    global_valid_toks=global_valid_toks,
                                    **inputs,
                                )
                            loss = torch.as_tensor(loss, device=where)
                        if not eval_mode:
                            # + 0 x the inputs: every parameter gets a gradient on every rank even when a custom
                            # loss is constant for this micro-batch, so FSDP's reduce-scatters still pair up
                            # across ranks. Activation checkpointing recomputes each layer in the backward, where
                            # Hugging Face looks the attention implementation up again: a packed row must still
                            # find the varlen kernel there (under sdpa it would attend across its sequences)
                            recompute_packed = mb.packed and host.varlen and checkpointing
                            with (
                                record_function("dask_lm.train.backward"),
                                varlen.packed_attention(model) if recompute_packed else contextlib.nullcontext(),
                            ):
                                anchor = sum(v.sum() for v in inputs.values() if isinstance(v, torch.Tensor))
                                _backward((loss + 0.0 * anchor) * (dp if host.fsdp else 1))
                        gb_loss += loss.detach().double().sum()
                        pending.append(mb_metrics)
                    if not eval_mode:
                        with record_function("dask_lm.train.step"):
                            norm, _stepped = self._clip_and_step(group, where)
                        norms.append(norm)
                    # read back once per global batch, after the step is queued, not once per micro-batch
                    for mb_metrics in pending:
                        if float(_to_number(mb_metrics.get("num_valid_samples", 1))) > 0:
                            self._record(metrics, mb_metrics, num_global_batches, gvs, gvt)
                    losses.append(float(gb_loss))
                    if host.rank == 0:
                        report_progress(progress_id, gb + 1)
            if not eval_mode:
                assert self.optimizer is not None  # ensure_optimizer() above
                self.optimizer.zero_grad(set_to_none=True)
                self.scheduler.step()
        finally:
            model.eval()
            host.end_pass()
        device.synchronize()
        elapsed = time.perf_counter() - start
        total = torch.tensor(
            collectives.sum_over_ranks(losses, group, where=where) if losses else [], dtype=torch.float32
        )
        # no empty_cache here: the next step's activations would come from fresh cudaMallocs (profiled on an H200:
        # 15-70 ms of idle GPU a step, 234 allocations for 0.5B packed); offload_before_refit / offload_to_cpu give
        # the cached memory back when something else needs the GPU
        record_call(int(data["input_lengths"].sum()) if data.size else 0, called)
        return TrainResult(
            loss=total,
            grad_norm=torch.tensor([norms[-1]], dtype=torch.float32) if norms else None,
            grad_norms=norms,
            all_mb_metrics=metrics,
            train_elapsed_seconds=elapsed,
            rank=host.rank,
            gpu_name=device.device_info().get("gpu_name"),
            model_dtype=str(host.dtype).replace("torch.", ""),
            num_tokens=int(data["input_lengths"].sum()) if data.size else 0,
        )

    def _clip_and_step(self, group: Any, where: torch.device) -> tuple[float, bool]:
        assert self.optimizer is not None  # train() runs a step only after ensure_optimizer()
        params = self.trainable_parameters()
        with record_function("dask_lm.train.grad_norm"):
            norm = _grad_norm(params, group, where)
        if not math.isfinite(norm):
            # stepping on inf / NaN gradients would write NaN into every weight; skip the step (NeMo RL steps anyway)
            warnings.warn(f"gradient norm is {norm}: skipping this optimizer step", RuntimeWarning, stacklevel=2)
            self.optimizer.zero_grad(set_to_none=True)
            return norm, False
        max_norm = self.cfg.max_grad_norm
        if max_norm is not None:
            coef = max_norm / (norm + 1e-6)
            if coef < 1.0:
                grads = [p.grad for p in params if p.grad is not None]
                torch._foreach_mul_(grads, coef)
        with record_function("dask_lm.train.optimizer"):
            self.optimizer.step()
        if self.masters is not None:
            with record_function("dask_lm.train.masters_to_model"):
                self.masters.copy_to_model()
        return norm, True

    def _record(
        self, metrics: dict[str, list[Any]], mb_metrics: dict[str, Any], num_global_batches: int, gvs: float, gvt: float
    ) -> None:
        """NeMo RL's bookkeeping: every metric but extrema is divided by the number of global batches, so the
        driver's sum over micro-batches is the mean over optimizer steps; lr and the global counts are added."""
        for key, value in mb_metrics.items():
            v = _to_number(value)
            if isinstance(v, float) and "_min" not in key and "_max" not in key:
                v = v / num_global_batches
            metrics.setdefault(key, []).append(v)
        if self.optimizer is not None:
            metrics.setdefault("lr", []).append(float(self.optimizer.param_groups[0]["lr"]))
        metrics.setdefault("global_valid_seqs", []).append(gvs)
        metrics.setdefault("global_valid_toks", []).append(gvt)


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


def _backward(loss: torch.Tensor) -> None:
    """``loss.backward()``. The compiled layers' backward is generated at its first call; a failure there cannot fall
    back the way the forward does (gradients may be half accumulated), so it says how to turn compiling off."""
    try:
        loss.backward()
    except fused.compile_errors() as e:
        raise RuntimeError(
            f"compiling the training backward failed ({type(e).__name__}: {e}); set "
            "policy.train_compile: false (or DASK_LM_COMPILE=0) to train eagerly"
        ) from e


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


def _grad_norm(params: Sequence[torch.Tensor], group: Any, where: torch.device) -> float:
    """Total L2 norm of all gradients across ranks, in fp64 from fp32 squares of each rank's shard."""
    local = torch.zeros((), dtype=torch.float64, device=where)
    for p in params:
        g = p.grad
        if g is None:
            continue
        g = g.to_local() if hasattr(g, "to_local") else g
        local += g.detach().float().pow(2).sum().to(torch.float64)
    total = collectives.sum_over_ranks([float(local)], group, where=where)[0]
    return math.sqrt(total) if math.isfinite(total) else total


def _run_dummy(host: TrainingHost, backward: bool) -> None:
    """A two-pad-token forward (and backward) whose loss is 0 but reaches every parameter, so the collectives of
    FSDP pair up with the ranks that still have real micro-batches."""
    ids = torch.full((1, 2), host.pad_token_id, dtype=torch.int64, device=host.device)
    hidden = final_hidden_states(host.model, ids)
    lp = next_token_logprobs_train(
        hidden, ids, torch.ones_like(ids, dtype=torch.bool), output_head(host.model), chunk_size=None
    )
    assert isinstance(lp, torch.Tensor)  # unfiltered=False: one tensor
    if backward:
        (lp.sum() * 0.0).backward()

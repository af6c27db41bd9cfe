"""Loss inputs from a micro-batch's final hidden states, a chunk of tokens at a time (the training path).

Equal to :func:`dask_lm.losses.prepare_loss_input` on the full logits, without ever holding ``[B, S, V]``: each
chunk's logits are recomputed in the backward pass. Packed micro-batches (one ``[1, T]`` row) are mapped back to
``[rows, width]`` with differentiable scatters, so losses see the same shapes in every batching mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from dask_lm.losses.base import LossInputType, loss_attribute
from dask_lm.losses.loss_input import input_type_of
from dask_lm.model import device
from dask_lm.model.forward import unpack_positions
from dask_lm.model.logprobs import chunk_bounds, next_token_logprobs_train, output_head, policy_logprob_options

if TYPE_CHECKING:
    from dask_lm.config import PolicyConfig
    from dask_lm.model.inference import ForwardLayout

__all__ = ["loss_inputs_from_hidden"]


class LossInputHost(Protocol):
    """What the loss inputs read of the rank (:class:`~dask_lm.workers.trainer.TrainingHost`)."""

    @property
    def cfg(self) -> PolicyConfig: ...

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def temperature(self) -> float: ...


def _positions(
    layout: ForwardLayout, width: int, *, predicting: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every real token of the micro-batch (``predicting``: except each row's last, which predicts nothing in the
    row): its (row, column) and its index into the flattened hidden states. Worked out from the host layout and
    uploaded: ``nonzero`` / boolean indexing / ``repeat_interleave`` on device tensors would make the host wait
    for the GPU once per micro-batch (seen as idle gaps in ``benchmarks/profile_train.py --trace``)."""
    lay = layout.host
    if layout.packed:
        assert lay.cu is not None  # a packed layout has its offsets
        rows, cols = unpack_positions(lay.cu, lay.lens, width)
        flat = torch.arange(rows.numel())
    else:
        assert lay.valid is not None  # host_layout sets it for padded rows
        rows, cols = lay.valid
        flat = rows * lay.width + cols
    if predicting:
        keep = cols < lay.lens[rows] - 1
        rows, cols, flat = rows[keep], cols[keep], flat[keep]
    where = layout.lens.device
    return device.upload(rows, where), device.upload(cols, where), device.upload(flat, where)


def _to_rows(values: torch.Tensor, layout: ForwardLayout, width: int) -> torch.Tensor:
    """A packed ``[1, T, ...]`` result as ``[rows, width, ...]`` (zeros past each row's length)."""
    rows, cols, _ = _positions(layout, width)
    out = values.new_zeros((layout.host.lens.numel(), width, *values.shape[2:]))
    return out.index_put((rows, cols), values[0])


def _logprob_inputs(
    worker: LossInputHost, hidden: torch.Tensor, layout: ForwardLayout, data: Any, loss_fn: Any, width: int
) -> dict[str, torch.Tensor]:
    options = policy_logprob_options(worker.cfg, worker.temperature, layout.scored)
    top_k, top_p = options["top_k"], options["top_p"]
    filtering = (top_k is not None and top_k > 0) or top_p < 1.0
    unfiltered = filtering and bool(loss_attribute(loss_fn, "reference_policy_kl_penalty"))
    res = next_token_logprobs_train(
        hidden, layout.ids, layout.targets_valid, output_head(worker.model), unfiltered=unfiltered, **options
    )
    outs = list(res) if isinstance(res, tuple) else [res]  # a pair exactly when `unfiltered`
    if layout.packed:
        outs = [_to_rows(o[..., None], layout, width)[..., 0] for o in outs]
    else:
        outs = [o[:, :width] for o in outs]
    if unfiltered:
        data["curr_logprobs_unfiltered"] = outs[1][:, 1:]
    return {"next_token_logprobs": outs[0][:, 1:]}


def _distillation_chunk(
    h: torch.Tensor,
    idx: torch.Tensor,
    teacher: torch.Tensor,
    head: Any,
    temperature: float,
    zero_outside: bool,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = head(h)
    if temperature != 1.0:
        logits = logits / temperature
    if zero_outside:
        full = torch.log_softmax(logits, dim=-1)
        s = full.gather(-1, idx)
        h_all = (full.exp() * full).sum(-1) if entropy else torch.zeros_like(s[:, 0])
    else:
        s = torch.log_softmax(logits.gather(-1, idx), dim=-1)
        h_all = torch.zeros_like(s[:, 0])
    t = torch.log_softmax(teacher.float(), dim=-1)
    return s, t, h_all


def _distillation_inputs(
    worker: LossInputHost, hidden: torch.Tensor, layout: ForwardLayout, data: Any, loss_fn: Any, width: int
) -> dict[str, Any]:
    from torch.utils.checkpoint import checkpoint

    rows, cols, flat = _positions(layout, width, predicting=True)
    lens = layout.lens
    h = hidden.reshape(-1, hidden.shape[-1])[flat]
    idx = data["teacher_topk_indices"][rows, cols].to(torch.int64)
    teacher = data["teacher_topk_logits"][rows, cols]
    k = idx.shape[-1]
    if k <= 0:
        raise ValueError(f"topk must be positive, got k={k}")
    zero = bool(loss_attribute(loss_fn, "zero_outside_topk"))
    entropy = zero and loss_attribute(loss_fn, "kl_type") != "forward"
    head = output_head(worker.model)
    chunk = worker.cfg.logprob_chunk_size
    parts = []
    for s, e in chunk_bounds(rows.numel(), chunk):
        args = (h[s:e], idx[s:e], teacher[s:e], head, worker.temperature, zero, entropy)
        parts.append(
            checkpoint(_distillation_chunk, *args, use_reentrant=False)
            if chunk and torch.is_grad_enabled()
            else _distillation_chunk(*args)
        )
    b = lens.numel()
    dev = hidden.device
    s_out = torch.zeros(b, max(width - 1, 0), k, dtype=torch.float32, device=dev)
    t_out = torch.zeros_like(s_out)
    h_out = torch.zeros(b, max(width - 1, 0), dtype=torch.float32, device=dev)
    if parts:
        s_out = s_out.index_put((rows, cols), torch.cat([p[0] for p in parts]))
        t_out = t_out.index_put((rows, cols), torch.cat([p[1] for p in parts]))
        h_out = h_out.index_put((rows, cols), torch.cat([p[2] for p in parts]))
    else:  # keep every parameter in the graph, so FSDP's gradient collectives pair up across ranks
        s_out = s_out + 0.0 * head(hidden.reshape(-1, hidden.shape[-1])[:1]).sum()
    return {"student_topk_logprobs": s_out, "teacher_topk_logprobs": t_out, "H_all": h_out if entropy else None}


def _logit_inputs(
    worker: LossInputHost, hidden: torch.Tensor, layout: ForwardLayout, width: int
) -> dict[str, torch.Tensor]:
    logits = output_head(worker.model)(hidden)
    if worker.temperature != 1.0:
        logits = logits / worker.temperature
    if layout.packed:
        logits = _to_rows(logits, layout, width)
    return {"logits": logits[:, :width]}


def loss_inputs_from_hidden(
    worker: LossInputHost, hidden: torch.Tensor, layout: ForwardLayout, data: Any, loss_fn: Any
) -> dict[str, Any]:
    """The keyword inputs ``loss_fn`` expects for this micro-batch (may add keys to ``data``, as NeMo RL does)."""
    width = layout.host.width  # the host's: no GPU wait
    kind = input_type_of(loss_fn)
    if kind == LossInputType.LOGPROB:
        return _logprob_inputs(worker, hidden, layout, data, loss_fn, width)
    if kind == LossInputType.DISTILLATION:
        return _distillation_inputs(worker, hidden, layout, data, loss_fn, width)
    return _logit_inputs(worker, hidden, layout, width)

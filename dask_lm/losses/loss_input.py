"""Loss inputs from full logits: ``prepare_loss_input`` and the logprob helpers NeMo RL's losses are tested with.

The trainer never materialises ``[B, S, V]`` logits for LOGPROB and DISTILLATION losses: it builds the same
inputs from hidden states a chunk of tokens at a time (:mod:`dask_lm.model.loss_inputs`). These functions are
the reference form, from logits you already have, for tests and for custom training loops.
"""

from __future__ import annotations

from typing import Any

import torch

from dask_lm.losses.base import LossInputType, loss_attribute
from dask_lm.losses.sampling import apply_top_k_top_p

__all__ = [
    "prepare_loss_input",
    "get_next_token_logprobs_from_logits",
    "get_logprobs_from_logits",
    "get_distillation_topk_logprobs_from_logits",
    "input_type_of",
]


def input_type_of(loss_fn: Any) -> LossInputType:
    """The loss's ``input_type`` as our enum (a NeMo RL enum or a plain string work too); LOGPROB by default."""
    value = getattr(loss_fn, "input_type", LossInputType.LOGPROB)
    value = getattr(value, "value", value)
    try:
        return LossInputType(str(value).lower())
    except ValueError:
        raise ValueError(
            f"{type(loss_fn).__name__}.input_type = {value!r} is not supported; use one of "
            f"{[t.value for t in LossInputType]}"
        ) from None


def _sampling(sampling_params: Any) -> tuple[float, int | None, float]:
    if sampling_params is None:
        return 1.0, None, 1.0
    get = (
        sampling_params.get if isinstance(sampling_params, dict) else (lambda k, d=None: getattr(sampling_params, k, d))
    )
    top_k = get("top_k", None)
    return (
        float(get("temperature", 1.0) or 1.0),
        (int(top_k) if top_k not in (None, -1, 0) else None),
        float(get("top_p", 1.0) or 1.0),
    )


def get_next_token_logprobs_from_logits(
    input_ids: torch.Tensor,
    next_token_logits: torch.Tensor,
    sampling_params: Any = None,
    chunk_size: int | None = None,
    **_parallel: Any,
) -> torch.Tensor:
    """float32 ``[B, S-1]``: element t is log p(input_ids[:, t+1]) under ``next_token_logits[:, t]``.

    ``sampling_params`` (``temperature`` / ``top_k`` / ``top_p``) filter the distribution as the sampler did;
    the logits are taken as already divided by the temperature. Tokens outside the filter get 0.
    """
    _temperature, top_k, top_p = _sampling(sampling_params)
    logits = next_token_logits[:, :-1].float()
    targets = input_ids[:, 1:].to(logits.device, torch.int64)
    step = chunk_size or logits.shape[1] or 1
    out = []
    for s in range(0, logits.shape[1], step):
        chunk = logits[:, s : s + step]
        if top_k is not None or top_p < 1.0:
            chunk = apply_top_k_top_p(chunk, top_k, top_p)
        lp = torch.log_softmax(chunk, dim=-1).gather(-1, targets[:, s : s + step, None]).squeeze(-1)
        out.append(torch.where(torch.isfinite(lp), lp, torch.zeros_like(lp)))
    return torch.cat(out, dim=1) if out else logits.new_zeros(logits.shape[0], 0)


def get_logprobs_from_logits(input_ids: torch.Tensor, next_token_logits: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """Earlier NeMo RL name of :func:`get_next_token_logprobs_from_logits`."""
    return get_next_token_logprobs_from_logits(input_ids, next_token_logits, **kwargs)


def get_distillation_topk_logprobs_from_logits(
    *,
    student_logits: torch.Tensor,
    teacher_topk_logits: torch.Tensor,
    teacher_topk_indices: torch.Tensor,
    zero_outside_topk: bool = False,
    calculate_entropy: bool = False,
    **_parallel: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(student_topk_logprobs, teacher_topk_logprobs, H_all)`` over the teacher's top-k, last position dropped.

    The student is renormalised over the k entries, or with ``zero_outside_topk`` keeps its full-vocabulary
    logprobs (then ``H_all`` = sum over the vocabulary of p log p when ``calculate_entropy``). The teacher is
    renormalised over its k entries. Indices may repeat; nothing is deduplicated.
    """
    if teacher_topk_indices.shape[-1] <= 0:
        raise ValueError(f"topk must be positive, got k={teacher_topk_indices.shape[-1]}")
    student = student_logits.float()
    idx = teacher_topk_indices.to(student.device, torch.int64)
    h_all = None
    if zero_outside_topk:
        full = torch.log_softmax(student, dim=-1)
        s = full.gather(-1, idx)
        if calculate_entropy:
            h_all = (full.exp() * full).sum(-1)
    else:
        s = torch.log_softmax(student.gather(-1, idx), dim=-1)
    t = torch.log_softmax(teacher_topk_logits.to(student.device, student.dtype), dim=-1)
    return s[:, :-1], t[:, :-1], (h_all[:, :-1] if h_all is not None else None)


def prepare_loss_input(
    logits: torch.Tensor,
    data: Any,
    loss_fn: Any,
    sampling_params: Any = None,
    chunk_size: int | None = None,
    **_parallel: Any,
) -> tuple[dict[str, Any], Any]:
    """``(inputs, data)`` for ``loss_fn(data=data, global_valid_seqs=..., global_valid_toks=..., **inputs)`` from full
    ``logits`` ``[B, S, V]`` (already divided by the temperature).

    LOGIT: ``{"logits"}``. LOGPROB: ``{"next_token_logprobs"}`` [B, S-1]; when top-k / top-p filtering is on and
    the loss has a KL penalty, the unfiltered logprobs go into ``data["curr_logprobs_unfiltered"]``.
    DISTILLATION: the student / teacher top-k logprobs and ``H_all`` from ``data["teacher_topk_logits"]`` and
    ``data["teacher_topk_indices"]``.
    """
    kind = input_type_of(loss_fn)
    if kind == LossInputType.LOGIT:
        return {"logits": logits}, data
    if kind == LossInputType.LOGPROB:
        if loss_attribute(loss_fn, "use_fused_linear_logprobs"):  # the "logits" are logprobs already
            return {"next_token_logprobs": logits.float()[:, : data["input_ids"].shape[1] - 1]}, data
        lp = get_next_token_logprobs_from_logits(
            data["input_ids"], logits, sampling_params=sampling_params, chunk_size=chunk_size
        )
        _t, top_k, top_p = _sampling(sampling_params)
        if (top_k is not None or top_p < 1.0) and bool(loss_attribute(loss_fn, "reference_policy_kl_penalty")):
            data["curr_logprobs_unfiltered"] = get_next_token_logprobs_from_logits(
                data["input_ids"], logits, chunk_size=chunk_size
            )
        return {"next_token_logprobs": lp}, data
    zero = bool(loss_attribute(loss_fn, "zero_outside_topk"))
    s, t, h = get_distillation_topk_logprobs_from_logits(
        student_logits=logits,
        teacher_topk_logits=data["teacher_topk_logits"],
        teacher_topk_indices=data["teacher_topk_indices"],
        zero_outside_topk=zero,
        calculate_entropy=zero and loss_attribute(loss_fn, "kl_type") != "forward",
    )
    return {"student_topk_logprobs": s, "teacher_topk_logprobs": t, "H_all": h}, data

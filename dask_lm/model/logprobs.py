"""Log-probabilities and top-k logits from final hidden states, a chunk of tokens at a time.

A model's ``lm_head`` turns ``[N, H]`` hidden states into ``[N, V]`` logits; for a 152k vocabulary a float32
``[B, S, V]`` tensor is 0.6 MB per token, which is what runs real jobs out of memory. These functions take only
the positions that count, run the head over ``chunk_size`` of them at a time, reduce each chunk to what the
caller needs (one logprob, or k logits) and let the chunk's logits go before the next one is built.
Peak extra memory is ``chunk_size x V x 4`` bytes (plus the same again while filtering), independent of batch shape.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import torch
import torch.nn.functional as F

from dask_lm.losses.sampling import apply_top_k_top_p
from dask_lm.model import device, fused
from dask_lm.model.hf import find_output_embeddings

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # Python 3.10
    from typing_extensions import Unpack

if TYPE_CHECKING:
    from dask_lm.config import PolicyConfig

__all__ = [
    "OutputHead",
    "output_head",
    "next_token_logprobs",
    "next_token_logprobs_greedy",
    "next_token_logprobs_train",
    "LogprobOptions",
    "policy_logprob_options",
    "topk_logits",
    "apply_top_k_top_p",
]


@dataclass
class OutputHead:
    """``hidden [N, H] -> float32 logits [N, V]`` for one model, with the model family's logit transforms.

    With ``fp32_out`` (half-precision weights on a GPU, see :func:`dask_lm.model.device.fp32_logits_capable`)
    an inference matmul writes float32 logits directly instead of rounding them to bf16 and upcasting: one pass
    over ``[N, V]`` instead of three, and the bf16 rounding error of the logits (up to 4e-3 nats) is gone. When
    autograd records the head (training), it stays ``F.linear``: the training path is unchanged."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    scale: float = 1.0
    softcap: float | None = None
    fp32_out: bool = False

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        records_graph = torch.is_grad_enabled() and (hidden.requires_grad or self.weight.requires_grad)
        if self.fp32_out and hidden.dim() == 2 and hidden.dtype == self.weight.dtype and not records_graph:
            logits = torch.mm(hidden, self.weight.t(), out_dtype=torch.float32)
            if self.bias is not None:
                logits += self.bias.float()
        else:
            logits = F.linear(hidden, self.weight, self.bias).float()
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def output_head(model: torch.nn.Module) -> OutputHead:
    """The output projection of a Hugging Face causal LM, read from its live (unsharded) parameters."""
    hf: Any = model  # a transformers PreTrainedModel (Module's __getattr__ would type its attributes Tensor | Module)
    head: Any = find_output_embeddings(model)
    assert head is not None, f"{type(model).__name__} has no output embeddings (the driver checks)"
    cfg = hf.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    scale = 1.0
    if getattr(text_cfg, "logit_scale", None) is not None:  # Cohere multiplies
        scale = float(text_cfg.logit_scale)
    if getattr(text_cfg, "logits_scaling", None) is not None:  # Granite divides
        scale = 1.0 / float(text_cfg.logits_scaling)
    softcap = getattr(text_cfg, "final_logit_softcapping", None)
    weight = head.weight
    return OutputHead(
        weight,
        getattr(head, "bias", None),
        scale,
        softcap,
        fp32_out=weight.is_cuda and device.fp32_logits_capable(weight.dtype),
    )


class LogprobOptions(TypedDict, total=False):
    """The keyword options of :func:`next_token_logprobs` and :func:`next_token_logprobs_train`, one type for both
    (and for what a policy's pass gives them, :func:`policy_logprob_options`); a key left out takes its default:
    temperature 1, ``chunk_size`` 1024 positions, no top-k / top-p filter, ``index`` worked out from ``valid``."""

    temperature: float
    chunk_size: int | None
    top_k: int | None
    top_p: float
    index: tuple[torch.Tensor, torch.Tensor] | None


def _resolved(
    options: LogprobOptions,
) -> tuple[float, int | None, int | None, float, tuple[torch.Tensor, torch.Tensor] | None]:
    """``(temperature, chunk_size, top_k, top_p, index)``, each key left out at its default; an unknown key is a
    ``TypeError``, as an unknown keyword argument is."""
    unknown = sorted(set(options) - set(LogprobOptions.__annotations__))
    if unknown:
        raise TypeError(
            f"unexpected keyword argument(s) {unknown}; the options are {list(LogprobOptions.__annotations__)}"
        )
    return (
        options.get("temperature", 1.0),
        options.get("chunk_size", 1024),
        options.get("top_k"),
        options.get("top_p", 1.0),
        options.get("index"),
    )


def policy_logprob_options(
    cfg: PolicyConfig, temperature: float, index: tuple[torch.Tensor, torch.Tensor] | None, *, reference: bool = False
) -> LogprobOptions:
    """The policy's logprobs are taken under its generation config's top-k / top-p filter (none without one, and
    none for the reference policy's logprobs), at its temperature, ``cfg.logprob_chunk_size`` positions at a time;
    ``index``: the pass's scored positions (``ForwardLayout.scored``)."""
    gen = None if reference else cfg.generation
    return {
        "temperature": temperature,
        "chunk_size": cfg.logprob_chunk_size,
        "top_k": gen.top_k if gen is not None else None,
        "top_p": gen.top_p if gen is not None else 1.0,
        "index": index,
    }


def chunk_bounds(n: int, chunk_size: int | None) -> list[tuple[int, int]]:
    step = chunk_size if chunk_size else n
    return [(s, min(s + step, n)) for s in range(0, n, max(step, 1))]


def next_token_logprobs(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    valid: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    **options: Unpack[LogprobOptions],
) -> torch.Tensor:
    """float32 ``[B, S]``: position i >= 1 holds log p(input_ids[:, i] | input_ids[:, :i]); position 0 and
    every position where ``valid`` is false hold 0.

    ``hidden`` is ``[B, S, H]`` (final hidden states, after the last norm); ``valid`` is ``[B, S]`` bool.
    ``index``, when the caller knows it, is ``valid[:, 1:].nonzero(as_tuple=True)`` (worked out on the host:
    ``nonzero`` on a device tensor makes the host wait for the GPU).
    """
    temperature, chunk_size, top_k, top_p, index = _resolved(options)
    return _next_token(
        hidden,
        input_ids,
        valid,
        head,
        temperature=temperature,
        chunk_size=chunk_size,
        top_k=top_k,
        top_p=top_p,
        index=index,
        greedy=False,
    )[0]


def next_token_logprobs_greedy(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    valid: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    *,
    chunk_size: int | None = 1024,
    index: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`next_token_logprobs` (temperature 1, no filter) and bool ``[B, S]``: whether token i is the argmax
    of the model's distribution at i - 1 (true at position 0 and where ``valid`` is false), from the same pass
    over the logits: scoring's ``is_greedy``."""
    lp, greedy = _next_token(
        hidden,
        input_ids,
        valid,
        head,
        temperature=1.0,
        chunk_size=chunk_size,
        top_k=None,
        top_p=1.0,
        index=index,
        greedy=True,
    )
    assert greedy is not None
    return lp, greedy


def _next_token(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    valid: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    *,
    temperature: float,
    chunk_size: int | None,
    top_k: int | None,
    top_p: float,
    index: tuple[torch.Tensor, torch.Tensor] | None,
    greedy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    b, s = input_ids.shape
    out = torch.zeros(b, s, dtype=torch.float32, device=hidden.device)
    is_max = torch.ones(b, s, dtype=torch.bool, device=hidden.device) if greedy else None
    if s < 2:
        return out, is_max
    rows, cols = index if index is not None else valid[:, 1:].nonzero(as_tuple=True)  # cols: predicting position
    if rows.numel() == 0:
        return out, is_max
    h = hidden[rows, cols]  # [N, H]
    targets = input_ids[rows, cols + 1]
    values = torch.empty(rows.numel(), dtype=torch.float32, device=hidden.device)
    argmax = torch.empty(rows.numel(), dtype=torch.bool, device=hidden.device) if greedy else None
    filtering = (top_k is not None and top_k > 0) or top_p < 1.0
    for start, end in chunk_bounds(rows.numel(), chunk_size):
        logits = head(h[start:end])
        if filtering:
            if temperature != 1.0:
                logits = logits / temperature
            logits = apply_top_k_top_p(logits, top_k, top_p)
            picked = logits.gather(1, targets[start:end, None]).squeeze(1)
            values[start:end] = picked - torch.logsumexp(logits, dim=-1)
        elif argmax is not None:
            values[start:end], argmax[start:end] = fused.pick_minus_logsumexp_greedy(logits, targets[start:end])
        else:  # one fused pass over the chunk's logits on a GPU (fused.py)
            values[start:end] = fused.pick_minus_logsumexp(logits, targets[start:end], temperature)
        del logits
    if filtering:
        bad = ~torch.isfinite(values)
        if bool(bad.any()):
            # attributed to this module: tasks.serve sends dask-lm's own warnings to the driver, which raises it at
            # the user's call, once for all ranks (so the text names no per-rank count)
            warnings.warn(_filtered_message(top_k, top_p), UserWarning, stacklevel=1)
            values = values.masked_fill(bad, 0.0)
    out[rows, cols + 1] = values
    if is_max is not None and argmax is not None:
        is_max[rows, cols + 1] = argmax
    return out, is_max


def topk_logits(
    hidden: torch.Tensor,
    valid: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    k: int,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = 1024,
    normalize: bool = False,
    index: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest temperature-scaled logits at every valid position: float32 ``[B, S, k]`` and int64
    vocabulary ids ``[B, S, k]``, sorted descending; invalid (padding) positions hold 0 in both. With
    ``normalize`` the values are logprobs (the logits minus the position's logsumexp). ``index``: the host's
    ``valid.nonzero(as_tuple=True)``, as in :func:`next_token_logprobs`."""
    b, s, _ = hidden.shape
    values = torch.zeros(b, s, k, dtype=torch.float32, device=hidden.device)
    indices = torch.zeros(b, s, k, dtype=torch.int64, device=hidden.device)
    rows, cols = index if index is not None else valid.nonzero(as_tuple=True)
    if rows.numel() == 0:
        return values, indices
    h = hidden[rows, cols]
    flat_v = torch.empty(rows.numel(), k, dtype=torch.float32, device=hidden.device)
    flat_i = torch.empty(rows.numel(), k, dtype=torch.int64, device=hidden.device)
    for start, end in chunk_bounds(rows.numel(), chunk_size):
        logits = head(h[start:end])
        if temperature != 1.0:
            logits = logits / temperature
        top = torch.topk(logits, k, dim=-1)
        values_ = top.values - fused.logsumexp(logits)[:, None] if normalize else top.values
        flat_v[start:end], flat_i[start:end] = values_, top.indices
        del logits
    values[rows, cols] = flat_v
    indices[rows, cols] = flat_i
    return values, indices


def _filtered_message(top_k: int | None, top_p: float) -> str:
    keys = ([f"generation.top_k = {top_k}"] if top_k is not None and top_k > 0 else []) + (
        [f"generation.top_p = {top_p}"] if top_p < 1.0 else []
    )
    return (
        f"{' and '.join(keys)} filter{'s' * (len(keys) == 1)} the logprobs too, as NeMo RL applies the "
        "sampler's filters to them: a "
        "token outside the filter gets logprob 0 (as if its probability were 1), and the others are "
        "renormalised within it; set generation.top_p = 1.0 and generation.top_k = None for the model's own "
        "logprobs (get_reference_policy_logprobs never filters)"
    )


def _chunk_logprobs(
    h: torch.Tensor,
    targets: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    temperature: float,
    top_k: int | None,
    top_p: float,
    unfiltered: bool,
) -> tuple[torch.Tensor, ...]:
    logits = head(h)
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, targets[:, None]).squeeze(1)
    if not ((top_k is not None and top_k > 0) or top_p < 1.0):
        lp = picked - lse
        return (lp, lp) if unfiltered else (lp,)
    filtered = apply_top_k_top_p(logits, top_k, top_p)
    lp = picked - torch.logsumexp(filtered, dim=-1)
    # a target outside the filter has logprob -inf: 0 there (and no gradient), as in the inference path
    lp = torch.where(torch.isfinite(filtered.gather(1, targets[:, None]).squeeze(1)), lp, torch.zeros_like(lp))
    return (lp, picked - lse) if unfiltered else (lp,)


def next_token_logprobs_train(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    valid: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    *,
    unfiltered: bool = False,
    **options: Unpack[LogprobOptions],
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`next_token_logprobs` with gradients, still memory-flat: training never holds a ``[N, V]`` float32
    tensor for more than one chunk. The plain head (no top-k / top-p filtering, no soft-capping) goes through
    :func:`dask_lm.model.linear_logprob.linear_logprobs`, whose backward recomputes only each chunk's logits;
    the others recompute each chunk's forward in the backward pass (``torch.utils.checkpoint``). With
    ``unfiltered`` it also returns the logprobs without top-k / top-p filtering (what a KL penalty needs), from the
    same logits. ``index``, when the caller knows it, is ``valid[:, 1:].nonzero(as_tuple=True)`` (worked out on
    the host: ``nonzero`` on a device tensor makes the host wait for the GPU)."""
    from torch.utils.checkpoint import checkpoint

    from dask_lm.model.linear_logprob import linear_logprobs

    temperature, chunk_size, top_k, top_p, index = _resolved(options)
    b, s = input_ids.shape
    rows, cols = index if index is not None else valid[:, 1:].nonzero(as_tuple=True)
    h = hidden[rows, cols]
    targets = input_ids[rows, cols + 1]
    n_out = 2 if unfiltered else 1
    pieces: list[tuple[torch.Tensor, ...]] = []
    filtering = (top_k is not None and top_k > 0) or top_p < 1.0
    if (
        isinstance(head, OutputHead)
        and head.softcap is None
        and not filtering
        and chunk_size
        and torch.is_grad_enabled()
        and rows.numel()
    ):
        lp = linear_logprobs(h, head.weight, head.bias, targets, scale=head.scale / temperature, chunk_size=chunk_size)
        pieces.append((lp, lp) if unfiltered else (lp,))
    else:
        for start, end in chunk_bounds(rows.numel(), chunk_size):
            args = (h[start:end], targets[start:end], head, temperature, top_k, top_p, unfiltered)
            if chunk_size and torch.is_grad_enabled():
                pieces.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
            else:
                pieces.append(_chunk_logprobs(*args))
    outs = []
    for j in range(n_out):
        values = torch.cat([p[j] for p in pieces]) if pieces else hidden.new_zeros(0, dtype=torch.float32)
        out = torch.zeros(b, s, dtype=torch.float32, device=hidden.device)
        if values.numel():
            outs.append(out.index_put((rows, cols + 1), values))
        else:  # no position to score: stay connected to the head and the decoder, so every gradient exists
            outs.append(out + 0.0 * head(hidden.reshape(-1, hidden.shape[-1])[:1]).sum())
    return (outs[0], outs[1]) if unfiltered else outs[0]

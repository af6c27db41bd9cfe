"""One forward pass of a Hugging Face model to its final hidden states, for plain and packed micro-batches.

Plain micro-batches are right-padded ``[b, L]`` rows cut to their longest row; causal attention means padding at
the end never changes an earlier position, so no attention mask is needed (NeMo RL does the same).

Packed micro-batches concatenate the real tokens of several rows into one ``[1, T]`` row. Hugging Face models do
not notice packing from restarted ``position_ids`` alone (the second sequence would attend to the first), so we
pass a block-diagonal causal mask ``[1, 1, T, T]``: boolean for ``sdpa``, additive float for ``eager`` (the
only form eager accepts). The dense mask costs O(T^2): on GPUs packed rows run through a varlen kernel instead
(:mod:`dask_lm.model.varlen`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dask_lm.model.hf import find_decoder

__all__ = ["MicroBatch", "plan_micro_batches", "decoder_of", "final_hidden_states", "unpack_positions"]


@dataclass(frozen=True)
class MicroBatch:
    """Rows ``[start, end)`` of a shard; ``packed`` runs them as one packed row; ``dummy`` results are dropped."""

    start: int
    end: int
    packed: bool = False
    dummy: bool = False


def plan_micro_batches(num_rows: int, *, mbs: int, micro_batch_indices: list | None, packed: bool) -> list[MicroBatch]:
    """Micro-batches of one shard: the driver's dynamic / packed boundaries when given, else ``mbs`` rows each."""
    if micro_batch_indices:
        assert len(micro_batch_indices) == 1, "inference shards carry one chunk of micro-batches"
        return [MicroBatch(int(s), int(e), packed=packed) for s, e in micro_batch_indices[0]]
    return [MicroBatch(s, min(s + mbs, num_rows)) for s in range(0, num_rows, mbs)]


def pad_with_dummies(plan: list[MicroBatch], target: int) -> list[MicroBatch]:
    """Every rank of an FSDP group must run the same number of forwards (each one all-gathers parameters):
    repeat this rank's own micro-batches (or a one-token row when it has none) and throw their outputs away."""
    out = list(plan)
    i = 0
    while len(out) < target:
        src = plan[i % len(plan)] if plan else MicroBatch(0, 0)
        out.append(MicroBatch(src.start, src.end, src.packed, dummy=True))
        i += 1
    return out


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The base transformer inside a ``*ForCausalLM`` / ``*ForSequenceClassification`` model (the driver checked
    that there is one: :func:`dask_lm.model.hf.check_policy_model`)."""
    dec = find_decoder(model)
    assert dec is not None, f"cannot find the decoder of {type(model).__name__}"
    return dec


def block_causal_mask(cu_seqlens: torch.Tensor, total: int, *, additive_dtype: torch.dtype | None) -> torch.Tensor:
    """``[1, 1, T, T]`` mask letting position q see k when both sit in the same sequence and k <= q."""
    dev = cu_seqlens.device
    # output_size: without it repeat_interleave reads the total back from the device (a host sync)
    seq_id = torch.repeat_interleave(
        torch.arange(cu_seqlens.numel() - 1, device=dev),
        (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64),
        output_size=total,
    )
    idx = torch.arange(total, device=dev)
    allowed = (seq_id[:, None] == seq_id[None, :]) & (idx[None, :] <= idx[:, None])
    if additive_dtype is None:
        return allowed[None, None]
    mask = torch.zeros(total, total, dtype=additive_dtype, device=dev)
    mask.masked_fill_(~allowed, torch.finfo(additive_dtype).min)
    return mask[None, None]


def unpack_positions(cu_seqlens: torch.Tensor, lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Index pairs mapping packed position ``cu[b] + p`` back to ``(row b, column p)`` for ``p < lengths[b]``."""
    lengths = lengths.to(torch.int64)
    rows = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    cols = torch.arange(int(lengths.sum()), device=lengths.device) - torch.repeat_interleave(
        cu_seqlens[:-1].to(torch.int64), lengths
    )
    assert cols.numel() == 0 or int(cols.max()) < width, "packed row longer than the shard's width"
    return rows, cols


def final_hidden_states(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    **attention_kwargs: Any,
) -> torch.Tensor:
    """Run the whole model (so FSDP's root hooks gather and free parameters as usual) and return the decoder's
    last hidden state ``[B, S, H]``. ``logits_to_keep=1`` keeps the model's own vocabulary projection down to
    one position; callers project the positions they need in chunks. ``attention_kwargs`` reach the attention
    functions (the packed sequence boundaries of :mod:`dask_lm.model.varlen`)."""
    captured: dict[str, torch.Tensor] = {}

    def grab(_module: Any, _args: Any, output: Any) -> None:
        captured["h"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    handle = decoder_of(model).register_forward_hook(grab)
    try:
        kwargs: dict[str, Any] = {"input_ids": input_ids, "use_cache": False}
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        kwargs.update(attention_kwargs)
        if _accepts_logits_to_keep(model):
            kwargs["logits_to_keep"] = 1
        model(**kwargs)
    finally:
        handle.remove()
    return captured["h"]


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    import inspect

    cls = type(model)
    cached = getattr(cls, "_dask_lm_logits_to_keep", None)
    if cached is None:
        cached = "logits_to_keep" in inspect.signature(cls.forward).parameters
        setattr(cls, "_dask_lm_logits_to_keep", cached)  # noqa: B010 (a per-class cache Module does not declare)
    return cached

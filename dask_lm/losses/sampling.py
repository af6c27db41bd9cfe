"""The sampler's filter on logits (top-k, then nucleus), shared by the losses' logprob helpers and the ranks'
logprob and generation code: pure tensor code, so ``dask_lm.losses`` depends on nothing of the workers."""

from __future__ import annotations

import torch

__all__ = ["apply_top_k_top_p"]


def apply_top_k_top_p(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Set logits outside the sampler's top-k / nucleus to -inf (rows are independent positions)."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the mass strictly before it already reaches top_p; the top token always stays
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits

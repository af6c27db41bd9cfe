"""The rank half of ``calibrate_qkv_fp8_scales``: how large each layer's query, key and value activations get.

NeMo RL calibrates FP8 KV-cache scales on its Megatron ranks: a forward hook on each layer's core attention sees
Q / K / V after the Q/K norms and RoPE, records ``amax(|x|)`` once per forward, and the percentile of those samples
(max over ranks) times a margin, over the FP8 e4m3 range, is the layer's scale. A Hugging Face decoder hands
exactly those tensors to its attention function (``attention_interface(module, query, key, value, mask, ...)``),
so here the forwards run under an attention implementation of our own, registered through
``transformers.AttentionInterface`` (no model code is patched): it records the three amaxes of the real tokens
(the padded tail of each row left out, by the micro-batch's lengths) and calls ``sdpa``'s function.

The forwards are eager (a compiled layer would trace the recording), one per micro-batch of
``micro_batch_size`` rows in order; dummy micro-batches that keep FSDP's collectives in step record nothing.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import torch

from dask_lm.data.messages import MicroBatchPlan
from dask_lm.data.tokens import TokenRows
from dask_lm.model import varlen

__all__ = ["NAME", "calibrate", "percentile_of"]

NAME = "dask_lm_qkv_calibration"
_LOCAL = threading.local()  # the recording of the forward running in this thread (None: not recording)


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """sdpa, recording each layer's q / k / v amax on the way (the mask and the rest pass through untouched)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    record = getattr(_LOCAL, "record", None)
    if record is not None:
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise ValueError(
                f"calibrate_qkv_fp8_scales: {type(module).__name__} has no `layer_idx`, so its scales "
                "cannot be named; it supports Hugging Face decoders whose attention modules carry one"
            )
        lengths = _LOCAL.lengths  # [B] on the device: rows are right-padded to the longest (and not masked)
        valid = (torch.arange(query.shape[2], device=query.device)[None, :] < lengths[:, None]).float()
        for name, t in (("q", query), ("k", key), ("v", value)):  # [B, heads, S, head_dim]
            per_position = t.detach().abs().amax(dim=(1, 3)).float()  # [B, S]
            record[layer][name].append((per_position * valid).amax())
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, *args, **kwargs)


def percentile_of(values: list[float], p: float) -> float:
    """NeMo RL's percentile of the samples: the sorted value at ``round(p / 100 * (n - 1))``; 0 without samples."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(p / 100.0 * (len(ordered) - 1))))]


def calibrate(
    rm: Any, rows: TokenRows, micro_batch_size: int | None, percentile: float, include_q: bool
) -> dict[int, dict[str, float]]:
    """This rank's ``{layer: {"q"?, "k", "v": percentile amax}}`` over its rows (``rm``: the rank's
    :class:`~dask_lm.workers.rank_model.RankModel`)."""
    varlen.register_attention(NAME, _attention)
    mbs = micro_batch_size or int(rm.cfg.logprob_batch_size or 1)
    plan = rm.plan_pass(rows, MicroBatchPlan(), mbs)  # rows in order, mbs each: never packed
    record: dict[int, dict[str, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
    try:
        with torch.no_grad(), varlen.attention_implementation(rm.model, NAME):
            for mb in plan:
                part = rows.slice(mb.start, mb.end)
                _LOCAL.record = None if mb.dummy else record
                _LOCAL.lengths = part.lengths.to(rm.device)
                try:
                    rm.forward_micro_batch(part, mb)  # eager: no compiled layers
                finally:
                    _LOCAL.record = _LOCAL.lengths = None
    finally:
        rm.end_pass()
    names = ("q", "k", "v") if include_q else ("k", "v")
    out: dict[int, dict[str, float]] = {}
    for layer, samples in sorted(record.items()):
        out[layer] = {
            n: percentile_of(torch.stack(samples[n]).tolist() if samples[n] else [], percentile) for n in names
        }
    return out

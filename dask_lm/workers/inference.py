"""The inference pass of a rank: micro-batches through the forward and a head, results back into host tensors.

``get_logprobs``, ``get_topk_logits`` and ``score`` differ only in what they compute from the final hidden states;
this module runs the loop they share, arranged so the GPU never waits for the host:

- everything the host needs to know about a micro-batch (lengths, packed offsets, which positions are scored,
  where each result goes) comes from the CPU copies of ``input_ids`` / ``input_lengths``
  (:func:`host_layout`), so no ``.item()``, ``nonzero`` or ``max()`` on a device tensor stalls the launch queue;
- a micro-batch's results are copied to page-locked host memory asynchronously and written into the output only
  after the next micro-batch has been launched (one micro-batch of lag), so the copy and the host-side scatter
  overlap the GPU's work instead of serialising with it.

Profiled on an H200 (``benchmarks/profile_forward.py``, Qwen2.5-0.5B, packed): the per-micro-batch host syncs had
left the GPU idle for 10% of the pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import record_function

from dask_lm.workers import device, fused, varlen
from dask_lm.workers.forward import MicroBatch, block_causal_mask, final_hidden_states, pack, unpack_positions

__all__ = ["HostLayout", "host_layout", "forward_rows", "run_pass"]


@dataclass
class HostLayout:
    """Where a micro-batch's tokens sit, computed on the host (CPU tensors)."""

    lens: torch.Tensor  # [b] int64
    width: int  # longest row
    cu: torch.Tensor | None = None  # packed: [b+1] int32 offsets
    position_ids: torch.Tensor | None = None  # packed: [1, T]
    packed_ids: torch.Tensor | None = None  # packed: [1, T]
    scored: tuple[torch.Tensor, torch.Tensor] | None = None  # (row, position) predicting a real next token
    valid: tuple[torch.Tensor, torch.Tensor] | None = None  # (row, position) of every real token


def host_layout(ids: torch.Tensor, lens: torch.Tensor, *, packed: bool) -> HostLayout:
    """The layout of rows ``ids [b, S]`` (CPU) with true lengths ``lens [b]``, packed into one row or padded."""
    lens = lens.to(torch.int64)
    width = int(lens.max())
    if packed:
        pids, pos, cu = pack(ids, lens)
        t = pids.shape[1]
        rows = torch.zeros(t, dtype=torch.int64)
        after = (pos[0, 1:] > 0).nonzero(as_tuple=True)[0]  # position p predicts p + 1 within its own row
        return HostLayout(lens, width, cu, pos, pids, (rows[: after.numel()], after), (rows, torch.arange(t)))
    valid = torch.arange(width)[None, :] < lens[:, None]
    return HostLayout(lens, width, scored=valid[:, 1:].nonzero(as_tuple=True), valid=valid.nonzero(as_tuple=True))


def forward_rows(model: torch.nn.Module, ids: torch.Tensor, lens: torch.Tensor, *, packed: bool, varlen_ok: bool,
                 where: torch.device, mask_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """Final hidden states of the rows ``ids [b, S]`` (host tensors, true lengths ``lens``), packed into one row or
    padded to the longest, and ``info``: the device tensors the heads and losses read (``ids``, ``lens``,
    ``valid``, ``targets_valid``, packed ``cu``), the host ``layout`` and the scored / valid positions uploaded
    (``scored``, ``valid_index``). Packed rows go through the varlen kernel when ``varlen_ok``, else through a
    block-diagonal mask (boolean, or additive in ``mask_dtype`` for eager attention)."""
    lay = host_layout(ids, lens, packed=packed)

    def up(t: torch.Tensor) -> torch.Tensor:
        return device.upload(t, where)

    d_lens = up(lay.lens)
    info: dict[str, Any]
    if packed:
        assert lay.packed_ids is not None and lay.position_ids is not None and lay.cu is not None
        pids, pos, cu = up(lay.packed_ids.to(torch.int64)), up(lay.position_ids), up(lay.cu)
        if varlen_ok:
            with varlen.packed_attention(model):
                hidden = final_hidden_states(model, pids, position_ids=pos, **varlen.packed_kwargs(cu, lay.width))
        else:
            mask = block_causal_mask(cu, pids.shape[1], additive_dtype=mask_dtype)
            hidden = final_hidden_states(model, pids, position_ids=pos, attention_mask=mask)
        info = {"ids": pids, "lens": d_lens, "cu": cu, "valid": torch.ones_like(pids, dtype=torch.bool),
                "targets_valid": pos > 0}
    else:
        d_ids = up(ids[:, : lay.width].to(torch.int64))
        valid = torch.arange(lay.width, device=where)[None, :] < d_lens[:, None]
        hidden = final_hidden_states(model, d_ids)
        info = {"ids": d_ids, "lens": d_lens, "valid": valid, "targets_valid": valid}
    assert lay.scored is not None and lay.valid is not None
    info.update(layout=lay, scored=tuple(up(t) for t in lay.scored), valid_index=tuple(up(t) for t in lay.valid))
    return hidden, info


@dataclass
class _Pending:
    mb: MicroBatch
    info: dict[str, Any]
    host: tuple[torch.Tensor, ...]
    done: Any


def _write(outs: tuple[torch.Tensor, ...], p: _Pending, per_row: bool) -> None:
    p.done.synchronize()  # this micro-batch's copies only; the next one keeps the GPU busy meanwhile
    layout: HostLayout = p.info["layout"]
    for out, value in zip(outs, p.host):
        if per_row:
            out[p.mb.start:p.mb.end] = value
        elif p.mb.packed:
            assert layout.cu is not None
            rows, cols = unpack_positions(layout.cu, layout.lens, out.shape[1])
            out[p.mb.start + rows, cols] = value[0]
        else:
            out[p.mb.start:p.mb.end, : value.shape[1]] = value


def run_pass(worker: Any, data: Any, meta: dict[str, Any], micro_batch_size: int | None,
             compute: Callable[[torch.Tensor, dict[str, Any]], tuple[torch.Tensor, ...]],
             outs: tuple[torch.Tensor, ...], *, per_row: bool = False) -> None:
    """Run every micro-batch of ``data`` through ``worker``'s forward and ``compute(hidden, info)``; write each
    result into the matching host tensor of ``outs``: per token (``[B, S, ...]``, from a padded ``[b, L, ...]`` or
    packed ``[1, T, ...]`` result) or, with ``per_row``, per row (``[B, ...]`` from ``[b, ...]``)."""
    pending: _Pending | None = None
    # the record_function ranges name the phases in a torch.profiler trace (benchmarks/profile_forward.py)
    try:
        for mb in worker._plan(data, meta, micro_batch_size):
            with record_function("dask_lm.decoder"):
                hidden, info = worker._inference_forward(data, mb)
            if mb.dummy or not info:
                continue
            with record_function("dask_lm.head"), fused.use_compiled(worker.compile):
                values = compute(hidden, info)
            with record_function("dask_lm.to_host"):
                host = tuple(v.to("cpu", non_blocking=True) for v in values)
                done = device.record_event()
                if pending is not None:
                    _write(outs, pending, per_row)
            pending = _Pending(mb, info, host, done)
        if pending is not None:
            with record_function("dask_lm.to_host"):
                _write(outs, pending, per_row)
    finally:
        worker._finish_pass()

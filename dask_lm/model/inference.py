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
from typing import Any, Protocol, TypedDict

import torch
from torch.profiler import record_function

from dask_lm.data.messages import MicroBatchPlan
from dask_lm.data.tokens import TokenRows
from dask_lm.model import device, fused, varlen
from dask_lm.model.forward import MicroBatch, block_causal_mask, final_hidden_states, unpack_positions

__all__ = ["HostLayout", "ForwardLayout", "PassRunner", "host_layout", "forward_rows", "run_pass"]


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


def host_layout(rows: TokenRows, *, packed: bool) -> HostLayout:
    """The layout of ``rows`` (host tensors), packed into one row or padded to the longest."""
    lens = rows.lengths
    width = int(lens.max())
    if packed:
        pids, pos, cu = rows.packed()  # the rows' own values and offsets: nothing is copied
        t = pids.shape[1]
        at_row = torch.zeros(t, dtype=torch.int64)
        after = (pos[0, 1:] > 0).nonzero(as_tuple=True)[0]  # position p predicts p + 1 within its own row
        return HostLayout(lens, width, cu, pos, pids, (at_row[: after.numel()], after), (at_row, torch.arange(t)))
    valid = torch.arange(width)[None, :] < lens[:, None]
    scored_row, scored_pos = valid[:, 1:].nonzero(as_tuple=True)  # a 2-d mask: one index tensor per dimension
    valid_row, valid_pos = valid.nonzero(as_tuple=True)
    return HostLayout(lens, width, scored=(scored_row, scored_pos), valid=(valid_row, valid_pos))


@dataclass(frozen=True, slots=True)
class ForwardLayout:
    """How a micro-batch went through the forward, for the heads and losses that read its final hidden states:
    the device tensors (uploaded from the host layout, so reading them never waits for the GPU) and the host
    layout itself. ``packed``: the rows were concatenated into one ``[1, T]`` sequence (``cu`` set)."""

    ids: torch.Tensor  # [b, L] padded, or [1, T] packed: the token ids the forward saw
    lens: torch.Tensor  # [b] true lengths
    valid: torch.Tensor  # same shape as ids: a real token
    targets_valid: torch.Tensor  # same shape as ids: a position whose next token is in the same row
    scored: tuple[torch.Tensor, torch.Tensor]  # (row, position) of the positions predicting a real next token
    valid_index: tuple[torch.Tensor, torch.Tensor]  # (row, position) of every real token
    host: HostLayout
    cu: torch.Tensor | None = None  # packed: [b+1] int32 offsets of the rows

    @property
    def packed(self) -> bool:
        return self.cu is not None


class _Positions(TypedDict):
    scored: tuple[torch.Tensor, torch.Tensor]
    valid_index: tuple[torch.Tensor, torch.Tensor]


def forward_rows(
    model: torch.nn.Module,
    rows: TokenRows,
    *,
    packed: bool,
    varlen_ok: bool,
    where: torch.device,
    mask_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, ForwardLayout]:
    """Final hidden states of ``rows`` (host tensors), packed into one row or padded to the longest, and their
    :class:`ForwardLayout`. Packed rows go through the varlen kernel when ``varlen_ok``, else through a
    block-diagonal mask (boolean, or additive in ``mask_dtype`` for eager attention). The ids go up as they are
    (``int32`` from the wire: half the bytes) and are widened on the device."""
    lay = host_layout(rows, packed=packed)

    def up(t: torch.Tensor) -> torch.Tensor:
        return device.upload(t, where)

    def positions() -> _Positions:
        assert lay.scored is not None and lay.valid is not None
        return {"scored": (up(lay.scored[0]), up(lay.scored[1])), "valid_index": (up(lay.valid[0]), up(lay.valid[1]))}

    d_lens = up(lay.lens)
    if packed:
        assert lay.packed_ids is not None and lay.position_ids is not None and lay.cu is not None
        pids, pos, cu = up(lay.packed_ids).to(torch.int64), up(lay.position_ids), up(lay.cu)
        if varlen_ok:
            with varlen.packed_attention(model):
                hidden = final_hidden_states(model, pids, position_ids=pos, **varlen.packed_kwargs(cu, lay.width))
        else:
            mask = block_causal_mask(cu, pids.shape[1], additive_dtype=mask_dtype)
            hidden = final_hidden_states(model, pids, position_ids=pos, attention_mask=mask)
        return hidden, ForwardLayout(
            pids, d_lens, torch.ones_like(pids, dtype=torch.bool), pos > 0, host=lay, cu=cu, **positions()
        )
    # a padded row's tail is never seen by its real tokens (causal attention, right padding): its value is any id
    d_ids = up(rows.padded(0, lay.width)).to(torch.int64)
    valid = torch.arange(lay.width, device=where)[None, :] < d_lens[:, None]
    hidden = final_hidden_states(model, d_ids)
    return hidden, ForwardLayout(d_ids, d_lens, valid, valid, host=lay, **positions())


class PassRunner(Protocol):
    """What :func:`run_pass` needs of a rank (:class:`~dask_lm.workers.rank_model.RankModel`)."""

    def compiled_now(self) -> bool: ...

    def plan_pass(self, data: Any, plan: MicroBatchPlan, micro_batch_size: int | None) -> list[MicroBatch]: ...

    def inference_forward(self, data: Any, mb: MicroBatch) -> tuple[torch.Tensor, ForwardLayout | None]: ...

    def end_pass(self) -> None: ...


@dataclass
class _Pending:
    mb: MicroBatch
    layout: ForwardLayout
    host: tuple[torch.Tensor, ...]
    done: Any


def _write(outs: tuple[torch.Tensor, ...], p: _Pending, per_row: bool) -> None:
    p.done.synchronize()  # this micro-batch's copies only; the next one keeps the GPU busy meanwhile
    layout = p.layout.host
    for out, value in zip(outs, p.host):
        if per_row:
            out[p.mb.start : p.mb.end] = value
        elif p.mb.packed:
            assert layout.cu is not None
            rows, cols = unpack_positions(layout.cu, layout.lens, out.shape[1])
            out[p.mb.start + rows, cols] = value[0]
        else:
            out[p.mb.start : p.mb.end, : value.shape[1]] = value


def run_pass(
    worker: PassRunner,
    data: Any,
    plan: MicroBatchPlan,
    micro_batch_size: int | None,
    compute: Callable[[torch.Tensor, ForwardLayout], tuple[torch.Tensor, ...]],
    outs: tuple[torch.Tensor, ...],
    *,
    per_row: bool = False,
) -> None:
    """Run every micro-batch of ``data`` through ``worker``'s forward and ``compute(hidden, layout)``; write each
    result into the matching host tensor of ``outs``: per token (``[B, S, ...]``, from a padded ``[b, L, ...]`` or
    packed ``[1, T, ...]`` result) or, with ``per_row``, per row (``[B, ...]`` from ``[b, ...]``)."""
    pending: _Pending | None = None
    # the record_function ranges name the phases in a torch.profiler trace (benchmarks/profile_forward.py)
    try:
        for mb in worker.plan_pass(data, plan, micro_batch_size):
            with record_function("dask_lm.decoder"):
                hidden, layout = worker.inference_forward(data, mb)
            if mb.dummy or layout is None:
                continue
            with record_function("dask_lm.head"), fused.use_compiled(worker.compiled_now()):
                values = compute(hidden, layout)
            with record_function("dask_lm.to_host"):
                host = tuple(v.to("cpu", non_blocking=True) for v in values)
                done = device.record_event()
                if pending is not None:
                    _write(outs, pending, per_row)
            pending = _Pending(mb, layout, host, done)
        if pending is not None:
            with record_function("dask_lm.to_host"):
                _write(outs, pending, per_row)
    finally:
        worker.end_pass()

"""What a training rank sends in a refit: its weights, whole and in the serving dtype, one by one or packed into
buckets. Every route (:mod:`dask_lm.refit.rank`, :mod:`dask_lm.refit.http`) reads them from here in the same order
on every rank, because under FSDP each whole tensor is an all-gather that all ranks must join.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from dask_lm.model import device
from dask_lm.model.weights import full_tensor, weight_names
from dask_lm.refit import buckets as bk

if TYPE_CHECKING:
    from dask_lm.config import PolicyConfig

__all__ = ["RefitHost", "refit_info", "iter_full_weights", "iter_buckets"]


class RefitHost(Protocol):
    """What a refit reads of the rank's model (:class:`~dask_lm.workers.rank_model.RankModel`), given to the
    :class:`~dask_lm.refit.rank.Refitter` when it is made."""

    cfg: PolicyConfig
    model: torch.nn.Module
    dtype: torch.dtype
    device: torch.device
    rank: int
    world_size: int
    keeps_fp32: bool  # training keeps fp32 weights (FSDP's fp32 shards or ``masters``) under a lower precision
    masters: Any  # the fp32 master weights of a single low-precision trainable rank (MasterWeights), else None

    def ensure_on_device(self) -> None: ...


def refit_info(worker: RefitHost) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """``{name: (full shape, dtype)}`` of what a refit sends: floating weights in the policy precision."""
    state = worker.model.state_dict()
    return {
        n: (torch.Size(state[n].shape), worker.dtype if state[n].is_floating_point() else state[n].dtype)
        for n in weight_names(worker.model)
    }


def iter_full_weights(worker: RefitHost, names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor in the serving dtype)`` in refit order. A collective per tensor under FSDP."""
    worker.ensure_on_device()
    info = refit_info(worker)
    state = worker.model.state_dict()
    for name in names or list(info):
        full = full_tensor(state[name].detach())
        yield name, full.to(info[name][1])


def iter_buckets(worker: RefitHost, plan: list[list[bk.Slot]], *, keep: bool) -> Iterator[torch.Tensor | None]:
    """Each bucket of ``plan`` packed into a fresh uint8 buffer on the device (None when ``keep`` is False: the
    rank still joins every all-gather but holds nothing). Fresh buffers, never reused: an engine may still read
    the previous one after answering (its load is queued on its stream, not finished)."""
    worker.ensure_on_device()  # first: state_dict() of a model parked on the host would hold the host tensors
    state = worker.model.state_dict()
    flat = None
    for bucket in plan:
        flat = None  # the previous bucket goes before the next is allocated (one bucket of memory, not two)
        flat = torch.empty(bk.bucket_nbytes(bucket), dtype=torch.uint8, device=worker.device) if keep else None
        for slot in bucket:
            full = full_tensor(state[slot.name].detach())
            if flat is not None:
                bk.write_slot(flat, slot, full.to(slot.dtype))
            del full
        device.synchronize()  # the bytes must be in place before a handle to them leaves the process
        yield flat

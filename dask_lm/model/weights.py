"""The model's weights as they leave a rank: which state-dict names, and each tensor whole.

Checkpoints (:mod:`dask_lm.workers.checkpointing`) and refit (:mod:`dask_lm.refit.source`) walk the same list in
the same order on every rank, because under FSDP each whole tensor is an all-gather that every rank must join.
"""

from __future__ import annotations

import torch

__all__ = ["weight_names", "full_tensor", "local_tensor"]


def weight_names(model: torch.nn.Module) -> list[str]:
    """State-dict names to save, without the second name of a tied (shared) parameter, as ``save_pretrained``."""
    seen: set[int] = set()
    names = []
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, t in model.state_dict(keep_vars=True).items():
        tensor = params.get(name, t)
        key = id(tensor)
        if key in seen:
            continue
        seen.add(key)
        names.append(name)
    return names


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an all-gather (every rank must call it, in the same order) for an FSDP DTensor."""
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if full_tensor is not None else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (the tensor itself when it is not a DTensor)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t

"""Optimizers, learning-rate schedulers and fp32 master weights, built from the policy config by class path.

The optimizer is ``policy.optimizer.{name, kwargs}`` (any ``torch.optim.Optimizer`` subclass by import path). The
scheduler is ``policy.scheduler``: one ``{name, kwargs}`` dict, or a list of them plus one ``{milestones: [...]}``
entry, which becomes a ``SequentialLR`` (NeMo RL's form); without one the learning rate stays constant.
:func:`dask_lm.config.optim.check_optim_config` resolves and binds all of it on the driver, so a typo fails before
any rank loads a model.

Low-precision training keeps fp32 master weights, as every serious trainer does: with bf16 parameters an AdamW
update of ``lr = 5e-6`` is below bf16's resolution for typical weights and would be lost entirely. With two or more
ranks FSDP2's ``MixedPrecisionPolicy`` does this (fp32 shards, bf16 compute). A single rank has no process group
to shard over, so :class:`MasterWeights` does the same by hand: the model keeps bf16 parameters for compute, an
fp32 copy of each is what the optimizer updates, and gradients accumulate in fp32 micro-batch by micro-batch.
FSDP2 over a one-member group would do the same with one code path, but measured on an H200 it is 10-25% slower
per step at 0.5B-1.5B for the same memory (``benchmarks/master_weights.py``; README), so one rank keeps this one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from dask_lm.config.optim import optimizer_class, resolve_class, scheduler_entries

__all__ = [
    "build_optimizer",
    "build_scheduler",
    "MasterWeights",
    "named_optimizer_state",
    "load_named_optimizer_state",
    "init_optimizer_state",
]


def build_optimizer(params: Iterable[torch.Tensor], cfg: Any) -> torch.optim.Optimizer:
    opt_cfg = cfg.optimizer
    assert opt_cfg is not None
    cls, kwargs = optimizer_class(opt_cfg)
    if isinstance(kwargs.get("betas"), list):  # YAML gives lists; Adam-family optimizers expect a tuple
        kwargs["betas"] = tuple(kwargs["betas"])
    from dask_lm.model import device  # here, not at the top: the driver imports this module for its checks

    params = list(params)
    # torch's Adam / AdamW / SGD default to their multi-tensor (foreach) step on a GPU; the fused one does the
    # whole update in one kernel per group. Chosen only for those three (others' fused support varies by torch
    # version) and only where the config leaves the implementation open.
    if (
        cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
        and not kwargs.get("differentiable")
        and "fused" not in kwargs
        and "foreach" not in kwargs
        and device.fused_optimizer_capable(params)
    ):
        kwargs["fused"] = True
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"`policy.optimizer.kwargs` do not fit {opt_cfg.name}: {e}") from e


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Any) -> torch.optim.lr_scheduler.LRScheduler:
    entries, milestones = scheduler_entries(cfg.scheduler)
    if not entries:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=_constant)
    built = []
    for path, kwargs, key in entries:
        cls = resolve_class(path, f"{key}.name")
        try:
            built.append(cls(optimizer, **kwargs))
        except (TypeError, ValueError) as e:
            raise ValueError(f"`{key}.kwargs` do not fit {path}: {e}") from e
    if len(built) == 1:
        return built[0]
    assert milestones is not None  # scheduler_entries requires them for several schedulers
    return torch.optim.lr_scheduler.SequentialLR(optimizer, schedulers=built, milestones=milestones)


def _constant(_step: int) -> float:  # module level, so the scheduler pickles
    return 1.0


class MasterWeights:
    """fp32 copies of a low-precision model's trainable parameters, for a rank without FSDP.

    The model computes in its own dtype; a post-accumulate-grad hook moves each parameter's gradient into its
    master's fp32 ``.grad`` (adding to what earlier micro-batches left) and frees the low-precision one. The
    optimizer steps the masters; :meth:`copy_to_model` writes them back, rounded to the model's dtype.
    """

    def __init__(self, model: torch.nn.Module, full_state: dict[str, torch.Tensor] | None = None) -> None:
        self.model_params: dict[str, torch.nn.Parameter] = {
            n: p for n, p in model.named_parameters() if p.requires_grad
        }
        self.masters: dict[str, torch.nn.Parameter] = {}
        for name, p in self.model_params.items():
            src = full_state[name] if full_state is not None and name in full_state else p.detach()
            self.masters[name] = torch.nn.Parameter(src.to(device=p.device, dtype=torch.float32, copy=True))
        self._by_param = {id(p): self.masters[n] for n, p in self.model_params.items()}
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate) for p in self.model_params.values()]
        self.copy_to_model()

    def _accumulate(self, p: torch.Tensor) -> None:
        master = self._by_param[id(p)]
        assert p.grad is not None  # a post-accumulate-grad hook runs once the gradient is in place
        if master.grad is None:
            master.grad = p.grad.to(torch.float32)
        else:
            master.grad.add_(p.grad)
        p.grad = None

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.masters.values())

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        return self.masters

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for name, p in self.model_params.items():
            p.copy_(self.masters[name])

    def to(self, where: str | torch.device) -> None:
        for m in self.masters.values():
            m.data = m.data.to(where)
            if m.grad is not None:
                m.grad = m.grad.to(where)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its optimizer state (Adam moments, step) without changing any weight, so that a
    checkpoint can be loaded into it in place: one step with zero gradients and a zero learning rate."""
    if optimizer.state:
        return
    saved = []
    for group in optimizer.param_groups:
        saved.append(group.get("lr"))
        if "lr" in group:
            group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
        for p in group["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, saved):
        if lr is not None:
            group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def named_optimizer_state(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by parameter name instead of position (the layout torch's
    ``get_optimizer_state_dict`` gives for FSDP models), so one checkpoint fits any number of ranks."""
    sd = optimizer.state_dict()
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    return {
        "state": {order[i]: dict(v) for i, v in sd["state"].items()},
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in sd["param_groups"]],
    }


def load_named_optimizer_state(optimizer: torch.optim.Optimizer, names: dict[int, str], state: dict[str, Any]) -> None:
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    index = {n: i for i, n in enumerate(order)}
    missing = [n for n in order if n not in state["state"]]
    if missing:
        raise ValueError(
            f"the optimizer checkpoint has no state for parameters {missing[:5]}: it was saved for a different model"
        )
    optimizer.load_state_dict(
        {
            "state": {index[n]: v for n, v in state["state"].items() if n in index},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
        }
    )

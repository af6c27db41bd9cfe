"""The optimizer and scheduler sections of the policy config, checked on the driver: class paths resolved and
keyword names bound against the constructors before any rank loads a model. The ranks build them from the same
entries (:mod:`dask_lm.workers.optim`)."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch

from dask_lm.config.equivalents import optimizer_substitute

__all__ = ["resolve_class", "bind_kwargs", "scheduler_entries", "check_optim_config", "optimizer_class"]


def resolve_class(path: str, key: str) -> type:
    """The class at import path ``path``; a ``ValueError`` naming config ``key`` when it cannot be imported."""
    if not isinstance(path, str) or "." not in path:
        raise ValueError(f"`{key}` must be a full import path such as 'torch.optim.AdamW', got {path!r}")
    module, _, name = path.rpartition(".")
    try:
        found: type = getattr(importlib.import_module(module), name)  # what it is, the caller checks
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(
            f"`{key}` = {path!r} cannot be imported ({e}); give a full import path such as 'torch.optim.AdamW'"
        ) from e
    return found


def optimizer_class(opt_cfg: Any) -> tuple[type, dict[str, Any]]:
    """The optimizer class and keyword arguments that run for ``policy.optimizer``: as named, or the torch
    equivalent of a faster implementation the config names (:mod:`dask_lm.config.equivalents`)."""
    name, kwargs = opt_cfg.name, dict(opt_cfg.kwargs)
    substitute = optimizer_substitute(name, kwargs)
    if substitute is not None:
        name, kwargs = substitute.name, dict(substitute.kwargs)
    return resolve_class(name, "policy.optimizer.name"), kwargs


def bind_kwargs(cls: type, kwargs: dict[str, Any], key: str, first: str) -> None:
    """Check that ``cls(<first>, **kwargs)`` would accept these keyword names (values are checked on build)."""
    try:
        inspect.signature(cls).bind(object(), **kwargs)
    except TypeError as e:
        allowed = [p for p in inspect.signature(cls).parameters if p != first]
        raise ValueError(f"`{key}` do not fit {cls.__module__}.{cls.__qualname__}: {e}; it accepts {allowed}") from None
    except ValueError:  # builtins without a signature: nothing to check here
        pass


def scheduler_entries(sched: Any) -> tuple[list[tuple[str, dict[str, Any], str]], list[int] | None]:
    """``[(class path, kwargs, config key)]`` and the SequentialLR milestones, from the dict or list form."""
    if sched is None:
        return [], None
    if isinstance(sched, dict):
        sched = [sched]
    if not isinstance(sched, list):
        raise ValueError(
            f"`policy.scheduler` must be a dict {{name, kwargs}} or a list of them, got {type(sched).__name__}"
        )
    entries, milestones = [], None
    for i, item in enumerate(sched):
        key = f"policy.scheduler[{i}]" if len(sched) > 1 else "policy.scheduler"
        if not isinstance(item, dict):
            raise ValueError(f"`{key}` must be a dict, got {item!r}")
        if "milestones" in item:
            if set(item) != {"milestones"} or not isinstance(item["milestones"], list):
                raise ValueError(f"`{key}` must be exactly {{milestones: [step, ...]}}, got {item!r}")
            milestones = [int(m) for m in item["milestones"]]
            continue
        unknown = set(item) - {"name", "kwargs"}
        if unknown or "name" not in item:
            raise ValueError(
                f"`{key}` needs `name` (a class path) and optional `kwargs`; unknown keys {sorted(unknown)}"
            )
        entries.append((item["name"], dict(item.get("kwargs") or {}), key))
    if len(entries) > 1 and milestones is None:
        raise ValueError(
            "`policy.scheduler` lists several schedulers but no {milestones: [...]} entry saying when "
            "each one takes over"
        )
    if milestones is not None and len(milestones) != len(entries) - 1:
        raise ValueError(
            f"`policy.scheduler` milestones {milestones} must have one entry fewer than the {len(entries)} schedulers"
        )
    return entries, milestones


def check_optim_config(cfg: Any) -> None:
    """Resolve the optimizer and scheduler classes and check their keyword names (driver side, no tensors)."""
    if cfg.optimizer is not None:
        cls, kwargs = optimizer_class(cfg.optimizer)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ValueError(f"`policy.optimizer.name` = {cfg.optimizer.name!r} is not a torch.optim.Optimizer")
        bind_kwargs(cls, kwargs, "policy.optimizer.kwargs", "params")
    entries, _ = scheduler_entries(cfg.scheduler)
    for path, kwargs, key in entries:
        cls = resolve_class(path, f"{key}.name")
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.lr_scheduler.LRScheduler)):
            raise ValueError(f"`{key}.name` = {path!r} is not a torch.optim.lr_scheduler.LRScheduler")
        bind_kwargs(cls, kwargs, f"{key}.kwargs", "optimizer")
    if cfg.max_grad_norm is not None and not cfg.max_grad_norm > 0:
        raise ValueError(f"`policy.max_grad_norm` must be > 0 or null (no clipping), got {cfg.max_grad_norm}")

"""The optimizer NeMo RL configs name by a faster implementation, and what dask-lm runs in its place: Transformer
Engine's ``FusedAdam`` (nine of NeMo RL's LLM recipe configs at 7ea279a name
``transformer_engine.pytorch.optimizers.fused_adam.FusedAdam``; its ``models/automodel/setup.py:806-819`` builds the
named class with the kwargs, "torch.bfloat16" strings made dtypes) becomes torch's ``AdamW`` or ``Adam``, which the
ranks build fused on GPUs (:func:`dask_lm.workers.optim.build_optimizer`). Plain data here, no torch: the config
check (:mod:`.keys`) says what happens before any rank starts, and the optimizer builders apply it.

What was checked, in Transformer Engine's ``transformer_engine/pytorch/optimizers/fused_adam.py`` (its docstring
and constructor): it "may be used as a drop-in replacement for ``torch.optim.AdamW``, or ``torch.optim.Adam`` with
``adam_w_mode=False``"; the defaults are ``lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
bias_correction=True, adam_w_mode=True, amsgrad=False`` (unsupported: it raises). Its update is
``p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)`` with ``m_hat = m / (1 - b1^t)``, ``v_hat = v / (1 - b2^t)``
in AdamW mode, and the gradient gets ``wd * p`` added first in L2 mode: term for term torch's AdamW (which scales
``p`` by ``1 - lr * wd`` before the same Adam step) and Adam with ``weight_decay``. Its other options are storage:
``master_weights`` / ``master_weight_dtype`` / ``store_param_remainders`` keep float32 master weights (the last as
the 16 bits a bf16 parameter lacks), which dask-lm keeps anyway for bf16 / fp16 training
(:mod:`dask_lm.workers.optim`); ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` store the moments in fewer bits, which
dask-lm does not (float32 moments: the same update with less rounding, twice their memory at bf16);
``capturable`` is for CUDA graphs and ``set_grad_none`` only changes ``zero_grad``. Torch's weight_decay default
(0.01 for AdamW) differs from FusedAdam's (0.0), so every default is passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["OptimizerSubstitute", "optimizer_substitute", "is_fused_adam"]

_DEFAULTS = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
_STORAGE = (
    "master_weights",
    "master_weight_dtype",
    "store_param_remainders",
    "exp_avg_dtype",
    "exp_avg_sq_dtype",
    "capturable",
    "set_grad_none",
    "use_decoupled_grad",
)


@dataclass(frozen=True)
class OptimizerSubstitute:
    """The torch optimizer that runs for a named one: its class path, keyword arguments, and what the config warning
    says about the swap."""

    name: str
    kwargs: dict[str, Any]
    description: str


def is_fused_adam(name: str) -> bool:
    """Transformer Engine's FusedAdam, under any of its import paths."""
    return name.startswith("transformer_engine.") and name.rpartition(".")[2] == "FusedAdam"


def _dtype_name(value: Any) -> str:
    return str(value).removeprefix("torch.")  # NeMo RL writes "torch.bfloat16" and resolves it itself


def optimizer_substitute(name: str, kwargs: dict[str, Any]) -> OptimizerSubstitute | None:
    """What runs for optimizer class ``name`` with ``kwargs``: None when it runs as named, else the substitute;
    a ``ValueError`` naming the keyword when an option has no torch equivalent."""
    if not isinstance(name, str) or not is_fused_adam(name):
        return None
    known = [*_DEFAULTS, "adam_w_mode", "bias_correction", "amsgrad", *_STORAGE]
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise ValueError(
            f"{unknown} are not keyword arguments of Transformer Engine's FusedAdam (it would refuse "
            f"them too); its keywords are {sorted(known)}"
        )
    if kwargs.get("bias_correction", True) is not True:
        raise ValueError(
            "FusedAdam's `bias_correction: false` has no torch equivalent (torch's Adam and AdamW always "
            "correct the moments' bias); remove it"
        )
    if kwargs.get("amsgrad", False):
        raise ValueError(
            "FusedAdam does not support `amsgrad` (it raises); remove it, or name torch.optim.AdamW with amsgrad: true"
        )
    adamw = kwargs.get("adam_w_mode", True) is not False
    torch_kwargs = {key: kwargs.get(key, default) for key, default in _DEFAULTS.items()}
    notes = []
    low = sorted(
        {
            _dtype_name(kwargs[k])
            for k in ("exp_avg_dtype", "exp_avg_sq_dtype")
            if k in kwargs and _dtype_name(kwargs[k]) not in ("float32", "float")
        }
    )
    if low:
        notes.append(
            f"its moments are kept in float32, not {'/'.join(low)} (the same update with less rounding; "
            "twice the moments' memory)"
        )
    if kwargs.get("master_weights") and _dtype_name(kwargs.get("master_weight_dtype", "float32")) != "float32":
        notes.append(
            "master weights are float32 (as dask-lm keeps them for bf16 / fp16 training), not "
            + _dtype_name(kwargs["master_weight_dtype"])
        )
    if kwargs.get("use_decoupled_grad"):
        notes.append("the gradients are read from .grad (use_decoupled_grad is for Megatron's optimizer)")
    cls = "torch.optim.AdamW" if adamw else "torch.optim.Adam"
    mode = "decoupled weight decay, adam_w_mode true" if adamw else "L2 weight decay, adam_w_mode false"
    description = f"Transformer Engine's FusedAdam runs as {cls} ({mode}: the same update), fused on GPU ranks"
    return OptimizerSubstitute(cls, torch_kwargs, "; ".join([description, *notes]))

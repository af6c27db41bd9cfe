"""The output head's reduction on a GPU through liger-kernel's cross-entropy Triton kernel: one read of the float32
``[n, V]`` logits for each row's logsumexp, its target's logit and whether the target is the row's argmax.

Why a kernel library here rather than :mod:`dask_lm.model.fused`'s compiled reduction: both make one pass over
the logits, but Inductor compiles that pass in every worker process (2-6 s per process before the first scored
row, which is why the scoring path ran the head eagerly below 8M tokens per worker), while Triton caches the
compiled kernel on disk (``~/.triton/cache``, or ``TRITON_CACHE_DIR``): the first process on a machine pays about a
second, later ones load it. ``benchmarks/head_kernels.py`` times eager, compiled and this kernel side by side.

What the kernel computes with ``HAS_GRADIENTS`` off (liger-kernel 0.8.5, ``liger_kernel/ops/cross_entropy.py``): an
online-softmax pass over each row in float32 giving ``loss = lse - x[target]`` (``reduction="none"``: one value per
row, no division), and with ``RETURN_TOKEN_ACCURACY`` ``1.0`` where the first index of the row's maximum equals the
target (lm-evaluation-harness's ``logits.argmax(-1) == continuation``). The logits are read, never written (the
in-place gradient store is the ``HAS_GRADIENTS`` branch), except for rows whose target equals ``ignore_index``,
which it zeroes: targets here are valid vocabulary ids, and ``ignore_index`` is -1, which none is.

We launch the kernel itself rather than liger's ``cross_entropy_forward``: that wrapper counts the non-ignored
rows with ``.item()`` and asserts the targets' range with two more, three host syncs per 1024-row chunk that stall
the pipelined scoring loop (the ranges are checked once per job on the driver already). The kernel's signature is
liger's internal API, so a call that does not match it (a newer liger) marks the kernel broken for the process and
the caller falls back to the compiled or eager reduction, with one warning. ``DASK_LM_LIGER=0`` turns it off; the
CPU path never uses it (CI checks the exact eager arithmetic).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch

__all__ = ["available", "pick_minus_lse", "pick_minus_lse_greedy"]

logger = logging.getLogger(__name__)
_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}  # "kernel": the Triton kernel or None, "block": BLOCK_SIZE cap, "warps": num_warps
_IGNORE = -1  # no valid target equals it (see above)


def _load() -> Any:
    with _LOCK:
        if "kernel" in _STATE:
            return _STATE["kernel"]
        kernel = None
        if os.environ.get("DASK_LM_LIGER", "1") != "0":
            try:
                from liger_kernel.ops import cross_entropy as ce

                kernel = ce.liger_cross_entropy_kernel
                _STATE["block"] = int(getattr(ce, "MAX_FUSED_SIZE", 32768))
            except Exception as e:  # not installed, or its import-time device probing failed
                logger.debug("liger-kernel unavailable (%s: %s)", type(e).__name__, e)
        _STATE["kernel"] = kernel
        return kernel


def available(logits: torch.Tensor) -> bool:
    """Whether the kernel can reduce ``logits``: float32, ``[n, V]`` with unit column stride, on a CUDA device, no
    gradient wanted, liger-kernel importable and not switched off or broken."""
    return (
        logits.is_cuda
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.stride(1) == 1
        and not (logits.requires_grad and torch.is_grad_enabled())
        and _load() is not None
    )


def _warps() -> int:
    # liger's choice for this kernel (its cross_entropy_forward): 32 warps on NVIDIA parts up to Hopper, where the
    # pass is bandwidth-bound; 8 for 2-byte inputs on Blackwell only, so float32 logits take 32 everywhere; 16 on
    # ROCm
    return 16 if torch.version.hip else 32


# what every launch asks of liger's cross-entropy kernel: the plain per-row loss, with no class weights, z-loss,
# smoothing, soft-capping, predicted tokens or gradients. The two counts only divide a "mean" loss: constant 1 here,
# as Triton specialises integer arguments (on divisibility by 16 and on 1), and the row count of a job's last chunk
# would otherwise compile a second variant
_FIXED: dict[str, Any] = {
    "weight_ptr": None,
    "z_loss_ptr": None,
    "loss_stride": 1,
    "predicted_tokens_ptr": None,
    "predicted_tokens_stride": 0,
    "n_non_ignore": 1,
    "sum_non_ignore_weight": 1,
    "weight_sum": 0.0,
    "ignore_index": _IGNORE,
    "lse_square_scale": 0.0,
    "label_smoothing": 0.0,
    "reduction": "none",
    "softcap": None,
    "RETURN_Z_LOSS": False,
    "RETURN_PREDICTED_TOKENS": False,
    "HAS_WEIGHT": False,
    "HAS_SOFTCAPPING": False,
    "HAS_GRADIENTS": False,
}


def _launch(logits: torch.Tensor, targets: torch.Tensor, greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    n, v = logits.shape
    targets = targets.contiguous()
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    hit = torch.empty(n, dtype=torch.float32, device=logits.device) if greedy else None
    block = min(_STATE["block"], 1 << max(v - 1, 1).bit_length())
    _STATE["kernel"][(n,)](
        X_ptr=logits,
        X_stride=logits.stride(0),
        Y_ptr=targets,
        Y_stride=targets.stride(0),
        loss_ptr=loss,
        token_accuracy_ptr=hit,
        token_accuracy_stride=1 if greedy else 0,
        n_cols=v,
        RETURN_TOKEN_ACCURACY=greedy,
        BLOCK_SIZE=block,
        num_warps=_warps(),
        **_FIXED,
    )
    return loss.neg_(), hit


def _call(logits: torch.Tensor, targets: torch.Tensor, greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    try:
        return _launch(logits, targets, greedy)
    except Exception as e:  # a signature this liger does not have, a Triton compile error: use the other paths
        with _LOCK:
            _STATE["kernel"] = None
        logger.warning(
            "liger-kernel's cross-entropy kernel failed (%s: %s); the head's reduction runs without it",
            type(e).__name__,
            e,
        )
        return None


def pick_minus_lse(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
    """``log_softmax(logits)[i, targets[i]]`` (float32 ``[n]``), or None where the kernel cannot run."""
    out = _call(logits, targets, False)
    return None if out is None else out[0]


def pick_minus_lse_greedy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`pick_minus_lse` and whether each target is its row's argmax (bool ``[n]``), or None."""
    out = _call(logits, targets, True)
    if out is None:
        return None
    lp, hit = out
    assert hit is not None
    return lp, hit > 0.5

"""A scoring replica's RMSNorms and gated (SwiGLU) MLPs through liger-kernel's Triton kernels, on one model
instance, where its decoder layers are not compiled.

Why: a small model's eager decoder is bound by its elementwise passes. HF's RMSNorm is six kernels (the float32
upcast, the square, the mean, the rsqrt, the product, the downcast, then the weight), its MLP's ``act(gate) * up``
two more, each a read and write of the activations. Compiling the layers fuses them (:mod:`dask_lm.model.fused`)
but costs 5-7 s per worker process even with Inductor's cache warm, which a job of a few million tokens does not
repay, so the scoring path runs its layers eagerly below 8M tokens per worker. liger-kernel's RMSNorm and SiLU-mul
kernels are one pass each and, compiled by Triton once per machine and kept on disk (``~/.triton/cache``), cost a
new process nothing. ``python benchmarks/profile_score.py --shape qwen2.5-0.5b`` (one H200, 4.34M tokens, the job's
37 partition tasks): model phase 16.44 s eager (27.8% MFU), 14.44 s with these kernels (31.7%), 12.92 s with the
layers compiled (35.4%, after 7.5 s of compilation).

What is patched: only module *instances* (never a transformers class, so another model in the process, or a
Policy's training layers, are untouched), and only the kinds whose arithmetic is the kernels':

- an RMSNorm of the Llama family (Llama, Mistral, Qwen2, Qwen3: ``weight * (x.float() * rsqrt(mean(x²) + eps))
  .to(dtype)``), which liger's ``"llama"`` casting mode computes in the same order (statistics in float32, the
  normalised row rounded to the input's dtype, then the weight's product). Gemma's ``1 + weight`` and float32
  weight product is another formula and is left alone;
- an MLP ``down(act(gate(x)) * up(x))`` whose activation is SiLU, as liger computes ``silu(gate)`` in float32,
  rounds it to the input's dtype and multiplies by ``up``, as the eager bf16 ops do.

Each patched forward calls liger's forward function directly (no autograd node: the replica only scores), and
falls back to the class's own forward where a gradient is wanted. Before the patch stays, one module of each kind
is run both ways on a probe input: an exception (another liger's internal API) or a difference beyond the dtype's
rounding leaves the model unpatched, with one warning. ``DASK_LM_LIGER=0`` turns it off; CPU models are never
patched (CI checks the exact eager arithmetic). :func:`unpatch` restores the class forwards, which
:meth:`dask_lm.scoring.replicas.Replica.compile` does before compiling (Inductor's fusion is faster still).
"""

from __future__ import annotations

import logging
import os
import types
from typing import Any

import torch

__all__ = ["targets", "patch", "unpatch"]

logger = logging.getLogger(__name__)

# the transformers classes whose forward is the formula above (each class checked against its modeling file)
_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
_PATCHED = "_dask_lm_liger"  # the instance attribute that marks a patched module


def _silu(act: Any) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def targets(model: torch.nn.Module) -> tuple[list[Any], list[Any]]:
    """The RMSNorms and MLPs of ``model`` whose arithmetic liger's kernels reproduce (see the module docstring).
    (``Any``: transformers' module classes, read by their attributes.)"""
    norms: list[Any] = []
    mlps: list[Any] = []
    for m in model.modules():
        kind, weight = type(m).__name__, getattr(m, "weight", None)
        if (
            kind in _NORMS
            and isinstance(weight, torch.Tensor)
            and weight.dim() == 1
            and isinstance(getattr(m, "variance_epsilon", None), float)
        ):
            norms.append(m)
        elif (
            kind in _MLPS
            and _silu(getattr(m, "act_fn", None))
            and all(isinstance(getattr(m, p, None), torch.nn.Linear) for p in ("gate_proj", "up_proj", "down_proj"))
        ):
            mlps.append(m)
    return norms, mlps


def _ops() -> tuple[Any, Any] | None:
    if os.environ.get("DASK_LM_LIGER", "1") == "0":
        return None
    try:
        from liger_kernel.ops.rms_norm import rms_norm_forward
        from liger_kernel.ops.swiglu import swiglu_forward
    except Exception as e:  # not installed, or its import-time device probing failed
        logger.debug("liger-kernel unavailable (%s: %s)", type(e).__name__, e)
        return None
    return rms_norm_forward, swiglu_forward


def _norm_forward(rms_norm_forward: Any) -> Any:
    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return type(self).forward(self, x)
        # liger's forward returns (y, x, rstd, block, warps, mode); row_mode None: its own per-row choice
        return rms_norm_forward(x.contiguous(), self.weight, self.variance_epsilon, 0.0, "llama", None)[0]

    return forward


def _mlp_forward(swiglu_forward: Any) -> Any:
    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return type(self).forward(self, x)
        return self.down_proj(swiglu_forward(self.gate_proj(x), self.up_proj(x))[2])

    return forward


def _agrees(want: Any, got: Any, width: int, like: torch.Tensor) -> bool:
    """Whether ``got(x)`` equals ``want(x)`` on a probe ``[64, width]`` input to within two units of the dtype's
    rounding: both round the same float32 values (only a sum's order differs). A different formula (Gemma's
    ``1 + weight``, another activation) is off by far more."""
    g = torch.Generator(device=like.device).manual_seed(0)
    x = torch.randn(64, width, device=like.device, dtype=like.dtype, generator=g)
    with torch.no_grad():
        w, o = want(x).float(), got(x).float()
    tol = 2 * torch.finfo(like.dtype).eps * w.abs() + 1e-6
    return bool(o.shape == w.shape and torch.isfinite(o).all() and ((o - w).abs() <= tol).all())


def patch(model: torch.nn.Module) -> int:
    """Route ``model``'s eligible RMSNorms and MLPs through liger's kernels (a CUDA model only); how many modules.
    0 where liger is missing or off, the model is on the CPU, or the probe disagrees (then nothing is patched)."""
    norms, mlps = targets(model)
    if (
        not (norms or mlps)
        or not all(m.weight.is_cuda for m in norms)
        or not all(m.gate_proj.weight.is_cuda for m in mlps)
    ):
        return 0
    ops = _ops()
    if ops is None:
        return 0
    norm_fwd, mlp_fwd = _norm_forward(ops[0]), _mlp_forward(ops[1])
    try:
        ok = all(
            _agrees(lambda x, n=n: type(n).forward(n, x), lambda x, n=n: norm_fwd(n, x), n.weight.shape[0], n.weight)
            for n in norms[:1]
        )
        # the MLP's own matmuls are the same calls either way: probe the gated product alone
        ok = ok and all(
            _agrees(
                lambda x, m=m: m.act_fn(x) * x.flip(0),
                lambda x: ops[1](x, x.flip(0))[2],
                m.up_proj.out_features,
                m.up_proj.weight,
            )
            for m in mlps[:1]
        )
    except Exception as e:  # another liger's signatures, a Triton compile error
        logger.warning(
            "liger-kernel's RMSNorm / SwiGLU kernels failed (%s: %s); the layers run eagerly", type(e).__name__, e
        )
        return 0
    if not ok:
        logger.warning(
            "liger-kernel's RMSNorm / SwiGLU kernels disagree with this model's forward on a probe; "
            "the layers run eagerly"
        )
        return 0
    for modules, fwd in ((norms, norm_fwd), (mlps, mlp_fwd)):
        for m in modules:
            m.forward = types.MethodType(fwd, m)
            setattr(m, _PATCHED, True)
    return len(norms) + len(mlps)


def unpatch(model: torch.nn.Module) -> int:
    """Undo :func:`patch` on ``model`` (the class forwards again); how many modules."""
    n = 0
    for m in model.modules():
        if m.__dict__.pop(_PATCHED, False):
            m.__dict__.pop("forward", None)
            n += 1
    return n

"""The training head: next-token logprobs through the output projection, with a backward written for it.

Autograd's way (what ``torch.utils.checkpoint`` over chunks of the head did here before) keeps the head's memory
flat, but pays for it: in the backward every chunk reruns its whole forward (the ``[c, V]`` matmul, the float32
upcast, the logsumexp, the gather) and then autograd's backward of ``log_softmax`` + ``gather`` + ``float`` +
``linear``, several ``[c, V]`` temporaries in all. The gradient of ``lp = z[t] - logsumexp(z)`` is closed-form,
``d lp / d z = onehot(t) - softmax(z)``, so this function saves what makes the backward cheap instead:

- forward, per chunk of rows: float32 logits (``torch.mm(..., out_dtype=float32)`` for half-precision weights on a
  GPU, so they are never rounded to bf16), their logsumexp and the target's logit; it keeps only the logsumexp
  (4 bytes a row) besides the inputs it already holds;
- backward, per chunk: the logits again (one matmul), the closed-form gradient ``(onehot(t) - exp(z - lse))``
  scaled by the incoming one in one compiled pass that writes it in the weight's dtype
  (:func:`dask_lm.model.fused.logprob_grad`; eager on the CPU), then the two matmuls for the hidden states and
  the weight (whose gradient accumulates over the chunks in place, in the weight's dtype, as autograd's did).

The forward's logsumexp and target pick are one compiled pass too (:func:`dask_lm.model.fused.pick_and_logsumexp`):
the eager chain read and wrote float32 ``[chunk, V]`` logits five times in the backward and three in the forward,
which at a 0.5B model's 152k vocabulary and 896 hidden size cost more than the head's matmuls.

The gradient comes from the loss, so any per-token weighting (policy-gradient advantages, importance ratios,
masks) is exact. liger-kernel's fused linear cross-entropy computes its gradients in the forward for a mean / sum
reduction (then scales them by the scalar upstream gradient); with ``reduction="none"`` (0.8.5) it defers them to
the backward and folds the per-token upstream gradient in, as this function does, with a Triton kernel for the
softmax gradient. Measured on an H200 (``benchmarks/profile_train.py --head-variants``, Qwen2.5-0.5B head, 16k
tokens, forward + backward): this function 69 ms, liger 102 ms, the checkpointed autograd path 109 ms; liger's
values carry the bf16 logits' rounding (3.9e-3 max error against float64, this function's 3.0e-6). Used for the
unfiltered head (no top-k / top-p, no soft-capping); the other cases keep the checkpointed autograd path.
"""

from __future__ import annotations

from typing import Any

import torch

from dask_lm.model import device, fused

__all__ = ["linear_logprobs"]


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: float) -> torch.Tensor:
    """float32 ``[c, V]``: ``(h @ W.T + b) * scale``, without a half-precision rounding where the device can."""
    if h.dtype != torch.float32 and device.fp32_logits_capable(h.dtype) and h.is_cuda:
        z = torch.mm(h, weight.t(), out_dtype=torch.float32)
    else:
        z = torch.mm(h, weight.t()).float()
    if bias is not None:
        z += bias.float()
    if scale != 1.0:
        z *= scale
    return z


class _LinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        scale: float,
        chunk: int,
    ) -> torch.Tensor:
        n = h.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=h.device)
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = _logits(h[s:e], weight, bias, scale)
            out[s:e], lse[s:e] = fused.pick_and_logsumexp(z, targets[s:e])  # one pass over z on a GPU
            del z
        ctx.save_for_backward(h, weight, bias, targets, lse)
        ctx.scale, ctx.chunk = scale, chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        h, weight, bias, targets, lse = ctx.saved_tensors
        scale, chunk = ctx.scale, ctx.chunk
        n = h.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(h) if need_h else None
        # the weight's gradient accumulates over the chunks in place, in its own dtype (addmm: each chunk's
        # product is added in float32 inside the GEMM, then rounded once), as autograd summed the chunks before;
        # a float32 accumulator would hold two more [V, H] copies on the rank (2.2 GB each at a 7B vocabulary)
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        g = grad_out.float()
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = _logits(h[s:e], weight, bias, scale)
            if grad_b is not None:  # need_b: the bias's gradient sums the float32 one, before it is rounded to
                # the weight's dtype
                dz32 = fused.logprob_grad(z, lse[s:e], g[s:e], targets[s:e], scale=scale)
                grad_b += dz32.sum(0)
                dz = dz32.to(weight.dtype)
                del dz32
            else:  # one fused pass on a GPU: reads z once, writes the gradient once in the weight's dtype
                dz = fused.logprob_grad(z, lse[s:e], g[s:e], targets[s:e], scale=scale, dtype=weight.dtype)
            del z
            if grad_h is not None:  # need_h
                grad_h[s:e] = torch.mm(dz, weight)
            if grad_w is not None:  # need_w
                grad_w.addmm_(dz.t(), h[s:e])
        if grad_b is not None and bias is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None


def linear_logprobs(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    scale: float = 1.0,
    chunk_size: int | None = 1024,
) -> torch.Tensor:
    """float32 ``[N]``: ``log_softmax((h @ W.T + b) * scale)[i, targets[i]]`` with gradients for ``h``, ``W`` and
    ``b``, computed ``chunk_size`` rows at a time (``None``: all at once) without keeping any ``[N, V]`` tensor."""
    chunk = max(1, min(chunk_size or h.shape[0], h.shape[0])) if h.shape[0] else 1
    return _LinearLogprob.apply(h, weight, bias, targets, float(scale), chunk)

"""Compiled kernels on GPUs: the heads' logsumexp and softmax-gradient passes, and the decoder layers (inference and
training).

Where the time goes without them (``benchmarks/profile_forward.py``, one H200, random Qwen2.5-0.5B in bf16, packed
32k-token micro-batches, share of the wall time): decoder 55%, output head 39% (logsumexp 22%, fp32 upcast 9%,
lm_head matmul 8%), GPU idle 6%. The head spent four times its matmul on memory passes over ``[n, V]`` logits:
write bf16, read it and write float32, read that twice for the max and the sum of exponentials. The decoder of a
small model is bound by its elementwise kernels (RMSNorm in float32, rotary embeddings, SiLU, residual adds),
each a separate pass over the activations.

Two measures, both PyTorch's own machinery (no hand-written kernels, nothing patched into model code):

- **Head**: the matmul writes float32 logits directly (``torch.mm(..., out_dtype=torch.float32)``: the bf16
  products accumulate in fp32 and the result is never rounded to bf16), and one compiled reduction
  reads them once for the target's logit and the logsumexp. 2.4x faster than the eager head on the H200, and its
  error against a float64 head is 3e-6, where bf16 logits give 4e-3.
  Where liger-kernel is installed (the ``cuda`` extra), that pass at temperature 1 is its Triton kernel instead
  (:mod:`dask_lm.model.liger_head`): 10% faster than the compiled one and, cached on disk by Triton, without
  Inductor's seconds of compilation in every worker process, so the scoring path gets the fast head on jobs too
  short to repay a compile.
- **Decoder**: every decoder layer is compiled (``nn.Module.compile``, regional: all layers share one graph) with
  dynamic shapes, so long-tailed lengths do not recompile. Inductor fuses the elementwise chains; 37% less decoder
  time at 0.5B, 28% at 1.5B.

Compiled code runs only where it is asked for: the inference forwards (logprobs, top-k, scores) and the training
forwards (their backward is compiled with them, through AOTAutograd) on a GPU. Generation runs the same layers
eagerly: each compiled layer dispatches, per call, on a per-thread switch that only :func:`use_compiled` turns on
(a thread-local flag, not the compiler's process-wide stance, which two worker threads could leave in the wrong
state, and which would also switch off other code's compilation).
On FSDP-sharded ranks FSDP's all-gather hooks run eagerly around each compiled layer (the usual per-block
compilation). The CPU path does not compile unless a policy asks for it (``inference_compile: true`` /
``train_compile: true``, as two tests do), so CI checks the exact eager arithmetic. ``DASK_LM_COMPILE=0`` turns all
of it off.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from dask_lm.model import device, liger_head

__all__ = [
    "enabled",
    "compile_errors",
    "pick_minus_logsumexp",
    "pick_minus_logsumexp_greedy",
    "logsumexp",
    "pick_and_logsumexp",
    "logprob_grad",
    "compile_decoder_layers",
    "use_compiled",
    "call",
]

logger = logging.getLogger(__name__)
_LOCK = threading.Lock()
_COMPILED: dict[str, Callable[..., Any]] = {}
_BROKEN: set[str] = set()
_T = TypeVar("_T")


class _Switch(threading.local):
    """Per thread: None outside :func:`use_compiled` (compiled head where capable, eager layers), else its
    argument."""

    compiled: bool | None = None


_SWITCH = _Switch()


def _options() -> dict[str, Any]:
    """Inductor options for every compile here. Inductor's mix-order reduction (RMSNorm's backward: the weight's
    gradient sums over tokens while the input's sums over the hidden size, fused into one kernel) is chosen by a
    size heuristic that, under dynamic shapes, becomes a guard on the token count of the first micro-batch a
    process compiles for (``nrow * hidden >= 5 * 2**20`` and ``nrow >= 4096``: 5851 tokens at Qwen2.5-0.5B). A
    later micro-batch on the other side of it recompiled every layer (seconds, mid-training; stop 21's
    ``benchmarks/train.py``). Non-strict mode skips those size checks (the fusion is made for any size), so one
    graph serves every micro-batch. Set only where this torch has the option (elsewhere the guard stays)."""
    import torch._inductor.config as inductor_config

    if hasattr(getattr(inductor_config, "triton", None), "mix_order_reduction_non_strict_mode"):
        return {"triton.mix_order_reduction_non_strict_mode": True}
    return {}


def enabled() -> bool:
    return device.compile_capable()


def _pick_minus_lse(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)


def _pick_minus_lse_greedy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # "the target's logit is the row's max", from the max the logsumexp takes anyway: one reduction pass, where
    # argmax was a second (6% of a 0.5B scoring forward on an H200). It differs from lm-evaluation-harness's
    # ``logits.argmax(-1) == continuation`` only on an exact tie of two float32 logits, where argmax takes the first
    picked = logits.gather(1, targets[:, None]).squeeze(1)
    top = logits.amax(dim=-1)
    lse = top + torch.log(torch.exp(logits - top[:, None]).sum(dim=-1))
    return picked - lse, picked >= top


def _lse(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature != 1.0:
        logits = logits / temperature
    return torch.logsumexp(logits, dim=-1)


def _pick_and_lse(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lse = torch.logsumexp(logits, dim=-1)
    return logits.gather(1, targets[:, None]).squeeze(1) - lse, lse


def _logprob_grad(
    logits: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, targets: torch.Tensor, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    # d lp / d z = onehot(t) - softmax(z), times the incoming gradient and the logits' scale (chain rule)
    onehot = torch.arange(logits.shape[1], device=logits.device)[None, :] == targets[:, None]
    return ((onehot.to(logits.dtype) - torch.exp(logits - lse[:, None])) * (grad * scale)[:, None]).to(dtype)


def compile_errors() -> tuple[type[BaseException], ...]:
    """What a failed compilation raises (a missing compiler, an unsupported op), as opposed to a runtime error."""
    errors: list[type[BaseException]] = [torch._dynamo.exc.TorchDynamoException]
    inductor_error = getattr(getattr(torch, "_inductor", None), "exc", None)
    if inductor_error is not None and hasattr(inductor_error, "InductorError"):
        errors.append(inductor_error.InductorError)
    return tuple(errors)


def _compilable(t: torch.Tensor) -> bool:
    return _SWITCH.compiled is not False and enabled() and t.is_cuda


def _run(name: str, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` compiled on a GPU (once per process, dynamic shapes), eager elsewhere or if compiling fails."""
    if name in _BROKEN or not _compilable(args[0]):
        return fn(*args)
    with _LOCK:
        compiled = _COMPILED.get(name)
        if compiled is None:
            compiled = _COMPILED[name] = torch.compile(fn, dynamic=True, options=_options())
    try:
        return compiled(*args)
    except compile_errors() as e:
        _BROKEN.add(name)
        logger.warning("torch.compile failed for %s (%s: %s); running it eagerly", name, type(e).__name__, e)
        return fn(*args)


def _own(t: torch.Tensor) -> torch.Tensor:
    # a slice of a longer tensor would make the compiled code guard on the base's length (duck sizing) and
    # recompile when the chunking changes; an own copy of a chunk's [n] vector costs nothing
    return t.clone() if t._base is not None else t


def pick_minus_logsumexp(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / temperature)[i, targets[i]]`` for float32 ``[n, V]`` logits: float32 ``[n]``.
    One fused pass over the logits on a GPU (no ``[n, V]`` temporaries): liger-kernel's Triton kernel at
    temperature 1 where it is installed (:mod:`dask_lm.model.liger_head`), else the compiled reduction; the plain
    expression on the CPU."""
    if temperature == 1.0 and liger_head.available(logits):
        out = liger_head.pick_minus_lse(logits, targets)
        if out is not None:
            return out
    return _run("pick_minus_lse", _pick_minus_lse, logits, _own(targets), float(temperature))


def pick_minus_logsumexp_greedy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pick_minus_logsumexp` at temperature 1, and whether each target is the argmax of its row (bool
    ``[n]``): the two reductions over the logits in one pass on a GPU (liger-kernel's, else compiled). liger's
    argmax is the first index of the row's maximum, lm-evaluation-harness's exactly; the compiled and eager
    reductions count a tie with the maximum as greedy."""
    if liger_head.available(logits):
        out = liger_head.pick_minus_lse_greedy(logits, targets)
        if out is not None:
            return out
    return _run("pick_minus_lse_greedy", _pick_minus_lse_greedy, logits, _own(targets))


def logsumexp(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``logsumexp(logits / temperature, -1)``, fused on a GPU like :func:`pick_minus_logsumexp`."""
    return _run("lse", _lse, logits, float(temperature))


def pick_and_logsumexp(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_softmax(logits)[i, targets[i]], logsumexp(logits, -1))`` for float32 ``[n, V]`` logits, in one pass
    over them on a GPU (the training head's forward, :mod:`dask_lm.model.linear_logprob`)."""
    return _run("pick_and_lse", _pick_and_lse, logits, _own(targets))


def logprob_grad(
    logits: torch.Tensor,
    lse: torch.Tensor,
    grad: torch.Tensor,
    targets: torch.Tensor,
    *,
    scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The gradient of ``lp[i] = log_softmax(z)[i, targets[i]]``, ``z = scale * x``, with respect to ``x``, from the
    float32 scaled logits ``z [n, V]``, their ``lse`` and the incoming ``grad [n]``:
    ``(onehot(t) - exp(z - lse)) * grad * scale`` in ``dtype``. On a GPU one compiled pass reads the logits once
    and writes the result once in the weight's dtype, where the eager chain made five ``[n, V]`` float32 passes
    (the training head's backward, :mod:`dask_lm.model.linear_logprob`)."""
    return _run("logprob_grad", _logprob_grad, logits, _own(lse), _own(grad), _own(targets), float(scale), dtype)


def compile_decoder_layers(model: torch.nn.Module, *, anywhere: bool = False) -> int:
    """Compile the decoder layers of ``model`` for forwards inside :func:`use_compiled`; the number compiled (0 when
    the model has no ``layers`` list or compiling is off here). Outside it (generation, or where a config turns
    compiling off) the layers keep running eagerly. ``anywhere``: also on the CPU (Inductor's C++ backend), when a
    policy asks for it explicitly (``inference_compile`` / ``train_compile: true``); ``DASK_LM_COMPILE=0`` still
    wins.

    What ``nn.Module.compile`` does (``_compiled_call_impl = torch.compile(_call_impl)``: regional compilation,
    one graph shared by every layer, module hooks such as FSDP's inside the call) with one difference: the call
    goes to the compiled code only while this thread is inside ``use_compiled(True)``."""
    from dask_lm.model.forward import decoder_of

    if not (enabled() or (anywhere and os.environ.get("DASK_LM_COMPILE", "1") != "0")):
        return 0
    layers = getattr(decoder_of(model), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        return 0
    for layer in layers:
        compiled = torch.compile(layer._call_impl, dynamic=True, options=_options())
        layer._compiled_call_impl = functools.partial(_dispatch, compiled, layer._call_impl)
    return len(layers)


def _dispatch(compiled: Callable[..., Any], eager: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return compiled(*args, **kwargs) if _SWITCH.compiled else eager(*args, **kwargs)


def call(compiled: bool, fn: Callable[[], Any], what: str) -> tuple[Any, bool]:
    """``fn()`` inside :func:`use_compiled`; a compilation that fails (no C compiler, an op Inductor cannot lower)
    is logged and ``fn`` runs again eagerly. Returns ``(result, whether compiled code stays on)``; errors of ``fn``
    itself propagate."""
    if compiled:
        try:
            with use_compiled(True):
                return fn(), True
        except compile_errors() as e:
            logger.warning("compiling %s failed (%s: %s); it runs eagerly from now on", what, type(e).__name__, e)
    with use_compiled(False):
        return fn(), False


@contextlib.contextmanager
def use_compiled(compiled: bool) -> Iterator[None]:
    """Inside (this thread only), compiled layers and head reductions run when ``compiled``, eagerly otherwise."""
    before = _SWITCH.compiled
    _SWITCH.compiled = bool(compiled)
    try:
        yield
    finally:
        _SWITCH.compiled = before

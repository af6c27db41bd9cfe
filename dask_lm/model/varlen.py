"""Packed micro-batches through a variable-length attention kernel, registered with transformers.

A packed micro-batch is one ``[1, T]`` row holding several sequences back to back. On the CPU it runs with a dense
block-diagonal ``[1, 1, T, T]`` mask (exact, and CI has no GPU); on a GPU that mask costs O(T^2) memory and turns
attention into a dense kernel over mostly masked blocks (27 ms per layer for a 31k-token row on an H200, against
0.5 ms for a varlen kernel). Here the packed forward instead runs under the attention implementation
``"dask_lm_varlen"``:

- registered through ``transformers.AttentionInterface`` (no model code is patched): it reshapes Hugging Face's
  ``[1, heads, T, head_dim]`` query / key / value to ``[T, heads, head_dim]`` and calls PyTorch's
  ``torch.nn.attention.varlen.varlen_attn`` (flash attention keyed by ``cu_seqlens``, causal, GQA);
- the sequence boundaries reach it as the ``cu_seq_lens_q`` / ``max_length_q`` keyword arguments that Hugging Face
  decoders pass through to their attention functions (the flash-attention convention);
- its mask function returns no mask, so no ``[T, T]`` tensor is ever built.

The model keeps its configured implementation (``sdpa``) for every other forward (plain micro-batches, KV-cached
generation): :func:`packed_attention` switches the implementation for one forward only.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "NAME",
    "available",
    "attention_implementation",
    "packed_attention",
    "packed_kwargs",
    "register_attention",
]

NAME = "dask_lm_varlen"
_REGISTERED = False
# the kernel's options, read at registration: a plain global that torch.compile can trace through (it would
# break the graph on inspect.signature inside every layer)
_OPTIONS: dict[Any, tuple[dict[str, Any], bool]] = {}


def _varlen_attn() -> Any:
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


@functools.cache
def _kernel_options(fn: Any) -> tuple[dict[str, Any], bool]:
    """How the installed torch's kernel spells causal masking (``window_size=(-1, 0)`` from 2.12, ``is_causal``
    before) and whether it takes ``enable_gqa``; read once per kernel, not in every layer's call."""
    params = inspect.signature(fn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return causal, "enable_gqa" in params


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    cu = kwargs.get("cu_seq_lens_q")
    assert cu is not None, "dask_lm_varlen runs only packed forwards, which pass cu_seq_lens_q"
    assert query.shape[0] == 1, "a packed micro-batch is one row"
    fn = _varlen_attn()
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, head_dim]
    options = _OPTIONS.get(fn)
    if options is None:  # a kernel swapped in after registration (tests)
        options = _OPTIONS[fn] = _kernel_options(fn)
    causal, takes_gqa = options
    extra: dict[str, Any] = dict(causal)
    if k.shape[1] != q.shape[1]:  # grouped-query attention: fewer key/value heads than query heads
        if takes_gqa:
            extra["enable_gqa"] = True
        else:  # torch 2.11's kernel has no GQA switch: give every query head its key/value head
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    max_len = int(kwargs["max_length_q"])
    out = fn(q, k.contiguous(), v.contiguous(), cu, cu, max_len, max_len, scale=scaling, **extra)
    return out[None], None  # [1, T, heads, head_dim], as Hugging Face's attention functions return


def _no_mask(*_args: Any, **_kwargs: Any) -> None:
    return None


def _register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    fn = _varlen_attn()
    _OPTIONS[fn] = _kernel_options(fn)
    register_attention(NAME, _attention, _no_mask)
    _REGISTERED = True


def register_attention(name: str, attention: Callable[..., Any], mask: Callable[..., Any] | None = None) -> None:
    """Register ``attention`` with transformers as the implementation ``name`` (what
    :func:`attention_implementation` switches a model to), with ``mask`` as its mask function (``None``: sdpa's).
    A later call with the same name replaces the registration."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] if mask is None else mask)


def available(dtype: torch.dtype) -> bool:
    """Whether packed forwards in ``dtype`` can use the varlen kernel here: flash attention on a capable GPU
    (:func:`dask_lm.model.device.flash_attention_capable`) and a torch that ships ``torch.nn.attention.varlen``.
    ``DASK_LM_VARLEN=0`` keeps the dense mask (for comparisons)."""
    import os

    from dask_lm.model import device

    if os.environ.get("DASK_LM_VARLEN", "1") == "0" or not device.flash_attention_capable(dtype):
        return False
    try:
        _varlen_attn()
    except ImportError:
        return False
    return True


def packed_kwargs(cu_seqlens: torch.Tensor, max_len: int) -> dict[str, Any]:
    """The keyword arguments a packed forward passes down to the attention function (flash-attention names);
    ``max_len`` (the longest sequence) comes from the host, so reading it does not wait for the GPU."""
    return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": max_len, "max_length_k": max_len}


@contextlib.contextmanager
def packed_attention(model: torch.nn.Module) -> Iterator[None]:
    """Run the forwards inside under ``dask_lm_varlen``, then restore the model's own implementation.

    The implementation is a field of the model's config, shared by every thread: two threads' packed forwards on
    one model therefore take turns (a per-model lock). Without it the first to finish would restore ``sdpa`` under
    the other's remaining layers, which would then attend across the packed sequences: wrong values, no error. A
    plain forward running meanwhile in another thread fails loudly instead (the kernel asserts its boundaries)."""
    _register()
    with attention_implementation(model, NAME):
        yield


@contextlib.contextmanager
def attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """The forwards inside run under the registered attention implementation ``name`` (the model's config and
    its text sub-config), under the model's lock; the model's own implementation is restored after."""
    with _model_lock(model):
        configs = _configs(model)
        before = [c._attn_implementation for c in configs]
        try:
            for c in configs:
                c._attn_implementation = name
            yield
        finally:
            for c, impl in zip(configs, before):
                c._attn_implementation = impl


_LOCKS_LOCK = threading.Lock()


def _model_lock(model: torch.nn.Module) -> threading.RLock:
    with _LOCKS_LOCK:
        lock = model.__dict__.get("_dask_lm_packed_lock")
        if lock is None:
            lock = model.__dict__["_dask_lm_packed_lock"] = threading.RLock()
        return lock


def _configs(model: torch.nn.Module) -> list[Any]:
    """The model's config and its text sub-config (where attention layers read the implementation from)."""
    cfg: Any = model.config  # a transformers PretrainedConfig (Module's __getattr__ types it Tensor | Module)
    out = [cfg]
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if text is not cfg:
        out.append(text)
    return out

"""Limits on what a model's ``config.json`` may ask for, checked from its JSON before anything is built.

A config is a few hundred bytes that decide how much memory every worker allocates: ``"vocab_size": 1000000000``
on a 64-wide model asks each worker for a 256 GB embedding, which it would try to allocate long after the cluster
started (swapping, or killed by its nanny). The driver refuses such a config up front (exit 2), naming the key and
the file. Each limit sits far above every released model, so that none is refused, and far below what would need
more memory than a machine holds:

- sizes, wherever they appear (the top level and every nested config, ``text_config`` included):
  ``vocab_size`` <= 2**24 (16.8M; the largest real vocabularies are about 262k), ``hidden_size`` / ``n_embd`` /
  ``d_model`` <= 2**17 (131,072; real ones reach 16-25k), ``intermediate_size`` and its aliases <= 2**20 (real ones
  under 110k), layers <= 2**12 (real models: under 200), attention heads, ``head_dim`` and experts <= 2**14,
  ``max_position_embeddings`` / ``n_positions`` <= 2**28 (the longest real contexts are about 10M);
- an estimate of the parameters each nested config describes, summed: embeddings (``vocab_size x hidden`` twice,
  as if untied, plus a learned position table), and per layer the attention projections and one dense MLP (three
  ``hidden x intermediate`` matrices) <= 2**41 (2.2 trillion, 4.4 TB in bf16). Mixture-of-experts layers are
  counted as one dense MLP, so the estimate of a real model stays below its true size; the largest dense open
  model has 0.4 trillion parameters;
- nesting depth <= 100 (real configs: under 10; a deeper one exhausts the recursion of the code that reads it).

Values that are not numbers are left to transformers, which reads the config next.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["MAX_DEPTH", "MAX_PARAMETERS", "LIMITS", "check_config_limits", "json_depth"]

MAX_DEPTH = 100
MAX_PARAMETERS = 2**41

_VOCAB = ("vocab_size", "padded_vocab_size")
_HIDDEN = ("hidden_size", "n_embd", "d_model")
_INTERMEDIATE = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "moe_intermediate_size")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_HEADS = ("num_attention_heads", "n_head", "num_key_value_heads", "head_dim")
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")
_POSITIONS = ("max_position_embeddings", "n_positions")

LIMITS: dict[str, int] = {
    **dict.fromkeys(_VOCAB, 2**24),
    **dict.fromkeys(_HIDDEN, 2**17),
    **dict.fromkeys(_INTERMEDIATE, 2**20),
    **dict.fromkeys(_LAYERS, 2**12),
    **dict.fromkeys(_HEADS, 2**14),
    **dict.fromkeys(_EXPERTS, 2**14),
    **dict.fromkeys(_POSITIONS, 2**28),
}
"""The largest value each size key may have (see the module docstring for why each is safe)."""


def json_depth(obj: Any) -> int:
    """How deeply ``obj`` (parsed JSON) nests: 0 for a scalar, 1 for a flat object or list. Iterative, so that a
    deep value cannot exhaust the recursion it is measured to protect."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_config_limits(cfg: dict[str, Any], where: str) -> None:
    """``ValueError`` naming ``where`` (the file, or the setting the values came from) and the key when ``cfg``
    nests deeper than :data:`MAX_DEPTH`, a size exceeds its :data:`LIMITS`, or the parameters the sizes describe
    exceed :data:`MAX_PARAMETERS`."""
    depth = json_depth(cfg)
    if depth > MAX_DEPTH:
        raise ValueError(
            f"{where} nests {depth} levels deep (more than {MAX_DEPTH}; real model configs nest fewer "
            "than 10): not a model config dask-lm will read; restore it (re-download the model, or save "
            "it again with save_pretrained)"
        )
    total = 0
    for path, section in _sections(cfg, ""):
        for key, limit in LIMITS.items():
            value = _number(section.get(key))
            if value is not None and value > limit:
                raise ValueError(
                    f"{where}: {path}{key} = {value:,} is larger than any model dask-lm can load (limit "
                    f"{limit:,}; real models stay far below it): the config is damaged or not meant "
                    "to be loaded; fix the value"
                )
        total += _parameters(section)
    if total > MAX_PARAMETERS:
        raise ValueError(
            f"{where}: its sizes describe about {total:.3g} parameters (from {_described(cfg)}), more "
            f"than any machine holds (limit {MAX_PARAMETERS:.3g}): the config is damaged or not meant "
            "to be loaded; fix the sizes"
        )


def _sections(cfg: dict[str, Any], prefix: str) -> list[tuple[str, dict[str, Any]]]:
    """``cfg`` and every object nested in it, with the dotted path that leads there (``text_config.``)."""
    out, stack = [], [(prefix, cfg)]
    while stack:
        path, section = stack.pop()
        out.append((path, section))
        stack.extend((f"{path}{k}.", v) for k, v in section.items() if isinstance(v, dict))
    return out


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return value


def _first(section: dict[str, Any], keys: tuple[str, ...]) -> float:
    for key in keys:
        value = _number(section.get(key))
        if value is not None and value > 0:
            return value
    return 0


def _parameters(section: dict[str, Any]) -> int:
    """The parameters one config section's sizes describe (0 without a hidden size): see the module docstring."""
    hidden = _first(section, _HIDDEN)
    if not hidden:
        return 0
    heads, kv_heads, head_dim = (
        _first(section, (k,)) for k in ("num_attention_heads", "num_key_value_heads", "head_dim")
    )
    query = heads * head_dim if heads and head_dim else hidden
    key_value = kv_heads * head_dim if kv_heads and head_dim else query
    layer = hidden * (2 * query + 2 * key_value) + 3 * hidden * _first(section, _INTERMEDIATE)
    embeddings = hidden * (2 * _first(section, _VOCAB) + _first(section, _POSITIONS))
    return int(embeddings + _first(section, _LAYERS) * layer)


def _described(cfg: dict[str, Any]) -> str:
    sizes = [
        f"{path}{key} = {value:,}"
        for path, section in _sections(cfg, "")
        for key in (*_VOCAB, *_HIDDEN, *_INTERMEDIATE, *_LAYERS)
        if (value := _number(section.get(key))) is not None
    ]
    return ", ".join(sizes[:6])

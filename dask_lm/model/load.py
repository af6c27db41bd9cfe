"""A scoring replica's weights, from safetensors to the device at the speed of the read.

``from_pretrained`` is general: it maps legacy key names, dequantises, shards, offloads and warns about missing
keys, and for a plain checkpoint of a known architecture that generality costs most of a replica's load (on an
H200, 11.4 s of a 0.5B model's 13.9 s cold start, for 1 GB of weights: ``benchmarks/model_load.py`` gives the
phases). The common case needs none of it: the file's tensor names are the model's own state-dict names.

:func:`load_causal_lm` takes that case directly. The model is built from its config on the target device with the
random initialisation skipped (transformers' ``no_init_weights``: the parameters are allocated, never filled, and
the buffers a module computes in its constructor, such as rotary frequencies, are computed there as usual), its
tied parameters are tied, and every tensor of the files is copied once into the parameter of its name, converted to
the model's dtype on the way (the same round-to-nearest-even cast ``from_pretrained`` applies). Anything else falls
back to ``from_pretrained`` unchanged, so that its own handling (and its own error messages) apply: a quantised
config, modules it keeps in float32, ``.bin`` weights, a file name the model does not have, a model tensor no file
holds, a shape that differs.
The two give the same state dict, bit for bit (``tests/test_model_load.py``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from dask_lm.io import modelcheck

__all__ = ["load_causal_lm", "load_pretrained", "direct_files"]

logger = logging.getLogger(__name__)


def load_causal_lm(model_dir: str, dtype: torch.dtype, where: torch.device) -> Any:
    """``AutoModelForCausalLM`` of ``model_dir`` in ``dtype`` on ``where``, in eval mode: loaded directly where the
    files allow it (see the module docstring), through ``from_pretrained`` otherwise."""
    return load_pretrained(model_dir, dtype, where)


def load_pretrained(
    model_dir: str,
    dtype: torch.dtype,
    where: torch.device,
    *,
    config: Any = None,
    auto: Any = None,
    attn_implementation: str | None = None,
) -> Any:
    """``auto.from_pretrained(model_dir, config=config, dtype=dtype, attn_implementation=...)`` on ``where``, in eval
    mode, loaded directly where the files allow it. ``auto`` defaults to ``AutoModelForCausalLM``, ``config`` to the
    directory's own (a Policy passes its config with ``hf_config_overrides`` applied)."""
    import transformers

    auto = auto or transformers.AutoModelForCausalLM
    spec = _Spec(auto, config, attn_implementation)
    files = direct_files(model_dir)
    model = _direct(model_dir, files, dtype, where, spec) if files else None
    return model if model is not None else _from_pretrained(model_dir, dtype, where, spec)


@dataclass(frozen=True)
class _Spec:
    """What a load builds besides the directory and dtype: the auto class, the config, the attention kernel."""

    auto: Any
    config: Any
    attn_implementation: str | None

    def kwargs(self) -> dict[str, Any]:
        """The attention kernel where one was asked for (the loads themselves say ``trust_remote_code=False``)."""
        return {} if self.attn_implementation is None else {"attn_implementation": self.attn_implementation}


def direct_files(model_dir: str) -> list[str] | None:
    """The safetensors files ``from_pretrained`` would read (:func:`dask_lm.io.modelcheck.weight_files`, in its
    order of preference: one file, or an index's shards); ``None`` where it would read ``.bin`` weights, which the
    direct path leaves to it."""
    files = modelcheck.weight_files(model_dir)
    if files[0] not in (modelcheck.SAFETENSORS, modelcheck.SAFETENSORS_INDEX):
        return None
    return [os.path.join(model_dir, f) for f in files if f.endswith(".safetensors")]


def _no_init_weights() -> Any:
    try:  # transformers 5
        from transformers.initialization import no_init_weights
    except ImportError:  # 4.57
        from transformers.modeling_utils import no_init_weights  # type: ignore[attr-defined,no-redef]
    return no_init_weights()


def _direct(model_dir: str, files: list[str], dtype: torch.dtype, where: torch.device, spec: _Spec) -> Any:
    """The direct load, or ``None`` (with the reason logged) where the files need ``from_pretrained``'s handling."""
    import transformers
    from safetensors import safe_open

    config = spec.config or transformers.AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    if getattr(config, "quantization_config", None) is not None:
        logger.debug("%s: a quantised config; loading through from_pretrained", model_dir)
        return None
    with _no_init_weights(), torch.device(where):
        model = spec.auto.from_config(config, dtype=dtype, trust_remote_code=False, **spec.kwargs())
    if getattr(model, "_keep_in_fp32_modules", None) or getattr(model, "_keep_in_fp32_modules_strict", None):
        logger.debug("%s: modules kept in float32; loading through from_pretrained", model_dir)
        return None
    model.tie_weights()  # no_init_weights also skips init_weights, which is where some versions tie
    targets = model.state_dict(keep_vars=True)  # tied names alias one tensor
    owner: dict[int, str] = {}  # each distinct tensor -> the file name that fills it
    headers: dict[str, tuple[str, list[int]]] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safetensors' safe_open is no mapping: keys() is all it has)
                headers[name] = (path, list(f.get_slice(name).get_shape()))
    for name, (_, shape) in headers.items():
        dst = targets.get(name)
        if dst is None or list(dst.shape) != shape:
            logger.debug(
                "%s: %s is %s in the files and %s in the model; loading through from_pretrained",
                model_dir,
                name,
                shape,
                None if dst is None else list(dst.shape),
            )
            return None
        owner.setdefault(id(dst), name)
    unfilled = [n for n, t in targets.items() if id(t) not in owner]
    if unfilled:
        logger.debug("%s: no file holds %s; loading through from_pretrained", model_dir, unfilled[:5])
        return None
    by_file: dict[str, list[str]] = {}
    for name in owner.values():
        by_file.setdefault(headers[name][0], []).append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(path, framework="pt") as f:
                for name in names:
                    targets[name].copy_(f.get_tensor(name))
    model.config.name_or_path = model_dir  # as from_pretrained records it
    _generation_config(model, model_dir)
    return model.eval()


def _generation_config(model: Any, model_dir: str) -> None:
    """The directory's ``generation_config.json`` as the model's generation config, where the model generates: what
    ``from_pretrained`` reads too (its eos ids stop generation; a checkpoint saves it back)."""
    import transformers

    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path) and getattr(model, "can_generate", lambda: False)():
        # the file read as from_pretrained reads it (a generation config holds no code to trust or refuse)
        with open(path, encoding="utf-8") as f:
            model.generation_config = transformers.GenerationConfig.from_dict(json.load(f))


def _from_pretrained(model_dir: str, dtype: torch.dtype, where: torch.device, spec: _Spec) -> Any:
    """``from_pretrained``'s own load. On a GPU straight to the device: a one-device ``device_map`` makes
    transformers place each loaded tensor where it goes. Some transformers versions want ``accelerate`` for any
    ``device_map`` (5.24 does, 5.17 does not); without it, and on a CPU, the model loads on the host and moves."""
    given = {"config": spec.config} if spec.config is not None else {}
    if where.type != "cpu":
        try:
            return spec.auto.from_pretrained(
                model_dir, dtype=dtype, device_map={"": where}, trust_remote_code=False, **given, **spec.kwargs()
            ).eval()
        except (ImportError, ValueError) as e:
            if "accelerate" not in str(e):
                raise
    model = spec.auto.from_pretrained(model_dir, dtype=dtype, trust_remote_code=False, **given, **spec.kwargs())
    return model.to(where).eval()

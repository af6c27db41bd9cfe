"""Make ``import nemo_rl....`` resolve to dask-lm, so code and tests written for NeMo RL run unchanged.

>>> from dask_lm.compat.nemo_rl import install
>>> install()
>>> from nemo_rl.distributed.batched_data_dict import BatchedDataDict   # dask_lm's class

Only the modules dask-lm implements are aliased: the batch / sharding layer (with the Policy's ``NamedSharding``),
the packing algorithms, and the losses with their helpers (under both the flat ``nemo_rl.algorithms.loss_functions``
of earlier releases and the ``nemo_rl.algorithms.loss`` package of later ones).
``install`` refuses to shadow a real NeMo RL installation unless ``force=True``.
"""

from __future__ import annotations

import sys
import types

__all__ = ["install", "ALIASES"]


def _module(name: str, source: object, names: list[str] | tuple[str, ...]) -> types.ModuleType:
    mod = types.ModuleType(name)
    for n in names:
        setattr(mod, n, getattr(source, n))
    return mod


def _loss_modules() -> dict[str, types.ModuleType]:
    from dask_lm import losses
    from dask_lm.engine import metrics

    everything = losses.__all__
    interfaces = ("LossFunction", "LossType", "LossInputType", "MetricNormalizer")
    helpers = ("masked_mean", "calculate_kl")
    model_utils = (
        "get_logprobs_from_logits",
        "get_next_token_logprobs_from_logits",
        "get_distillation_topk_logprobs_from_logits",
    )
    utils = _module("nemo_rl.algorithms.utils", losses, helpers)
    dist_utils = _module("nemo_rl.distributed.model_utils", losses, model_utils)
    return {
        "nemo_rl.algorithms": types.ModuleType("nemo_rl.algorithms"),
        "nemo_rl.algorithms.utils": utils,
        "nemo_rl.algorithms.loss_functions": _module("nemo_rl.algorithms.loss_functions", losses, everything),
        "nemo_rl.algorithms.loss": _module("nemo_rl.algorithms.loss", losses, everything),
        "nemo_rl.algorithms.loss.interfaces": _module("nemo_rl.algorithms.loss.interfaces", losses, interfaces),
        "nemo_rl.algorithms.loss.loss_functions": _module("nemo_rl.algorithms.loss.loss_functions", losses, everything),
        "nemo_rl.algorithms.loss.loss_input": _module(
            "nemo_rl.algorithms.loss.loss_input", losses, ("prepare_loss_input",)
        ),
        "nemo_rl.distributed.model_utils": dist_utils,
        "nemo_rl.utils": types.ModuleType("nemo_rl.utils"),
        "nemo_rl.utils.timer": _module("nemo_rl.utils.timer", metrics, ("Timer",)),
        "nemo_rl.utils.flops_tracker": _module("nemo_rl.utils.flops_tracker", metrics, ("FLOPTracker",)),
    }


def _modules() -> dict[str, types.ModuleType]:
    from dask_lm.data import batch, named_sharding, packing, sharding

    batched = types.ModuleType("nemo_rl.distributed.batched_data_dict")
    for name in ("BatchedDataDict", "SlicedDataDict"):
        setattr(batched, name, getattr(batch, name))
    for name in ("DynamicBatchingArgs", "SequencePackingArgs"):
        setattr(batched, name, getattr(sharding, name))
    named = _module("nemo_rl.distributed.named_sharding", named_sharding, ("NamedSharding",))
    algorithms = types.ModuleType("nemo_rl.data.packing.algorithms")
    for name in packing.__all__:
        setattr(algorithms, name, getattr(packing, name))
    pkg = types.ModuleType("nemo_rl.data.packing")
    for name in packing.__all__:
        setattr(pkg, name, getattr(packing, name))
    pkg.algorithms = algorithms  # type: ignore[attr-defined]
    return {
        **_loss_modules(),
        "nemo_rl": types.ModuleType("nemo_rl"),
        "nemo_rl.distributed": types.ModuleType("nemo_rl.distributed"),
        "nemo_rl.distributed.batched_data_dict": batched,
        "nemo_rl.distributed.named_sharding": named,
        "nemo_rl.data": types.ModuleType("nemo_rl.data"),
        "nemo_rl.data.packing": pkg,
        "nemo_rl.data.packing.algorithms": algorithms,
    }


ALIASES = (
    "nemo_rl.distributed.batched_data_dict",
    "nemo_rl.distributed.named_sharding",
    "nemo_rl.data.packing",
    "nemo_rl.data.packing.algorithms",
    "nemo_rl.algorithms.loss_functions",
    "nemo_rl.algorithms.loss",
    "nemo_rl.algorithms.utils",
    "nemo_rl.distributed.model_utils",
    "nemo_rl.utils.timer",
    "nemo_rl.utils.flops_tracker",
)


def install(force: bool = False) -> None:
    """Register the aliases in ``sys.modules``."""
    if not force and "nemo_rl" in sys.modules and not getattr(sys.modules["nemo_rl"], "_dask_lm_alias", False):
        raise RuntimeError("a real nemo_rl package is already imported; pass force=True to shadow it")
    mods = _modules()
    for name, mod in mods.items():
        mod._dask_lm_alias = True  # type: ignore[attr-defined]
        mod.__path__ = []  # a package, so submodule imports resolve
        if force or name not in sys.modules:
            sys.modules[name] = mod
    for name, _mod in mods.items():  # parent.child attributes, as a real import would set them
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, sys.modules[name])

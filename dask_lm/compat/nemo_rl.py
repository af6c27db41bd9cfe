"""Make ``import nemo_rl....`` resolve to dask-lm, so code and tests written for NeMo RL run unchanged.

>>> from dask_lm.compat.nemo_rl import install
>>> install()
>>> from nemo_rl.distributed.batched_data_dict import BatchedDataDict   # dask_lm's class

Only the modules dask-lm implements are aliased: the batch / sharding layer and the packing algorithms.
``install`` refuses to shadow a real NeMo RL installation unless ``force=True``.
"""

from __future__ import annotations

import sys
import types

__all__ = ["install", "ALIASES"]


def _modules() -> dict[str, types.ModuleType]:
    from dask_lm.engine import batch, packing, sharding

    batched = types.ModuleType("nemo_rl.distributed.batched_data_dict")
    for name in ("BatchedDataDict", "SlicedDataDict"):
        setattr(batched, name, getattr(batch, name))
    for name in ("DynamicBatchingArgs", "SequencePackingArgs"):
        setattr(batched, name, getattr(sharding, name))
    algorithms = types.ModuleType("nemo_rl.data.packing.algorithms")
    for name in packing.__all__:
        setattr(algorithms, name, getattr(packing, name))
    pkg = types.ModuleType("nemo_rl.data.packing")
    for name in packing.__all__:
        setattr(pkg, name, getattr(packing, name))
    pkg.algorithms = algorithms  # type: ignore[attr-defined]
    return {
        "nemo_rl": types.ModuleType("nemo_rl"),
        "nemo_rl.distributed": types.ModuleType("nemo_rl.distributed"),
        "nemo_rl.distributed.batched_data_dict": batched,
        "nemo_rl.data": types.ModuleType("nemo_rl.data"),
        "nemo_rl.data.packing": pkg,
        "nemo_rl.data.packing.algorithms": algorithms,
    }


ALIASES = ("nemo_rl.distributed.batched_data_dict", "nemo_rl.data.packing", "nemo_rl.data.packing.algorithms")


def install(force: bool = False) -> None:
    """Register the aliases in ``sys.modules``."""
    if not force and "nemo_rl" in sys.modules and not getattr(sys.modules["nemo_rl"], "_dask_lm_alias", False):
        raise RuntimeError("a real nemo_rl package is already imported; pass force=True to shadow it")
    mods = _modules()
    for name, mod in mods.items():
        mod._dask_lm_alias = True  # type: ignore[attr-defined]
        mod.__path__ = []  # type: ignore[attr-defined]  # a package, so submodule imports resolve
        if force or name not in sys.modules:
            sys.modules[name] = mod
    for name, mod in mods.items():  # parent.child attributes, as a real import would set them
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, sys.modules[name])

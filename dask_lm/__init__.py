"""dask-lm: language-model policy work (logprobs, top-k, scores, training, refit) on the GPUs of a Dask cluster.

The public API mirrors NVIDIA NeMo RL's ``Policy``; see ``dask_lm.Policy`` and ``dask_lm.connect``.

The names below are imported on first use (PEP 562), not with the package: ``import dask_lm`` and the
``dask-lm`` command's ``--help`` / ``--version`` then cost milliseconds instead of the seconds that torch,
transformers and distributed take to import. ``from dask_lm import Policy`` and ``dask_lm.Policy`` work as
before; a type checker or an IDE reads the imports under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "PolicyConfig": "dask_lm.config",
    "BatchedDataDict": "dask_lm.data.batch",
    "DynamicBatchingArgs": "dask_lm.data.batch",
    "SequencePackingArgs": "dask_lm.data.batch",
    "SlicedDataDict": "dask_lm.data.batch",
    "connect": "dask_lm.engine.cluster",
    "demo_data": "dask_lm.demo",
    "demo_model": "dask_lm.demo",
    "PackingAlgorithm": "dask_lm.data.packing",
    "get_packer": "dask_lm.data.packing",
    "Policy": "dask_lm.engine.policy",
    "PolicyFuture": "dask_lm.engine.futures",
    "set_progress": "dask_lm.engine.progress",
    "ScoreResult": "dask_lm.scoring.result",
    "score_parquet": "dask_lm.scoring.job",
    "score": "dask_lm.scoring.frame",
    "read_scores": "dask_lm.io.results",
    "BatchError": "dask_lm.errors",
    "FLOPTracker": "dask_lm.engine.metrics",
    "Timer": "dask_lm.engine.metrics",
    "RankFailedError": "dask_lm.errors",
    "WorkerLostError": "dask_lm.errors",
    "RefitError": "dask_lm.errors",
    **{
        name: "dask_lm.losses"
        for name in (
            "ClippedPGLossConfig",
            "ClippedPGLossFn",
            "DistillationLossConfig",
            "DistillationLossFn",
            "DPOLossConfig",
            "DPOLossFn",
            "LossFunction",
            "LossInputType",
            "LossType",
            "NLLLoss",
            "NLLLossFn",
            "PreferenceLossFn",
            "calculate_kl",
            "masked_mean",
            "prepare_loss_input",
        )
    },
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dask_lm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from dask_lm.config import PolicyConfig
    from dask_lm.data.batch import BatchedDataDict, DynamicBatchingArgs, SequencePackingArgs, SlicedDataDict
    from dask_lm.data.packing import PackingAlgorithm, get_packer
    from dask_lm.demo import demo_data, demo_model
    from dask_lm.engine.cluster import connect
    from dask_lm.engine.futures import PolicyFuture
    from dask_lm.engine.metrics import FLOPTracker, Timer
    from dask_lm.engine.policy import Policy
    from dask_lm.engine.progress import set_progress
    from dask_lm.errors import BatchError, RankFailedError, RefitError, WorkerLostError
    from dask_lm.io.results import read_scores
    from dask_lm.losses import (
        ClippedPGLossConfig,
        ClippedPGLossFn,
        DistillationLossConfig,
        DistillationLossFn,
        DPOLossConfig,
        DPOLossFn,
        LossFunction,
        LossInputType,
        LossType,
        NLLLoss,
        NLLLossFn,
        PreferenceLossFn,
        calculate_kl,
        masked_mean,
        prepare_loss_input,
    )
    from dask_lm.scoring.frame import score
    from dask_lm.scoring.job import score_parquet
    from dask_lm.scoring.result import ScoreResult

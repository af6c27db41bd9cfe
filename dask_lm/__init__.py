"""dask-lm: language-model policy work (logprobs, top-k, scores, training, refit) on the GPUs of a Dask cluster.

The public API mirrors NVIDIA NeMo RL's ``Policy``; see ``dask_lm.Policy`` and ``dask_lm.connect``.
"""

from __future__ import annotations

from dask_lm.config import PolicyConfig
from dask_lm.engine.batch import BatchedDataDict, DynamicBatchingArgs, SequencePackingArgs, SlicedDataDict
from dask_lm.engine.cluster import connect
from dask_lm.engine.packing import PackingAlgorithm, get_packer
from dask_lm.engine.policy import Policy
from dask_lm.engine.progress import set_progress
from dask_lm.engine.scoring import ScoreResult, score_parquet
from dask_lm.engine.sharding import BatchError
from dask_lm.engine.metrics import FLOPTracker, Timer
from dask_lm.engine.worker_group import RankFailedError, WorkerLostError
from dask_lm.workers.refit import RefitError
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

__version__ = "0.1.0"

__all__ = [
    "BatchError",
    "ClippedPGLossConfig",
    "ClippedPGLossFn",
    "DPOLossConfig",
    "DPOLossFn",
    "DistillationLossConfig",
    "DistillationLossFn",
    "FLOPTracker",
    "LossFunction",
    "LossInputType",
    "LossType",
    "NLLLoss",
    "NLLLossFn",
    "PreferenceLossFn",
    "Timer",
    "calculate_kl",
    "masked_mean",
    "prepare_loss_input",
    "BatchedDataDict",
    "DynamicBatchingArgs",
    "PackingAlgorithm",
    "Policy",
    "PolicyConfig",
    "RankFailedError",
    "WorkerLostError",
    "RefitError",
    "ScoreResult",
    "SequencePackingArgs",
    "SlicedDataDict",
    "connect",
    "score_parquet",
    "set_progress",
    "get_packer",
    "__version__",
]

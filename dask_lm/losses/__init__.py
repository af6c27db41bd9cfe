"""Training losses (NeMo RL's ``LossFunction`` contract): NLL, DPO, clipped policy gradient, distillation.

This is a package rather than DESIGN.md's single ``workers/losses.py``: the losses are public API that users
import and subclass, they are pure tensor code (no worker state), and together they are well past one file's size.
"""

from dask_lm.losses.base import (
    BaseLoss,
    LossBatch,
    LossConfig,
    LossFunction,
    LossInputType,
    LossType,
    MetricNormalizer,
    calculate_kl,
    masked_mean,
)
from dask_lm.losses.distillation import DistillationLossConfig, DistillationLossFn
from dask_lm.losses.loss_input import (
    get_distillation_topk_logprobs_from_logits,
    get_logprobs_from_logits,
    get_next_token_logprobs_from_logits,
    prepare_loss_input,
)
from dask_lm.losses.policy_gradient import ClippedPGLossConfig, ClippedPGLossFn
from dask_lm.losses.supervised import DPOLossConfig, DPOLossFn, NLLLoss, NLLLossFn, PreferenceLossFn

__all__ = [
    "BaseLoss",
    "ClippedPGLossConfig",
    "ClippedPGLossFn",
    "DPOLossConfig",
    "DPOLossFn",
    "DistillationLossConfig",
    "DistillationLossFn",
    "LossBatch",
    "LossConfig",
    "LossFunction",
    "LossInputType",
    "LossType",
    "MetricNormalizer",
    "NLLLoss",
    "NLLLossFn",
    "PreferenceLossFn",
    "calculate_kl",
    "get_distillation_topk_logprobs_from_logits",
    "get_logprobs_from_logits",
    "get_next_token_logprobs_from_logits",
    "masked_mean",
    "prepare_loss_input",
]

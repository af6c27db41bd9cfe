"""Supervised and preference losses: NLL (SFT), DPO, and the Bradley-Terry preference loss.

DPO rows are interleaved: chosen, rejected, chosen, rejected, ... (even rows chosen). Keep pairs together: plain
micro-batches of an even size, and no dynamic batching or sequence packing (they reorder rows), which
``Policy.train`` checks before it starts.

Position convention: ``reference_policy_logprobs`` is exactly what ``get_reference_policy_logprobs`` returns
(position i holds token i), and the loss reads ``[:, 1:]`` like every other per-token input. NeMo RL's DPO loop
instead rolls the reference left by one and reads ``[:, :-1]``; with dask-lm, pass the reference unrolled.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from dask_lm.losses.base import (
    BaseLoss,
    LossBatch,
    LossConfig,
    LossInputType,
    LossType,
    MetricNormalizer,
    masked_mean,
    metric,
)

__all__ = ["NLLLoss", "NLLLossFn", "DPOLossConfig", "DPOLossFn", "PreferenceLossFn"]


class NLLLoss(BaseLoss):
    """Negative log-likelihood of the masked tokens, normalised by the global count of valid tokens (SFT).

    Needs ``token_mask`` [B, S] (1 where a token is trained on) and ``sample_mask`` [B]. With ``dpo_loss=True``
    it returns the per-sample sums ``[B]`` instead (or per-sample means with ``dpo_average_log_probs``).
    """

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.LOGPROB
    required_keys = ("token_mask", "sample_mask")

    def __init__(self, cfg: Any = None, use_fused_linear_logprobs: bool = False, **_: Any) -> None:
        self.use_fused_linear_logprobs = use_fused_linear_logprobs
        self.metric_normalizations = {
            "loss": MetricNormalizer.TOKENS,
            "num_unmasked_tokens": MetricNormalizer.NONE,
            "num_valid_samples": MetricNormalizer.NONE,
        }

    # the inputs are the keywords `input_names` lists (BaseLoss.__call__ checks them), not **inputs
    def compute(  # type: ignore[override]
        self,
        batch: LossBatch,
        *,
        next_token_logprobs: torch.Tensor,
        dpo_loss: bool = False,
        dpo_average_log_probs: bool = False,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        data, _, global_valid_toks = batch
        lp = next_token_logprobs
        token_mask = data["token_mask"][:, 1:].to(lp.device)
        sample_mask = data["sample_mask"].to(lp.device)
        mask = token_mask * sample_mask.unsqueeze(-1)
        if dpo_loss:
            loss = -(lp * mask).sum(-1)
            if dpo_average_log_probs:
                loss = loss / mask.sum(-1).clamp(min=1)
        else:
            loss = -masked_mean(lp, mask, global_normalization_factor=global_valid_toks)
        # with dpo_loss the loss is per sample: its metric is that tensor (detached), one value per sample
        return loss, {
            "loss": metric(loss) if loss.dim() == 0 else loss.detach(),
            "num_unmasked_tokens": metric(mask.sum()),
            "num_valid_samples": metric(sample_mask.sum()),
        }


NLLLossFn = NLLLoss  # NeMo RL's later name


@dataclasses.dataclass(kw_only=True)
class DPOLossConfig(LossConfig):
    _section: ClassVar[str] = "DPOLossFn"
    reference_policy_kl_penalty: float = 0.05
    """beta: the strength of the implicit KL to the reference."""
    preference_loss_weight: float = 1.0
    sft_loss_weight: float = 0.0
    """Weight of an NLL term on the chosen rows."""
    preference_average_log_probs: bool = False
    """Average (instead of sum) the per-token log-ratios of a row before comparing chosen with rejected."""
    sft_average_log_probs: bool = False


def _preference(
    rewards: torch.Tensor, sample_mask: torch.Tensor, global_valid_seqs: Any, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bradley-Terry loss of chosen ([::2]) over rejected ([1::2]) rows, normalised per global pair."""
    chosen, rejected = rewards[::2], rewards[1::2]
    pairs = global_valid_seqs / 2
    per_pair = -F.logsigmoid(beta * (chosen - rejected))
    loss = masked_mean(per_pair, sample_mask[::2], global_normalization_factor=pairs)
    accuracy = masked_mean((chosen > rejected).float(), sample_mask[::2], global_normalization_factor=pairs)
    chosen_mean = masked_mean(chosen, sample_mask[::2], global_normalization_factor=pairs)
    rejected_mean = masked_mean(rejected, sample_mask[1::2], global_normalization_factor=pairs)
    return loss, accuracy, chosen_mean, rejected_mean


def _check_pairs(rows: int) -> None:
    if rows % 2:
        raise ValueError(
            f"a preference micro-batch has {rows} rows; rows must come in (chosen, rejected) pairs: "
            "use an even train_micro_batch_size and keep dynamic batching and packing off"
        )


class DPOLossFn(BaseLoss):
    """Direct Preference Optimisation with an optional SFT term (NeMo RL's config keys and metrics).

    reward_b = sum_t (logprob - reference_logprob) over the row's token_mask (mean with
    ``preference_average_log_probs``); loss = w_p * mean over pairs of -log sigmoid(beta (r_chosen - r_rejected))
    + w_s * NLL of the chosen rows. At the reference (policy == reference) the preference loss is log 2.
    """

    loss_type = LossType.SEQUENCE_LEVEL
    input_type = LossInputType.LOGPROB
    required_keys = ("token_mask", "sample_mask", "reference_policy_logprobs")
    requires_pairs = True

    def __init__(self, cfg: Any = None, use_fused_linear_logprobs: bool = False, **_: Any) -> None:
        self.cfg = DPOLossConfig.from_any(cfg)
        self.use_fused_linear_logprobs = use_fused_linear_logprobs
        self.reference_policy_kl_penalty = self.cfg.reference_policy_kl_penalty
        self.preference_loss_weight = self.cfg.preference_loss_weight
        self.sft_loss_weight = self.cfg.sft_loss_weight
        self.preference_average_log_probs = self.cfg.preference_average_log_probs
        self.sft_average_log_probs = self.cfg.sft_average_log_probs
        self.sft_loss = NLLLoss()
        self.metric_normalizations = {
            k: MetricNormalizer.SEQUENCES
            for k in ("loss", "sft_loss", "preference_loss", "accuracy", "rewards_chosen_mean", "rewards_rejected_mean")
        }
        self.metric_normalizations["num_valid_samples"] = MetricNormalizer.NONE

    # the inputs are the keywords `input_names` lists (BaseLoss.__call__ checks them), not **inputs
    def compute(  # type: ignore[override]
        self, batch: LossBatch, *, next_token_logprobs: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        data, global_valid_seqs, global_valid_toks = batch
        lp = next_token_logprobs
        _check_pairs(lp.shape[0])
        sample_mask = data["sample_mask"].to(lp.device)
        sft = torch.zeros((), device=lp.device)
        if self.sft_loss_weight > 0:
            assert global_valid_toks is not None, "the SFT term of DPO needs global_valid_toks"
            per_sample, _ = self.sft_loss(
                lp,
                data,
                global_valid_seqs=global_valid_seqs,
                global_valid_toks=global_valid_toks,
                dpo_loss=True,
                dpo_average_log_probs=self.sft_average_log_probs,
            )
            sft = masked_mean(per_sample[::2], sample_mask[::2], global_normalization_factor=global_valid_seqs / 2)
        token_mask = data["token_mask"][:, 1:].to(lp.device)
        ref = data["reference_policy_logprobs"][:, 1:].to(lp.device)
        rewards = ((lp - ref) * token_mask).sum(-1)
        if self.preference_average_log_probs:
            rewards = rewards / token_mask.sum(-1).clamp(min=1)
        pref, accuracy, chosen, rejected = _preference(
            rewards, sample_mask, global_valid_seqs, self.reference_policy_kl_penalty
        )
        loss = self.sft_loss_weight * sft + self.preference_loss_weight * pref
        return loss, {
            "loss": metric(loss),
            "sft_loss": metric(sft),
            "preference_loss": metric(pref),
            "accuracy": metric(accuracy),
            "rewards_chosen_mean": metric(chosen),
            "rewards_rejected_mean": metric(rejected),
            "num_valid_samples": metric(sample_mask.sum() / 2),
        }


class PreferenceLossFn(BaseLoss):
    """Bradley-Terry loss on a reward model's scalar outputs (``input_type`` LOGIT: ``logits`` [B, 1])."""

    loss_type = LossType.SEQUENCE_LEVEL
    input_type = LossInputType.LOGIT
    input_names = ("logits",)
    required_keys = ("sample_mask",)
    requires_pairs = True

    def __init__(self, cfg: Any = None) -> None:
        pass

    # the inputs are the keywords `input_names` lists (BaseLoss.__call__ checks them), not **inputs
    def compute(  # type: ignore[override]
        self, batch: LossBatch, *, logits: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        data, global_valid_seqs, _ = batch
        rewards = logits.squeeze(-1).float()
        _check_pairs(rewards.shape[0])
        sample_mask = data["sample_mask"].to(rewards.device)
        loss, accuracy, chosen, rejected = _preference(rewards, sample_mask, global_valid_seqs, 1.0)
        return loss, {
            "loss": metric(loss),
            "accuracy": metric(accuracy),
            "rewards_chosen_mean": metric(chosen),
            "rewards_rejected_mean": metric(rejected),
            "num_valid_samples": metric(sample_mask.sum() / 2),
        }

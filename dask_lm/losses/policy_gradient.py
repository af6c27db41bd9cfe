"""``ClippedPGLossFn``: the clipped policy-gradient loss of PPO and GRPO, with its variants.

Notation (all per token, ``[B, S-1]``, read from the data with ``[:, 1:]``): c = current logprobs (the ones being
trained), p = ``prev_logprobs`` (the policy that produced the advantages), g = ``generation_logprobs`` (the
sampler's), r = ``reference_policy_logprobs``, A = ``advantages``; mask = token_mask * sample_mask.

* ratio rho = exp(c - p), clipped to [1 - eps_low, 1 + eps_high]; loss per token max(-A rho, -A clip(rho)).
  GSPO (``sequence_level_importance_ratios``): rho = exp(masked mean over the row of (c - p)).
  REINFORCE (``disable_ppo_ratio``): rho = c. ``force_on_policy_ratio``: rho = exp(c - c.detach()) = 1 with c's
  gradient. CISPO (``use_cispo``): -A * sg(clip(rho)) * c. Dual clip (``ratio_clip_c`` > 1): where A < 0 the
  per-token loss is capped at -A * c_dual.
* importance weights w = exp(p - g) correct for a sampler that differs from the trained policy
  (``use_importance_sampling_correction``); truncated as "tis" (clamp), "icepop" (zero outside [min, max]) or
  "seq-mask-tis" (drop whole rows whose geometric-mean ratio is outside [min, max]).
* KL to the reference, beta * k1/k2/k3(c, r) with the input / output clamps (:func:`calculate_kl`).
* Token-level losses divide by the global valid-token count; sequence-level ones average each row over its
  tokens, then divide by the global valid-sequence count.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from dask_lm import interface
from dask_lm.losses.base import (
    BaseLoss,
    LossBatch,
    LossConfig,
    LossConfigError,
    LossInputType,
    LossType,
    MetricNormalizer,
    calculate_kl,
    masked_mean,
    metric,
)

__all__ = ["ClippedPGLossConfig", "ClippedPGLossFn"]

_TIS_TYPES = ("tis", "icepop", "seq-mask-tis")


@dataclasses.dataclass(kw_only=True)
class ClippedPGLossConfig(LossConfig):
    _section: ClassVar[str] = "ClippedPGLossFn"
    ratio_clip_min: float = 0.2
    """eps_low: the ratio is clipped below at 1 - ratio_clip_min."""
    ratio_clip_max: float = 0.2
    """eps_high: the ratio is clipped above at 1 + ratio_clip_max."""
    ratio_clip_c: float | None = None
    """Dual-clip constant (> 1) for negative advantages; None turns it off."""
    reference_policy_kl_penalty: float = 0.01
    """beta of the KL penalty to the reference policy (0 turns it off)."""
    reference_policy_kl_type: str = "k3"
    kl_input_clamp_value: float | None = 20.0
    kl_output_clamp_value: float | None = 10.0
    use_on_policy_kl_approximation: bool = False
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_ratio: float | None = None
    truncated_importance_sampling_type: str | None = None
    truncated_importance_sampling_ratio_min: float | None = None
    token_level_loss: bool = True
    disable_ppo_ratio: bool = False
    force_on_policy_ratio: bool = False
    sequence_level_importance_ratios: bool = False
    use_kl_in_reward: bool = False
    """The KL goes into the reward instead (the caller's job); the loss then adds no KL term."""
    use_cispo: bool = False
    positive_example_nll_weight: float = 0.0
    """Weight of an NLL term on rows whose reward is positive (needs a ``rewards`` [B] key)."""
    seq_logprob_error_in_loss: bool = False
    """Accepted for NeMo RL compatibility; only false is supported."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise LossConfigError(message)


def _nan_to_zero(t: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)


class ClippedPGLossFn(BaseLoss):
    """PPO / GRPO / GSPO / REINFORCE / CISPO loss with NeMo RL's config keys, defaults and metrics."""

    input_type = LossInputType.LOGPROB

    def __init__(self, cfg: Any = None, use_fused_linear_logprobs: bool = False) -> None:
        c = self.cfg = ClippedPGLossConfig.from_any(cfg)
        self.use_fused_linear_logprobs = use_fused_linear_logprobs
        self.ratio_clip_min = c.ratio_clip_min
        self.ratio_clip_max = c.ratio_clip_max
        self.ratio_clip_c = c.ratio_clip_c
        self.reference_policy_kl_penalty = 0.0 if c.use_kl_in_reward else c.reference_policy_kl_penalty
        self.kl_type = c.reference_policy_kl_type
        _check(
            self.kl_type in ("k1", "k2", "k3"),
            f"`reference_policy_kl_type` must be 'k1', 'k2' or 'k3', got {self.kl_type!r}",
        )
        _check(c.reference_policy_kl_penalty >= 0, "`reference_policy_kl_penalty` must be >= 0")
        _check(not c.seq_logprob_error_in_loss, "`seq_logprob_error_in_loss` is not supported; set it to false")
        self.loss_type = LossType.TOKEN_LEVEL if c.token_level_loss else LossType.SEQUENCE_LEVEL
        _check(
            not (c.sequence_level_importance_ratios and c.token_level_loss),
            "sequence-level importance ratios (GSPO) are mutually exclusive with a token-level loss: set "
            "`token_level_loss: false` with `sequence_level_importance_ratios: true`",
        )
        if c.use_cispo:
            for key in ("disable_ppo_ratio", "force_on_policy_ratio", "sequence_level_importance_ratios"):
                _check(not getattr(c, key), f"use_cispo is incompatible with {key}; turn one of them off")
            _check(
                c.ratio_clip_c is None,
                "use_cispo is incompatible with dual clipping (ratio_clip_c); set "
                "ratio_clip_c=null when use_cispo=True",
            )
            _check(c.token_level_loss, "use_cispo requires token_level_loss=True (LossType.TOKEN_LEVEL)")
        self.tis_type = c.truncated_importance_sampling_type
        self.tis_max = c.truncated_importance_sampling_ratio
        self.tis_min = c.truncated_importance_sampling_ratio_min
        if self.tis_type is not None or self.tis_max is not None:
            _check(
                c.use_importance_sampling_correction,
                "truncated importance sampling is only supported when use_importance_sampling_correction is True",
            )
            _check(
                self.tis_type in _TIS_TYPES,
                f"truncated_importance_sampling_type must be 'tis', 'icepop', or 'seq-mask-tis', got {self.tis_type!r}",
            )
            _check(
                self.tis_max is not None and self.tis_max > 0, "truncated_importance_sampling_ratio should be positive"
            )
            assert self.tis_max is not None  # the _check above raised otherwise
            if self.tis_min is not None:
                _check(
                    self.tis_min <= self.tis_max,
                    "truncated_importance_sampling_ratio_min must be <= "
                    f"truncated_importance_sampling_ratio (got {self.tis_min} > {self.tis_max})",
                )
            if self.tis_type in ("icepop", "seq-mask-tis"):
                _check(
                    self.tis_min is not None,
                    f"truncated_importance_sampling_ratio_min should be set when "
                    f"truncated_importance_sampling_type is {self.tis_type!r}",
                )
            if self.tis_type == "seq-mask-tis":
                _check(
                    not c.sequence_level_importance_ratios,
                    "'seq-mask-tis' works on token-level importance "
                    "ratios; turn `sequence_level_importance_ratios` off",
                )
            self.tis_min = 0.0 if self.tis_min is None else self.tis_min
        elif self.tis_min is not None:
            interface.warn(
                "`truncated_importance_sampling_ratio_min` is ignored without `truncated_importance_sampling_type`"
            )
        if self.ratio_clip_c is not None:
            _check(self.ratio_clip_c > 1, f"`ratio_clip_c` (dual clip) must be > 1, got {self.ratio_clip_c}")
        keys = ["token_mask", "sample_mask", "advantages", "generation_logprobs"]
        if not c.force_on_policy_ratio:
            keys.append("prev_logprobs")
        if self.reference_policy_kl_penalty != 0:
            keys.append("reference_policy_logprobs")
        if c.positive_example_nll_weight > 0:
            keys.append("rewards")
        self.required_keys = tuple(keys)
        self.metric_normalizations = self._metric_normalizations()

    def _metric_normalizations(self) -> dict[str, MetricNormalizer]:
        """How each metric averages over micro-batches (what a trainer that re-normalises metrics needs)."""
        c = self.cfg
        per = MetricNormalizer.TOKENS if self.loss_type == LossType.TOKEN_LEVEL else MetricNormalizer.SEQUENCES
        out = {"loss": per, "kl_penalty": per}
        for key in (
            "probs_ratio",
            "probs_ratio_clamped",
            "token_mult_prob_error",
            "gen_kl_error",
            "policy_kl_error",
            "js_divergence_error",
            "approx_entropy",
        ):
            out[key] = MetricNormalizer.TOKENS
        out["sampling_importance_ratio"] = (
            MetricNormalizer.SEQUENCES if c.sequence_level_importance_ratios else MetricNormalizer.TOKENS
        )
        for key in (
            "num_valid_samples",
            "positive_nll_loss",
            "probs_ratio_min",
            "probs_ratio_max",
            "probs_ratio_clamped_min",
            "probs_ratio_clamped_max",
        ):
            out[key] = MetricNormalizer.NONE
        if self.tis_type is not None:
            out["is_oob_ratio"] = (
                MetricNormalizer.SEQUENCES if self.tis_type == "seq-mask-tis" else MetricNormalizer.TOKENS
            )
        return out

    # ----------------------------------------------------------------------------------------------- pieces
    def _reduce(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        token_mask: torch.Tensor,
        sample_mask: torch.Tensor,
        gvs: Any,
        gvt: Any,
    ) -> torch.Tensor:
        if self.loss_type == LossType.TOKEN_LEVEL:
            return masked_mean(x, mask, global_normalization_factor=gvt)
        return masked_mean(masked_mean(x, token_mask, dim=-1), sample_mask, global_normalization_factor=gvs)

    def _importance_weights(
        self,
        prev: torch.Tensor,
        gen: torch.Tensor,
        mask: torch.Tensor,
        token_mask: torch.Tensor,
        sample_mask: torch.Tensor,
        gvs: Any,
        gvt: Any,
    ) -> tuple[torch.Tensor, float | None]:
        c = self.cfg
        if c.sequence_level_importance_ratios:
            w = _nan_to_zero(torch.exp(((prev - gen) * mask).sum(-1)).detach())[:, None]
        else:
            w = _nan_to_zero(torch.exp(prev - gen)).detach()
        if self.tis_type is None:
            return w, None
        lo, hi = self.tis_min, self.tis_max
        assert lo is not None and hi is not None  # __init__ checks the max and defaults the min when tis_type is set
        if self.tis_type == "tis":
            outside = ((w > hi) | (w < lo)).float().expand_as(mask)
            oob = metric(masked_mean(outside, mask, global_normalization_factor=gvt))
            return w.clamp(min=lo, max=hi), oob
        if self.tis_type == "icepop":
            keep = (w >= lo) & (w <= hi)
            oob = metric(masked_mean((~keep).float().expand_as(mask), mask, global_normalization_factor=gvt))
            return torch.where(keep, w, torch.zeros_like(w)), oob
        # seq-mask-tis: a row's geometric-mean ratio decides whether the whole row counts
        geo = torch.exp(masked_mean(_nan_to_zero(prev - gen), token_mask, dim=-1)).detach()
        keep_row = ((geo >= lo) & (geo <= hi)).float()
        oob = metric(masked_mean(1.0 - keep_row, sample_mask, global_normalization_factor=gvs))
        return w * keep_row[:, None], oob

    # ----------------------------------------------------------------------------------------------- loss
    # the inputs are the keywords `input_names` lists (BaseLoss.__call__ checks them), not **inputs
    def compute(  # type: ignore[override]
        self, batch: LossBatch, *, next_token_logprobs: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        data, gvs, gvt = batch
        c = self.cfg
        curr = next_token_logprobs
        dev = curr.device
        token_mask = data["token_mask"][:, 1:].to(dev)
        sample_mask = data["sample_mask"].to(dev)
        mask = token_mask * sample_mask.unsqueeze(-1)
        adv = data["advantages"][:, 1:].to(dev)
        gen = data["generation_logprobs"][:, 1:].to(dev)
        # force_on_policy: the batch was generated by this very policy, so prev is the current logprobs (ratio
        # exactly 1, gradient kept) and no separate prev-logprob pass is needed; prev_logprobs is never read
        prev = curr.detach() if c.force_on_policy_ratio else data["prev_logprobs"][:, 1:].to(dev)
        beta = self.reference_policy_kl_penalty

        with torch.no_grad():
            token_mult_prob_error = masked_mean(
                torch.exp((gen - prev).abs() * mask), mask, global_normalization_factor=gvt
            )
            gen_kl_error = masked_mean(
                calculate_kl(gen, prev, self.kl_type, None, None), mask, global_normalization_factor=gvt
            )
            policy_kl_error = masked_mean(
                calculate_kl(prev, gen, self.kl_type, None, None), mask, global_normalization_factor=gvt
            )
            mid = torch.logaddexp(prev, gen) - torch.log(torch.tensor(2.0, device=dev))
            js = 0.5 * (torch.exp(prev - mid) - (prev - mid) - 1) + 0.5 * (torch.exp(gen - mid) - (gen - mid) - 1)
            js_divergence_error = masked_mean(js, mask, global_normalization_factor=gvt)

        if beta != 0:
            ref = data["reference_policy_logprobs"][:, 1:].to(dev)
            kl_curr = data.get("curr_logprobs_unfiltered", curr) if hasattr(data, "get") else curr
            weights = (
                torch.exp(kl_curr - gen) if c.use_on_policy_kl_approximation else torch.exp(kl_curr - kl_curr.detach())
            )
            weights = torch.where(torch.isfinite(weights), weights, torch.zeros_like(weights))
            per_token_kl = beta * calculate_kl(
                kl_curr,
                ref,
                self.kl_type,
                c.kl_input_clamp_value,
                c.kl_output_clamp_value,
                importance_sampling_weights=weights,
            )
            kl = self._reduce(per_token_kl, mask, token_mask, sample_mask, gvs, gvt)
        else:
            kl = torch.zeros((), device=dev)

        if c.force_on_policy_ratio:
            ratios = ratios_clamped = torch.exp(curr - curr.detach())
        elif c.disable_ppo_ratio:
            ratios = ratios_clamped = curr
        else:
            log_ratio = curr - prev
            if c.sequence_level_importance_ratios:
                ratios = torch.exp(masked_mean(log_ratio, token_mask, dim=-1))[:, None].expand_as(curr)
            else:
                ratios = torch.exp(log_ratio)
            ratios_clamped = ratios.clamp(1.0 - self.ratio_clip_min, 1.0 + self.ratio_clip_max)

        if c.use_cispo:
            clip_loss = -adv * ratios_clamped.detach() * curr
        else:
            clip_loss = torch.maximum(-adv * ratios, -adv * ratios_clamped)
            if self.ratio_clip_c is not None:
                clip_loss = torch.where(adv < 0, torch.minimum(clip_loss, -adv * self.ratio_clip_c), clip_loss)

        is_weights, is_oob_ratio = self._importance_weights(prev, gen, mask, token_mask, sample_mask, gvs, gvt)
        actor_weights = is_weights if c.use_importance_sampling_correction else torch.ones_like(prev)
        actor_loss = self._reduce(actor_weights * clip_loss, mask, token_mask, sample_mask, gvs, gvt)
        if c.sequence_level_importance_ratios:
            sampling_importance_ratio = masked_mean(
                is_weights.squeeze(-1), sample_mask, global_normalization_factor=gvs
            )
        else:
            sampling_importance_ratio = masked_mean(is_weights, mask, global_normalization_factor=gvt)

        positive_nll = torch.zeros((), device=dev)
        if c.positive_example_nll_weight > 0 and "rewards" in data:
            # VAPO: an NLL on the tokens of rows that earned a positive reward, averaged over those tokens
            correct = mask * (data["rewards"].to(dev) > 0).float().unsqueeze(-1)
            n = correct.sum()
            if n > 0:
                positive_nll = masked_mean(-curr, correct, global_normalization_factor=n)

        with torch.no_grad():
            approx_entropy = -masked_mean(torch.exp(curr - gen) * curr, mask, global_normalization_factor=gvt)

        loss = actor_loss + kl + c.positive_example_nll_weight * positive_nll
        valid = mask.bool()
        if bool(valid.any()):
            r, rc = ratios.detach()[valid], ratios_clamped.detach()[valid]
            extrema = {
                "probs_ratio_min": metric(r.min()),
                "probs_ratio_max": metric(r.max()),
                "probs_ratio_clamped_min": metric(rc.min()),
                "probs_ratio_clamped_max": metric(rc.max()),
            }
        else:
            extrema = {
                "probs_ratio_min": float("inf"),
                "probs_ratio_max": float("-inf"),
                "probs_ratio_clamped_min": float("inf"),
                "probs_ratio_clamped_max": float("-inf"),
            }
        metrics: dict[str, Any] = {
            "loss": metric(loss),
            "probs_ratio": metric(masked_mean(ratios.detach(), mask, global_normalization_factor=gvt)),
            "probs_ratio_clamped": metric(masked_mean(ratios_clamped.detach(), mask, global_normalization_factor=gvt)),
            **extrema,
            "kl_penalty": metric(kl) / beta if beta != 0 else 0.0,
            "token_mult_prob_error": metric(token_mult_prob_error),
            "gen_kl_error": metric(gen_kl_error),
            "policy_kl_error": metric(policy_kl_error),
            "js_divergence_error": metric(js_divergence_error),
            "sampling_importance_ratio": metric(sampling_importance_ratio),
            "num_valid_samples": metric(sample_mask.sum()),
            "approx_entropy": metric(approx_entropy),
        }
        if is_oob_ratio is not None:
            metrics["is_oob_ratio"] = is_oob_ratio
        metrics["positive_nll_loss"] = metric(positive_nll)
        return loss, metrics

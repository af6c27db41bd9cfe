"""``DistillationLossFn``: KL between a teacher's top-k distribution and the student's, per token.

The teacher's ``get_topk_logits`` output goes into the training data as ``teacher_topk_logits`` /
``teacher_topk_indices`` ``[B, S, k]`` (position t: the distribution over token t+1, as ``get_topk_logits``
returns it; callers never shift it). The trainer gathers the student's logprobs at the same indices
(``student_topk_logprobs``), renormalises the teacher over its k entries (``teacher_topk_logprobs``), drops the
last position of both (it predicts past the row), and, for ``zero_outside_topk`` with a reverse or mixed KL,
hands over ``H_all`` = sum over the whole vocabulary of p log p of the student.

* forward KL = sum_k P_t (log P_t - log P_s); reverse KL = sum_k P_s (log P_s - log P_t); mixed = w fwd + (1-w) rev.
* Without ``zero_outside_topk`` the student is renormalised over the k entries too. With it, the student keeps
  its full-vocabulary logprobs and the reverse KL adds the mass outside the top-k, whose teacher logprob is taken
  as -100 (the teacher puts no mass there): + H_rest - (-100) * P_rest.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from dask_lm.errors import LossConfigError
from dask_lm.losses.base import BaseLoss, LossBatch, LossConfig, LossInputType, LossType, masked_mean, metric

__all__ = ["DistillationLossConfig", "DistillationLossFn"]


@dataclasses.dataclass(kw_only=True)
class DistillationLossConfig(LossConfig):
    _section: ClassVar[str] = "DistillationLossFn"
    kl_type: str = "mixed"
    """'forward', 'reverse' or 'mixed'."""
    mixed_kl_weight: float = 0.5
    """Weight of the forward KL in 'mixed' (the reverse KL gets 1 - weight)."""
    zero_outside_topk: bool = False


class DistillationLossFn(BaseLoss):
    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.DISTILLATION
    input_names = ("student_topk_logprobs", "teacher_topk_logprobs", "H_all")
    required_keys = ("teacher_topk_logits", "teacher_topk_indices", "token_mask", "sample_mask")
    log_infinitesimal = -100.0

    def __init__(self, cfg: Any = None) -> None:
        self.cfg = DistillationLossConfig.from_any(cfg)
        self.kl_type = self.cfg.kl_type
        self.mixed_kl_weight = self.cfg.mixed_kl_weight
        self.zero_outside_topk = self.cfg.zero_outside_topk
        if self.kl_type not in ("forward", "reverse", "mixed"):
            raise LossConfigError(
                f"Invalid KL type: `kl_type` must be 'forward', 'reverse' or 'mixed', got {self.kl_type!r}"
            )
        if not 0.0 <= self.mixed_kl_weight <= 1.0:
            raise LossConfigError(
                f"Invalid mixed KL weight: `mixed_kl_weight` must be in [0, 1], got {self.mixed_kl_weight}"
            )

    @property
    def needs_entropy(self) -> bool:
        return self.zero_outside_topk and self.kl_type != "forward"

    # the inputs are the keywords `input_names` lists (BaseLoss.__call__ checks them), not **inputs
    def compute(  # type: ignore[override]
        self,
        batch: LossBatch,
        *,
        student_topk_logprobs: torch.Tensor,
        teacher_topk_logprobs: torch.Tensor,
        H_all: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        data, _, global_valid_toks = batch
        s, t = student_topk_logprobs, teacher_topk_logprobs.to(student_topk_logprobs.device)
        ps, pt = s.exp(), t.exp()
        forward = (pt * (t - s)).sum(-1)
        reverse = (ps * (s - t)).sum(-1)
        w = self.mixed_kl_weight
        per_token = {"forward": forward, "reverse": reverse, "mixed": w * forward + (1 - w) * reverse}[self.kl_type]
        if self.needs_entropy:
            if H_all is None:
                raise ValueError(
                    "zero_outside_topk with a reverse or mixed KL needs H_all (the student's "
                    "sum p log p over the whole vocabulary)"
                )
            h_rest = H_all - (ps * s).sum(-1)
            p_rest = 1.0 - ps.sum(-1)
            correction = h_rest - self.log_infinitesimal * p_rest
            if self.kl_type == "mixed":
                correction = correction * (1 - w)
            per_token = per_token + correction
        if "token_mask" in data and "sample_mask" in data:
            token_mask = data["token_mask"][:, 1:][:, : per_token.shape[1]].to(s.device)
            mask = token_mask * data["sample_mask"].to(s.device).unsqueeze(-1)
            loss = masked_mean(per_token, mask, global_normalization_factor=global_valid_toks)
        else:
            loss = per_token.mean()
        rows = metric(data["sample_mask"].sum()) if "sample_mask" in data else data["input_ids"].shape[0]
        return loss, {"loss": metric(loss), "num_valid_samples": rows}

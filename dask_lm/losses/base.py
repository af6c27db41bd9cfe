"""The loss-function contract (NeMo RL's ``LossFunction``), its helpers, and typed loss configs.

A loss is any object with ``loss_type`` (token- or sequence-level), ``input_type`` (what the trainer hands it)
and a ``__call__`` returning ``(scalar loss, metrics dict)``. The trainer calls it by keyword, as NeMo RL's
DTensor workers do (``nemo_rl/models/policy/workers/dtensor_policy_worker.py:927-932``,
``nemo_rl/models/automodel/train.py:646-651``)::

    loss_fn(data=mb, global_valid_seqs=gvs, global_valid_toks=gvt, **inputs)

so the parameters may come in any order: NeMo RL declares its losses input first
(``__call__(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks)``,
``nemo_rl/algorithms/loss/loss_functions.py:374-379``), dask-lm's protocol data first; both are called the same
way. ``inputs`` depend on ``input_type`` (see :mod:`dask_lm.losses.loss_input`):

* ``LOGPROB``: ``next_token_logprobs`` float32 ``[B, S-1]``; element ``t`` is log p(token t+1 | tokens <= t).
* ``DISTILLATION``: ``student_topk_logprobs`` / ``teacher_topk_logprobs`` ``[B, S-1, k]`` and ``H_all``.
* ``LOGIT``: ``logits`` ``[B, S, V]`` (the whole vocabulary: memory-hungry, for losses that need it).

``global_valid_seqs`` / ``global_valid_toks`` are the valid sequences and tokens of the whole global batch over
every rank. A loss divides by them (never by its micro-batch's own counts), so summing micro-batches and ranks
gives the global-batch mean: the loss and the update do not depend on micro-batch size or rank count.

Per-token data (``prev_logprobs``, ``generation_logprobs``, ``reference_policy_logprobs``, ``advantages``,
``token_mask``) is ``[B, S]`` in ``get_logprobs``' convention (position i holds token i's value, position 0 is
unused) and losses read it with ``[:, 1:]`` to line up with ``next_token_logprobs``; callers never shift it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import threading
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, NamedTuple, Protocol, TypeVar

import torch

from dask_lm.errors import LossConfigError

__all__ = [
    "LossType",
    "LossInputType",
    "MetricNormalizer",
    "LossFunction",
    "loss_attribute",
    "masked_mean",
    "metric",
    "deferred_metrics",
    "calculate_kl",
    "LossConfig",
    "LossConfigError",
    "BaseLoss",
    "LossBatch",
]


class LossType(str, enum.Enum):
    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class LossInputType(str, enum.Enum):
    LOGIT = "logit"
    LOGPROB = "logprob"
    DISTILLATION = "distillation"


class MetricNormalizer(str, enum.Enum):
    """How a metric is averaged over micro-batches: per valid token, per valid sequence, or not at all."""

    TOKENS = "tokens"
    SEQUENCES = "sequences"
    NONE = "none"


class LossFunction(Protocol):
    """What ``Policy.train`` needs from a loss. Write your own by giving a class these members, or by subclassing
    this protocol (as NeMo RL's losses subclass theirs), which also gives it the optional attributes' defaults.

    ``loss_type`` and ``input_type`` are required (NeMo RL's enums or plain strings work too); ``__call__`` is
    called by keyword, so it may list its input first, as NeMo RL's losses do.

    The other attributes below are optional: the trainer reads each with :func:`loss_attribute`, which falls back
    to the default given here, and reads no other attribute of a loss.
    """

    loss_type: LossType
    input_type: LossInputType

    required_keys: tuple[str, ...] = ()
    """Data keys the loss reads; ``Policy.train`` checks that the batch has them before any rank runs."""
    requires_pairs: bool = False
    """Rows come in (chosen, rejected) pairs: ``train`` refuses odd batch and micro-batch sizes and the batching
    modes that reorder rows (dynamic batching, sequence packing). A dask-lm attribute; NeMo RL has none."""
    reference_policy_kl_penalty: float = 0.0
    """Nonzero while the sampler filters the vocabulary (``generation.top_k`` / ``top_p``): the trainer also puts
    the unfiltered logprobs into ``data["curr_logprobs_unfiltered"]`` (NeMo RL's ``prepare_loss_input``,
    ``nemo_rl/algorithms/loss/utils.py:97-108``)."""
    zero_outside_topk: bool = False
    """DISTILLATION inputs: the student's full-vocabulary logprobs at the teacher's top-k instead of the ones
    renormalised over the k entries."""
    kl_type: str = "forward"
    """DISTILLATION inputs: with ``zero_outside_topk`` and any ``kl_type`` but ``"forward"``, ``H_all`` is the
    student's sum of p log p over the vocabulary (else None) (``nemo_rl/algorithms/loss/utils.py:123``)."""
    use_fused_linear_logprobs: bool = False
    """Read by :func:`~dask_lm.losses.prepare_loss_input` only: its ``logits`` argument holds next-token
    logprobs already (NeMo RL's Megatron fusion). The trainer always computes the logprobs itself."""

    def __call__(
        self, data: Any, global_valid_seqs: torch.Tensor, global_valid_toks: torch.Tensor, **inputs: Any
    ) -> tuple[torch.Tensor, dict[str, Any]]: ...


def loss_attribute(loss_fn: Any, name: str) -> Any:
    """``loss_fn.name``, or the default that :class:`LossFunction` declares for it when the loss has none."""
    assert name in LossFunction.__annotations__, f"{name!r} is not an attribute of the LossFunction contract"
    return getattr(loss_fn, name, getattr(LossFunction, name, None))


_DEFERRED = threading.local()


def metric(value: Any) -> Any:
    """A metric of a loss's return: a Python number, as NeMo RL's losses return (``.item()``), except inside
    :func:`deferred_metrics`, where a one-element tensor stays a detached tensor. Reading a GPU tensor back makes the
    host wait for every kernel queued before it: the trainer reads all of a step's metrics once, after the step."""
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach()
    if value.numel() != 1 or getattr(_DEFERRED, "on", False):  # .item() takes any one-element tensor
        return value
    return value.item()


@contextlib.contextmanager
def deferred_metrics() -> Iterator[None]:
    """Inside (this thread), :func:`metric` keeps tensors; the caller converts them (the trainer does, per step)."""
    before = getattr(_DEFERRED, "on", False)
    _DEFERRED.on = True
    try:
        yield
    finally:
        _DEFERRED.on = before


def masked_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    dim: int | None = None,
    global_normalization_factor: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """``sum(values * mask) / (denominator + 1e-8)``; the denominator is ``mask.sum(dim)`` or, for losses,
    the global count. An all-zero mask gives 0, never NaN."""
    num = (values * mask).sum() if dim is None else (values * mask).sum(dim=dim)
    denom: torch.Tensor | float
    if global_normalization_factor is None:
        denom = mask.sum() if dim is None else mask.sum(dim=dim)
    else:
        denom = global_normalization_factor
    # the epsilon is added in the tensor's own dtype (float32 for integer counts), as NeMo RL does: 3 + 1e-8 is
    # exactly 3.0 in float32, which keeps on-policy ratios exactly 1
    if not isinstance(denom, torch.Tensor):
        denom = torch.tensor(denom, device=num.device)
    return num / (denom + 1e-8)


def calculate_kl(
    logprobs: torch.Tensor,
    logprobs_reference: torch.Tensor,
    kl_type: str = "k3",
    input_clamp_value: float | None = 20.0,
    output_clamp_value: float | None = 10.0,
    importance_sampling_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the two logprobs of the sampled token.

    With ``r = logprobs_reference - logprobs`` (clamped to ``+-input_clamp_value``): k1 = -r, k2 = r^2 / 2,
    k3 = e^r - 1 - r (unbiased and non-negative). ``importance_sampling_weights`` multiply the estimate (for
    samples drawn from another policy); where the input clamp was active they carry no gradient. The result is
    clamped to ``+-output_clamp_value``, weight included.
    """
    logr = logprobs_reference - logprobs
    clamped = torch.zeros_like(logr, dtype=torch.bool)
    if input_clamp_value is not None:
        clamped = logr.abs() > input_clamp_value
        logr = logr.clamp(min=-input_clamp_value, max=input_clamp_value)
    if kl_type == "k1":
        kl = -logr
    elif kl_type == "k2":
        kl = logr.square() / 2
    elif kl_type == "k3":
        kl = torch.exp(logr) - 1 - logr
    else:
        raise ValueError(f"kl_type must be 'k1', 'k2' or 'k3', got {kl_type!r}")
    if importance_sampling_weights is not None:
        w = torch.where(clamped, importance_sampling_weights.detach(), importance_sampling_weights)
        kl = w * kl
    if output_clamp_value is not None:
        kl = kl.clamp(min=-output_clamp_value, max=output_clamp_value)
    return kl


C = TypeVar("C", bound="LossConfig")


@dataclasses.dataclass(kw_only=True)
class LossConfig(Mapping[str, Any]):
    """A loss configuration: built from a plain dict with NeMo RL's key names (missing keys take their
    defaults, unknown keys raise naming the key), read by attribute or, as NeMo RL's dicts are, by item."""

    _section: ClassVar[str] = "loss"

    @classmethod
    def from_any(cls: type[C], cfg: Any) -> C:
        if cfg is None:
            return cls()
        if isinstance(cfg, cls):
            return cfg
        if not isinstance(cfg, Mapping):
            # another config object (e.g. NeMo RL's): take the fields it has
            cfg = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls) if hasattr(cfg, f.name)}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in cfg if k not in names]
        if unknown:
            hints = [
                f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, names, 1)) else repr(k)
                for k in unknown
            ]
            raise LossConfigError(
                f"unknown {cls._section} config keys: {', '.join(hints)}; known keys: {sorted(names)}"
            )
        try:
            return cls(**dict(cfg))
        except TypeError as e:
            raise LossConfigError(f"{cls._section} config: {e}") from None

    def __getitem__(self, key: str) -> Any:
        if key not in self:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return (f.name for f in dataclasses.fields(self))

    def __len__(self) -> int:
        return len(dataclasses.fields(self))

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in {f.name for f in dataclasses.fields(self)}


class LossBatch(NamedTuple):
    """What every loss is called with besides its inputs: the microbatch's data and the global counts its sums are
    normalized by (``None`` where the caller gives none)."""

    data: Any
    global_valid_seqs: Any = None
    global_valid_toks: Any = None


class BaseLoss:
    """Shared call handling for dask-lm's losses.

    The trainer calls a loss by keyword (``loss(data=..., global_valid_seqs=..., global_valid_toks=...,
    **inputs)``, as NeMo RL does). Positional calls work in both orders too: data first (this protocol's order)
    or inputs first (NeMo RL's declared order, ``loss(next_token_logprobs, data, ...)``, which its own losses use
    when they call each other); a tensor in the first position selects the inputs-first form.
    """

    loss_type: LossType = LossType.TOKEN_LEVEL
    input_type: LossInputType = LossInputType.LOGPROB
    input_names: ClassVar[tuple[str, ...]] = ("next_token_logprobs",)
    required_keys: tuple[str, ...] = ()
    """Data keys the loss reads (:attr:`LossFunction.required_keys`)."""

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        rest = list(args)
        if rest and (isinstance(rest[0], torch.Tensor) or (rest[0] is None and len(rest) > len(self.input_names))):
            for name in self.input_names:  # the inputs-first form
                if rest:
                    kwargs.setdefault(name, rest.pop(0))
        for name in LossBatch._fields:
            if rest:
                if name in kwargs:
                    raise TypeError(f"{type(self).__name__}() got multiple values for {name!r}")
                kwargs[name] = rest.pop(0)
        if rest:
            raise TypeError(f"{type(self).__name__}() got {len(rest)} unexpected positional arguments")
        if "data" not in kwargs:
            raise TypeError(f"{type(self).__name__}() needs `data`")
        missing = [n for n in self.input_names if n not in kwargs and n != "H_all"]
        if missing:
            raise TypeError(f"{type(self).__name__}() needs {missing} (its input_type is {self.input_type.value})")
        batch = LossBatch(*(kwargs.pop(name, None) for name in LossBatch._fields))
        return self.compute(batch, **kwargs)

    def compute(self, batch: LossBatch, **inputs: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """The loss of ``batch`` given the inputs ``input_names`` lists, by keyword."""
        raise NotImplementedError

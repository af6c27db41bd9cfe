"""The loss-function contract (NeMo RL's ``LossFunction``), its helpers, and typed loss configs.

A loss is any object with ``loss_type`` (token- or sequence-level), ``input_type`` (what the trainer hands it)
and ``__call__(data, global_valid_seqs, global_valid_toks, **inputs) -> (scalar loss, metrics dict)``. The
trainer builds ``inputs`` from ``input_type`` (see :mod:`dask_lm.losses.loss_input`):

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
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import torch

from dask_lm.errors import LossConfigError

__all__ = ["LossType", "LossInputType", "MetricNormalizer", "LossFunction", "masked_mean", "metric",
           "deferred_metrics", "calculate_kl",
           "LossConfig", "LossConfigError", "BaseLoss"]


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


@runtime_checkable
class LossFunction(Protocol):
    """What ``Policy.train`` needs from a loss. Write your own by giving a class these members."""

    loss_type: LossType
    input_type: LossInputType

    def __call__(self, data: Any, global_valid_seqs: torch.Tensor, global_valid_toks: torch.Tensor,
                 **inputs: Any) -> tuple[torch.Tensor, dict[str, Any]]: ...


_DEFERRED = threading.local()


def metric(value: Any) -> Any:
    """A metric of a loss's return: a Python number, as NeMo RL's losses return (``.item()``), except inside
    :func:`deferred_metrics`, where a one-element tensor stays a detached tensor. Reading a GPU tensor back makes the host
    wait for every kernel queued before it: the trainer reads all of a step's metrics once, after the step."""
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


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None,
                global_normalization_factor: torch.Tensor | float | None = None) -> torch.Tensor:
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


def calculate_kl(logprobs: torch.Tensor, logprobs_reference: torch.Tensor, kl_type: str = "k3",
                 input_clamp_value: float | None = 20.0, output_clamp_value: float | None = 10.0,
                 importance_sampling_weights: torch.Tensor | None = None) -> torch.Tensor:
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
            hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, names, 1)) else repr(k)
                     for k in unknown]
            raise LossConfigError(f"unknown {cls._section} config keys: {', '.join(hints)}; known keys: "
                                  f"{sorted(names)}")
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


class BaseLoss:
    """Shared call handling for dask-lm's losses.

    The documented convention is ``loss(data, global_valid_seqs, global_valid_toks, **inputs)``. Earlier NeMo RL
    releases passed the inputs first and positionally (``loss(next_token_logprobs, data, ...)``); a tensor in
    the first position selects that form, so losses written for either port unchanged.
    """

    loss_type: LossType = LossType.TOKEN_LEVEL
    input_type: LossInputType = LossInputType.LOGPROB
    input_names: ClassVar[tuple[str, ...]] = ("next_token_logprobs",)
    required_keys: tuple[str, ...] = ()
    """Data keys the loss reads; ``Policy.train`` checks them before any rank runs."""

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        rest = list(args)
        if rest and (isinstance(rest[0], torch.Tensor) or (rest[0] is None and len(rest) > len(self.input_names))):
            for name in self.input_names:  # the inputs-first form
                if rest:
                    kwargs.setdefault(name, rest.pop(0))
        for name in ("data", "global_valid_seqs", "global_valid_toks"):
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
        return self.compute(**kwargs)

    def compute(self, *, data: Any, global_valid_seqs: Any = None, global_valid_toks: Any = None,
                **inputs: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        raise NotImplementedError

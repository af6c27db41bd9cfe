"""Timers and training FLOPs per model family (driver side); the MFU of a call from its ranks' devices is
:mod:`dask_lm.data.flops`.

FLOPs follow the Megatron / NeMo RL convention so numbers compare across projects: matrix-multiply FLOPs of the
model (2 per multiply-add), causal attention counted as half of the full score matrix, training = 3 x forward
(backward costs twice the forward), summed over the *real* length of every sequence, never the padded one. For a
sequence of ``s`` tokens and a dense gated-MLP decoder with ``L`` layers, hidden size ``h``, query width
``q = heads * head_dim``, key/value width ``kv = kv_heads * head_dim``, MLP width ``f`` and vocabulary ``V``:

    forward(s) = 2 s [L (h q + 2 h kv + q h + 3 h f) + h V] + 2 L s^2 q

For Llama and Qwen3 this equals NeMo RL's ``llama`` / ``qwen3`` formulas term by term. NeMo RL's ``qwen2`` formula
counts the K and V projections as if there were as many KV heads as query heads; ours counts the real GQA widths,
so Qwen2.5 MFU here is slightly lower (and right).
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

from dask_lm.data.flops import device_peak_tflops

__all__ = ["Timer", "timed", "FLOPTracker", "flops_per_sequence", "_aggregate_megatron_flops_metrics"]

logger = logging.getLogger("dask_lm")

# model_type -> how to read the decoder's widths from its config; all are dense decoders with a gated MLP
_DENSE_GATED = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo2", "granite"}


def _widths(config: Any) -> dict[str, int]:
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(cfg, "model_type", None)
    if model_type not in _DENSE_GATED:
        raise ValueError(f"no FLOPs formula for model_type {model_type!r} (known: {sorted(_DENSE_GATED)})")
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    return {
        "L": int(cfg.num_hidden_layers),
        "h": int(cfg.hidden_size),
        "q": heads * head_dim,
        "kv": kv_heads * head_dim,
        "f": int(cfg.intermediate_size),
        "V": int(cfg.vocab_size),
    }


def flops_per_sequence(config: Any, seq_len: int, *, training: bool = True) -> float:
    """FLOPs of one sequence of ``seq_len`` real tokens (forward + backward when ``training``)."""
    w = _widths(config)
    s = float(seq_len)
    per_layer = w["h"] * w["q"] + 2 * w["h"] * w["kv"] + w["q"] * w["h"] + 3 * w["h"] * w["f"]
    forward = 2.0 * s * (w["L"] * per_layer + w["h"] * w["V"]) + 2.0 * w["L"] * s * s * w["q"]
    return 3.0 * forward if training else forward


class FLOPTracker:
    """Counts training FLOPs of the sequences handed to ``track_batch`` (NeMo RL's ``FLOPTracker`` interface)."""

    def __init__(self, config: Any, *, training: bool = True) -> None:
        _widths(config)  # raises for unknown families
        self.config = config
        self.training = training
        self.total_flops = 0.0

    @classmethod
    def from_config(cls, config: Any, hf_config: Any = None, *, training: bool = True) -> FLOPTracker | None:
        """A tracker for this Hugging Face config (forward only unless ``training``), or None (with a log line)
        for families without a formula. NeMo RL's form, ``from_config(model_name, hf_config)``
        (``nemo_rl/utils/flops_tracker.py``), works too: the config counts, the name is not read."""
        if hf_config is not None:
            config = hf_config
        try:
            return cls(config, training=training)
        except (ValueError, AttributeError, TypeError) as e:
            logger.info("FLOPs are not reported: %s", e)
            return None

    def reset(self) -> None:
        self.total_flops = 0.0

    def track_batch(self, sequence_lengths: Sequence[int] | Any) -> None:
        lengths = sequence_lengths.tolist() if hasattr(sequence_lengths, "tolist") else list(sequence_lengths)
        self.total_flops += sum(flops_per_sequence(self.config, int(n), training=self.training) for n in lengths)

    def track(self, n_samples: int, seq_len: int) -> None:
        self.total_flops += n_samples * flops_per_sequence(self.config, seq_len, training=self.training)


def _aggregate_megatron_flops_metrics(results: Sequence[dict[str, Any]], world_size: int) -> dict[str, Any]:
    """NeMo RL's aggregation helper: FLOP fields taken from the first result, peak = ranks x device peak; as in
    ``nemo_rl/models/policy/lm_policy.py:68-87``, ``train_elapsed_seconds`` and ``theoretical_tflops`` are left
    out when the result has no time or its device no known peak."""
    first = results[0] if results else {}
    num_ranks = int(first.get("num_ranks") or world_size)
    out: dict[str, Any] = {"total_flops": first.get("total_flops"), "num_ranks": num_ranks}
    if "train_elapsed_seconds" in first:
        out["train_elapsed_seconds"] = first["train_elapsed_seconds"]
    peak = device_peak_tflops(first.get("gpu_name"))
    if peak is not None:
        out["theoretical_tflops"] = num_ranks * peak
    return out


def timed(timer: Any, label: str) -> contextlib.AbstractContextManager[Any]:
    """``timer.time(label)`` when the caller passed a timer (NeMo RL's ``timer=`` arguments), else nothing."""
    return timer.time(label) if timer is not None and hasattr(timer, "time") else contextlib.nullcontext()


class Timer:
    """Named wall-clock timers with a list of durations per label (NeMo RL's ``Timer`` interface).

    >>> timer = Timer()
    >>> with timer.time("policy_training"):
    ...     pass
    >>> timer.reduce("policy_training", "count")
    1
    """

    _OPS: ClassVar[dict[str, Callable[[list[float]], float]]] = {
        "mean": statistics.fmean,
        "median": statistics.median,
        "min": min,
        "max": max,
        "sum": sum,
        "count": len,
        "std": lambda v: statistics.pstdev(v) if len(v) > 1 else 0.0,
    }

    def __init__(self) -> None:
        self._timers: dict[str, list[float]] = {}
        self._start: dict[str, float] = {}

    def start(self, label: str) -> None:
        if label in self._start:
            raise ValueError(f"timer {label!r} is already running")
        self._start[label] = time.perf_counter()

    def stop(self, label: str) -> float:
        if label not in self._start:
            raise ValueError(f"timer {label!r} was not started")
        elapsed = time.perf_counter() - self._start.pop(label)
        self._timers.setdefault(label, []).append(elapsed)
        return elapsed

    @contextlib.contextmanager
    def time(self, label: str) -> Iterator[None]:
        self.start(label)
        try:
            yield
        finally:
            self.stop(label)

    def get_elapsed(self, label: str) -> list[float]:
        if label not in self._timers:
            raise ValueError(f"no timings for {label!r}; known: {sorted(self._timers)}")
        return list(self._timers[label])

    def get_latest_elapsed(self, label: str) -> float:
        return self.get_elapsed(label)[-1]

    def reduce(self, label: str, operation: str = "mean") -> float:
        if operation not in self._OPS:
            raise ValueError(f"unknown reduction {operation!r}; use one of {sorted(self._OPS)}")
        return self._OPS[operation](self.get_elapsed(label))

    def get_timing_metrics(self, reduction_op: str | dict[str, str] = "sum") -> dict[str, float | list[float]]:
        out: dict[str, float | list[float]] = {}
        for label in self._timers:
            op = reduction_op.get(label, "sum") if isinstance(reduction_op, dict) else reduction_op
            out[label] = self.reduce(label, op)
        return out

    def reset(self, label: str | None = None) -> None:
        if label is None:
            self._timers.clear()
            self._start.clear()
        else:
            self._timers.pop(label, None)
            self._start.pop(label, None)

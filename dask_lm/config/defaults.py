"""Defaults that more than one place needs, each written once here: the micro-batch token budgets.

A default that only one config field has lives on that field (its dataclass default); the numbers below are read
by several modules (the scoring options, the Policy's inference pass, lm-eval's request engine, the CLI's help), so
they get names instead of being repeated."""

from __future__ import annotations

__all__ = ["PACKED_BATCH_TOKENS", "PADDED_BATCH_TOKENS"]

# Packed rows (GPU workers: real tokens only, varlen attention) run 32k tokens per forward, in scoring jobs and in a
# Policy's inference pass alike (benchmarks/logprobs.py): at 16k a 0.5B forward is short enough that the head's and
# the layers' launches show; on an H200, 16k / 32k / 64k / 128k tokens ran at 0.98 / 1 / 1.02 / 1.02x the speed for
# Qwen2.5-0.5B; activations stay near 1 GiB at 0.5B (32k x 4864 x bf16 x 3 in the MLP), and the head's fp32 logits
# are bounded by the chunk size.
PACKED_BATCH_TOKENS = 32768
# Padded rows (CPU workers, lm-eval's request engine) count the padding too, so they get half the budget.
PADDED_BATCH_TOKENS = 16384

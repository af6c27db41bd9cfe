"""FLOPs formulas against torch's own FLOP counter, MFU aggregation, and the Timer."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from dask_lm.data.flops import aggregate_flops_metrics, device_peak_tflops
from dask_lm.engine.metrics import FLOPTracker, Timer, flops_per_sequence


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_forward_flops_match_torch_flop_counter(tiny, family):
    """torch counts every matmul of an eager-attention forward, the full S x S score matrix included; our formula
    counts the causal half of attention, so the two differ by exactly 2 L S^2 q."""
    cfg = transformers.AutoConfig.from_pretrained(tiny[family])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny[family], dtype=torch.float32, attn_implementation="eager"
    )
    s = 37
    ids = torch.randint(0, cfg.vocab_size, (1, s))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(ids)
    heads, head_dim = (
        cfg.num_attention_heads,
        getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
    )
    causal_discount = 2 * cfg.num_hidden_layers * s * s * heads * head_dim
    assert flops_per_sequence(cfg, s, training=False) == counter.get_total_flops() - causal_discount
    assert flops_per_sequence(cfg, s) == 3 * flops_per_sequence(cfg, s, training=False)


def test_tracker_counts_real_lengths_and_refuses_unknown_families(tiny):
    cfg = transformers.AutoConfig.from_pretrained(tiny["llama"])
    tracker = FLOPTracker.from_config(cfg)
    tracker.track_batch(torch.tensor([5, 9]))
    assert tracker.total_flops == flops_per_sequence(cfg, 5) + flops_per_sequence(cfg, 9)
    assert FLOPTracker.from_config(transformers.GPT2Config()) is None


def test_mfu_aggregation():
    out = aggregate_flops_metrics([2.0, 4.0], ["NVIDIA H200", "NVIDIA H200"], 2, total_flops=4e15)
    assert out["train_elapsed_seconds"] == 4.0  # the slowest rank ends the step
    assert out["achieved_tflops"] == pytest.approx(1000.0)
    assert out["theoretical_tflops"] == pytest.approx(2 * 989.5)
    assert out["mfu"] == pytest.approx(1000.0 / 1979.0)
    assert device_peak_tflops("NVIDIA H100 PCIe") == 756.0 and device_peak_tflops("cpu") is None
    cpu = aggregate_flops_metrics([1.0], ["cpu"], 1, 1e12)
    assert "mfu" not in cpu and "theoretical_tflops" not in cpu and cpu["achieved_tflops"] == pytest.approx(1.0)
    # no FLOP formula for the model: no FLOP figure at all (NeMo RL's loops test `"total_flops" in result`)
    assert set(aggregate_flops_metrics([1.0], ["NVIDIA H200"], 1, None)) == {
        "num_ranks",
        "train_elapsed_seconds",
        "theoretical_tflops",
    }


def test_timer():
    timer = Timer()
    for _ in range(3):
        with timer.time("step"):
            pass
    assert timer.reduce("step", "count") == 3
    assert timer.get_timing_metrics("sum")["step"] >= 0
    with pytest.raises(ValueError, match="not started"):
        timer.stop("other")

"""The FLOP figures of one ``train()`` call from its ranks' times and devices: throughput and MFU against the
devices' dense bf16 peak. The combine task that joins the ranks' answers computes them on rank 0's worker
(:func:`dask_lm.workers.combine.reduce_train`); the driver's NeMo RL helper reads the peaks too
(:mod:`dask_lm.engine.metrics`, which also counts the FLOPs). Plain numbers: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["device_peak_tflops", "aggregate_flops_metrics"]

# dense (not 2:4 sparse) bf16 tensor-core peaks, TFLOP/s, from the vendors' datasheets; matched by substring of
# torch.cuda.get_device_name, most specific first
_BF16_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("B100", 1750.0),
    ("H200", 989.5),
    ("H100 PCIe", 756.0),
    ("H100", 989.5),
    ("H800", 989.5),
    ("H20", 148.0),
    ("GH200", 989.5),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("L4", 121.0),
    ("MI300X", 1307.4),
    ("MI325X", 1307.4),
    ("RTX 4090", 165.2),
    ("RTX 6000 Ada", 364.2),
    ("V100", 125.0),
)


def device_peak_tflops(gpu_name: str | None) -> float | None:
    """Dense bf16 peak of a GPU by name (``None`` for CPUs and unknown devices)."""
    if not gpu_name or gpu_name == "cpu":
        return None
    for key, peak in _BF16_PEAK_TFLOPS:
        if key.lower() in gpu_name.lower():
            return peak
    return None


def aggregate_flops_metrics(
    elapsed_seconds: Sequence[float], gpu_names: Sequence[str | None], world_size: int, total_flops: float | None
) -> dict[str, Any]:
    """FLOP figures of one ``train()`` call from each rank's time in it and device: total and per-rank TFLOP/s
    and MFU.

    The elapsed time is the slowest rank's (a step is done when every rank is); the peak is the sum of each
    rank's device peak. A figure that cannot be known is left out rather than guessed or None, as NeMo RL's
    Policy leaves ``total_flops`` out without a FLOP formula and ``theoretical_tflops`` out for a device without
    a known peak (``nemo_rl/models/policy/lm_policy.py:834-845``): its loops test for the key, then divide by it
    (``nemo_rl/algorithms/sft.py:614-629``). So a CPU rank, or any GPU missing from the peak table, gives no
    ``theoretical_tflops`` and no ``mfu``; a model family without a formula gives none of the FLOP figures.
    """
    out: dict[str, Any] = {"num_ranks": len(elapsed_seconds) or world_size}
    elapsed = max((float(e or 0.0) for e in elapsed_seconds), default=0.0)
    out["train_elapsed_seconds"] = elapsed
    peaks = [device_peak_tflops(name) for name in gpu_names]
    theoretical = sum(p for p in peaks if p is not None) if peaks and None not in peaks else None
    if theoretical is not None:
        out["theoretical_tflops"] = theoretical
    if total_flops is None:
        return out
    out["total_flops"] = total_flops
    if elapsed <= 0:
        return out
    achieved = total_flops / elapsed / 1e12
    out["achieved_tflops"] = achieved
    out["achieved_tflops_per_rank"] = achieved / out["num_ranks"]
    if theoretical:
        out["mfu"] = achieved / theoretical
    return out

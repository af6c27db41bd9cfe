"""Helpers shared by the benchmark scripts: synthetic rows, random model shapes, the measured matmul peak."""

from __future__ import annotations

import math
import os
import time

import torch

GIB = 2**30
H200_BF16_DENSE = 989.5e12  # datasheet dense bf16 (perf_anchors.md section 6); MFU is also given against it
SHAPES = {
    "qwen2.5-0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
}
SHAPE_CHOICES = ["tiny", *SHAPES]  # what every script's --shape accepts


def make_rows(
    num_rows: int, min_len: int, max_len: int, median_len: int, sigma: float, vocab: int, pad_id: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids [N, S]`` and ``input_lengths [N]``: lognormal lengths, random ids in [3, vocab)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.exp(torch.randn(num_rows, generator=g) * sigma + math.log(median_len))
    lens = lens.round().clamp(min_len, max_len).long()
    ids = torch.randint(3, vocab, (num_rows, int(lens.max())), generator=g)
    ids[torch.arange(ids.shape[1])[None, :] >= lens[:, None]] = pad_id
    return ids, lens


def build_model(shape: str, root: str, max_len: int) -> str:
    """A random model directory: ``tiny`` (CPU-sized llama) or a real Qwen2.5 shape (for the GPU)."""
    path = os.path.join(root, shape)
    if shape == "tiny":
        from dask_lm.tiny import build_tiny_model

        return build_tiny_model(
            path,
            family="llama",
            vocab_size=4096,
            hidden_size=256,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=512,
            max_position_embeddings=max(4096, max_len),
        )
    import transformers

    cfg = transformers.Qwen2Config(**SHAPES[shape], max_position_embeddings=max(32768, max_len), pad_token_id=0)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    # HF's default init (std 0.02), not tiny's widened one: 24 layers of std-0.2 weights give extreme logits.
    # Built in bf16 directly on the GPU when there is one (a 7B model in seconds, where fp32 on the CPU took
    # minutes) and saved as bf16 safetensors, the precision the benchmarks load it in.
    where = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    with where:
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    if where.type == "cuda":
        torch.cuda.empty_cache()
    print(f"built random {shape} (bf16, on {where.type}) in {time.perf_counter() - t0:.1f} s", flush=True)
    return path


def measured_peak(device: torch.device) -> tuple[float, str]:
    """Best matmul FLOP/s on ``device``: bf16 8192^3 on a GPU (as in perf_anchors.md section 0), fp32 2048^3 on CPU."""
    n, dtype, iters = (8192, torch.bfloat16, 10) if device.type == "cuda" else (2048, torch.float32, 5)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for i in range(iters + 3):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        if i >= 3:  # the first calls pick kernels and warm clocks
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best, f"{'bf16' if dtype == torch.bfloat16 else 'fp32'} {n}^3 matmul"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _worker_peak_bytes() -> int:
    """Runs on the worker (via client.run): peak device bytes, or the worker process's peak RSS on CPU."""
    import resource

    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _worker_reset_peak() -> int:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
    return torch.get_num_threads()


def _worker_last_call_seconds(dask_worker) -> float:
    """Runs on the worker: seconds the rank spent inside its last Policy call (its compute, without the driver)."""
    from dask_lm.workers.state import PLUGIN_NAME

    return float(dask_worker.plugins[PLUGIN_NAME].last_call["seconds"])


class DriverBytes:
    """Bytes this process (the driver) writes to the scheduler over TCP while the block runs: what a Policy call
    sends, tasks, scattered rows and plans alike (``distributed.comm.tcp.TCP.write`` returns the bytes of the
    frames it wrote). Only writes to the scheduler's address count, so a LocalCluster's scheduler, which runs in
    this same process and forwards what it received to the workers, is not counted twice. The client sends through
    the scheduler unless ``distributed.client.direct-to-workers`` is set: off by default, so every byte it sends is
    here."""

    def __init__(self, client) -> None:
        self.address = client.scheduler.address
        self.total = 0

    def __enter__(self) -> DriverBytes:
        from distributed.comm.tcp import TCP

        original, counter = TCP.write, self

        async def write(comm, *args, **kwargs):
            n = await original(comm, *args, **kwargs)
            if comm.peer_address == counter.address:
                counter.total += int(n or 0)
            return n

        self._original, TCP.write = original, write
        return self

    def __exit__(self, *exc) -> None:
        from distributed.comm.tcp import TCP

        TCP.write = self._original

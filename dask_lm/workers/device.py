"""The one module that knows CUDA from CPU.

Everything else asks this module for the rank's device, the collective backend, memory figures and profiler
hooks. dask-cuda gives every worker a rotated ``CUDA_VISIBLE_DEVICES``, so a worker's own GPU is always
``cuda:0``: never index devices by rank. Only worker-side code imports this module; the driver (``engine/``,
``io/``) never initialises CUDA.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

__all__ = [
    "is_cuda",
    "local_device",
    "collective_backend",
    "torch_dtype",
    "synchronize",
    "empty_cache",
    "free_memory_bytes",
    "memory_in_use_bytes",
    "peak_memory_bytes",
    "reset_peak_memory",
    "device_info",
    "pin",
    "start_profiler",
    "stop_profiler",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_cuda() -> bool:
    """True when this process should run on a GPU. ``DASK_LM_FORCE_CPU=1`` forces the CPU path."""
    return os.environ.get("DASK_LM_FORCE_CPU", "0") != "1" and torch.cuda.is_available()


def local_device() -> torch.device:
    if is_cuda():
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def collective_backend() -> str:
    return "nccl" if is_cuda() else "gloo"


def torch_dtype(precision: str) -> torch.dtype:
    try:
        return _DTYPES[precision]
    except KeyError:
        raise ValueError(f"`policy.precision` must be one of {sorted(_DTYPES)}, got {precision!r}") from None


def synchronize() -> None:
    if is_cuda():
        torch.cuda.synchronize()


def empty_cache() -> None:
    if is_cuda():
        torch.cuda.empty_cache()


def free_memory_bytes() -> int:
    """Free memory of the physical device, as NVML sees it (host RAM on CPU)."""
    if is_cuda():
        free, _total = torch.cuda.mem_get_info(0)  # cudaMemGetInfo: the whole device, not torch's pool
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def memory_in_use_bytes() -> int:
    if is_cuda():
        return int(torch.cuda.memory_allocated(0))
    import psutil

    return int(psutil.Process().memory_info().rss)


def peak_memory_bytes() -> int:
    if is_cuda():
        return int(torch.cuda.max_memory_allocated(0))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reset_peak_memory() -> None:
    if is_cuda():
        torch.cuda.reset_peak_memory_stats(0)


def device_info() -> dict[str, Any]:
    """Node IP and device identity, for ``print_node_ip_and_gpu_id`` and the notebook repr."""
    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        ip = "127.0.0.1"
    info: dict[str, Any] = {"node_ip": ip, "hostname": socket.gethostname(), "pid": os.getpid()}
    if is_cuda():
        props = torch.cuda.get_device_properties(0)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        info.update(device="cuda", gpu_id=visible, gpu_name=props.name, gpu_uuid=str(getattr(props, "uuid", "")),
                    total_memory=int(props.total_memory))
    else:
        info.update(device="cpu", gpu_id=None, gpu_name="cpu", gpu_uuid=None, total_memory=None)
    return info


def pin(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``: page-locked on GPU machines so copies back to the device can be asynchronous."""
    host = t.detach().to("cpu", copy=True)
    return host.pin_memory() if is_cuda() else host


def start_profiler() -> None:
    if is_cuda():
        torch.cuda.profiler.start()


def stop_profiler() -> None:
    if is_cuda():
        torch.cuda.profiler.stop()

"""The one module that knows CUDA from CPU.

Everything else asks this module for the rank's device, the collective backend, memory figures and profiler
hooks. dask-cuda gives every worker a rotated ``CUDA_VISIBLE_DEVICES``, so a worker's own GPU is always
``cuda:0``: never index devices by rank. Only worker-side code imports this module; the driver (``engine/``,
``io/``) never initialises CUDA.
"""

from __future__ import annotations

import functools
import os
import socket
from typing import Any

import torch

__all__ = [
    "is_cuda",
    "flash_attention_capable",
    "fp32_logits_capable",
    "compile_capable",
    "local_device",
    "collective_backend",
    "torch_dtype",
    "dtype_name",
    "dtypes_by_name",
    "synchronize",
    "initialise",
    "empty_cache",
    "free_memory_bytes",
    "ipc_kind",
    "shareable_free_bytes",
    "memory_in_use_bytes",
    "peak_memory_bytes",
    "reset_peak_memory",
    "device_info",
    "pin",
    "upload",
    "record_event",
    "start_profiler",
    "stop_profiler",
    "device_id",
    "device_uuid",
    "index_for_uuid",
    "ipc_collect",
    "refit_device",
    "standalone_group",
    "close_standalone_group",
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


def flash_attention_capable(dtype: torch.dtype) -> bool:
    """A GPU of compute capability 8.0+ (Ampere, Hopper) computing in half precision: what flash-attention
    kernels such as ``torch.nn.attention.varlen.varlen_attn`` need."""
    if not is_cuda() or dtype not in (torch.bfloat16, torch.float16):
        return False
    return torch.cuda.get_device_capability(0)[0] >= 8


def fp32_logits_capable(dtype: torch.dtype) -> bool:
    """Whether a half-precision matmul can write float32 output directly here (``torch.mm(..., out_dtype=)``,
    CUDA only, torch >= 2.8): the output head's logits then skip the bf16 rounding and the separate upcast pass."""
    return is_cuda() and dtype in (torch.bfloat16, torch.float16) and _mm_out_dtype(dtype)


@functools.cache
def _mm_out_dtype(dtype: torch.dtype) -> bool:
    """One tiny matmul with ``out_dtype``: older torch has no such argument (TypeError) or no kernel for it."""
    try:
        x = torch.ones(2, 2, dtype=dtype, device="cuda")
        return torch.mm(x, x, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def compile_capable() -> bool:
    """Whether ``torch.compile`` (Inductor, Triton kernels) runs the inference forward here: a GPU with Triton.
    The CPU path stays eager, so CI checks the exact reference arithmetic. ``DASK_LM_COMPILE=0`` turns it off."""
    if os.environ.get("DASK_LM_COMPILE", "1") == "0" or not is_cuda():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fused_optimizer_capable(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused (single-kernel) optimizer step can run on ``params``: floating tensors on a GPU."""
    return bool(params) and all(p.is_cuda and p.is_floating_point() for p in params)


def collective_backend() -> str:
    return "nccl" if is_cuda() else "gloo"


def torch_dtype(precision: str) -> torch.dtype:
    try:
        return _DTYPES[precision]
    except KeyError:
        raise ValueError(f"`policy.precision` must be one of {sorted(_DTYPES)}, got {precision!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as messages between processes name it (``"bfloat16"``): what :func:`dtypes_by_name` reads back."""
    return str(dtype).removeprefix("torch.")


def dtypes_by_name(*dtypes: torch.dtype) -> dict[str, torch.dtype]:
    """``name -> dtype`` for the dtypes a message may name: a table, so a name from a peer is only ever a key, never
    an attribute lookup."""
    return {dtype_name(d): d for d in dtypes}


def synchronize() -> None:
    if is_cuda():
        torch.cuda.synchronize()


def initialise() -> None:
    """Make this process's CUDA context and the allocator's first block now (about a second on a GPU; nothing on
    the CPU), so that the first task that needs the device does not pay for it (:mod:`dask_lm.workers.warm`)."""
    if is_cuda():
        torch.empty(1, device=local_device())
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


def ipc_kind() -> str:
    """How this rank shares a buffer with another process on its machine (:mod:`dask_lm.model.shared_buffer`):
    CUDA IPC on a GPU, a POSIX shared-memory file on the CPU."""
    return "cuda" if is_cuda() else "shm"


def shareable_free_bytes() -> int:
    """The bytes a new shareable buffer may take: the GPU's free memory, or on the CPU the smaller of free host RAM
    and the free space of ``/dev/shm`` (a tmpfs with its own size limit, often half the RAM, 64 MiB in Docker)."""
    free = free_memory_bytes()
    if is_cuda():
        return free
    try:
        st = os.statvfs("/dev/shm")
    except OSError:  # no /dev/shm: the buffer cannot be made at all
        return 0
    return min(free, st.f_bavail * st.f_frsize)


def total_memory_bytes() -> int | None:
    """The GPU's memory, or None on the CPU (where there is no device memory to budget)."""
    if is_cuda():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return None


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
    """Node IP and device identity, for ``print_node_ip_and_gpu_id`` and the notebook repr. The node IP is the
    host of this Dask worker's address (what the scheduler and the other ranks reach it by); outside a worker,
    what the host name resolves to (often 127.0.1.1 on Debian-like hosts, the same on every node)."""
    from dask_lm.comm.rendezvous import worker_host

    try:
        ip = worker_host()
    except ValueError:  # not in a Dask worker
        try:
            ip = socket.gethostbyname(socket.gethostname())
        except OSError:
            ip = "127.0.0.1"
    info: dict[str, Any] = {"node_ip": ip, "hostname": socket.gethostname(), "pid": os.getpid()}
    if is_cuda():
        props = torch.cuda.get_device_properties(0)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        info.update(
            device="cuda",
            gpu_id=visible,
            gpu_name=props.name,
            gpu_uuid=str(getattr(props, "uuid", "")),
            total_memory=int(props.total_memory),
        )
    else:
        info.update(device="cpu", gpu_id=None, gpu_name="cpu", gpu_uuid=None, total_memory=None)
    return info


def pin(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host copies of ``tensors``: page-locked on GPU machines so copies back to the device can be asynchronous.
    Each is copied once, straight into its page-locked buffer, the copies queued on the stream and waited for once
    (a copy into pageable memory and then into page-locked memory took twice the bytes and a wait per tensor: 1 s
    for a 0.5B model's bf16 weights on an H100)."""
    if not is_cuda():
        return {n: t.detach().to("cpu", copy=True) for n, t in tensors.items()}
    out = {}
    for n, t in tensors.items():
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out[n] = host.copy_(t.detach(), non_blocking=True)
    synchronize()
    return out


def upload(t: torch.Tensor, where: torch.device) -> torch.Tensor:
    """``t`` (on the host) on ``where`` without making the host wait: through page-locked memory on a GPU, so the
    copy queues behind the work already launched instead of stalling the next launches."""
    if where.type == "cuda":
        return t.pin_memory().to(where, non_blocking=True)
    return t.to(where)


class _Done:
    def synchronize(self) -> None:
        pass


def record_event() -> Any:
    """A marker after the work queued so far; ``.synchronize()`` waits for it (at once on the CPU)."""
    if is_cuda():
        event = torch.cuda.Event()
        event.record()
        return event
    return _Done()


def start_profiler() -> None:
    if is_cuda():
        torch.cuda.profiler.start()


def stop_profiler() -> None:
    if is_cuda():
        torch.cuda.profiler.stop()


# ----------------------------------------------------------------------------------------- refit helpers
def device_uuid(index: int = 0) -> str:
    """The GPU's UUID as ``str(props.uuid)``: the form SGLang's reduction patch writes into CUDA IPC payloads."""
    return str(torch.cuda.get_device_properties(index).uuid)


def device_id() -> str:
    """A stable name for this rank's device: the GPU UUID, or ``cpu-<host>-<pid>`` on a CPU worker."""
    if is_cuda():
        return device_uuid(0)
    return f"cpu-{socket.gethostname()}-{os.getpid()}"


def index_for_uuid(device: Any) -> int:
    """The local CUDA index of a device named by UUID (ints pass through): CUDA_VISIBLE_DEVICES differs between
    the process that exported an IPC handle and the one that opens it, so indices cannot travel."""
    if isinstance(device, int):
        return device
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == str(device):
            return i
    raise ValueError(
        f"CUDA IPC payload names device {device!r}, which this process cannot see "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); the receiver must run on "
        "the same node and see that GPU"
    )


def ipc_collect() -> None:
    """Free CUDA blocks that were exported over IPC once every consumer has released them."""
    if is_cuda():
        torch.cuda.ipc_collect()


def refit_device(index: int | None = None) -> torch.device:
    """The device a refit receiver works on: ``cuda:<index>`` (default: the process's current CUDA device, which
    an inference engine has already chosen), or the CPU."""
    if is_cuda():
        return torch.device("cuda", torch.cuda.current_device() if index is None else index)
    return torch.device("cpu")


def standalone_group(store: Any, rank: int, world_size: int, timeout_s: float, backend: str | None = None) -> Any:
    """A process group outside ``torch.distributed``'s world (refit to inference processes): ``backend``, or by
    default NCCL on GPUs, gloo on CPU. Used through its own methods, never through ``dist.*`` helpers; NCCL runs
    on the device of the tensors it is given, gloo's point-to-point calls take host tensors
    (:func:`standalone_tensors_device`)."""
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl" or (backend is None and is_cuda()):
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def standalone_tensors_device(backend: str | None) -> torch.device:
    """Where the tensors a standalone group of ``backend`` moves live: the rank's GPU for NCCL, the host for gloo
    (its send / recv read host memory only)."""
    return local_device() if backend == "nccl" or (backend is None and is_cuda()) else torch.device("cpu")


def close_standalone_group(group: Any) -> None:
    """Drop a refit group without waiting for its peers: NCCL's orderly shutdown can wait for a peer that keeps
    its end open (or is gone), so NCCL communicators are aborted; gloo ones shut down."""
    import torch.distributed as dist

    nccl = getattr(dist, "ProcessGroupNCCL", None)  # absent from CPU-only builds
    if nccl is not None and isinstance(group, nccl):
        group.abort()
    else:
        group.shutdown()

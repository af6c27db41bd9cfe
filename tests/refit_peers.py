"""Inference-side processes for the refit tests: each receives one refit with dask_lm.refit.receiver and saves
what arrived (cloned, by name) for the test to compare with the weights the policy wrote to disk."""

from __future__ import annotations

import os

os.environ.setdefault("DASK_LM_FORCE_CPU", "1")


def _collector():
    got, messages = {}, []

    def on_weights(named):
        messages.append([n for n, _ in named])
        for n, t in named:
            assert n not in got, f"{n} arrived twice"
            got[n] = t.detach().to("cpu", copy=True)

    return got, messages, on_weights


def zmq_peer(address: str, refit_info: dict, out_path: str, timeout_s: float = 120.0) -> None:
    import torch

    from dask_lm.refit.receiver import receive_via_zmq

    got, messages, on_weights = _collector()
    stats = receive_via_zmq(address, refit_info, on_weights, timeout_s=timeout_s)
    torch.save({"weights": got, "messages": messages, "stats": stats}, out_path)


def collective_peer(
    ip: str, port: int, world_size: int, rank: int, refit_info: dict, out_path: str, calls: int = 1
) -> None:
    import torch

    from dask_lm.refit.receiver import CollectiveReceiver

    receiver = CollectiveReceiver(ip, port, world_size, rank, refit_info, timeout_s=120)
    results = []
    for _ in range(calls):
        got, messages, on_weights = _collector()
        try:
            stats = receiver.receive(on_weights)
        except Exception as e:  # the test reads the error back
            results.append({"error": f"{type(e).__name__}: {e}"})
            break
        results.append({"weights": got, "messages": messages, "stats": stats})
    torch.save(results, out_path)  # before closing: what arrived is on disk whatever closing does
    receiver.close()


def cuda_ipc_exporter(conn) -> None:
    """Export a CUDA buffer (int32 0..4095 as 16 KiB of uint8) as a wire header over ``conn``; keep it alive
    until the other end answers."""
    import torch

    from dask_lm.model import cuda_ipc
    from dask_lm.refit import wire

    t = torch.arange(4096, dtype=torch.int32, device="cuda").view(torch.uint8)
    torch.cuda.synchronize()
    conn.send_bytes(wire.encode_weights(["w"], t.numel(), transport="ipc", ipc=cuda_ipc.encode_cuda(t)))
    conn.recv_bytes()


def sglang_cuda_payload_check(out_path: str) -> None:
    """In a process of its own (SGLang's torch patch is process-wide): build our CUDA IPC payload without a GPU,
    with torch's reduce_tensor answering as it does for a CUDA tensor (15 arguments, device index 0) and a fixed
    GPU UUID, then hand it to SGLang's deserializer. Writes what SGLang raised."""
    import torch
    from sglang_server import install_triton_stub
    from torch.multiprocessing import reductions

    from dask_lm.model import device
    from dask_lm.refit import buckets as bk

    fake_uuid = "GPU-12345678-1234-1234-1234-123456789abc"
    args = (
        torch.Tensor,
        (16,),
        (1,),
        0,
        torch.UntypedStorage,
        torch.uint8,
        0,
        b"\x01" * 64,
        16,
        0,
        False,
        "/torch_ipc_ref",
        0,
        b"\x02" * 64,
        True,
    )
    reductions.reduce_tensor = lambda t: (reductions.rebuild_cuda_tensor, args)
    device.device_uuid = lambda index=0: fake_uuid
    plan = bk.plan_buckets({"w": ((4,), torch.float32)}, 1024)
    payload = bk.dumps_b64(bk.sglang_bucket(torch.zeros(16, dtype=torch.uint8), plan[0]), "ipc")

    install_triton_stub()
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()  # what the server runs before it deserializes
    try:
        MultiprocessingSerializer.deserialize(payload)
        result = "accepted"
    except Exception as e:
        result = f"{type(e).__name__}: {e}"
    with open(out_path, "w") as f:
        f.write(result)


def reshard_peer(ip: str, port: int, world_size: int, rank: int, plan: dict, out_path: str) -> None:
    import torch

    from dask_lm.refit.receiver import ReshardReceiver

    receiver = ReshardReceiver(ip, port, world_size, rank, plan, timeout_s=120)
    got, messages, on_weights = _collector()
    try:
        stats = receiver.receive(on_weights)
        torch.save({"weights": got, "messages": messages, "stats": stats}, out_path)
    except Exception as e:  # the test reads the error back
        torch.save({"error": f"{type(e).__name__}: {e}"}, out_path)
    receiver.close()

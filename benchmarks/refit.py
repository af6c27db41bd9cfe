"""Refit speed: every weight of a Qwen2.5-shaped bf16 policy, from its Dask worker to an inference process.

Two routes, timed in one run with the copy rates that bound them:

- same GPU, CUDA IPC buckets: ``Policy.stream_weights_via_ipc_zmq`` to a receiver process on the policy's GPU that
  copies each bucket into its own preallocated weights (what an inference engine's ``load_weights`` does); the
  limit is the GPU's device-to-device copy rate (a 1 GiB ``copy_`` on that GPU, measured here);
- another GPU, NCCL: ``Policy.broadcast_weights_for_collective`` to a receiver process on the second GPU; the limit
  is the GPU-to-GPU copy rate (a 1 GiB peer copy, measured here).

Each route runs ``--repeats`` times after one warm-up; the best and median times are printed with GB/s and the
fraction of the limit. Weights are random (``skip_weight_load``): only their sizes matter.

    python benchmarks/refit.py --shapes qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import GIB, SHAPES


def _config_dir(shape: str, root: str) -> str:
    """A model directory with only config.json: the policy builds random weights (skip_weight_load)."""
    import transformers

    path = os.path.join(root, shape)
    transformers.Qwen2Config(**SHAPES[shape], pad_token_id=0).save_pretrained(path)
    return path


def _copy_rate(src_dev: str, dst_dev: str, nbytes: int = GIB, iters: int = 10) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device=src_dev)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
    best = float("inf")
    for i in range(iters + 2):
        torch.cuda.synchronize(src_dev)
        torch.cuda.synchronize(dst_dev)
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(src_dev)
        torch.cuda.synchronize(dst_dev)
        if i >= 2:
            best = min(best, time.perf_counter() - t0)
    return nbytes / best


def _receiver_weights(info: dict) -> dict[str, torch.Tensor]:
    return {n: torch.empty(tuple(shape), dtype=dtype, device="cuda") for n, (shape, dtype) in info.items()}


def _load_into(weights: dict[str, torch.Tensor]):
    def on_weights(named):
        for n, t in named:
            weights[n].copy_(t, non_blocking=True)

    return on_weights


def zmq_receiver(address: str, info: dict, calls: int, conn) -> None:
    from dask_lm.refit.receiver import receive_via_zmq

    weights = _receiver_weights(info)
    conn.send(_copy_rate("cuda:0", "cuda:0"))  # the limit, on the same GPU, in this run
    for _ in range(calls):
        receive_via_zmq(address, info, _load_into(weights), timeout_s=600)
    torch.cuda.synchronize()


def nccl_receiver(port: int, info: dict, calls: int) -> None:
    from dask_lm.refit.receiver import CollectiveReceiver

    weights = _receiver_weights(info)
    receiver = CollectiveReceiver("127.0.0.1", port, 2, 1, info, timeout_s=600)
    for _ in range(calls):
        receiver.receive(_load_into(weights))
    torch.cuda.synchronize()
    receiver.close()


def _spawn(target, args, env: dict[str, str]):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
        proc.start()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return proc


def _timed(client, submit, calls: int) -> tuple[list[float], list[float]]:
    """Wall seconds of each call seen from the driver, and the rank's own seconds for the stream."""
    times, inside = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        stats = client.gather(submit())
        times.append(time.perf_counter() - t0)
        inside.append(stats[0]["seconds"])
    return times[1:], inside[1:]


def run_shape(client, shape: str, root: str, tok, buffer_bytes: int, repeats: int, peer_rate: float | None) -> None:
    import dask_lm

    policy = dask_lm.Policy(
        client,
        {"model_name": _config_dir(shape, root), "precision": "bfloat16"},
        tok,
        workers_per_node=1,
        init_optimizer=False,
        init_reference_model=False,
        skip_weight_load=True,
    )
    with policy:
        info = policy.prepare_refit_info()
        total = sum(torch.Size(s).numel() * d.itemsize for s, d in info.values())
        gpu = str(policy.worker_info[0]["gpu_id"])  # the physical index (dask-cuda rotates CUDA_VISIBLE_DEVICES)
        calls = repeats + 1
        # same GPU: CUDA IPC buckets over ZMQ
        parent, child = mp.get_context("spawn").Pipe()
        proc = _spawn(
            zmq_receiver,
            (policy.get_zmq_addresses()[0], info, calls, child),
            {"CUDA_VISIBLE_DEVICES": gpu, "DASK_LM_FORCE_CPU": "0"},
        )
        child.close()  # so a receiver that dies makes recv() fail instead of waiting forever
        d2d = parent.recv()
        ipc = _timed(client, lambda: policy.stream_weights_via_ipc_zmq(buffer_bytes, timeout_s=120), calls)
        proc.join(600)
        _report(shape, "CUDA IPC, same GPU", total, ipc, d2d, "D2D copy")
        if peer_rate is None:
            return
        # another GPU: NCCL broadcast
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        other = next(g for g in map(str, range(torch.cuda.device_count())) if g != gpu)
        proc = _spawn(nccl_receiver, (port, info, calls), {"CUDA_VISIBLE_DEVICES": other, "DASK_LM_FORCE_CPU": "0"})
        client.gather(policy.init_collective("127.0.0.1", port, 2, train_world_size=1))
        nccl = _timed(client, lambda: policy.broadcast_weights_for_collective(buffer_size_bytes=buffer_bytes), calls)
        proc.join(600)
        _report(shape, "NCCL, GPU to GPU", total, nccl, peer_rate, "peer copy")


def _report(
    shape: str, route: str, total: int, timed: tuple[list[float], list[float]], limit: float, limit_name: str
) -> None:
    times, inside = timed
    best, med, rank_best = min(times), statistics.median(times), min(inside)
    rate = total / best
    print(
        f"{shape:>13}  {route:<19} {total / 1e9:6.2f} GB  best {best:6.3f} s  median {med:6.3f} s  "
        f"{rate / 1e9:7.1f} GB/s  = {rate / limit:5.1%} of {limit_name} {limit / 1e9:.0f} GB/s  "
        f"(in the rank: {rank_best:6.3f} s, {total / rank_best / 1e9:7.1f} GB/s)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b")
    parser.add_argument("--buffer-mb", type=int, default=1024, help="refit bucket size (MiB)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/refit.py needs CUDA GPUs")
    import transformers

    import dask_lm
    from dask_lm.tiny import train_tiny_tokenizer

    peer = _copy_rate("cuda:0", "cuda:1") if torch.cuda.device_count() > 1 else None
    torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as root:
        tok = transformers.AutoTokenizer.from_pretrained(train_tiny_tokenizer(os.path.join(root, "tok")))
        client = dask_lm.connect(cluster="cuda")
        try:
            print(
                f"buffer {args.buffer_mb} MiB, {args.repeats} timed calls after a warm-up; "
                f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}",
                flush=True,
            )
            for shape in args.shapes.split(","):
                run_shape(client, shape, root, tok, args.buffer_mb * 2**20, args.repeats, peer)
        finally:
            dask_lm.engine.cluster.close(client)


if __name__ == "__main__":
    main()

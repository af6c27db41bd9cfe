"""The inference side of dask-lm's ZMQ and collective refits: run these in the process that serves the model.

SGLang servers need nothing from here (they speak their own protocol, see ``Policy.stream_weights_via_http``).
A vLLM-style worker extension, a custom server or a test calls:

- :func:`receive_via_zmq` on the socket of the policy rank that shares its device
  (``Policy.get_zmq_addresses()``), while the policy runs ``stream_weights_via_ipc_zmq``;
- :class:`CollectiveReceiver` to join ``Policy.init_collective``'s group, then ``receive`` while the policy runs
  ``broadcast_weights_for_collective``.

Both hand ``on_weights`` a list of ``(name, tensor)`` per bucket. The tensors are views of a buffer that is
reused (or owned by the policy) after ``on_weights`` returns: copy them into the model there, e.g. with
``model.load_weights(...)`` or ``param.copy_(tensor)``. Nothing received is unpickled (ZMQ messages are msgpack
headers and raw bytes, :mod:`dask_lm.refit.wire`), and the policy's socket sits in a directory only its user can
enter: run the receiver as that user, on the same host.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from dask_lm.model import cuda_ipc, device
from dask_lm.refit import buckets as bk
from dask_lm.refit import reshard, wire

__all__ = ["receive_via_zmq", "CollectiveReceiver", "ReshardReceiver"]

OnWeights = Callable[[list[tuple[str, torch.Tensor]]], None]
RefitInfo = Mapping[str, tuple[Sequence[int], torch.dtype]]


def receive_via_zmq(
    address: str, refit_info: RefitInfo, on_weights: OnWeights, *, timeout_s: float = 120.0
) -> dict[str, Any]:
    """Serve one ``stream_weights_via_ipc_zmq`` call on ``address`` (connects a REP socket; returns after the
    ``complete`` message). ``refit_info`` is ``Policy.prepare_refit_info()``.

    Messages are data only (:mod:`dask_lm.refit.wire`): a message that is not a valid dask-lm refit message for
    this refit info is answered with a rejection (so the policy fails at once) and raises ``ValueError`` here."""
    import zmq

    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    sock.connect(address)
    start, received, messages = time.perf_counter(), 0, 0
    seen: set[str] = set()
    try:
        while True:
            try:
                frames = sock.recv_multipart(copy=False)
            except zmq.Again:
                raise TimeoutError(f"no refit message on {address} within {timeout_s:.0f} s") from None
            try:
                used, tensors = _read(frames, refit_info, seen)
                if tensors is None:  # the `complete` message
                    sock.send(wire.ACK)
                    break
                on_weights(tensors)
                device.synchronize()
            except Exception as e:  # tell the policy at once instead of leaving it to its timeout
                try:
                    sock.send_multipart(wire.reject_frames(f"{type(e).__name__}: {e}"), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                if isinstance(e, ValueError):
                    raise ValueError(f"refit message {messages + 1} on {address}: {e}") from None
                raise
            received, messages = received + used, messages + 1
            del tensors, frames  # release the producer's buffer before saying so
            sock.send(wire.ACK)
    finally:
        sock.close(linger=0)
    return {"bytes": received, "messages": messages, "seconds": time.perf_counter() - start}


def _read(
    frames: list[Any], refit_info: RefitInfo, seen: set[str]
) -> tuple[int, list[tuple[str, torch.Tensor]] | None]:
    """``(bytes, [(name, view of the buffer)])`` of a weights message, ``(0, None)`` for ``complete``; every part
    checked first (``ValueError`` naming what is wrong)."""
    header = wire.decode_header(frames[0].bytes)
    kind, transport = header["kind"], header.get("transport")
    expected_frames = 2 if transport == "bytes" else 1
    if len(frames) != expected_frames:
        raise ValueError(
            f"a {kind!r} refit message{f' ({transport})' if transport else ''} should have "
            f"{expected_frames} frame(s), got {len(frames)}"
        )
    if kind == "complete":
        missing = [n for n in refit_info if n not in seen]
        if missing:
            raise ValueError(
                f"the policy finished with {len(missing)} of {len(refit_info)} weights not sent "
                f"({missing[:3]}...): the refit info differs from the policy's"
            )
        return 0, None
    slots = wire.layout(header["names"], header["used"], refit_info, seen)
    used = header["used"]
    if transport == "bytes":
        data = frames[1].buffer
        if len(data) != used:
            raise ValueError(f"a refit message announces {used} bytes and carries {len(data)}")
        flat = torch.frombuffer(data, dtype=torch.uint8) if used else torch.empty(0, dtype=torch.uint8)
    else:
        flat = cuda_ipc.open_cuda(header["ipc"])
        if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < used:
            raise ValueError(
                f"the CUDA IPC buffer of a refit message is {flat.dtype} {tuple(flat.shape)}, not a flat "
                f"uint8 buffer of at least {used} bytes"
            )
    return used, [
        (name, flat[start : start + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape))
        for name, start, shape, dtype in slots
    ]


class CollectiveReceiver:
    """An inference rank of ``Policy.init_collective``'s group (rank ``train_world_size + i``).

    The constructor blocks until every member joined, so create it while the policy's ``init_collective``
    futures are pending (another thread or process). Buffers live on ``cuda:<device_index>`` (default: the
    current CUDA device), or on the CPU without GPUs."""

    def __init__(
        self,
        ip: str,
        port: int,
        world_size: int,
        rank: int,
        refit_info: RefitInfo,
        *,
        timeout_s: float = 600.0,
        device_index: int | None = None,
    ) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        if not 0 < rank < world_size:
            raise ValueError(f"an inference rank must be in [1, {world_size}), got {rank}")
        self.refit_info = dict(refit_info)
        self.device = device.refit_device(device_index)  # the engine's current GPU unless told otherwise
        self.store = dist.TCPStore(ip, int(port), world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
        self.group = device.standalone_group(dist.PrefixStore("dask-lm-refit", self.store), rank, world_size, timeout_s)

    def _broadcast(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        self.group.broadcast([t], opts).wait()

    def receive(self, on_weights: OnWeights) -> dict[str, Any]:
        """Take part in one ``broadcast_weights_for_collective`` call."""
        import torch.distributed as dist

        header = torch.zeros(5, dtype=torch.int64, device=self.device)
        self._broadcast(header)
        buffer_size = int(header[0].item())
        plan = bk.plan_buckets(self.refit_info, buffer_size)
        ok = bk.plan_digest(plan) == [int(x) for x in header[1:].tolist()]
        agreed = torch.tensor([1 if ok else 0], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]  # pybind converts it; the stubs omit that
        self.group.allreduce([agreed], opts).wait()
        if not ok:
            raise ValueError(
                "this receiver's refit info does not match the policy's (different names, shapes or "
                "dtypes): pass Policy.prepare_refit_info() unchanged"
            )
        if int(agreed.item()) != 1:
            raise RuntimeError("another member of the refit group planned different buckets; nothing was received")
        start, total = time.perf_counter(), 0
        for bucket in plan:
            flat = torch.empty(bk.bucket_nbytes(bucket), dtype=torch.uint8, device=self.device)
            self._broadcast(flat)
            on_weights(bk.unpack(flat, bucket))
            total += flat.numel()
        device.synchronize()
        return {"bytes": total, "buckets": len(plan), "seconds": time.perf_counter() - start}

    def close(self) -> None:
        try:
            device.close_standalone_group(self.group)
        except Exception:  # peers already gone
            pass


class ReshardReceiver(CollectiveReceiver):
    """An inference rank of a resharded refit (``Policy.nccl_reshard_refit``): member ``train_world_size + j`` of
    ``init_nccl_reshard_comm_group``'s group, holding slice ``j % tp`` of each weight as the ``plan``
    (``Policy.prepare_nccl_reshard_refit_info()``, plain data) says. Each call of :meth:`receive` hands
    ``on_weights([(name, slice)])`` one weight at a time, assembled from the training ranks' boxes."""

    def __init__(
        self,
        ip: str,
        port: int,
        world_size: int,
        rank: int,
        plan: dict[str, Any],
        *,
        timeout_s: float = 600.0,
        device_index: int | None = None,
    ) -> None:
        n = plan.get("train_world_size") if isinstance(plan, dict) else None
        if type(n) is not int or world_size != n + plan.get("gen_world_size", -1):
            raise ValueError(f"`world_size` = {world_size} is not the plan's training plus inference ranks")
        reshard.check_plan(plan, rank - n)
        super().__init__(ip, port, world_size, rank, {}, timeout_s=timeout_s, device_index=device_index)
        self.plan, self.gen_rank = plan, rank - n

    def receive(self, on_weights: OnWeights) -> dict[str, Any]:
        """Take part in one ``nccl_reshard_refit`` call."""
        return reshard.receive_slices(self.group, self.plan, self.gen_rank, self.device, on_weights)

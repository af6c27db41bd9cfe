"""The worker half of weight refit: the policy's weights, full and in the serving dtype, streamed to inference.

Every stream walks the same list (:func:`refit_info`: Hugging Face state-dict names without tied duplicates, full
shapes, the policy precision) in the same order on every rank, because under FSDP each full tensor is an
all-gather that all ranks must join. Three routes leave from here:

- SGLang over HTTP (:mod:`dask_lm.refit.http`): CUDA IPC handles of flattened buckets in JSON;
- ZMQ (:meth:`Refitter.stream_via_zmq`): vLLM-style colocated workers, a REQ socket per rank in a private directory
  (:mod:`dask_lm.refit.zmq_endpoint`), data-only messages (:mod:`dask_lm.refit.wire`), two ping-pong buffers;
- a collective (:meth:`Refitter.init_collective`, :meth:`Refitter.broadcast`): rank 0 broadcasts buckets to
  inference ranks that joined a process group of their own (NCCL on GPUs, gloo on CPU).

The consumer side of the last two is :mod:`dask_lm.refit.receiver`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from dask_lm.comm import collectives
from dask_lm.comm.progress import report_progress
from dask_lm.errors import RefitError
from dask_lm.model import cuda_ipc, device
from dask_lm.model.weights import local_tensor
from dask_lm.refit import buckets as bk
from dask_lm.refit import reshard as reshard_mod
from dask_lm.refit import wire, zmq_endpoint
from dask_lm.refit.source import RefitHost, iter_buckets, iter_full_weights, refit_info

if TYPE_CHECKING:
    from dask_lm.data.messages import CollectiveInitRequest

__all__ = ["RefitError", "Refitter", "RefitHost", "refit_info", "iter_buckets"]

logger = logging.getLogger("dask_lm.worker")
ZMQ_ALIGN = wire.ALIGN


class Refitter:
    """The refit side of one rank: the connections weights leave by, kept from one refit to the next, and the model
    whose weights they carry (given when it is made, read through :class:`~dask_lm.refit.source.RefitHost`).

    - ``groups``: gloo groups of the HTTP route (``"all"`` for its agreements, one per engine fed by several
      ranks; :mod:`dask_lm.refit.http`);
    - ``collective``: ``(group, store)`` of :meth:`init_collective`, the group shared with the inference ranks;
    - ``refit_zmq``: this rank's ZMQ endpoint (:mod:`dask_lm.refit.zmq_endpoint` keeps it here).
    """

    def __init__(self, host: RefitHost) -> None:
        self.host = host
        self.rank = host.rank  # names the ZMQ endpoint's private directory
        self.groups: dict[Any, Any] = {}
        self.collective: tuple[Any, Any] | None = None
        # the collective's member offset, size, and where its tensors live (the GPU for NCCL, the host for gloo)
        self.place: dict[str, Any] = {}
        self.refit_zmq: Any = None

    def gloo_groups(self, layout: list[list[int]], world_size: int, timeout_s: float) -> dict[Any, Any]:
        """Gloo groups of their own (created once; every rank creates every group, in the same order): ``"all"``
        for the HTTP route's agreements, so they never pair with an async checkpoint's collectives on the
        policy's gloo group, and one per engine fed by several ranks, for gathering its entries."""
        from datetime import timedelta

        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        if "all" not in self.groups:
            self.groups["all"] = dist.new_group(ranks=list(range(world_size)), backend="gloo", timeout=timeout)
        for feeders in layout:
            members = tuple(sorted(set(feeders)))
            if len(members) > 1 and members not in self.groups:
                self.groups[members] = dist.new_group(ranks=list(members), backend="gloo", timeout=timeout)
        return self.groups

    def info(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """``prepare_refit_info``: what every stream sends (:func:`~dask_lm.refit.source.refit_info`)."""
        return refit_info(self.host)

    def stream_via_http(self, urls: list[str], **kwargs: Any) -> dict[str, Any]:
        from dask_lm.refit import http as refit_http

        return refit_http.stream_via_http(self.host, self, urls, **kwargs)

    def stream_via_zmq(self, **kwargs: Any) -> dict[str, Any]:
        return _stream_via_zmq(self.host, self, **kwargs)

    def init_collective(self, req: CollectiveInitRequest) -> bool:
        """Join the refit group as member ``rank_offset + rank``: the training side's rank r is member r (its
        rank 0 hosts the rendezvous store at ``ip:port``), a generation-side Policy's ranks follow at
        ``rank_offset`` (``init_collective_mcore_generation``). Returns once every member has joined."""
        import torch.distributed as dist

        from dask_lm.comm import rendezvous

        ip, port, world_size, timeout_s = req.ip, req.port, req.world_size, req.timeout_s
        rank_offset, backend = req.rank_offset, req.backend

        member = rank_offset + self.rank
        assert rank_offset > 0 or self.rank < req.train_world_size, "the driver checks the ranks against the group"
        self.close_collective()
        # gloo's / NCCL's own sockets on the interface of `ip` when this host has it (rank 0), else on the worker's
        rendezvous.pin_interfaces(ip if rendezvous.interface_for(ip) else rendezvous.worker_host())
        store = rendezvous.create_store(
            ip,
            int(port),
            world_size,
            is_master=member == 0,
            timeout_s=timeout_s,
            wait_for_workers=True,
            what="init_collective (policy rank 0)",
        )
        group = device.standalone_group(
            dist.PrefixStore("dask-lm-refit", store), member, world_size, timeout_s, backend
        )
        self.collective = (group, store)
        self.place = {
            "rank_offset": rank_offset,
            "world_size": world_size,
            "where": device.standalone_tensors_device(backend),
        }
        return True

    def swap(self, is_source: bool) -> dict[str, Any]:
        """``swap_weights_via_reshard``: this rank's rows of every weight to the receiving Policy of the refit
        group, or its own rows from the sending one (:mod:`dask_lm.refit.swap`)."""
        from dask_lm.refit import swap

        if self.collective is None:
            raise ValueError(
                "swap_weights_via_reshard() needs init_collective_mcore_generation() on both Policies first"
            )
        group, place = self.collective[0], self.place
        if is_source:
            return swap.send(self.host, group, world_size=place["world_size"], where=place["where"])
        return swap.receive(
            self.host, group, rank_offset=place["rank_offset"], world_size=place["world_size"], where=place["where"]
        )

    def close_collective(self) -> None:
        existing, self.collective = self.collective, None
        if existing is not None:
            group, _store = existing
            try:
                device.close_standalone_group(group)
            except Exception:  # an old group whose peers are gone; dropping it is all that is left to do
                logger.debug("closing the previous refit group", exc_info=True)

    def broadcast(self, **kwargs: Any) -> dict[str, Any]:
        if self.collective is None:
            raise ValueError("broadcast_weights_for_collective() needs init_collective() first")
        return _broadcast_all(self.host, self.collective[0], **kwargs)

    def reshard(self, plan: dict[str, Any]) -> dict[str, Any]:
        """Send this rank's boxes of its shards to the inference ranks of the refit group (``nccl_reshard_refit``):
        each gets only its slice of each weight (:mod:`dask_lm.refit.reshard`)."""
        if self.collective is None:
            raise ValueError("nccl_reshard_refit() needs init_nccl_reshard_comm_group() (or init_collective()) first")
        host = self.host
        host.ensure_on_device()
        info = refit_info(host)
        state = host.model.state_dict()

        def weights(name: str) -> torch.Tensor:
            return local_tensor(state[name].detach()).to(info[name][1])  # this rank's rows, in the serving dtype

        with torch.no_grad():
            out = reshard_mod.send_slices(self.collective[0], plan, host.rank, weights, self.place["where"])
        device.synchronize()
        return out

    def close(self) -> None:
        """Policy shutdown: the collective group, the ZMQ socket and its directory, the gloo groups."""
        self.close_collective()
        zmq_endpoint.close(self)
        if self.groups:
            import torch.distributed as dist

            for g in self.groups.values():
                dist.destroy_process_group(g)
            self.groups.clear()


# ----------------------------------------------------------------------------------------- ZMQ (colocated vLLM)
def _stream_via_zmq(
    host: RefitHost, refitter: Refitter, *, buffer_size_bytes: int, timeout_s: float, progress_id: str | None = None
) -> dict[str, Any]:
    """Send every weight to the REP peer of this rank's socket, in ping-pong buffers of half the budget.

    Messages follow :mod:`dask_lm.refit.wire` (data only): a msgpack header naming the tensors of one buffer,
    which sit back to back at 512-byte aligned offsets, and the buffer itself (a CUDA IPC handle in the header on
    GPUs, the bytes as a second frame on CPU); then a ``complete`` header. The peer answers each message with a
    fixed ACK once it has loaded it; any other answer fails the call, unread."""
    import zmq

    ep = zmq_endpoint.bind(refitter)
    sock, address = ep.sock, ep.address
    transport = "ipc" if device.is_cuda() else "bytes"
    info = refit_info(host)
    half = bk.align_up(max(buffer_size_bytes // 2, 1), ZMQ_ALIGN)
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    start, sent_bytes, messages = time.perf_counter(), 0, 0
    tensor_bytes = 0  # tensor bytes already sent (alignment gaps left out), for the driver's progress bar
    pending, last = False, ""  # `last`: the message the next answer is for, to name it in errors

    def ack() -> None:
        nonlocal pending
        try:
            frames = sock.recv_multipart()
        except zmq.Again:
            raise TimeoutError(
                f"no answer from the inference worker on {address} within {timeout_s:.0f} s: is it "
                "running and connected to this socket?"
            ) from None
        pending = False
        try:
            reason = wire.read_reply(frames)
        except ValueError as e:
            raise RefitError(
                f"the peer on {address} answered {last} with something other than a dask-lm refit "
                f"reply, which was not read: {e}. Is receive_via_zmq of the same dask-lm version "
                "connected to this socket?"
            ) from None
        if reason is not None:
            raise RefitError(f"the inference worker on {address} rejected {last}: {reason}")

    def send(buf: torch.Tensor, names: list[str], used: int) -> None:
        nonlocal pending, last, sent_bytes, messages, tensor_bytes
        device.synchronize()
        if transport == "ipc":
            frames: list[Any] = [wire.encode_weights(names, used, transport="ipc", ipc=cuda_ipc.encode_cuda(buf))]
        else:  # the bytes themselves, without a copy: the buffer is not touched again before the peer answers
            # ndarray.data is memoryview(array) (numpy types the buffer protocol only from Python 3.12)
            frames = [wire.encode_weights(names, used, transport="bytes"), buf[:used].numpy().data]
        if pending:
            ack()  # the peer is done with the other buffer; it may be reused after this
        try:
            sock.send_multipart(frames, copy=False)
        except zmq.Again:
            raise TimeoutError(
                f"the inference worker on {address} did not take a message within {timeout_s:.0f} s"
            ) from None
        pending, sent_bytes, messages = True, sent_bytes + used, messages + 1
        last = f"refit message {messages}"
        tensor_bytes += sum(info[n][0].numel() * info[n][1].itemsize for n in names)
        if host.rank == 0:
            report_progress(progress_id, tensor_bytes)

    try:
        buffers = [torch.empty(half, dtype=torch.uint8, device=host.device) for _ in range(2)]
        names: list[str]
        current, used, names = 0, 0, []
        for name, t in iter_full_weights(host, list(info)):
            size = t.numel() * t.element_size()
            if size > half:  # alone, in a one-off buffer that is acknowledged at once
                if names:
                    send(buffers[current], names, used)
                    current, used, names = 1 - current, 0, []
                one_off = torch.empty(size, dtype=torch.uint8, device=host.device)
                one_off.copy_(t.contiguous().reshape(-1).view(torch.uint8))
                send(one_off, [name], size)
                ack()
                del one_off
                continue
            offset = bk.align_up(used, ZMQ_ALIGN)
            if offset + size > half:
                send(buffers[current], names, used)
                current, offset, names = 1 - current, 0, []
            buffers[current][offset : offset + size].copy_(t.contiguous().reshape(-1).view(torch.uint8))
            used = offset + size
            names.append(name)
            del t
        if names:
            send(buffers[current], names, used)
        if pending:
            ack()
        del buffers
        device.ipc_collect()
        last = "the final 'complete' message"
        try:
            sock.send(wire.encode_complete())
        except zmq.Again:
            raise TimeoutError(
                f"the inference worker on {address} did not take the last message within {timeout_s:.0f} s"
            ) from None
        ack()
    except BaseException:
        zmq_endpoint.close_socket(refitter)  # a REQ socket that missed an answer cannot send again
        raise
    seconds = time.perf_counter() - start
    return {"address": address, "bytes": sent_bytes, "messages": messages, "seconds": seconds}


# ----------------------------------------------------------------------------------------- collective broadcast
def _broadcast_all(
    host: RefitHost, group: Any, *, buffer_size_bytes: int, progress_id: str | None = None
) -> dict[str, Any]:
    """Broadcast every bucket from training rank 0 over the refit group.

    First a header goes out: the buffer size and a digest of the plan. Receivers plan the same buckets from their
    refit info and that size, and every member reports in an all-reduce whether its digest matched, so a receiver
    with other refit info fails loudly instead of loading shifted bytes."""
    plan = bk.plan_buckets(refit_info(host), buffer_size_bytes)
    header = torch.tensor([buffer_size_bytes, *bk.plan_digest(plan)], dtype=torch.int64, device=host.device)
    _broadcast(group, header)
    # the receivers answer whether their plan matched the header's digest; this side has nothing to disagree with
    if not collectives.all_agree(True, group, where=host.device, standalone=True):
        raise RefitError(
            "an inference rank planned different refit buckets from the same header: its refit info "
            "differs from prepare_refit_info() of this policy"
        )
    start, total, sent_tensors = time.perf_counter(), 0, 0
    for bucket, flat in zip(plan, iter_buckets(host, plan, keep=host.rank == 0)):
        if flat is None:  # every member of a broadcast needs a buffer of the right size
            flat = torch.empty(bk.bucket_nbytes(bucket), dtype=torch.uint8, device=host.device)
        _broadcast(group, flat)
        total += flat.numel()
        sent_tensors += sum(s.nbytes for s in bucket)
        if host.rank == 0:
            report_progress(progress_id, sent_tensors)
        del flat
    device.synchronize()
    return {"bytes": total, "buckets": len(plan), "seconds": time.perf_counter() - start}


def _broadcast(group: Any, t: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    group.broadcast([t], opts).wait()

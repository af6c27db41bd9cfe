"""Weights from one Policy into another over the refit group (NeMo RL's ``swap_weights_via_reshard``).

NeMo RL pairs a Megatron training Policy with a Megatron generation-side Policy of other parallel sizes: both join
one cross-world group (``init_collective_mcore_generation``: training ranks are members ``0 .. N-1``, generation
ranks follow at ``rank_offset`` N), and the training side's ``swap_weights_via_reshard(is_source=True)`` meets the
generation side's ``is_source=False``. A dask-lm Policy's ranks are FSDP2 data-parallel ranks, so the reshard is
from ``N`` row shards to ``M`` row shards: generation rank ``j`` needs rows ``torch.chunk(weight, M)[j]`` of every
weight, exactly its own FSDP shard. :func:`dask_lm.refit.reshard.build_plan` with the ``"rows"`` split and one
replica of ``M`` says which training rank holds which part of them; each box crosses the group once.

What travels is what training keeps (the fp32 master weights of a low-precision trainable Policy, else the
weights in its precision), so a receiver of the same configuration ends with bit-identical weights, and a
receiver in a lower precision rounds them as the source's own forward does.

The receiving side also takes a plain ``broadcast_weights_for_collective`` from the training side: the first
message of both is a broadcast of five int64 from member 0, a negative magic here, the bucket size there. Either
way every member agrees on the plan (an all-reduce of a flag) before the first weight is read, so a receiver
of another architecture or precision fails loudly instead of loading shifted bytes.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from dask_lm.comm import collectives
from dask_lm.model import device
from dask_lm.model.weights import local_tensor, weight_names
from dask_lm.refit import buckets as bk
from dask_lm.refit import reshard

if TYPE_CHECKING:
    from dask_lm.refit.source import RefitHost

__all__ = ["SWAP_MAGIC", "send", "receive"]

SWAP_MAGIC = -0x5357415031  # "SWAP1": never a bucket size (those are positive)
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}


def _kept_dtype(host: RefitHost) -> torch.dtype:
    """The dtype training keeps the floating weights in: fp32 where there are fp32 masters, else the precision."""
    return torch.float32 if host.keeps_fp32 else host.dtype


def _info(host: RefitHost, floating: torch.dtype) -> dict[str, tuple[torch.Size, torch.dtype]]:
    state = host.model.state_dict()
    return {
        n: (torch.Size(state[n].shape), floating if state[n].is_floating_point() else state[n].dtype)
        for n in weight_names(host.model)
    }


def _digest(plan: dict[str, Any]) -> int:
    names = "\n".join(f"{p['name']}{p['shape']}{p['dtype']}" for p in plan["params"])
    return zlib.crc32(names.encode())


def _rows(host: RefitHost) -> Iterator[tuple[str, torch.Tensor, list[torch.Tensor]]]:
    """Each weight's name, the tensor holding this rank's rows as training keeps them (a master weight where
    there is one), and every tensor a received copy must go into (the model's own rows, and the master)."""
    state = host.model.state_dict()
    master_of = host.masters.named_parameters() if host.masters is not None else {}
    for name in weight_names(host.model):
        own = local_tensor(state[name])  # shares its storage with the parameter (FSDP2: the local shard)
        master = master_of.get(name)
        yield name, (master if master is not None else own), [own] + ([master] if master is not None else [])


def _agree(group: Any, ok: bool, where: torch.device, what: str) -> None:
    agreed = collectives.all_agree(ok, group, where=where, standalone=True)
    if not ok:
        raise ValueError(what)
    if not agreed:
        raise RuntimeError(
            "another member of the refit group planned a different weight swap (another "
            "architecture or rank count); nothing was sent"
        )


def _broadcast(group: Any, t: torch.Tensor) -> None:
    """``t`` from member 0 to every member (the standalone group's own call, as the other refit routes)."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    group.broadcast([t], opts).wait()


def _header(group: Any, values: list[int], where: torch.device) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64, device=where)
    _broadcast(group, t)
    return [int(x) for x in t.tolist()]


def send(host: RefitHost, group: Any, *, world_size: int, where: torch.device) -> dict[str, Any]:
    """The training side (members ``0 .. N-1``): each rank sends the boxes of its rows that generation ranks
    need, after every member agreed on the plan."""
    host.ensure_on_device()
    n = host.world_size
    m = world_size - n
    floating = _kept_dtype(host)
    plan = reshard.build_plan(_info(host, floating), train_world_size=n, gen_world_size=m, split="rows", gen_tp=m)
    _header(group, [SWAP_MAGIC, n, m, _DTYPE_CODES[floating], _digest(plan)], where)
    _agree(group, True, where, "")
    kept = {name: t for name, t, _into in _rows(host)}
    with torch.no_grad():
        out = reshard.send_slices(group, plan, host.rank, lambda name: kept[name].detach(), where)
    device.synchronize()
    return {**out, "role": "source", "ranks": [n, m]}


def receive(host: RefitHost, group: Any, *, rank_offset: int, world_size: int, where: torch.device) -> dict[str, Any]:
    """The generation side (members ``rank_offset ..``): this rank's rows of every weight, from a swap or from a
    ``broadcast_weights_for_collective`` of the training side, written into its own shards (and masters)."""
    host.ensure_on_device()
    header = _header(group, [0] * 5, where)
    into = {name: targets for name, _kept, targets in _rows(host)}
    m = host.world_size
    start = time.perf_counter()

    def write(name: str, rows: torch.Tensor) -> None:
        for t in into[name]:
            t.copy_(rows.to(device=t.device, dtype=t.dtype).reshape(t.shape))

    def write_all(pairs: list[tuple[str, torch.Tensor]]) -> None:
        for name, rows in pairs:
            write(name, rows)

    if header[0] == SWAP_MAGIC:
        _magic, n, sender_m, code, digest = header
        floating = _CODE_DTYPES.get(code)
        plan = None
        if floating is not None and sender_m == m and n == rank_offset and n + m == world_size:
            plan = reshard.build_plan(
                _info(host, floating), train_world_size=n, gen_world_size=m, split="rows", gen_tp=m
            )
        _agree(
            group,
            plan is not None and _digest(plan) == digest,
            where,
            f"the weight swap's sender has {n} ranks for {sender_m} receivers and other weights (names, shapes) "
            f"than this Policy, or this Policy's {m} ranks did not join at rank_offset {n}: both Policies must "
            "load the same architecture, and the receiving one joins at the sender's rank count",
        )
        assert plan is not None
        with torch.no_grad():
            got = reshard.receive_slices(group, plan, host.rank, where, write_all)
        device.synchronize()
        return {**got, "role": "target", "ranks": [n, m], "from": "swap"}
    return _receive_broadcast(host, group, header, write, where, start)


def _receive_broadcast(
    host: RefitHost,
    group: Any,
    header: list[int],
    write: Callable[[str, torch.Tensor], None],
    where: torch.device,
    start: float,
) -> dict[str, Any]:
    """A ``broadcast_weights_for_collective`` of the training side: whole weights in buckets, of which this rank
    keeps its rows ``torch.chunk(weight, M)[rank]``."""
    from dask_lm.refit.source import refit_info

    info = refit_info(host)
    plan = bk.plan_buckets(info, header[0])
    _agree(
        group,
        bk.plan_digest(plan) == header[1:],
        where,
        "the training Policy broadcast other weights (names, shapes or precision) than this Policy's refit info: "
        "load the same architecture in the same `precision` on both, or use swap_weights_via_reshard on both "
        "sides (it sends what training keeps and casts on arrival)",
    )
    total = 0
    with torch.no_grad():
        for bucket in plan:
            flat = torch.empty(bk.bucket_nbytes(bucket), dtype=torch.uint8, device=where)
            _broadcast(group, flat)
            for name, full in bk.unpack(flat, bucket):
                lo, hi = reshard.chunk(full.shape[0], host.world_size)[host.rank] if full.dim() else (0, 0)
                write(name, full[lo:hi] if full.dim() else full)
            total += flat.numel()
    device.synchronize()
    return {
        "bytes": total,
        "buckets": len(plan),
        "seconds": time.perf_counter() - start,
        "role": "target",
        "from": "broadcast",
    }

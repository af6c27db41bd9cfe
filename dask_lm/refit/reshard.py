"""Resharded refit (NeMo RL's ``nccl_reshard_refit``): each inference rank gets only its slice of each weight,
straight from the training ranks' FSDP shards, point to point.

NeMo RL reshards Megatron's tensor-parallel shards into vLLM's. A dask-lm Policy's ranks are FSDP2 data-parallel
ranks: rank ``i`` of ``N`` holds rows ``torch.chunk(weight, N, dim=0)[i]`` of every weight. An inference engine of
``M`` tensor-parallel ranks wants a different cut: rank ``j`` holds chunk ``j`` of ``M`` along one dimension of
each weight, or the whole weight. The plan (:func:`build_plan`) says, for every weight, which box of it goes from
which training rank to which inference rank; each box is the intersection of a training rank's rows with an
inference rank's slice, so no byte crosses the wire twice and no rank gathers a full weight.

How an inference rank cuts a weight (``gen_parallelism["split"]``):

- ``"rows"``: every weight of two or more dimensions along dim 0, vectors too;
- ``"columns"``: along dim 1 (vectors are whole on every rank);
- ``"tensor_parallel"`` (default): Megatron's convention, as vLLM and SGLang shard a Hugging Face decoder:
  column-parallel projections (``q/k/v/gate/up_proj``, the embeddings, ``lm_head``) and their biases along dim 0,
  row-parallel ones (``o_proj``, ``down_proj``) along dim 1, everything else (norms) whole.

The plan is plain data (ints, strings, lists), so it can be sent to inference processes as JSON or msgpack. The
group is ``init_nccl_reshard_comm_group``'s (the refit group: training rank ``i`` is member ``i``, inference rank
``j`` is member ``N + j``); the inference side is :class:`dask_lm.refit.receiver.ReshardReceiver`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dask_lm.model import device

PLAN_VERSION = 1
SPLITS = ("tensor_parallel", "rows", "columns")
_COLUMN_PARALLEL = re.compile(
    r"(^|\.)(q_proj|k_proj|v_proj|qkv_proj|gate_proj|up_proj|gate_up_proj|embed_tokens|"
    r"lm_head|wte|c_attn|c_fc)(\.|$)"
)
_ROW_PARALLEL = re.compile(r"(^|\.)(o_proj|down_proj|dense|c_proj)(\.|$)")
_DTYPES = device.dtypes_by_name(
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
)

Box = list[list[int]]  # per dimension [start, end)

__all__ = ["PLAN_VERSION", "SPLITS", "chunk", "split_dim", "build_plan", "send_slices", "receive_slices"]


def chunk(n: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of ``torch.chunk(range(n), parts)``'s pieces, padded with empty ones to ``parts``
    (FSDP2 shards dim 0 this way: ``ceil(n / parts)`` rows each, the last ones short or empty)."""
    size = -(-n // parts) if n else 0
    return [(min(i * size, n), min((i + 1) * size, n)) for i in range(parts)]


def split_dim(name: str, ndim: int, split: str) -> int | None:
    """The dimension an inference rank cuts ``name`` along, or None to take it whole."""
    if ndim == 0:
        return None
    if split == "rows":
        return 0
    if split == "columns":
        return 1 if ndim >= 2 else None
    if _COLUMN_PARALLEL.search(name):
        return 0
    if _ROW_PARALLEL.search(name):
        return 1 if ndim >= 2 else None  # a row-parallel bias is added after the reduction: whole
    return None


def _intersect(a: Box, b: Box) -> Box | None:
    box = [[max(x0, y0), min(x1, y1)] for (x0, x1), (y0, y1) in zip(a, b)]
    return box if all(s < e for s, e in box) else None


def build_plan(
    refit_info: Mapping[str, tuple[Any, Any]],
    *,
    train_world_size: int,
    gen_world_size: int,
    split: str,
    gen_tp: int | None = None,
) -> dict[str, Any]:
    """Which box of each weight goes from which training rank to which inference rank (see the module docstring).
    ``refit_info`` is ``Policy.prepare_refit_info()``: ``{name: (full shape, dtype)}`` in refit order. The
    inference ranks are ``gen_world_size / gen_tp`` replicas of ``gen_tp`` tensor-parallel ranks (default: one
    replica); rank ``j`` holds slice ``j % gen_tp``."""
    tp = gen_world_size if gen_tp is None else gen_tp
    assert split in SPLITS and train_world_size >= 1 and tp >= 1 and gen_world_size % tp == 0, (
        split,
        train_world_size,
        gen_world_size,
        tp,
    )
    params = []
    for name, (shape, dtype) in refit_info.items():
        shape = [int(d) for d in shape]
        full = [[0, d] for d in shape]
        dim = split_dim(name, len(shape), split)
        cuts = chunk(shape[dim], tp) if dim is not None else []
        dst: list[Box] = [
            full if dim is None else [*full[:dim], list(cuts[j % tp]), *full[dim + 1 :]] for j in range(gen_world_size)
        ]
        src = [[[lo, hi], *full[1:]] for lo, hi in chunk(shape[0], train_world_size)] if shape else []
        transfers = []
        for j, want in enumerate(dst):
            if not shape:  # a scalar: whole, from training rank 0
                transfers.append([0, j, []])
                continue
            for i, have in enumerate(src):
                box = _intersect(have, want)
                if box is not None:
                    transfers.append([i, j, box])
        params.append(
            {
                "name": name,
                "shape": shape,
                "dtype": device.dtype_name(dtype),
                "split_dim": dim,
                "dst": dst,
                "transfers": transfers,
            }
        )
    return {
        "v": PLAN_VERSION,
        "train_world_size": train_world_size,
        "gen_world_size": gen_world_size,
        "gen_tp": tp,
        "split": split,
        "params": params,
    }


def _slices(box: Box, origin: list[int] | None = None) -> tuple[slice, ...]:
    origin = origin or [0] * len(box)
    return tuple(slice(s - o, e - o) for (s, e), o in zip(box, origin))


def send_slices(
    group: Any, plan: dict[str, Any], rank: int, weights: Callable[[str], torch.Tensor], where: torch.device
) -> dict[str, Any]:
    """Training rank ``rank``'s side: for each weight in plan order, post a send of every box it holds to its
    inference rank, then wait for them (all of one weight's messages are in flight together, so no order of
    matching can deadlock). ``weights(name)`` is this rank's local shard (rows ``chunk(rows, N)[rank]``) in the
    serving dtype."""
    n = int(plan["train_world_size"])
    start, sent, total = time.perf_counter(), 0, 0
    for tag, p in enumerate(plan["params"]):
        mine = [t for t in p["transfers"] if t[0] == rank]
        if not mine:
            continue
        local = weights(p["name"])
        origin: list[int] = []
        if p["shape"]:
            lo, hi = chunk(p["shape"][0], n)[rank]
            assert local.shape[0] == hi - lo, (
                f"{p['name']}: rank {rank} holds {local.shape[0]} rows, FSDP's dim-0 chunk is [{lo}, {hi})"
            )
            origin = [lo, *[0] * (len(p["shape"]) - 1)]
        works, pieces = [], []
        for _src, dst, box in mine:
            piece = local[_slices(box, origin)].contiguous().to(where) if box else local.reshape(()).to(where)
            pieces.append(piece)  # kept alive until its send completes
            works.append(group.send([piece], n + dst, tag))
            sent += 1
            total += piece.numel() * piece.element_size()
        for w in works:
            w.wait()
    return {"messages": sent, "bytes": total, "seconds": time.perf_counter() - start}


def receive_slices(
    group: Any,
    plan: dict[str, Any],
    gen_rank: int,
    where: torch.device,
    on_weights: Callable[[list[tuple[str, torch.Tensor]]], None],
) -> dict[str, Any]:
    """Inference rank ``gen_rank``'s side: each weight's slice (its ``dst`` box, a new tensor), assembled from the
    training ranks' boxes, handed to ``on_weights([(name, slice)])`` weight by weight."""
    start, total = time.perf_counter(), 0
    for tag, p in enumerate(plan["params"]):
        dtype = _DTYPES[p["dtype"]]
        want = p["dst"][gen_rank]
        out = torch.empty([e - s for s, e in want], dtype=dtype, device=where)
        works, parts = [], []
        for src, dst, box in p["transfers"]:
            if dst != gen_rank:
                continue
            buf = torch.empty([e - s for s, e in box], dtype=dtype, device=where)
            parts.append((box, buf))
            works.append(group.recv([buf], src, tag))
        for w in works:
            w.wait()
        for box, buf in parts:
            out[_slices(box, [s for s, _ in want])] = buf
            total += buf.numel() * buf.element_size()
        on_weights([(p["name"], out)])
    return {"bytes": total, "weights": len(plan["params"]), "seconds": time.perf_counter() - start}


def check_plan(plan: Any, gen_rank: int) -> None:
    """The checks an inference process runs on a plan it was handed (plain data from the driver)."""
    if not isinstance(plan, dict) or plan.get("v") != PLAN_VERSION or not isinstance(plan.get("params"), list):
        raise ValueError(
            f'not a dask-lm reshard plan (a dict with "v": {PLAN_VERSION} and "params"); pass '
            "Policy.prepare_nccl_reshard_refit_info()'s result unchanged"
        )
    m = plan.get("gen_world_size")
    if type(m) is not int or not 0 <= gen_rank < m:
        raise ValueError(f"inference rank {gen_rank} is not in the plan's {m!r} inference ranks")
    for p in plan["params"]:
        if p.get("dtype") not in _DTYPES:
            raise ValueError(f"weight {p.get('name')!r}: dtype {p.get('dtype')!r} is not one of {sorted(_DTYPES)}")

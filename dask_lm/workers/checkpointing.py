"""The worker half of checkpoints: gather full weights to rank 0, save optimizer state with DCP, publish.

Weights are written as a Hugging Face directory by rank 0 while every rank takes part in the all-gathers (one
tensor at a time, in the same order on every rank). Optimizer and scheduler state go through
``torch.distributed.checkpoint`` (DCP): each rank writes its own shard of the optimizer state, so a model whose
optimizer state does not fit one rank still saves, and a checkpoint saved on N ranks loads on M. The state is keyed
by parameter name, whether it came from FSDP (torch's ``get_optimizer_state_dict``) or from a single rank's master
weights (:func:`~dask_lm.workers.optim.named_optimizer_state`), so the two are interchangeable.

Completion is agreed on before anything is renamed: every rank reports success in an all-reduce, and only then
does rank 0 rename the temporary directories into place; otherwise it deletes them. An async save stages the
tensors on the host and returns; ``finalize`` waits for the writes, agrees and publishes.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from dask_lm.io import checkpoint as ckpt
from dask_lm.workers import device
from dask_lm.workers.optim import init_optimizer_state, load_named_optimizer_state, named_optimizer_state

if TYPE_CHECKING:
    from dask_lm.workers.policy_worker import PolicyWorker

__all__ = ["save_checkpoint", "finalize_async_save", "load_optimizer_state", "weight_names"]

logger = logging.getLogger("dask_lm.worker")
SCHEDULER_FILE = "scheduler.pt"


def weight_names(model: torch.nn.Module) -> list[str]:
    """State-dict names to save, without the second name of a tied (shared) parameter, as ``save_pretrained``."""
    seen: set[int] = set()
    names = []
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, t in model.state_dict(keep_vars=True).items():
        tensor = params.get(name, t)
        key = id(tensor)
        if key in seen:
            continue
        seen.add(key)
        names.append(name)
    return names


def _full(t: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if full_tensor is not None else t


def _barrier_ok(worker: PolicyWorker, ok: bool) -> bool:
    """All ranks agree: True only when every rank succeeded (doubles as the barrier before publishing)."""
    if worker.world_size == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    assert worker.cpu_group is not None, "a multi-rank policy has a gloo group for host-side collectives"
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=worker.cpu_group)
    return bool(flag.item())


def _write_weights(worker: PolicyWorker, tmp: str, max_shard_size: int, *, staged: dict | None) -> None:
    """Gather every weight (all ranks), rank 0 writes shards as they fill, or keeps them in ``staged``."""
    model = worker.model
    state = model.state_dict()
    masters = worker.masters.named_parameters() if worker.masters is not None else {}
    names = weight_names(model)
    save_dtype = worker.save_dtype
    entries = []
    for n in names:
        t = state[n]
        dtype = save_dtype if t.is_floating_point() else t.dtype
        entries.append((n, tuple(t.shape), dtype))  # DTensor shapes are global
    shards = ckpt.plan_shards(entries, max_shard_size)
    total = sum(int(torch.Size(s).numel()) * torch.empty((), dtype=d).element_size() for _, s, d in entries)
    dtypes = {n: d for n, _, d in entries}
    writing = worker.rank == 0
    error: BaseException | None = None
    for i, shard in enumerate(shards):
        tensors = {}
        for n in shard:
            src = masters[n] if n in masters else state[n]
            full = _full(src.detach())  # a collective under FSDP: every rank runs it, in this order
            if writing:
                tensors[n] = full.to("cpu", dtype=dtypes[n], copy=True)
            del full
        if not writing or error is not None:
            continue
        if staged is not None:
            staged.setdefault("shards", []).append((i, len(shards), tensors))
            continue
        try:
            ckpt.write_shard(tmp, i, len(shards), tensors)
        except BaseException as e:  # keep taking part in the gathers; report after the loop
            error = e
    if writing and error is None:
        if staged is not None:
            staged.update(index=(shards, total))
        else:
            ckpt.write_index(tmp, shards, total)
    if error is not None:
        raise error


def _write_config(worker: PolicyWorker, tmp: str) -> None:
    import copy

    cfg = copy.deepcopy(worker.model.config)
    cfg.dtype = worker.save_dtype  # what the safetensors hold (fp32 masters of a bf16 policy)
    if hasattr(cfg, "torch_dtype") and not isinstance(getattr(type(cfg), "torch_dtype", None), property):
        try:
            cfg.torch_dtype = worker.save_dtype
        except AttributeError:
            pass
    cfg.save_pretrained(tmp)
    gen = getattr(worker.model, "generation_config", None)
    if gen is not None and getattr(worker.model, "can_generate", lambda: False)():
        gen.save_pretrained(tmp)


def optimizer_state(worker: PolicyWorker, *, for_load: bool = False) -> dict[str, Any]:
    """``{"optim": name-keyed optimizer state}``; with ``for_load`` the state exists first (a template)."""
    opt = worker.optimizer
    assert opt is not None
    if worker.fsdp:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return {"optim": get_optimizer_state_dict(worker.model, opt)}  # initialises missing state itself
    if for_load:
        init_optimizer_state(opt)
    return {"optim": named_optimizer_state(opt, worker.optimizer_param_names())}


def _dcp_kwargs(worker: PolicyWorker) -> dict[str, Any]:
    if worker.world_size == 1:
        return {"no_dist": True}
    return {"process_group": worker.cpu_group}


def save_checkpoint(worker: PolicyWorker, *, weights: tuple[str, str] | None, optimizer: tuple[str, str] | None,
                    tokenizer: tuple[str, str, Any] | None, async_save: bool, max_shard_size: int) -> dict[str, Any]:
    """Write the temporary directories; publish them now (sync) or leave that to :func:`finalize_async_save`.

    Every rank runs the same sequence of collectives whatever fails: agree that the directories exist, write
    (rank 0 keeps gathering even after a failed write), agree on success, then rank 0 publishes or discards.
    """
    import torch.distributed.checkpoint as dcp

    if worker.pending_save is not None:  # one save at a time: finish the previous one first
        finalize_async_save(worker)
    pending: dict[str, Any] = {"publish": [], "dcp": None, "writer": None}
    tmps = [t for t in (weights and weights[0], optimizer and optimizer[0], tokenizer and tokenizer[0]) if t]
    ok, error = True, None
    try:
        if optimizer:
            worker.ensure_optimizer()
        if worker.rank == 0:
            for t in tmps:
                os.makedirs(t, exist_ok=False)
    except BaseException as e:
        ok, error = False, e
    if not _barrier_ok(worker, ok):
        if worker.rank == 0:
            for t in tmps:
                ckpt.discard(t)
        raise error or RuntimeError("another rank could not prepare the checkpoint; nothing was written")
    try:
        staged: dict[str, Any] | None = {} if async_save else None
        if weights:
            _write_weights(worker, weights[0], max_shard_size, staged=staged)
            if worker.rank == 0:
                _write_config(worker, weights[0])
            pending["publish"].append(weights)
        if optimizer:
            state = optimizer_state(worker)
            if async_save:
                pending["dcp"] = dcp.async_save(state, checkpoint_id=optimizer[0], **_dcp_kwargs(worker))
            else:
                dcp.save(state, checkpoint_id=optimizer[0], **_dcp_kwargs(worker))
            if worker.rank == 0:  # tiny and rank-independent; after the collective so a failure cannot desync it
                torch.save(worker.scheduler.state_dict(), os.path.join(optimizer[0], SCHEDULER_FILE))
            pending["publish"].append(optimizer)
        if tokenizer:
            if worker.rank == 0:
                tokenizer[2].save_pretrained(tokenizer[0])
            pending["publish"].append(tokenizer[:2])
        if async_save and worker.rank == 0 and staged:
            pending["writer"] = worker.writer.submit(lambda: _write_staged(weights[0], staged))  # type: ignore[index]
    except BaseException as e:
        ok, error = False, e
    if async_save and ok:
        pending["tmps"] = tmps
        worker.pending_save = pending
        return {"staged": True}
    _conclude(worker, pending, tmps, ok, error)
    return {"staged": False}


def _write_staged(directory: str, staged: dict[str, Any]) -> None:
    for i, count, tensors in staged.get("shards", []):
        ckpt.write_shard(directory, i, count, tensors)
    shards, total = staged["index"]
    ckpt.write_index(directory, shards, total)


def _conclude(worker: PolicyWorker, pending: dict[str, Any], tmps: list[str], ok: bool,
              error: BaseException | None) -> None:
    agreed = _barrier_ok(worker, ok)
    if worker.rank == 0:
        if agreed:
            for tmp, final in pending["publish"]:
                ckpt.publish(tmp, final)
        else:
            for tmp in tmps:
                ckpt.discard(tmp)
    if error is not None:
        raise error
    if not agreed:
        raise RuntimeError("another rank failed while saving the checkpoint; nothing was published")


def finalize_async_save(worker: PolicyWorker) -> bool:
    """Wait until every byte of the pending async save is written, then publish it (all ranks agree first)."""
    pending, worker.pending_save = worker.pending_save, None
    if pending is None:
        return False
    ok, error = True, None
    try:
        if pending["dcp"] is not None:
            fut = pending["dcp"]
            (fut.result() if hasattr(fut, "result") else fut.upload_completion.result())
        if pending["writer"] is not None:
            pending["writer"].result()
    except BaseException as e:
        ok, error = False, e
    _conclude(worker, pending, pending["tmps"], ok, error)
    return True


def load_optimizer_state(worker: PolicyWorker, path: str) -> None:
    """Restore optimizer and scheduler state saved by :func:`save_checkpoint` (any number of ranks then)."""
    import torch.distributed.checkpoint as dcp

    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, ".metadata")):
        raise ValueError(f"optimizer_path {path!r} is not an optimizer checkpoint (no DCP .metadata file in it)")
    worker.ensure_optimizer()
    state = optimizer_state(worker, for_load=True)
    dcp.load(state, checkpoint_id=path, **_dcp_kwargs(worker))
    if worker.fsdp:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(worker.model, worker.optimizer, state["optim"])
    else:
        load_named_optimizer_state(worker.optimizer, worker.optimizer_param_names(), state["optim"])
    sched_file = os.path.join(path, SCHEDULER_FILE)
    if os.path.exists(sched_file):
        worker.scheduler.load_state_dict(torch.load(sched_file, weights_only=False))
    device.empty_cache()

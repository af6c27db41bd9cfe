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

import io
import json
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from dask_lm.comm import collectives
from dask_lm.io import checkpoint as ckpt
from dask_lm.io import safe_load
from dask_lm.io.checkpoint import FRESH_OPTIMIZER, BackgroundWriter
from dask_lm.model import device
from dask_lm.model.weights import full_tensor, weight_names
from dask_lm.workers.optim import (
    init_optimizer_state,
    load_named_optimizer_state,
    named_optimizer_state,
)

if TYPE_CHECKING:
    from dask_lm.data.messages import SaveRequest
    from dask_lm.workers.trainer import Trainer

__all__ = ["Checkpointer", "CheckpointHost"]

logger = logging.getLogger("dask_lm.worker")
SCHEDULER_FILE = "scheduler.pt"


class CheckpointHost(Protocol):
    """What checkpoints read of the rank's model (:class:`~dask_lm.workers.rank_model.RankModel`), given to the
    :class:`Checkpointer` when it is made."""

    model: torch.nn.Module
    rank: int
    world_size: int
    fsdp: bool
    group: Any  # the training group (NCCL on GPUs)
    cpu_group: Any  # the gloo group for host-side collectives; None on one rank
    device: torch.device

    @property
    def save_dtype(self) -> torch.dtype: ...

    def ensure_on_device(self) -> None: ...


def _agreement_group(host: CheckpointHost, *, main_group: bool = False) -> Any:
    """Where the ranks agree on a phase's success (None: one rank, nothing to agree with).

    Host-side agreement runs on the policy's gloo group; ``main_group`` uses the training group instead, for the
    moment when an async DCP save is using the gloo group from its background thread (two threads issuing
    collectives on one group could pair them up wrongly)."""
    if host.world_size == 1:
        return None
    if main_group:
        return host.group
    assert host.cpu_group is not None, "a multi-rank policy has a gloo group for host-side collectives"
    return host.cpu_group


def _write_weights(
    host: CheckpointHost, trainer: Trainer, tmp: str, max_shard_size: int, *, staged: dict | None
) -> None:
    """Gather every weight (all ranks), rank 0 writes shards as they fill, or keeps them in ``staged``."""
    model = host.model
    state = model.state_dict()
    masters = trainer.masters.named_parameters() if trainer.masters is not None else {}
    names = weight_names(model)
    save_dtype = host.save_dtype
    entries = []
    for n in names:
        t = state[n]
        dtype = save_dtype if t.is_floating_point() else t.dtype
        entries.append((n, tuple(t.shape), dtype))  # DTensor shapes are global
    shards = ckpt.plan_shards(entries, max_shard_size)
    total = sum(int(torch.Size(s).numel()) * torch.empty((), dtype=d).element_size() for _, s, d in entries)
    dtypes = {n: d for n, _, d in entries}
    writing = host.rank == 0
    error: BaseException | None = None
    for i, shard in enumerate(shards):
        tensors = {}
        for n in shard:
            src = masters[n] if n in masters else state[n]
            full = full_tensor(src.detach())  # a collective under FSDP: every rank runs it, in this order
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


def _write_config(host: CheckpointHost, tmp: str) -> None:
    import copy

    # a transformers PretrainedConfig (Module's __getattr__ would type it Tensor | Module)
    cfg: Any = copy.deepcopy(host.model.config)
    cfg.dtype = host.save_dtype  # what the safetensors hold (fp32 masters of a bf16 policy)
    # older transformers keep a separate torch_dtype attribute; newer ones make it a deprecated alias of dtype
    # (a property that warns when read), so look at the class, not the instance
    if not isinstance(getattr(type(cfg), "torch_dtype", None), property) and "torch_dtype" in vars(cfg):
        cfg.torch_dtype = host.save_dtype
    cfg.save_pretrained(tmp)
    gen = getattr(host.model, "generation_config", None)
    if gen is not None and getattr(host.model, "can_generate", lambda: False)():
        gen.save_pretrained(tmp)


def optimizer_state(host: CheckpointHost, trainer: Trainer, *, for_load: bool = False) -> dict[str, Any]:
    """``{"optim": name-keyed optimizer state}``; with ``for_load`` the state exists first (a template)."""
    opt = trainer.optimizer
    assert opt is not None
    if host.fsdp:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return {"optim": get_optimizer_state_dict(host.model, opt)}  # initialises missing state itself
    if for_load:
        init_optimizer_state(opt)
    return {"optim": named_optimizer_state(opt, trainer.param_names())}


def _dcp_kwargs(host: CheckpointHost) -> dict[str, Any]:
    if host.world_size == 1:
        return {"no_dist": True}
    return {"process_group": host.cpu_group}


def _on_host(state: Any) -> Any:
    """A host copy of every tensor in a nested state (the staging step of an async save)."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.detach().to("cpu", copy=True), state)


def _looks_like_checkpoint(path: str) -> bool:
    markers = ("config.json", ".metadata", FRESH_OPTIMIZER, SCHEDULER_FILE, "tokenizer_config.json", "tokenizer.json")
    return not os.listdir(path) or any(os.path.exists(os.path.join(path, m)) for m in markers)


def _prepare(host: CheckpointHost, finals: list[str], tmps: list[str]) -> None:
    if host.rank != 0:
        return
    for final in finals:
        if os.path.isdir(final) and not _looks_like_checkpoint(final):
            raise ValueError(
                f"{final!r} exists and does not look like a checkpoint (no config.json, optimizer or "
                "tokenizer files); refusing to replace it: pick an empty or new directory"
            )
    for t in tmps:
        os.makedirs(t, exist_ok=False)


class Checkpointer:
    """The checkpoint side of one rank: the background thread that writes staged shards (a
    :class:`~dask_lm.io.checkpoint.BackgroundWriter`) and the async save it has not finished yet (at most one).

    Every rank runs the same collectives in the same order whatever fails, and the ranks agree on success after
    each phase (:mod:`dask_lm.comm.collectives`): (1) the directories exist, (2) the weights are gathered and
    written (rank 0 keeps gathering even after a failed write) with config and tokenizer, (3) the optimizer state
    is written (DCP fails on every rank together), (4) rank 0 publishes, or discards everything.

    It is made with what it saves and restores: the rank's model (``host``) and its :class:`Trainer` (the optimizer,
    the scheduler and the fp32 masters).
    """

    def __init__(self, host: CheckpointHost, trainer: Trainer) -> None:
        self.host = host
        self.trainer = trainer
        self.writer = BackgroundWriter()
        self.pending: dict[str, Any] | None = None

    def save(self, req: SaveRequest) -> dict[str, Any]:
        """Write the temporary directories; publish them now (sync) or leave that to :meth:`finalize`.
        ``req.weights_tokenizer`` (the policy's tokenizer) is saved into the weights directory too, which makes it a
        complete Hugging Face model directory."""
        import torch.distributed.checkpoint as dcp

        weights, optimizer, tokenizer = req.weights, req.optimizer, req.tokenizer
        async_save, max_shard_size, weights_tokenizer = req.async_save, req.max_shard_size, req.weights_tokenizer
        host, trainer = self.host, self.trainer
        if self.pending is not None:  # one save at a time: finish the previous one first
            self.finalize()
        parts = [p for p in (weights, optimizer, tokenizer and tokenizer[:2]) if p]
        tmps, finals = [p[0] for p in parts], [p[1] for p in parts]
        with _failing_together(host, tmps, "prepare the checkpoint directories"):
            if optimizer is not None:
                trainer.ensure_optimizer()
            _prepare(host, finals, tmps)
        host.ensure_on_device()  # FSDP gathers run on the device the mesh lives on
        staged: dict[str, Any] | None = {} if async_save else None
        with _failing_together(host, tmps, "write the weights"):
            if weights:
                with ckpt.writing(weights[1]):
                    _write_weights(host, trainer, weights[0], max_shard_size, staged=staged)
                    if host.rank == 0:
                        _write_config(host, weights[0])
                        if weights_tokenizer is not None:
                            weights_tokenizer.save_pretrained(weights[0])
            if tokenizer and host.rank == 0:
                with ckpt.writing(tokenizer[1]):
                    tokenizer[2].save_pretrained(tokenizer[0])
        pending: dict[str, Any] = {
            "publish": parts,
            "tmps": tmps,
            "dcp": None,
            "writer": None,
            "dcp_path": optimizer and optimizer[1],
            "writer_path": weights and weights[1],
        }
        if optimizer:
            error = collectives.capture(
                lambda: _write_optimizer(host, trainer, optimizer, pending, async_save, dcp, self.writer)
            )
            agreed = None
            if async_save:  # a rank whose staging failed must not leave its peers waiting for a finalize
                agreed = collectives.all_agree(
                    error is None, _agreement_group(host, main_group=True), where=host.device
                )
                if not agreed:
                    _wait_quietly(pending)
            _raise_together(host, error, tmps, "write the optimizer state", agreed=agreed)
        if async_save:
            if host.rank == 0 and staged:
                pending["writer"] = self.writer.submit(lambda: _write_staged(weights[0], staged))  # type: ignore[index]
            self.pending = pending
            return {"staged": True}
        _publish(host, pending)
        return {"staged": False}

    def finalize(self) -> bool:
        """Wait until every byte of the pending async save is written, then publish it (all ranks agree first)."""
        host = self.host
        pending, self.pending = self.pending, None
        if pending is None:
            return False

        def wait() -> None:
            if pending["dcp"] is not None:
                fut = pending["dcp"]
                with ckpt.writing(pending["dcp_path"]):
                    (fut.result() if hasattr(fut, "result") else fut.upload_completion.result())
            if pending["writer"] is not None:
                with ckpt.writing(pending["writer_path"]):
                    pending["writer"].result()

        _raise_together(host, collectives.capture(wait), pending["tmps"], "finish writing the checkpoint")
        _publish(host, pending)
        return True

    def abandon(self) -> bool:
        """Drop a pending async save without a collective (its driver is gone, or a peer rank is): nothing is
        published, and this rank's temporary directories go. Finishing it would need every rank to agree, and a
        rank that is gone never answers; a checkpoint nobody asked to finish is not worth a worker blocked until
        the collective timeout."""
        pending, self.pending = self.pending, None
        if pending is None:
            return False
        logger.warning(
            "abandoning an unfinished async checkpoint (its Policy lost its driver or a rank); nothing "
            "of it is published"
        )
        for tmp in pending["tmps"]:
            ckpt.discard(tmp)
        return True

    def close(self, *, orphaned: bool) -> None:
        """Policy shutdown: finish a pending async save (its staged bytes are never dropped on the floor), or,
        ``orphaned`` (a peer or the driver is gone), abandon it without waiting on a collective."""
        if self.pending is None:
            return
        if orphaned:
            self.abandon()
            return
        try:
            self.finalize()
        except Exception:
            logger.exception("finishing a pending async checkpoint during shutdown failed")

    def load_optimizer(self, path: str) -> None:
        """Restore optimizer and scheduler state saved by :meth:`save` (any number of ranks then), at the Policy's
        start (``optimizer_path``). Every pickled file is read as data only (:mod:`dask_lm.io.safe_load`): a
        tampered one is refused, never run."""
        host, trainer = self.host, self.trainer
        fresh = os.path.join(path, FRESH_OPTIMIZER)
        if not os.path.isdir(path) or not (os.path.exists(os.path.join(path, ".metadata")) or os.path.exists(fresh)):
            raise ValueError(f"optimizer_path {path!r} is not an optimizer checkpoint written by save_checkpoint")
        trainer.ensure_optimizer()
        opt = trainer.optimizer
        assert opt is not None
        if os.path.exists(fresh):  # saved before the first step: only the hyperparameters
            with open(fresh) as f:
                groups = json.load(f)["param_groups"]
            if len(groups) != len(opt.param_groups):
                raise ValueError(
                    f"optimizer_path {path!r} has {len(groups)} parameter groups, this optimizer "
                    f"{len(opt.param_groups)}"
                )
            for group, saved in zip(opt.param_groups, groups):
                group.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items()})
        else:
            from torch.distributed.checkpoint.api import CheckpointException

            state = optimizer_state(host, trainer, for_load=True)
            try:
                safe_load.dcp_load(state, path, **_dcp_kwargs(host))
            except safe_load.UnsafeCheckpointError:
                raise
            except (Exception, CheckpointException) as e:  # CheckpointException (a BaseException) wraps every rank's
                raise ValueError(
                    f"optimizer_path {path!r} does not fit this model and optimizer (saved for another "
                    f"model, or another optimizer class): {_root_line(e)}"
                ) from None
            if host.fsdp:
                from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

                set_optimizer_state_dict(host.model, opt, state["optim"])
            else:
                load_named_optimizer_state(opt, trainer.param_names(), state["optim"])
        sched_file = os.path.join(path, SCHEDULER_FILE)
        if os.path.exists(sched_file):
            trainer.scheduler.load_state_dict(safe_load.load_plain(sched_file, "LR scheduler state"))
        device.empty_cache()


def _discard_on_rank_0(host: CheckpointHost, tmps: list[str]) -> Callable[[], None]:
    def discard() -> None:
        if host.rank == 0:
            for t in tmps:
                ckpt.discard(t)

    return discard


def _raise_together(
    host: CheckpointHost, error: BaseException | None, tmps: list[str], what: str, agreed: bool | None = None
) -> None:
    """All ranks agree that ``what`` succeeded everywhere; otherwise rank 0 deletes every temporary directory and
    each rank raises (its own error, or one naming the failure elsewhere)."""
    collectives.raise_together(
        error,
        _agreement_group(host),
        agreed=agreed,
        peer_message=f"another rank failed to {what}; the checkpoint was discarded",
        on_failure=_discard_on_rank_0(host, tmps),
    )


def _failing_together(host: CheckpointHost, tmps: list[str], what: str) -> Any:
    """:func:`_raise_together` around a block: its exception is held until every rank has reported in."""
    return collectives.failing_together(
        _agreement_group(host),
        peer_message=f"another rank failed to {what}; the checkpoint was discarded",
        on_failure=_discard_on_rank_0(host, tmps),
    )


def _write_optimizer(
    host: CheckpointHost,
    trainer: Trainer,
    paths: tuple[str, str],
    pending: dict[str, Any],
    async_save: bool,
    dcp: Any,
    writer: BackgroundWriter,
) -> None:
    with ckpt.writing(paths[1]):
        _write_optimizer_files(host, trainer, paths[0], pending, async_save, dcp, writer)


def _write_optimizer_files(
    host: CheckpointHost,
    trainer: Trainer,
    directory: str,
    pending: dict[str, Any],
    async_save: bool,
    dcp: Any,
    writer: BackgroundWriter,
) -> None:
    opt = trainer.optimizer
    assert opt is not None
    if not opt.state:
        # no step taken yet: nothing to shard. Saving through DCP would first initialise the live state (Adam at
        # step 1 with zero moments), silently changing the next real step; record the hyperparameters instead
        if host.rank == 0:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            with open(os.path.join(directory, FRESH_OPTIMIZER), "w") as f:
                json.dump({"param_groups": groups}, f, default=float)
    else:
        state = optimizer_state(host, trainer)
        if async_save and host.world_size == 1:
            # DCP's async path insists on a CPU default process group even without one; stage and write it here
            staged = _on_host(state)
            pending["dcp"] = writer.submit(lambda: dcp.save(staged, checkpoint_id=directory, no_dist=True))
        elif async_save:
            pending["dcp"] = dcp.async_save(state, checkpoint_id=directory, **_dcp_kwargs(host))
        else:
            dcp.save(state, checkpoint_id=directory, **_dcp_kwargs(host))
    if host.rank == 0:  # tiny and rank-independent; after the collective so a failure cannot desync it
        _save_scheduler(trainer, os.path.join(directory, SCHEDULER_FILE))


def _save_scheduler(trainer: Trainer, path: str) -> None:
    """The LR scheduler's state, checked to load back as plain data (:func:`safe_load.load_plain`): a state that
    would need code to load fails the save now, not the restore later."""
    buf = io.BytesIO()
    torch.save(trainer.scheduler.state_dict(), buf)
    try:
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as e:
        raise ValueError(
            f"the LR scheduler {type(trainer.scheduler).__name__} keeps state that is not plain "
            f"data ({safe_load.one_line(e)}); checkpoints load without running code, so use a scheduler "
            "whose state_dict() holds only numbers, strings, lists, dicts and tensors"
        ) from None
    with open(path, "wb") as f:
        f.write(buf.getbuffer())


def _write_staged(directory: str, staged: dict[str, Any]) -> None:
    for i, count, tensors in staged.get("shards", []):
        ckpt.write_shard(directory, i, count, tensors)
    shards, total = staged["index"]
    ckpt.write_index(directory, shards, total)


def _wait_quietly(pending: dict[str, Any]) -> None:
    for key in ("dcp", "writer"):
        fut = pending.get(key)
        if fut is None:
            continue
        try:
            (fut.result() if hasattr(fut, "result") else fut.upload_completion.result())
        except BaseException:  # the caller reports the first failure
            pass


def _publish(host: CheckpointHost, pending: dict[str, Any]) -> None:
    """Rank 0 renames every directory into place; if one rename fails the rest are discarded."""
    if host.rank != 0:
        return
    done = 0
    try:
        for tmp, final in pending["publish"]:
            ckpt.publish(tmp, final)
            done += 1
    except BaseException:
        for tmp, _final in pending["publish"][done:]:
            ckpt.discard(tmp)
        raise


def _root_line(e: BaseException) -> str:
    """One line for DCP's CheckpointException (whose message is every rank's traceback): the first failure."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        e = next(iter(failures.values()))[0]
    return safe_load.one_line(e)[:500]

"""The training half of ``Policy`` (driver side): ``train``, checkpoints and the placement hooks of an RL loop.

Mixed into :class:`dask_lm.Policy`. Every check that can fail on user input runs here, before any rank is
touched: the loss contract, the keys it needs, shapes, finite values, batch-size arithmetic, pair-keeping for
preference losses, checkpoint paths. The ranks then run :mod:`dask_lm.workers.trainer` and
:mod:`dask_lm.workers.checkpointing`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import os
import time
from typing import Any

from distributed import span

from dask_lm.data.batch import BatchedDataDict
from dask_lm.data.messages import (
    ActionRequest,
    PlacementAction,
    ReduceTrain,
    SaveRequest,
    Shard,
    TrainRequest,
)
from dask_lm.data.validation import validate_input_batch, validate_train_batch
from dask_lm.engine import progress
from dask_lm.engine.dataflow import RemoteRows, is_remote
from dask_lm.engine.events import log_call
from dask_lm.engine.futures import Pending
from dask_lm.engine.metrics import timed
from dask_lm.engine.policy_base import PolicyBase
from dask_lm.io import checkpoint as ckpt
from dask_lm.losses.base import loss_attribute

__all__ = ["TrainCall", "TrainingMixin", "submit_train"]


@dataclasses.dataclass(frozen=True, slots=True)
class TrainCall:
    """One ``train`` call, its arguments as the user gave them (``train``'s parameters, in its order): what
    ``Policy.submit("train", ...)`` checks, shards and posts, handed on as one value."""

    data: Any
    loss_fn: Any
    eval_mode: bool = False
    gbs: int | None = None  # None: the config's train_global_batch_size
    mbs: int | None = None  # None: the config's train_micro_batch_size
    timer: Any = None
    check_dim_skip_keys: Any = None


def submit_train(self: TrainingMixin, /, *args: Any, **kwargs: Any) -> Pending:
    """``Policy.submit("train", ...)``'s entry: ``train``'s arguments made one :class:`TrainCall`, then posted."""
    return self._submit_train(TrainCall(*args, **kwargs))


# the entry takes what TrainCall takes and says so to inspect (tests/test_submit_table.py holds it to train's)
submit_train.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY), *inspect.signature(TrainCall).parameters.values()]
)


def _checkpoint_options(checkpointing_cfg: Any) -> tuple[bool, int]:
    """``(async_save, max_shard_size)`` from a NeMo RL checkpointing config (other keys are the trainer's)."""
    cfg = dict(checkpointing_cfg or {})
    fmt = cfg.get("model_save_format", "safetensors")
    if fmt not in (None, "safetensors"):
        raise ValueError(
            f"`checkpointing.model_save_format` = {fmt!r}: dask-lm writes Hugging Face safetensors "
            "directories (loadable with from_pretrained); set it to 'safetensors'"
        )
    async_save = bool(cfg.get("async_save", cfg.get("is_async", False)))
    return async_save, ckpt.parse_size(cfg.get("max_shard_size", "5GB"))


class TrainingMixin(PolicyBase):
    # ----------------------------------------------------------------------------------------- train
    def train(
        self,
        data: BatchedDataDict[Any],
        loss_fn: Any,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
        timer: Any = None,
        check_dim_skip_keys: Any = None,
    ) -> dict[str, Any]:
        """One optimizer step per global batch of ``gbs`` rows (``eval_mode``: forward only, nothing changes).

        Returns ``loss`` (float32 [num_global_batches]), ``grad_norm`` (the last step's norm before clipping,
        None in eval), ``all_mb_metrics`` (metric -> one value per micro-batch and rank), ``num_ranks``,
        ``train_elapsed_seconds`` and the FLOP figures (``total_flops``, ``theoretical_tflops``, ``achieved_tflops``,
        ``mfu``, ...), each left out where it cannot be known, as NeMo RL's Policy leaves them out.
        """
        out: dict[str, Any] = self.submit(
            "train",
            data,
            loss_fn,
            eval_mode=eval_mode,
            gbs=gbs,
            mbs=mbs,
            timer=timer,
            check_dim_skip_keys=check_dim_skip_keys,
        ).result()
        return out

    def _train_sizes(self, call: TrainCall) -> tuple[int, int]:
        """``(gbs, mbs)`` after the checks that need no data."""
        cfg, loss_fn, eval_mode = self.cfg, call.loss_fn, call.eval_mode
        dp = self.data_parallel_size
        gbs = int(call.gbs or cfg.train_global_batch_size)
        mbs = int(call.mbs or cfg.train_micro_batch_size)
        if gbs < 1 or mbs < 1:
            raise ValueError(f"train: gbs and mbs must be >= 1, got gbs={gbs}, mbs={mbs}")
        if cfg.reward_model_cfg.enabled:
            raise ValueError("train: training a reward model (reward_model_cfg.enabled) is not supported yet")
        if not eval_mode and not self.init_optimizer:
            raise ValueError(
                "train: this Policy was created with init_optimizer=False; create it with "
                "init_optimizer=True to train (eval_mode=True works without one)"
            )
        if loss_attribute(loss_fn, "requires_pairs"):
            if cfg.dynamic_batching.enabled or cfg.sequence_packing.enabled:
                raise ValueError(
                    f"train: {type(loss_fn).__name__} needs (chosen, rejected) rows side by side, which "
                    "dynamic batching and sequence packing reorder; set policy.dynamic_batching.enabled "
                    "and policy.sequence_packing.enabled to false"
                )
            if mbs % 2 or (gbs // dp) % 2:
                raise ValueError(
                    f"train: {type(loss_fn).__name__} takes (chosen, rejected) pairs: the micro-batch "
                    f"size ({mbs}) and the rows per rank per step ({gbs // dp}) must be even"
                )
        if gbs % dp:
            raise ValueError(f"train: the global batch size {gbs} must be a multiple of the {dp} ranks")
        return gbs, mbs

    @staticmethod
    def _global_batches(rows: int, gbs: int) -> int:
        if rows % gbs:
            raise ValueError(
                f"train: the batch has {rows} rows, not a multiple of the global batch size {gbs}; pass "
                "gbs=, or pad the batch with rows whose sample_mask is 0"
            )
        return rows // gbs

    def _submit_train(self, call: TrainCall) -> Pending:
        cfg, data = self.cfg, call.data
        gbs, mbs = self._train_sizes(call)
        start = time.perf_counter()
        # rows that stay on the workers are checked there and planned here from their lengths
        remote = (
            RemoteRows(self, data, call="train", train=(call.loss_fn, call.check_dim_skip_keys))
            if is_remote(data)
            else None
        )
        if remote is None:
            data = validate_input_batch(
                data,
                what="train",
                vocab_size=self.vocab_size,
                max_length=cfg.max_total_sequence_length,
                pad_token_id=self.pad_token_id,
            )
            data = validate_train_batch(
                data, call.loss_fn, check_dim_skip_keys=call.check_dim_skip_keys, vocab_size=self.vocab_size
            )
        rows = data.size if remote is None else remote.rows
        num_global_batches = self._global_batches(rows, gbs)
        with timed(call.timer, "policy_training/sharding_data"):
            shards, _order, packed = self._shard(data if remote is None else remote.skeleton(), gbs)
        posted = [Shard.of(s, packed=packed) for s in shards] if remote is None else remote.bind(shards, packed=packed)
        return self._post_train(
            call,
            posted,
            [s["input_lengths"] for s in shards],
            gbs=gbs,
            mbs=mbs,
            num_global_batches=num_global_batches,
            rows=rows,
            start=start,
        )

    def _post_train(
        self,
        call: TrainCall,
        shards: Any,
        lengths: list[Any],
        *,
        gbs: int,
        mbs: int,
        num_global_batches: int,
        rows: int,
        start: float,
    ) -> Pending:
        """Post a :class:`TrainRequest` of each rank's shard (``shards``: a list of Shards, or rows that stay on the
        workers, :class:`~dask_lm.engine.dataflow.RemoteRows`) for ``call``, whose sizes are ``gbs`` and ``mbs`` as
        resolved; ``lengths``: each rank's row lengths, for the FLOP count."""
        eval_mode = call.eval_mode
        tracker = self.flops_tracker  # NeMo RL's: reset, then this call's rows (lm_policy.py:786-790)
        if tracker is not None:
            tracker.reset()
            tracker.training = not eval_mode  # an eval call runs forwards only
            for lens in lengths:
                tracker.track_batch(lens)
        label = "eval" if eval_mode else "train"
        # a bar only when there is something to follow: RL loops call train() once per step with one global batch
        show = num_global_batches if num_global_batches > 1 else 0
        group = self.group
        progress_id, _bar = progress.open_bar(self.client, show, label, "global batch")
        try:
            with timed(call.timer, "policy_training/submit_training_futures"), span(f"dask-lm/{label}"):
                make = functools.partial(
                    TrainRequest,
                    loss_fn=call.loss_fn,
                    eval_mode=eval_mode,
                    gbs=gbs,
                    mbs=mbs,
                    num_global_batches=num_global_batches,
                    progress_id=progress_id,
                )
                futures = self._post_requests(make, shards, what=label)
        except BaseException:
            progress.close_bar(progress_id)
            raise
        client, policy_id = self.client, group.policy_id

        def done(out: Any, error: BaseException | None) -> None:
            progress.close_bar(progress_id)
            if error is not None:
                return
            lr = out["all_mb_metrics"].get("lr")
            log_call(
                client,
                policy_id,
                label,
                start=start,
                tokens=out["num_tokens"],
                rows=rows,
                global_batches=num_global_batches,
                loss=out["loss"],
                grad_norm=None if out["grad_norm"] is None else float(out["grad_norm"]),
                lr=lr[-1] if lr else None,
                mfu=out.get("mfu"),
            )

        return Pending(futures, ReduceTrain(tracker.total_flops if tracker is not None else None), label, done)

    # ----------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(
        self,
        weights_path: str | os.PathLike[str],
        optimizer_path: str | os.PathLike[str] | None = None,
        tokenizer_path: str | os.PathLike[str] | None = None,
        checkpointing_cfg: Any = None,
    ) -> None:
        """Write ``weights_path`` as a Hugging Face model directory (weights, config, generation config and the
        policy's tokenizer: it loads with both ``AutoModelForCausalLM`` and ``AutoTokenizer``), ``optimizer_path``
        as optimizer + scheduler state (torch.distributed.checkpoint) and ``tokenizer_path`` with the tokenizer
        alone (NeMo RL's layout).

        Each directory is written under a temporary name and renamed into place when complete. With
        ``checkpointing_cfg={"async_save": True}`` this returns once the state is staged in host memory;
        :meth:`finalize_async_save` then blocks until every byte is written and the directories appear.
        """
        async_save, max_shard = _checkpoint_options(checkpointing_cfg)
        paths = {"weights_path": weights_path, "optimizer_path": optimizer_path, "tokenizer_path": tokenizer_path}
        resolved = {k: os.path.abspath(os.fspath(v)) for k, v in paths.items() if v is not None}
        if "weights_path" not in resolved:
            raise ValueError("save_checkpoint: `weights_path` is required")
        for (ka, a), (kb, b) in itertools.combinations(resolved.items(), 2):
            if os.path.commonpath([a, b]) in (a, b):
                raise ValueError(
                    f"save_checkpoint: `{ka}` ({a}) and `{kb}` ({b}) must be separate directories, "
                    "neither inside the other (each is replaced as a whole)"
                )
        if "optimizer_path" in resolved and not self.init_optimizer:
            raise ValueError(
                "save_checkpoint: `optimizer_path` needs an optimizer; this Policy was created with "
                "init_optimizer=False"
            )
        for key, path in resolved.items():
            if os.path.exists(path) and not os.path.isdir(path):
                raise ValueError(f"save_checkpoint: `{key}` {path!r} exists and is not a directory")
        weights = (ckpt.temporary_sibling(resolved["weights_path"]), resolved["weights_path"])
        optimizer = None
        if "optimizer_path" in resolved:
            optimizer = (ckpt.temporary_sibling(resolved["optimizer_path"]), resolved["optimizer_path"])
        tokenizer = None
        if "tokenizer_path" in resolved:
            tokenizer = (ckpt.temporary_sibling(resolved["tokenizer_path"]), resolved["tokenizer_path"], self.tokenizer)
        # the tokenizer's files go into weights_path too, so that it is a complete Hugging Face directory:
        # from_pretrained of the model and of the tokenizer, and `dask-lm score --model`, all take it as it is
        weights_tokenizer = self.tokenizer if hasattr(self.tokenizer, "save_pretrained") else None
        with span("dask-lm/save-checkpoint"):
            self.group.run(
                SaveRequest(
                    weights,
                    optimizer,
                    tokenizer,
                    async_save=async_save,
                    max_shard_size=max_shard,
                    weights_tokenizer=weights_tokenizer,
                ),
                what="save_checkpoint",
                key_name="save-checkpoint",
            )

    def finalize_async_save(self) -> None:
        """Block until a pending async ``save_checkpoint`` is fully written and renamed into place."""
        with span("dask-lm/finalize-checkpoint"):
            self.group.run(
                ActionRequest("finalize_async_save"), what="finalize_async_save", key_name="finalize-checkpoint"
            )

    # ----------------------------------------------------------------------------------------- placement
    def _on_all(self, action: PlacementAction) -> None:
        self.group.run(ActionRequest(action), what=action, key_name=action.replace("_", "-"))

    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        """Weights and optimizer state on the devices, ready for ``train``."""
        self._on_all("prepare_for_training")

    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        self._on_all("finish_training")

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        self._on_all("prepare_for_generation")
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        self._on_all("finish_generation")
        return True

    def invalidate_kv_cache(self, *args: Any, **kwargs: Any) -> bool:
        self._on_all("invalidate_kv_cache")
        return True

    def offload_before_refit(self) -> None:
        """Optimizer state to host memory, freeing device memory for the inference engine's weights."""
        self._on_all("offload_before_refit")

    def offload_after_refit(self) -> None:
        """Weights and optimizer state to host memory (the inference engine has the weights now)."""
        self._on_all("offload_after_refit")

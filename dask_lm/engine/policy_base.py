"""What the driver halves of ``Policy`` share: the policy's state on the driver, its ranks, and how a batch is
cut into per-rank shards. :class:`dask_lm.engine.training.TrainingMixin`, :class:`dask_lm.refit.driver.RefitMixin`
and :class:`dask_lm.Policy` derive from it, so each half sees the same typed attributes without restating them."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from dask_lm.config import PolicyConfig
from dask_lm.config.defaults import PACKED_BATCH_TOKENS
from dask_lm.data.batch import BatchedDataDict, SlicedDataDict
from dask_lm.data.named_sharding import NamedSharding
from dask_lm.data.sharding import DynamicBatchingArgs, SequencePackingArgs
from dask_lm.engine.metrics import FLOPTracker
from dask_lm.engine.worker_group import WorkerGroup
from dask_lm.workers import tasks

__all__ = ["PolicyBase"]


def _budget(tokens: int | None) -> int:
    assert tokens is not None, "PolicyConfig fills the token budgets of an enabled batching mode"
    return int(tokens)


class PolicyBase:
    """The driver-side state of a Policy (set by ``Policy.__init__``) and the helpers every call uses."""

    cfg: PolicyConfig
    client: Any  # distributed.Client
    tokenizer: Any
    pad_token_id: int
    hf_config: Any
    vocab_size: int | None
    init_optimizer: bool
    worker_info: list[dict[str, Any]]
    sharding_annotations: NamedSharding
    """The ranks as NeMo RL's named axes (pipeline, data, context, tensor parallel); every rank is data-parallel."""
    flops_tracker: FLOPTracker | None
    """Counts the FLOPs of each ``train()`` call (None for model families without a formula): NeMo RL's
    attribute, set in its constructor (``nemo_rl/models/policy/lm_policy.py:331-337``)."""
    _group: WorkerGroup | None
    _finalizer: weakref.finalize[..., Any]

    @staticmethod
    def _pad_id(tokenizer: Any) -> int:
        for attr in ("pad_token_id", "eos_token_id"):
            value = getattr(tokenizer, attr, None)
            if isinstance(value, int):
                return value
        return 0

    @property
    def group(self) -> WorkerGroup:
        if self._group is None or not self._finalizer.alive:
            raise RuntimeError("this Policy has been shut down; create a new one")
        return self._group

    @property
    def data_parallel_size(self) -> int:
        return self.group.world_size

    def _auto_packing(self) -> int | None:
        """The token budget when inference packs rows by itself (``policy.inference_packing``), else None."""
        cfg = self.cfg
        on = cfg.inference_packing
        if on is None:
            # GPU ranks with the varlen kernel: without it (float32, eager attention, pre-Ampere GPUs) a packed
            # micro-batch needs a dense [T, T] mask, slower than padded rows
            on = bool(self.worker_info) and all(i.get("device") == "cuda" and i.get("varlen") for i in self.worker_info)
        if not on:
            return None
        return max(cfg.inference_mb_tokens or PACKED_BATCH_TOKENS, cfg.max_total_sequence_length)

    def _shard(
        self, data: BatchedDataDict[Any], gbs: int | None = None, auto_pack: bool = False
    ) -> tuple[list[SlicedDataDict], list[int] | None, bool]:
        """DP shards (plain, dynamic or packed), the permutation that restores input order (or None), and whether
        the shards are packed.

        Inference (``gbs`` None) takes any batch size (shards may differ by a row) and the logprob token budgets;
        training splits per global batch of ``gbs`` rows with the training budgets. ``auto_pack``: an inference
        call that may pack by itself when no batching mode is configured (:meth:`_auto_packing`)."""
        cfg = self.cfg
        training = gbs is not None
        if cfg.dynamic_batching.enabled:
            db = cfg.dynamic_batching
            dynamic = DynamicBatchingArgs(
                input_key="input_ids",
                input_lengths_key="input_lengths",
                sequence_length_round=db.sequence_length_round,
                max_tokens_per_microbatch=_budget(db.train_mb_tokens if training else db.logprob_mb_tokens),
            )
            return (*self._split(data, gbs, dynamic_batching_args=dynamic), False)
        sp = cfg.sequence_packing
        budget: int | None = None
        pad_multiple = 1
        if sp.enabled:
            budget = _budget(sp.train_mb_tokens if training else sp.logprob_mb_tokens)
            pad_multiple = cfg.make_sequence_length_divisible_by
        elif auto_pack and not training:
            budget = self._auto_packing()
        if budget is None:
            shards, order = self._split(data, gbs)
            return shards, order, False
        packing = SequencePackingArgs(
            input_key="input_ids",
            input_lengths_key="input_lengths",
            max_tokens_per_microbatch=budget,
            algorithm=sp.algorithm,
            sequence_length_pad_multiple=pad_multiple,
            microbatch_order=sp.microbatch_order,
        )
        return (*self._split(data, gbs, sequence_packing_args=packing), True)

    def _split(
        self,
        data: BatchedDataDict[Any],
        gbs: int | None,
        *,
        dynamic_batching_args: DynamicBatchingArgs | None = None,
        sequence_packing_args: SequencePackingArgs | None = None,
    ) -> tuple[list[SlicedDataDict], list[int] | None]:
        """``data.shard_by_batch_size`` over the ranks: ``(shards, order)``, ``order`` None without reordering."""
        out = data.shard_by_batch_size(
            self.data_parallel_size,
            batch_size=gbs,
            allow_uneven_shards=gbs is None,
            dynamic_batching_args=dynamic_batching_args,
            sequence_packing_args=sequence_packing_args,
        )
        if isinstance(out, tuple):
            return out
        return out, None

    def submit(self, method: str, /, *args: Any, collect: bool = True, **kwargs: Any) -> Any:
        """A call's future (:meth:`dask_lm.Policy.submit`)."""
        raise NotImplementedError  # Policy defines it; the training half's blocking train() calls it

    def _post_requests(self, make: Callable[[Any], Any], shards: Any, *, what: str) -> list[Any]:
        """``make(shard)`` to :func:`tasks.serve` on each rank: ``shards`` is a list of Shards (built here, scattered
        to their ranks) or rows that live on the workers (:class:`dask_lm.engine.dataflow.RemoteRows`), whose
        requests are built on each rank's worker."""
        key_name = what.replace("_", "-")
        if isinstance(shards, list):
            return self.group.post([make(s) for s in shards], what=what, key_name=key_name)
        requests = shards.requests(make)
        return self.group.submit(
            tasks.serve, self.group.policy_id, per_rank=[(r,) for r in requests], key_name=key_name
        )

    def get_free_memory_bytes(self) -> int:
        """The smallest free device memory over the workers (host RAM on CPU workers)."""
        infos = self.group.call(tasks.rank_info, what="get_free_memory_bytes", key_name="free-memory")
        return int(min(i["free_memory_bytes"] for i in infos))

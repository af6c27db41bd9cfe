"""One rank of a Policy: builds the model, shards it with FSDP2, and answers logprob / top-k / score calls.

A ``PolicyWorker`` lives inside a Dask worker process (held by the plugin in ``state.py``) and is driven by
pinned tasks from ``tasks.py``. Every public method here is the worker half of a ``Policy`` method.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from dask_lm.config import PolicyConfig
from dask_lm.engine.batch import BatchedDataDict
from dask_lm.workers import device
from dask_lm.workers.forward import (
    MicroBatch,
    block_causal_mask,
    final_hidden_states,
    pack,
    pad_with_dummies,
    plan_micro_batches,
    unpack_positions,
)
from dask_lm.workers.logprobs import next_token_logprobs, output_head, topk_logits

__all__ = ["PolicyWorker", "local_tensor"]

logger = logging.getLogger("dask_lm.worker")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (the tensor itself when it is not a DTensor)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def resolve_class(path: str, key: str) -> type:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"`{key}` = {path!r} cannot be imported ({e}); give a full import path such as "
                         "'torch.optim.AdamW'") from e


class PolicyWorker:
    """The model, optimizer and reference weights of one rank."""

    def __init__(self, cfg: PolicyConfig, *, rank: int, world_size: int, group: Any, pad_token_id: int,
                 init_optimizer: bool = True, init_reference_model: bool = True, weights_path: str | None = None,
                 skip_weight_load: bool = False) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.pad_token_id = pad_token_id
        self.device = device.local_device()
        self.dtype = device.torch_dtype(cfg.precision)
        self.is_reward_model = cfg.reward_model_cfg.enabled
        self.model = self._build_model(skip_weight_load)
        self.fsdp = world_size > 1
        if self.fsdp:
            self._apply_fsdp()
        self.model.eval()
        # the reference is the weights as loaded from model_name, taken before any weights_path restore
        self.reference: dict[str, torch.Tensor] | None = None
        if init_reference_model:
            self.reference = {n: device.pin(local_tensor(p)) for n, p in self.model.named_parameters()}
        if weights_path:
            self.load_weights(weights_path)
        self.optimizer = self._build_optimizer() if init_optimizer and cfg.optimizer is not None else None
        self.extension_state: dict[str, Any] = {}

    # ----------------------------------------------------------------------------------------- build
    def _build_model(self, skip_weight_load: bool) -> torch.nn.Module:
        import transformers

        cfg = self.cfg
        auto = (transformers.AutoModelForSequenceClassification if self.is_reward_model
                else transformers.AutoModelForCausalLM)
        overrides = dict(cfg.hf_config_overrides or {})
        if self.is_reward_model:
            overrides["num_labels"] = 1  # a Bradley-Terry reward model has one score
        hf_config = transformers.AutoConfig.from_pretrained(cfg.model_name, **overrides)
        if getattr(hf_config, "pad_token_id", None) is None:
            # sequence-classification heads refuse batches > 1 without a pad id; we pool by length anyway
            hf_config.pad_token_id = self.pad_token_id
        kwargs = {"config": hf_config, "dtype": self.dtype, "attn_implementation": cfg.attn_implementation}
        if skip_weight_load:
            model = auto.from_config(hf_config, dtype=self.dtype, attn_implementation=cfg.attn_implementation)
        else:
            model = auto.from_pretrained(cfg.model_name, **kwargs)
        return model.to(self.device)

    def _apply_fsdp(self) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(self.group, self.device.type)
        block_names = set(getattr(self.model, "_no_split_modules", None) or [])
        blocks = [m for m in self.model.modules() if type(m).__name__ in block_names]
        assert blocks, f"{type(self.model).__name__} declares no _no_split_modules to shard by"
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def _build_optimizer(self) -> torch.optim.Optimizer:
        opt_cfg = self.cfg.optimizer
        assert opt_cfg is not None
        cls = resolve_class(opt_cfg.name, "policy.optimizer.name")
        kwargs = dict(opt_cfg.kwargs)
        if "betas" in kwargs:
            kwargs["betas"] = tuple(kwargs["betas"])
        try:
            return cls(self.model.parameters(), **kwargs)
        except TypeError as e:
            raise ValueError(f"`policy.optimizer.kwargs` do not fit {opt_cfg.name}: {e}") from e

    def load_weights(self, weights_path: str) -> None:
        """Load a Hugging Face model directory (``save_pretrained`` / ``save_checkpoint`` output) into this rank."""
        import transformers

        auto = (transformers.AutoModelForSequenceClassification if self.is_reward_model
                else transformers.AutoModelForCausalLM)
        full = auto.from_pretrained(weights_path, dtype=self.dtype).state_dict()
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True, strict=False))
        else:
            missing, unexpected = self.model.load_state_dict(full, strict=False)
            if unexpected:
                raise ValueError(f"weights_path {weights_path!r} holds tensors this model lacks: {unexpected[:5]}")

    # ----------------------------------------------------------------------------------------- passes
    @property
    def temperature(self) -> float:
        gen = self.cfg.generation
        return gen.temperature if gen is not None else 1.0

    def _plan(self, data: BatchedDataDict, meta: dict[str, Any], mbs: int | None) -> list[MicroBatch]:
        self._ensure_on_device()
        plan = plan_micro_batches(data.size, mbs=mbs or int(self.cfg.logprob_batch_size or 1),
                                  micro_batch_indices=meta.get("micro_batch_indices"),
                                  packed=bool(meta.get("packed")))
        if self.fsdp:
            count = torch.tensor([len(plan)], dtype=torch.int64, device=self.device)
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX, group=self.group)
            plan = pad_with_dummies(plan, int(count.item()))
        return plan

    def _forward(self, data: BatchedDataDict, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Hidden states of one micro-batch plus how to map them back: ``(hidden, info)``."""
        if mb.end == mb.start:  # a dummy on a rank with no rows: one pad token keeps the collectives in step
            ids = torch.full((1, 1), self.pad_token_id, dtype=torch.int64, device=self.device)
            return final_hidden_states(self.model, ids), {}
        ids = data["input_ids"][mb.start:mb.end].to(self.device, torch.int64, non_blocking=True)
        lens = data["input_lengths"][mb.start:mb.end].to(self.device, torch.int64, non_blocking=True)
        if mb.packed:
            pids, pos, cu = pack(ids, lens)
            additive = None if self.cfg.attn_implementation == "sdpa" else self.dtype
            mask = block_causal_mask(cu, pids.shape[1], additive_dtype=additive)
            hidden = final_hidden_states(self.model, pids, position_ids=pos, attention_mask=mask)
            return hidden, {"ids": pids, "lens": lens, "cu": cu, "valid": torch.ones_like(pids, dtype=torch.bool),
                            "targets_valid": pos > 0}
        width = int(lens.max())
        ids = ids[:, :width]
        valid = torch.arange(width, device=self.device)[None, :] < lens[:, None]
        hidden = final_hidden_states(self.model, ids)
        return hidden, {"ids": ids, "lens": lens, "valid": valid, "targets_valid": valid}

    def _scatter(self, out: torch.Tensor, mb: MicroBatch, values: torch.Tensor, info: dict[str, torch.Tensor]) -> None:
        """Write a micro-batch's ``[b, L, ...]`` (or packed ``[1, T, ...]``) result into the shard output."""
        if mb.packed:
            rows, cols = unpack_positions(info["cu"], info["lens"], out.shape[1])
            out[mb.start + rows.cpu(), cols.cpu()] = values[0].to("cpu")
        else:
            out[mb.start:mb.end, : values.shape[1]] = values.to("cpu")

    def _finish_pass(self) -> None:
        if self.fsdp:
            # the root FSDP group stays gathered after forward (embeddings / lm_head); free it between calls
            self.model.reshard()

    @torch.no_grad()
    def get_logprobs(self, data: BatchedDataDict, meta: dict[str, Any], micro_batch_size: int | None = None,
                     reference: bool = False) -> dict[str, torch.Tensor]:
        gen = self.cfg.generation
        top_k = None if reference or gen is None else gen.top_k
        top_p = 1.0 if reference or gen is None else gen.top_p
        with self._reference_weights() if reference else contextlib.nullcontext():
            width = data["input_ids"].shape[1]
            out = torch.zeros(data.size, width, dtype=torch.float32)
            start = time.perf_counter()
            try:
                for mb in self._plan(data, meta, micro_batch_size):
                    hidden, info = self._forward(data, mb)
                    if mb.dummy or not info:
                        continue
                    lp = next_token_logprobs(hidden, info["ids"], info["targets_valid"], output_head(self.model),
                                             temperature=self.temperature, chunk_size=self.cfg.logprob_chunk_size,
                                             top_k=top_k, top_p=top_p)
                    self._scatter(out, mb, lp, info)
            finally:
                self._finish_pass()
        self._record(data, start)
        return {"reference_logprobs" if reference else "logprobs": out}

    @torch.no_grad()
    def get_topk_logits(self, data: BatchedDataDict, meta: dict[str, Any], k: int,
                        micro_batch_size: int | None = None) -> dict[str, torch.Tensor]:
        width = data["input_ids"].shape[1]
        values = torch.zeros(data.size, width, k, dtype=torch.float32)
        indices = torch.zeros(data.size, width, k, dtype=torch.int64)
        start = time.perf_counter()
        try:
            for mb in self._plan(data, meta, micro_batch_size):
                hidden, info = self._forward(data, mb)
                if mb.dummy or not info:
                    continue
                v, i = topk_logits(hidden, info["valid"], output_head(self.model), k, temperature=self.temperature,
                                   chunk_size=self.cfg.logprob_chunk_size)
                self._scatter(values, mb, v, info)
                self._scatter(indices, mb, i, info)
        finally:
            self._finish_pass()
        self._record(data, start)
        return {"topk_logits": values, "topk_indices": indices}

    @torch.no_grad()
    def score(self, data: BatchedDataDict, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
        if not self.is_reward_model:
            raise ValueError("score() needs a reward model: set `policy.reward_model_cfg.enabled: true` and point "
                             "`policy.model_name` at a sequence-classification checkpoint")
        head = getattr(self.model, "score", None)
        assert head is not None, f"{type(self.model).__name__} has no `score` head"
        scores = torch.zeros(data.size, dtype=torch.float32)
        start = time.perf_counter()
        try:
            for mb in self._plan(data, meta, None):
                hidden, info = self._forward(data, mb)
                if mb.dummy or not info:
                    continue
                if mb.packed:
                    last = hidden[0, info["cu"][1:].to(torch.int64) - 1]
                else:
                    rows = torch.arange(hidden.shape[0], device=hidden.device)
                    last = hidden[rows, info["lens"] - 1]
                scores[mb.start:mb.end] = head(last).float().squeeze(-1).cpu()
        finally:
            self._finish_pass()
        self._record(data, start)
        return {"scores": scores}

    def _ensure_on_device(self) -> None:
        # offload_to_cpu / finish_inference park the weights on the host; a pass brings them back first
        if next(self.model.parameters()).device.type != self.device.type:
            self.model.to(self.device)

    # ----------------------------------------------------------------------------------------- reference
    @contextlib.contextmanager
    def _reference_weights(self) -> Iterator[None]:
        if self.reference is None:
            raise ValueError("this Policy was created with init_reference_model=False, so it kept no reference "
                             "weights; create it with init_reference_model=True to call "
                             "get_reference_policy_logprobs")
        params = dict(self.model.named_parameters())
        current = {n: device.pin(local_tensor(p)) for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                local_tensor(p).copy_(self.reference[n], non_blocking=True)
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    local_tensor(p).copy_(current[n], non_blocking=True)
            device.synchronize()

    # ----------------------------------------------------------------------------------------- placement
    def prepare_for_lp_inference(self) -> bool:
        self.model.to(self.device)
        self.model.eval()
        if self.cfg.offload_optimizer_for_logprob:
            self._move_optimizer("cpu")
        device.empty_cache()
        return True

    def finish_inference(self) -> bool:
        self.model.to("cpu")
        device.empty_cache()
        return True

    def offload_to_cpu(self) -> bool:
        self.model.to("cpu")
        self.model.eval()
        self._move_optimizer("cpu")
        device.empty_cache()
        return True

    def _move_optimizer(self, where: str) -> None:
        if self.optimizer is None:
            return
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    state[k] = v.to(where)

    def _record(self, data: BatchedDataDict, start: float) -> None:
        from dask_lm.workers.state import get_state

        try:
            st = get_state()
        except RuntimeError:
            return
        tokens = int(data["input_lengths"].sum()) if data.size else 0
        st.last_call = {"tokens": tokens, "seconds": time.perf_counter() - start}
        # a token count on the task: the dashboard's fine performance metrics sum it per span (per Policy call)
        from distributed.metrics import context_meter

        context_meter.digest_metric("tokens", tokens, "count")

    def shutdown(self) -> None:
        self.optimizer = None
        self.reference = None
        self.model = None  # type: ignore[assignment]

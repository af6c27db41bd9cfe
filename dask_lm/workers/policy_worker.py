"""One rank of a Policy: builds the model, shards it with FSDP2, and answers logprob / top-k / score calls.

A ``PolicyWorker`` lives inside a Dask worker process (held by the plugin in ``state.py``) and is driven by
pinned tasks from ``tasks.py``. Every public method here is the worker half of a ``Policy`` method.

The worker owns the model (and the reference weights kept at load) and the forward over it; the rest of a
rank's state belongs to three components it composes, each in its own module:

- :class:`~dask_lm.workers.trainer.Trainer`: optimizer, LR scheduler, fp32 master weights; runs ``train``;
- :class:`~dask_lm.workers.checkpointing.Checkpointer`: the background writer and the pending async save;
- :class:`~dask_lm.refit.rank.Refitter`: the refit gloo groups, the collective group, the ZMQ socket.

They reach the model through the worker's public forward protocol (:meth:`PolicyWorker.plan_pass`,
:meth:`~PolicyWorker.forward_micro_batch`, :meth:`~PolicyWorker.end_pass`, :meth:`~PolicyWorker.ensure_on_device`),
which the inference loop (:func:`~dask_lm.model.inference.run_pass`) and generation use as well.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from dask_lm.comm import collectives
from dask_lm.config import PolicyConfig
from dask_lm.data.batch import BatchedDataDict
from dask_lm.data.messages import MicroBatchPlan, TrainResult
from dask_lm.data.tokens import TokenRows
from dask_lm.model import device, fused, varlen
from dask_lm.model.forward import MicroBatch, final_hidden_states, pad_with_dummies, plan_micro_batches
from dask_lm.model.hf import fsdp_blocks
from dask_lm.model.inference import ForwardLayout, forward_rows, run_pass
from dask_lm.model.logprobs import next_token_logprobs, output_head, topk_logits
from dask_lm.refit.rank import Refitter, refit_info
from dask_lm.workers.checkpointing import Checkpointer, load_optimizer_state
from dask_lm.workers.optim import MasterWeights
from dask_lm.workers.trainer import Trainer

__all__ = ["PolicyWorker", "local_tensor"]

def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (the tensor itself when it is not a DTensor)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


class PolicyWorker:
    """The model and reference weights of one rank, and the components that hold the rest of its state."""

    def __init__(self, cfg: PolicyConfig, *, rank: int, world_size: int, group: Any, pad_token_id: int,
                 init_optimizer: bool = True, init_reference_model: bool = True, weights_path: str | None = None,
                 optimizer_path: str | None = None, skip_weight_load: bool = False, cpu_group: Any = None,
                 fsdp: bool | None = None) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        # FSDP2 shards over the group where there are peers. ``fsdp=True`` with one rank (a one-member group) is
        # for benchmarks/master_weights.py, which measures it against the MasterWeights path one rank takes
        self.fsdp = world_size > 1 if fsdp is None else fsdp
        # a one-rank policy has no peers: with no group, the collectives.* agreements answer locally
        self.group: Any = group if self.fsdp else None
        self.cpu_group = cpu_group
        self.pad_token_id = pad_token_id
        self.device = device.local_device()
        self.dtype = device.torch_dtype(cfg.precision)
        self.is_reward_model = cfg.reward_model_cfg.enabled
        self.trainable = bool(init_optimizer and cfg.optimizer is not None)
        # low-precision training keeps fp32 master weights (see optim.py): FSDP's fp32 shards, or MasterWeights
        self.keeps_fp32 = self.trainable and self.dtype != torch.float32
        self.model = self._build_model(skip_weight_load)
        if cfg.dtensor_cfg.activation_checkpointing:
            hf: Any = self.model  # a transformers PreTrainedModel (Module's __getattr__ types methods Tensor | Module)
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        masters: MasterWeights | None = None
        if self.fsdp:
            self._apply_fsdp()
        elif self.keeps_fp32:
            # fp32 masters copied from the fp32 load (no bf16 rounding), then the model's parameters (not its
            # buffers: RoPE tables stay fp32, as in a model loaded in bf16) are cast for compute
            masters = MasterWeights(self.model)
            for p in self.model.parameters():
                p.data = p.data.to(self.dtype)
        self.model.eval()
        # packed micro-batches through flash varlen attention instead of a dense [T, T] mask, where the GPU can
        self.varlen = cfg.attn_implementation == "sdpa" and varlen.available(self.dtype)
        # compiled decoder layers and head reductions for the inference forwards on a GPU (fused.py)
        # and for training forwards (their backward compiled with them); each a per-call switch on the same layers
        want, want_train = cfg.inference_compile, cfg.train_compile
        self.compile = want is True or (want is None and fused.enabled())
        self.train_compile = want_train is True or (want_train is None and fused.enabled())
        if cfg.dtensor_cfg.activation_checkpointing:
            # the recomputation runs in autograd's thread, outside this thread's compiled-layer switch: it would
            # recompute eagerly what the compiled forward saved differently (the config refuses `true` with it)
            self.train_compile = False
        if self.compile or self.train_compile:
            # true also compiles on the CPU (Inductor's C++ backend: slow to compile, used by the tests)
            layers = fused.compile_decoder_layers(self.model, anywhere=True in (want, want_train)) > 0
            self.compile = self.compile and (layers or fused.enabled())
            self.train_compile = self.train_compile and layers
        # the reference is the weights as loaded from model_name, taken before any weights_path restore; kept in
        # the compute dtype (what the forward sees), as each rank's own shard in pinned host memory
        self.reference: dict[str, torch.Tensor] | None = None
        if init_reference_model:
            self.reference = {n: device.pin(local_tensor(p).to(self.dtype)) for n, p in self.model.named_parameters()}
        if weights_path:
            self._load_weights(weights_path, masters)
        # built after the restore: an optimizer class may read the weights it is given (a user's, by import path)
        self.trainer = Trainer(cfg, self.model, masters, trainable=self.trainable)
        self.checkpointer = Checkpointer()
        if optimizer_path:
            load_optimizer_state(self, optimizer_path)
        self.refitter = Refitter(rank)
        self.extension_state: dict[str, Any] = {}

    # ----------------------------------------------------------------------------------------- build
    def _build_model(self, skip_weight_load: bool) -> torch.nn.Module:
        import transformers

        # one weight-loading bar per worker process would garble the driver's own "loading the model" bar
        transformers.utils.logging.disable_progress_bar()
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
        # training in low precision loads fp32: FSDP keeps fp32 shards (MixedPrecisionPolicy computes in
        # `precision`), a single rank copies them into MasterWeights before casting the model
        dtype = torch.float32 if self.keeps_fp32 else self.dtype
        kwargs = {"config": hf_config, "dtype": dtype, "attn_implementation": cfg.attn_implementation}
        if skip_weight_load:
            # random weights made where they live: seconds on a GPU, where a CPU init of a 7B model takes minutes
            with self.device:
                model = auto.from_config(hf_config, dtype=dtype, attn_implementation=cfg.attn_implementation)
        else:
            model = auto.from_pretrained(cfg.model_name, **kwargs)
        return model.to(self.device)

    def _apply_fsdp(self) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = DeviceMesh.from_group(self.group, self.device.type)
        kwargs: dict[str, Any] = {"mesh": mesh}
        if self.keeps_fp32:  # compute in `precision`, reduce gradients in fp32 into the fp32 shards
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        blocks = fsdp_blocks(self.model)
        assert blocks, f"{type(self.model).__name__} declares no _no_split_modules to shard by (the driver checks)"
        self.reshard_after_forward = self._reshard_after_forward()
        for block in blocks:
            fully_shard(block, reshard_after_forward=self.reshard_after_forward, **kwargs)
        fully_shard(self.model, **kwargs)

    def _reshard_after_forward(self) -> bool:
        """``dtensor_cfg.reshard_after_forward``, or where it is null: keep the blocks gathered between forward and
        backward when a full copy of the weights in the compute dtype fits in an eighth of the device."""
        want = self.cfg.dtensor_cfg.reshard_after_forward
        if want is not None:
            return want
        unsharded = sum(p.numel() for p in self.model.parameters()) * torch.finfo(self.dtype).bits // 8
        capacity = device.total_memory_bytes()
        return capacity is None or unsharded > capacity // 8

    def load_weights(self, weights_path: str) -> None:
        """Load a Hugging Face model directory (``save_pretrained`` / ``save_checkpoint`` output) into this rank.

        A trainable low-precision policy reads it in fp32 into its master weights, so a checkpoint written by
        ``save_checkpoint`` (fp32 masters) restores the exact state training continues from."""
        self._load_weights(weights_path, self.trainer.masters)

    def _load_weights(self, weights_path: str, masters: MasterWeights | None) -> None:
        import transformers

        auto = (transformers.AutoModelForSequenceClassification if self.is_reward_model
                else transformers.AutoModelForCausalLM)
        dtype = torch.float32 if self.keeps_fp32 else self.dtype
        try:
            full = auto.from_pretrained(weights_path, dtype=dtype).state_dict()
        except (OSError, ValueError) as e:
            raise ValueError(f"weights_path {weights_path!r} is not a loadable Hugging Face model directory: {e}") from e
        own = self.model.state_dict()
        unexpected = [k for k in full if k not in own]
        if unexpected:
            raise ValueError(f"weights_path {weights_path!r} holds tensors this model lacks: {unexpected[:5]}; it "
                             f"was saved from another architecture than `policy.model_name`")
        self.ensure_on_device()
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True, strict=False))
            return
        if masters is not None:
            with torch.no_grad():
                for name, master in masters.named_parameters().items():
                    if name in full:
                        master.copy_(full[name])
            masters.copy_to_model()
            full = {k: v for k, v in full.items() if k not in masters.named_parameters()}
        self.model.load_state_dict(full, strict=False)

    # ----------------------------------------------------------------------------------------- passes
    @property
    def temperature(self) -> float:
        gen = self.cfg.generation
        return gen.temperature if gen is not None else 1.0

    # the forward protocol: what run_pass, the trainer, generation and refits call on this rank
    def plan_pass(self, rows: TokenRows, plan: MicroBatchPlan, mbs: int | None) -> list[MicroBatch]:
        """The micro-batches of an inference pass over ``rows``; every rank gets as many (dummies pad the
        shorter plans), since each forward all-gathers parameters under FSDP."""
        self.ensure_on_device()
        mb_plan = plan_micro_batches(rows.size, mbs=mbs or int(self.cfg.logprob_batch_size or 1),
                                     micro_batch_indices=plan.micro_batch_indices, packed=plan.packed)
        if self.fsdp:
            count = collectives.max_over_ranks([len(mb_plan)], self.group, where=self.device)[0]
            mb_plan = pad_with_dummies(mb_plan, count)
        return mb_plan

    def forward_micro_batch(self, rows: TokenRows, mb: MicroBatch) -> tuple[torch.Tensor, ForwardLayout | None]:
        """Hidden states of one micro-batch (``rows`` holds exactly its rows) plus how to map them back (None for a
        dummy). The layout (lengths, packed offsets, scored positions) is worked out on the host and uploaded, so
        nothing here waits for the GPU (see :mod:`dask_lm.model.inference`)."""
        if mb.end == mb.start:  # a dummy on a rank with no rows: one pad token keeps the collectives in step
            ids = torch.full((1, 1), self.pad_token_id, dtype=torch.int64, device=self.device)
            return final_hidden_states(self.model, ids), None
        additive = None if self.cfg.attn_implementation == "sdpa" else self.dtype
        return forward_rows(self.model, rows, packed=mb.packed, varlen_ok=self.varlen, where=self.device, mask_dtype=additive)

    def inference_forward(self, rows: TokenRows, mb: MicroBatch) -> tuple[torch.Tensor, ForwardLayout | None]:
        """:meth:`forward_micro_batch` for logprobs / top-k / scores: through the compiled layers when
        ``self.compile``. A compilation that fails (no C compiler, an op Inductor cannot lower) turns compilation
        off for this rank with a warning and runs the micro-batch eagerly; errors of the forward itself propagate."""
        part = rows.slice(mb.start, mb.end)  # views: a micro-batch is contiguous rows
        out, self.compile = fused.call(self.compile, lambda: self.forward_micro_batch(part, mb),
                                       "this rank's decoder")
        return out

    def training_forward(self, data: BatchedDataDict, mb: MicroBatch) -> tuple[torch.Tensor, ForwardLayout | None]:
        """:meth:`forward_micro_batch` for training, through the compiled layers when ``train_compile``. A single
        rank whose compilation fails falls back to eager with a warning; an FSDP rank cannot (re-running the
        forward would issue its all-gathers twice and desynchronise the group's collectives), so it fails with the
        fix instead."""
        # loss functions read padded micro-batches (NeMo RL's contract), so training keeps them and cuts the rows
        # out of this one
        rows = TokenRows.from_padded(data["input_ids"][mb.start:mb.end], data["input_lengths"][mb.start:mb.end])
        if not (self.train_compile and self.fsdp):
            out, self.train_compile = fused.call(self.train_compile, lambda: self.forward_micro_batch(rows, mb),
                                                 "this rank's training forward")
            return out
        try:
            with fused.use_compiled(True):
                return self.forward_micro_batch(rows, mb)
        except fused.compile_errors() as e:
            raise RuntimeError(f"compiling the training forward failed on rank {self.rank} ({type(e).__name__}: "
                               f"{e}); set policy.train_compile: false (or DASK_LM_COMPILE=0) to train eagerly") from e

    def end_pass(self) -> None:
        """After a pass (inference, training step, generation), also a failed one."""
        if self.fsdp:
            # the root FSDP group stays gathered after forward (embeddings / lm_head), and the blocks too where
            # they keep their parameters until a backward (reshard_after_forward false): free them between calls
            from torch.distributed.fsdp import FSDPModule

            for m in self.model.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    def ensure_on_device(self) -> None:
        # offload_to_cpu / finish_inference park the weights on the host; a pass brings them back first
        if next(self.model.parameters()).device.type != self.device.type:
            self.model.to(self.device)

    @torch.no_grad()
    def get_logprobs(self, rows: TokenRows, plan: MicroBatchPlan, micro_batch_size: int | None = None,
                     reference: bool = False) -> dict[str, torch.Tensor]:
        gen = self.cfg.generation
        top_k = None if reference or gen is None else gen.top_k
        top_p = 1.0 if reference or gen is None else gen.top_p
        out = torch.zeros(rows.size, rows.width, dtype=torch.float32)

        def compute(hidden: torch.Tensor, layout: ForwardLayout) -> tuple[torch.Tensor, ...]:
            return (next_token_logprobs(hidden, layout.ids, layout.targets_valid, output_head(self.model),
                                        temperature=self.temperature, chunk_size=self.cfg.logprob_chunk_size,
                                        top_k=top_k, top_p=top_p, index=layout.scored),)

        start = time.perf_counter()
        with self._reference_weights() if reference else contextlib.nullcontext():
            run_pass(self, rows, plan, micro_batch_size, compute, (out,))
        self._record(rows.num_tokens, start)
        return {"reference_logprobs" if reference else "logprobs": out}

    @torch.no_grad()
    def get_topk_logits(self, rows: TokenRows, plan: MicroBatchPlan, k: int,
                        micro_batch_size: int | None = None) -> dict[str, torch.Tensor]:
        values = torch.zeros(rows.size, rows.width, k, dtype=torch.float32)
        indices = torch.zeros(rows.size, rows.width, k, dtype=torch.int64)

        def compute(hidden: torch.Tensor, layout: ForwardLayout) -> tuple[torch.Tensor, ...]:
            return topk_logits(hidden, layout.valid, output_head(self.model), k, temperature=self.temperature,
                               chunk_size=self.cfg.logprob_chunk_size, index=layout.valid_index)

        start = time.perf_counter()
        run_pass(self, rows, plan, micro_batch_size, compute, (values, indices))
        self._record(rows.num_tokens, start)
        return {"topk_logits": values, "topk_indices": indices}

    @torch.no_grad()
    def score(self, rows: TokenRows, plan: MicroBatchPlan) -> dict[str, torch.Tensor]:
        if not self.is_reward_model:
            raise ValueError("score() needs a reward model: set `policy.reward_model_cfg.enabled: true` and point "
                             "`policy.model_name` at a sequence-classification checkpoint")
        head = getattr(self.model, "score", None)
        assert head is not None, f"{type(self.model).__name__} has no `score` head"
        scores = torch.zeros(rows.size, dtype=torch.float32)

        def compute(hidden: torch.Tensor, layout: ForwardLayout) -> tuple[torch.Tensor, ...]:
            if layout.cu is not None:  # packed: each row's last token sits just before the next row's offset
                last = hidden[0, layout.cu[1:].to(torch.int64) - 1]
            else:
                last = hidden[torch.arange(hidden.shape[0], device=hidden.device), layout.lens - 1]
            return (head(last).float().squeeze(-1),)

        start = time.perf_counter()
        run_pass(self, rows, plan, None, compute, (scores,), per_row=True)
        self._record(rows.num_tokens, start)
        return {"scores": scores}

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

    def generate(self, data: BatchedDataDict, plan: MicroBatchPlan, greedy: bool = False,
                 seed: int | None = None) -> dict[str, torch.Tensor]:
        from dask_lm.workers import generation

        gen = self.cfg.generation
        assert gen is not None and gen.max_new_tokens, "the driver checks generation.max_new_tokens"
        tokenizer = None
        if gen.stop_strings:
            import transformers

            tokenizer = transformers.AutoTokenizer.from_pretrained(self.cfg.tokenizer.name or self.cfg.model_name)
        self.ensure_on_device()
        self.model.eval()
        start = time.perf_counter()
        out = generation.generate(self, data["input_ids"], data["input_lengths"], greedy=greedy,
                                  max_new_tokens=int(gen.max_new_tokens), tokenizer=tokenizer, seed=seed)
        self._record(int(data["input_lengths"].sum()) if data.size else 0, start)
        return out

    # ----------------------------------------------------------------------------------------- training
    def train(self, data: BatchedDataDict, plan: MicroBatchPlan, loss_fn: Any, *, eval_mode: bool, gbs: int, mbs: int,
              num_global_batches: int, progress_id: str | None = None) -> TrainResult:
        start = time.perf_counter()
        out = self.trainer.train(self, data, plan, loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs,
                                 num_global_batches=num_global_batches, progress_id=progress_id)
        self._record(int(data["input_lengths"].sum()) if data.size else 0, start)
        return out

    @property
    def save_dtype(self) -> torch.dtype:
        """The dtype checkpoints hold: fp32 when training keeps fp32 masters, else the model's."""
        return torch.float32 if self.keeps_fp32 else self.dtype

    def save_checkpoint(self, weights: tuple[str, str] | None, optimizer: tuple[str, str] | None,
                        tokenizer: tuple[str, str, Any] | None, *, async_save: bool, max_shard_size: int,
                        weights_tokenizer: Any = None) -> dict:
        return self.checkpointer.save(self, weights=weights, optimizer=optimizer, tokenizer=tokenizer,
                                      async_save=async_save, max_shard_size=max_shard_size,
                                      weights_tokenizer=weights_tokenizer)

    def finalize_async_save(self) -> bool:
        return self.checkpointer.finalize(self)

    # ----------------------------------------------------------------------------------------- placement
    def prepare_for_training(self) -> bool:
        self.ensure_on_device()
        if self.trainer.optimizer is not None:
            self.trainer.move_to(self.device)
        return True

    def finish_training(self) -> bool:
        return True

    def prepare_for_lp_inference(self) -> bool:
        self.ensure_on_device()
        self.model.eval()
        if self.cfg.offload_optimizer_for_logprob:
            self.trainer.move_to("cpu")
        device.empty_cache()
        return True

    def prepare_for_generation(self) -> bool:
        self.ensure_on_device()
        self.model.eval()
        return True

    def finish_generation(self) -> bool:
        return True

    def invalidate_kv_cache(self) -> bool:
        return True  # generation keeps no KV cache between calls

    def finish_inference(self) -> bool:
        self.model.to("cpu")
        device.empty_cache()
        return True

    def offload_before_refit(self) -> bool:
        """Optimizer state (and fp32 masters) to host memory: the weights stay, ready to be streamed."""
        self.trainer.move_to("cpu")
        device.empty_cache()
        return True

    def offload_to_cpu(self) -> bool:
        """Everything to host memory: weights, optimizer state, masters."""
        self.model.to("cpu")
        self.model.eval()
        self.trainer.move_to("cpu")
        device.empty_cache()
        return True

    offload_after_refit = offload_to_cpu

    # ----------------------------------------------------------------------------------------- refit
    def prepare_refit_info(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        return refit_info(self)

    def report_device_id(self) -> str:
        return device.device_id()

    def stream_weights_via_http(self, urls: list[str], **kwargs: Any) -> dict[str, Any]:
        return self.refitter.stream_via_http(self, urls, **kwargs)

    def stream_weights_via_ipc_zmq(self, **kwargs: Any) -> dict[str, Any]:
        return self.refitter.stream_via_zmq(self, **kwargs)

    def init_collective(self, ip: str, port: int, world_size: int, **kwargs: Any) -> bool:
        return self.refitter.init_collective(self, ip, port, world_size, **kwargs)

    def broadcast_weights_for_collective(self, **kwargs: Any) -> dict[str, Any]:
        return self.refitter.broadcast(self, **kwargs)

    def _record(self, tokens: int, start: float) -> None:
        from dask_lm.workers.state import get_state

        try:
            st = get_state()
        except RuntimeError:
            return
        st.last_call = {"tokens": tokens, "seconds": time.perf_counter() - start}
        # a token count on the task: the dashboard's fine performance metrics sum it per span (per Policy call)
        from distributed.metrics import context_meter

        context_meter.digest_metric("tokens", tokens, "count")

    def shutdown(self, orphaned: bool = False) -> None:
        """Free everything. ``orphaned``: the driver or a peer rank is gone, so nothing here may wait on a
        collective (a pending async save is abandoned instead of finished)."""
        self.checkpointer.close(self, orphaned=orphaned)
        self.refitter.close()
        self.trainer.close()
        self.reference = None
        self.model = None  # type: ignore[assignment]

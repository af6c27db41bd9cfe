"""The model of one rank and the passes over it: built, sharded with FSDP2, loaded; logprobs, top-k, scores.

A :class:`RankModel` is what every part of a rank needs of the model, and nothing else: the config, the rank's
place in its group, the device and compute dtype, the Hugging Face module itself and the forward protocol over it
(:meth:`~RankModel.plan_pass`, :meth:`~RankModel.forward_micro_batch`, :meth:`~RankModel.inference_forward`,
:meth:`~RankModel.training_forward`, :meth:`~RankModel.end_pass`, :meth:`~RankModel.ensure_on_device`). The
inference loop (:func:`~dask_lm.model.inference.run_pass`), generation and the components a
:class:`~dask_lm.workers.policy_worker.PolicyWorker` composes (:class:`~dask_lm.workers.trainer.Trainer`,
:class:`~dask_lm.workers.checkpointing.Checkpointer`, :class:`~dask_lm.refit.rank.Refitter`) are each given it when
they are made and read it through their own protocol; none of them reaches back into the worker.

It also keeps the reference weights (the weights as loaded, for ``get_reference_policy_logprobs``) and, for a
low-precision trainable policy on one rank, the fp32 master weights (:class:`~dask_lm.workers.optim.MasterWeights`):
both are copies taken while the model is built, before any ``weights_path`` restore (the reference) or before the
cast to the compute dtype (the masters). The trainer steps the masters; :meth:`RankModel.load_weights` writes them.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dask_lm.comm import collectives
from dask_lm.config import PolicyConfig
from dask_lm.data.batch import BatchedDataDict
from dask_lm.data.messages import MicroBatchPlan
from dask_lm.data.tokens import TokenRows
from dask_lm.model import device, fused, varlen
from dask_lm.model.forward import MicroBatch, final_hidden_states, pad_with_dummies, plan_micro_batches
from dask_lm.model.hf import fsdp_blocks, rank_config
from dask_lm.model.inference import ForwardLayout, forward_rows, run_pass
from dask_lm.model.load import load_pretrained
from dask_lm.model.logprobs import next_token_logprobs, output_head, policy_logprob_options, topk_logits
from dask_lm.model.weights import local_tensor
from dask_lm.workers.compile_ahead import CompileAhead
from dask_lm.workers.optim import MasterWeights
from dask_lm.workers.state import record_call

__all__ = ["RankModel", "RankPlace"]


@dataclass(frozen=True)
class RankPlace:
    """Where a rank sits in its policy: its number of ``world_size``, and the process groups it shares with the
    other ranks (``group`` for the tensors, ``cpu_group`` gloo for host-side agreement; None where there is none)."""

    rank: int
    world_size: int
    group: Any = None
    cpu_group: Any = None


class RankModel:
    """One rank's model: built from ``cfg.model_name`` (random weights with ``skip_weight_load``), sharded over
    ``group`` where there are peers, restored from ``weights_path`` when given; with the reference weights when
    ``keep_reference`` and fp32 master weights when ``trainable`` in low precision on one rank."""

    def __init__(
        self,
        cfg: PolicyConfig,
        place: RankPlace,
        *,
        pad_token_id: int,
        trainable: bool,
        keep_reference: bool,
        weights_path: str | None = None,
        skip_weight_load: bool = False,
        fsdp: bool | None = None,
    ) -> None:
        self.cfg = cfg
        self.rank = place.rank
        self.world_size = world_size = place.world_size
        group, cpu_group = place.group, place.cpu_group
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
        self.trainable = trainable
        # low-precision training keeps fp32 master weights (see optim.py): FSDP's fp32 shards, or MasterWeights
        self.keeps_fp32 = self.trainable and self.dtype != torch.float32
        # seconds each step of the build took (Policy.start_phases reports them per rank)
        self.start_phases: dict[str, float] = {}
        clock = time.perf_counter()

        def mark(step: str) -> None:
            nonlocal clock
            device.synchronize()  # each step's device work counted in its own step
            now = time.perf_counter()
            self.start_phases[step], clock = now - clock, now

        self.model = self._build_model(skip_weight_load)
        mark("weights")
        if cfg.dtensor_cfg.activation_checkpointing:
            hf: Any = self.model  # a transformers PreTrainedModel (Module's __getattr__ types methods Tensor | Module)
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # None on one rank, True / False as chosen under FSDP (init_policy reports it to the driver)
        self.reshard_after_forward: bool | None = None
        # the fp32 copies the optimizer of a single low-precision rank steps (under FSDP the shards are fp32 already)
        self.masters: MasterWeights | None = None
        if self.fsdp:
            self._apply_fsdp()
            mark("shard")
        elif self.keeps_fp32:
            # fp32 masters copied from the fp32 load (no bf16 rounding), then the model's parameters (not its
            # buffers: RoPE tables stay fp32, as in a model loaded in bf16) are cast for compute
            self.masters = MasterWeights(self.model)
            for p in self.model.parameters():
                p.data = p.data.to(self.dtype)
            mark("master_weights")
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
            mark("compile_setup")
        # the reference is the weights as loaded from model_name, taken before any weights_path restore; kept in
        # the compute dtype (what the forward sees), as each rank's own shard in pinned host memory
        self.reference: dict[str, torch.Tensor] | None = None
        if keep_reference:
            self.reference = device.pin({n: local_tensor(p).to(self.dtype) for n, p in self.model.named_parameters()})
            mark("reference")
        if weights_path:
            self.load_weights(weights_path)
            mark("weights_path")
        # a rank without peers compiles its inference forward in the background; calls run eagerly meanwhile
        self.compile_ahead: CompileAhead | None = None
        if self.compile and not self.fsdp and os.environ.get("DASK_LM_COMPILE_AHEAD", "1") != "0":
            self.compile_ahead = CompileAhead.start(self)

    # ----------------------------------------------------------------------------------------- build
    def _build_model(self, skip_weight_load: bool) -> torch.nn.Module:
        import transformers

        # one weight-loading bar per worker process would garble the driver's own "loading the model" bar
        transformers.utils.logging.disable_progress_bar()
        cfg = self.cfg
        auto = (
            transformers.AutoModelForSequenceClassification
            if self.is_reward_model
            else transformers.AutoModelForCausalLM
        )
        hf_config = rank_config(cfg, self.pad_token_id)
        # training in low precision loads fp32: FSDP keeps fp32 shards (MixedPrecisionPolicy computes in
        # `precision`), a single rank copies them into MasterWeights before casting the model
        dtype = torch.float32 if self.keeps_fp32 else self.dtype
        if skip_weight_load:
            # random weights made where they live: seconds on a GPU, where a CPU init of a 7B model takes minutes
            with self.device:
                model = auto.from_config(
                    hf_config, dtype=dtype, attn_implementation=cfg.attn_implementation, trust_remote_code=False
                )
            return model.to(self.device)
        # from the safetensors straight into device memory, as a scoring replica loads (model/load.py): no random
        # init, no host copy
        return load_pretrained(
            cfg.model_name,
            dtype,
            self.device,
            config=hf_config,
            auto=auto,
            attn_implementation=cfg.attn_implementation,
        )

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
        import transformers

        auto = (
            transformers.AutoModelForSequenceClassification
            if self.is_reward_model
            else transformers.AutoModelForCausalLM
        )
        dtype = torch.float32 if self.keeps_fp32 else self.dtype
        try:
            full = auto.from_pretrained(weights_path, dtype=dtype, trust_remote_code=False).state_dict()
        except (OSError, ValueError) as e:
            raise ValueError(
                f"weights_path {weights_path!r} is not a loadable Hugging Face model directory: {e}"
            ) from e
        own = self.model.state_dict()
        unexpected = [k for k in full if k not in own]
        if unexpected:
            raise ValueError(
                f"weights_path {weights_path!r} holds tensors this model lacks: {unexpected[:5]}; it "
                f"was saved from another architecture than `policy.model_name`"
            )
        self.ensure_on_device()
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True, strict=False))
            return
        masters = self.masters
        if masters is not None:
            with torch.no_grad():
                for name, master in masters.named_parameters().items():
                    if name in full:
                        master.copy_(full[name])
            masters.copy_to_model()
            full = {k: v for k, v in full.items() if k not in masters.named_parameters()}
        self.model.load_state_dict(full, strict=False)

    @property
    def save_dtype(self) -> torch.dtype:
        """The dtype checkpoints hold: fp32 when training keeps fp32 masters, else the model's."""
        return torch.float32 if self.keeps_fp32 else self.dtype

    def to_host(self) -> None:
        """The weights to host memory (``offload_to_cpu`` / ``finish_inference``); the next pass brings them back."""
        self._settle_compile()
        self.model.to("cpu")

    def close(self) -> None:
        """Policy shutdown: drop the model, the masters and the reference, so their memory can go."""
        self._settle_compile()
        self.reference = None
        self.masters = None
        self.model = None  # type: ignore[assignment]

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
        mb_plan = plan_micro_batches(
            rows.size,
            mbs=mbs or int(self.cfg.logprob_batch_size or 1),
            micro_batch_indices=plan.micro_batch_indices,
            packed=plan.packed,
        )
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
        return forward_rows(
            self.model, rows, packed=mb.packed, varlen_ok=self.varlen, where=self.device, mask_dtype=additive
        )

    def _settle_compile(self) -> None:
        # the background compile reads the weights: whatever moves or drops them waits for it first
        if self.compile_ahead is not None:
            self.compile_ahead.wait()

    def compiled_now(self) -> bool:
        """Whether the next inference micro-batch runs compiled: ``self.compile``, once a background compile
        (:mod:`~dask_lm.workers.compile_ahead`) is done; eager while it runs."""
        ahead = self.compile_ahead
        if ahead is not None:
            if not ahead.done():
                return False
            if isinstance(ahead.failed, fused.compile_errors()):
                self.compile = False  # it warned; the call would fail the same way
            self.compile_ahead = None
        return self.compile

    def inference_forward(self, rows: TokenRows, mb: MicroBatch) -> tuple[torch.Tensor, ForwardLayout | None]:
        """:meth:`forward_micro_batch` for logprobs / top-k / scores: through the compiled layers when
        :meth:`compiled_now`. A compilation that fails (no C compiler, an op Inductor cannot lower) turns
        compilation off for this rank with a warning and runs the micro-batch eagerly; errors of the forward itself
        propagate."""
        part = rows.slice(mb.start, mb.end)  # views: a micro-batch is contiguous rows
        compiled = self.compiled_now()
        out, still = fused.call(compiled, lambda: self.forward_micro_batch(part, mb), "this rank's decoder")
        if compiled:
            self.compile = still
        return out

    def training_forward(self, data: BatchedDataDict, mb: MicroBatch) -> tuple[torch.Tensor, ForwardLayout | None]:
        """:meth:`forward_micro_batch` for training, through the compiled layers when ``train_compile``. A single
        rank whose compilation fails falls back to eager with a warning; an FSDP rank cannot (re-running the
        forward would issue its all-gathers twice and desynchronise the group's collectives), so it fails with the
        fix instead."""
        # loss functions read padded micro-batches (NeMo RL's contract), so training keeps them and cuts the rows
        # out of this one
        rows = TokenRows.from_padded(data["input_ids"][mb.start : mb.end], data["input_lengths"][mb.start : mb.end])
        if not (self.train_compile and self.fsdp):
            out, self.train_compile = fused.call(
                self.train_compile, lambda: self.forward_micro_batch(rows, mb), "this rank's training forward"
            )
            return out
        try:
            with fused.use_compiled(True):
                return self.forward_micro_batch(rows, mb)
        except fused.compile_errors() as e:
            raise RuntimeError(
                f"compiling the training forward failed on rank {self.rank} ({type(e).__name__}: "
                f"{e}); set policy.train_compile: false (or DASK_LM_COMPILE=0) to train eagerly"
            ) from e

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
    def get_logprobs(
        self, rows: TokenRows, plan: MicroBatchPlan, micro_batch_size: int | None = None, reference: bool = False
    ) -> dict[str, torch.Tensor]:
        out = torch.zeros(rows.size, rows.width, dtype=torch.float32)

        def compute(hidden: torch.Tensor, layout: ForwardLayout) -> tuple[torch.Tensor, ...]:
            return (self.logprob_head(hidden, layout, reference=reference),)

        start = time.perf_counter()
        with self._reference_weights() if reference else contextlib.nullcontext():
            run_pass(self, rows, plan, micro_batch_size, compute, (out,))
        record_call(rows.num_tokens, start)
        return {"reference_logprobs" if reference else "logprobs": out}

    def logprob_head(self, hidden: torch.Tensor, layout: ForwardLayout, *, reference: bool = False) -> torch.Tensor:
        """The next-token logprobs of one micro-batch's final hidden states (``get_logprobs``' head)."""
        options = policy_logprob_options(self.cfg, self.temperature, layout.scored, reference=reference)
        return next_token_logprobs(hidden, layout.ids, layout.targets_valid, output_head(self.model), **options)

    @torch.no_grad()
    def get_topk_logits(
        self, rows: TokenRows, plan: MicroBatchPlan, k: int, micro_batch_size: int | None = None
    ) -> dict[str, torch.Tensor]:
        values = torch.zeros(rows.size, rows.width, k, dtype=torch.float32)
        indices = torch.zeros(rows.size, rows.width, k, dtype=torch.int64)

        def compute(hidden: torch.Tensor, layout: ForwardLayout) -> tuple[torch.Tensor, ...]:
            return topk_logits(
                hidden,
                layout.valid,
                output_head(self.model),
                k,
                temperature=self.temperature,
                chunk_size=self.cfg.logprob_chunk_size,
                index=layout.valid_index,
            )

        start = time.perf_counter()
        run_pass(self, rows, plan, micro_batch_size, compute, (values, indices))
        record_call(rows.num_tokens, start)
        return {"topk_logits": values, "topk_indices": indices}

    @torch.no_grad()
    def score(self, rows: TokenRows, plan: MicroBatchPlan) -> dict[str, torch.Tensor]:
        if not self.is_reward_model:
            raise ValueError(
                "score() needs a reward model: set `policy.reward_model_cfg.enabled: true` and point "
                "`policy.model_name` at a sequence-classification checkpoint"
            )
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
        record_call(rows.num_tokens, start)
        return {"scores": scores}

    # ----------------------------------------------------------------------------------------- reference
    @contextlib.contextmanager
    def _reference_weights(self) -> Iterator[None]:
        if self.reference is None:
            raise ValueError(
                "this Policy was created with init_reference_model=False, so it kept no reference "
                "weights; create it with init_reference_model=True to call "
                "get_reference_policy_logprobs"
            )
        params = dict(self.model.named_parameters())
        current = device.pin({n: local_tensor(p) for n, p in params.items()})
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

"""The Policy configuration, key for key NeMo RL's ``policy:`` section: :class:`PolicyConfig` and its sections.

A user passes a plain dict (as NeMo RL code does) or a :class:`PolicyConfig`. Every key has a default except
``model_name``; an unknown key, or a value of the wrong type, raises ``ValueError`` naming the dotted key
(``policy.dynamic_batching.logprob_mb_tokens``) and what was expected, before any worker is touched. Each field's
default is written once, on the field; its docstring is what ``docs/reference/config.md`` shows
(:mod:`dask_lm.config.doc`).

Example
-------
>>> cfg = PolicyConfig.from_dict({"model_name": "/models/qwen", "precision": "float32",
...                               "dynamic_batching": {"enabled": True, "logprob_mb_tokens": 4096}})
>>> cfg.dynamic_batching.logprob_mb_tokens
4096
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from dask_lm.config.generation import GenerationConfig
from dask_lm.config.keys import check_unhonoured
from dask_lm.config.schema import Section, config_from_dict

__all__ = [
    "PolicyConfig",
    "TokenizerConfig",
    "DTensorConfig",
    "MegatronConfig",
    "DynamicBatchingConfig",
    "SequencePackingConfig",
    "RewardModelConfig",
    "OptimizerConfig",
    "Precision",
]

Precision = Literal["float32", "bfloat16", "float16"]


@dataclass(kw_only=True)
class TokenizerConfig(Section):
    name: str | None = None
    """Tokenizer path or id; defaults to ``model_name``."""
    chat_template: str | None = None
    """NeMo RL's chat template for the tokenizer (its ``get_tokenizer`` applies it before the Policy sees the
    tokenizer)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra arguments of ``apply_chat_template`` where NeMo RL tokenizes."""
    use_processor: bool = False
    """Load a multimodal processor instead of a tokenizer (NeMo RL)."""
    use_fastokens: bool = False
    """NeMo RL's switch to a faster tokenizer implementation where it loads the tokenizer."""
    audio: dict[str, Any] | None = None
    """NeMo RL's audio settings of a multimodal processor."""
    video: dict[str, Any] | None = None
    """NeMo RL's video settings of a multimodal processor."""


@dataclass(kw_only=True)
class DTensorConfig(Section):
    enabled: bool = True
    """FSDP2 (``fully_shard``) over the ranks; the only backend dask-lm has."""
    v2: bool = field(default=True, metadata={"key": "_v2"})
    """NeMo RL's choice between its two DTensor workers."""
    tensor_parallel_size: int = 1
    """Tensor-parallel ranks per model replica (NeMo RL); dask-lm shards with FSDP2 alone."""
    context_parallel_size: int = 1
    """Context-parallel ranks, which split each sequence (NeMo RL)."""
    expert_parallel_size: int = 1
    """Expert-parallel ranks for MoE layers (NeMo RL)."""
    dp_replicate_size: int = 1
    """Replica groups of hybrid sharding (HSDP) in NeMo RL."""
    sequence_parallel: bool = False
    """Split activations over the tensor-parallel ranks (NeMo RL)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them: less memory, more
    compute."""
    reshard_after_forward: bool | None = None
    """dask-lm's: whether FSDP2 frees each block's gathered parameters after its forward (``fully_shard``'s
    ``reshard_after_forward``). false keeps them from a block's forward to its backward, which saves one all-gather
    per block per micro-batch at the cost of a full copy of the weights (compute dtype) per GPU. null (auto): false
    on GPU ranks where that copy takes at most an eighth of the device's memory, else true."""
    cpu_offload: bool = False
    """FSDP's offload of parameters to CPU memory (NeMo RL)."""
    custom_parallel_plan: str | None = None
    """Import path of a custom tensor-parallel plan (NeMo RL)."""
    defer_fsdp_grad_sync: bool = False
    """Reduce gradients once per global batch instead of after every micro-batch (NeMo RL)."""
    clear_cache_every_n_steps: int | None = None
    """Empty the CUDA cache every N micro-batches (NeMo RL)."""
    env_vars: dict[str, Any] | None = None
    """Environment variables set in every rank's worker process when the Policy starts."""
    lora_cfg: dict[str, Any] | None = None
    """NeMo RL's LoRA adapter settings."""
    lora: dict[str, Any] | None = None
    """The LoRA section of NeMo RL's unit-test config; NeMo RL itself reads ``lora_cfg``."""
    automodel_kwargs: dict[str, Any] | None = None
    """NeMo Automodel's model-building options."""
    moe_parallelizer: dict[str, Any] | None = None
    """NeMo RL's options for sharding MoE layers."""


@dataclass(kw_only=True)
class MegatronConfig(Section):
    _UNKNOWN_KEYS_INTO: ClassVar[str] = "extra"  # Megatron's own keys, kept as they are (the backend is refused)
    enabled: bool = False
    """Run NeMo RL's Megatron backend instead of DTensor (FSDP2)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The section's other keys (Megatron's own), kept as they are."""


@dataclass(kw_only=True)
class DynamicBatchingConfig(Section):
    enabled: bool = False
    """Cut micro-batches by a token budget (``train_mb_tokens``, ``logprob_mb_tokens``) instead of a row count; not
    together with ``sequence_packing``."""
    train_mb_tokens: int | None = None
    """Token budget of a training micro-batch (default: max_total_sequence_length x train_micro_batch_size)."""
    logprob_mb_tokens: int | None = None
    """Token budget of a logprob / top-k / score micro-batch (default: max_total_sequence_length x
    logprob_batch_size)."""
    sequence_length_round: int = 64
    """A micro-batch's padded width is rounded up to a multiple of this."""


@dataclass(kw_only=True)
class SequencePackingConfig(Section):
    enabled: bool = False
    """Pack rows end to end into micro-batches of a token budget, without padding between them; not together with
    ``dynamic_batching``."""
    train_mb_tokens: int | None = None
    """Token budget of a packed training micro-batch (default: max_total_sequence_length x train_micro_batch_size)."""
    logprob_mb_tokens: int | None = None
    """Token budget of a packed logprob / top-k / score micro-batch (default: max_total_sequence_length x
    logprob_batch_size)."""
    algorithm: Literal[
        "modified_first_fit_decreasing", "first_fit_decreasing", "first_fit_shuffle", "concatenative"
    ] = "modified_first_fit_decreasing"
    """The bin-packing algorithm that groups rows into micro-batches."""
    microbatch_order: Literal["packer", "largest_first"] = "packer"
    """The order of the packed micro-batches: as the packer made them, or the largest first."""
    sequence_length_round: int | None = None
    """Accepted for NeMo RL compatibility and, as there, unused: the pad multiple is
    ``make_sequence_length_divisible_by``."""
    fuse_loss: bool | None = None
    """NeMo RL's fused loss over a packed micro-batch (its Megatron backend)."""


@dataclass(kw_only=True)
class RewardModelConfig(Section):
    enabled: bool = False
    """Load the model as a reward model (a sequence-classification head): ``Policy.score`` returns its scores."""
    reward_model_type: Literal["bradley_terry"] = "bradley_terry"
    """The reward model's kind."""


@dataclass(kw_only=True)
class OptimizerConfig(Section):
    name: str = "torch.optim.AdamW"
    """Import path of the optimizer class."""
    kwargs: dict[str, Any] = field(
        default_factory=lambda: {"lr": 5e-6, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8}
    )
    """Keyword arguments of the optimizer class (learning rate, weight decay, ...)."""


@dataclass(kw_only=True)
class PolicyConfig(Section):
    """The policy configuration, key for key NeMo RL's ``PolicyConfig`` (plus a few dask-lm keys at the end)."""

    model_name: str
    """Hugging Face model directory, or a Hub id (``Qwen/Qwen2.5-0.5B``): the driver resolves it once into its
    local snapshot in the Hugging Face cache (downloading what is missing; ``HF_HUB_OFFLINE=1``: the cache only)
    and the workers load that directory (:mod:`dask_lm.io.hub`)."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """The tokenizer section; ``name`` defaults to ``model_name``."""
    train_global_batch_size: int = 32
    """Rows per optimizer step, over all ranks together."""
    train_micro_batch_size: int = 4
    """Rows per forward / backward pass on a rank; gradients add up over a global batch."""
    logprob_batch_size: int | None = None
    """Rows per logprob / top-k / score micro-batch (default: ``train_micro_batch_size``)."""
    logprob_chunk_size: int | None = 1024
    """Token positions per float32 log-softmax chunk. dask-lm chunks over the flattened tokens of a micro-batch
    (NeMo RL chunks along the sequence), so peak memory is ``chunk x vocab x 4`` bytes whatever the batch shape.
    null computes a whole micro-batch at once."""
    generation_batch_size: int = 32
    """Batch size of NeMo RL's legacy HF generation."""
    max_total_sequence_length: int = 512
    """Longest row in tokens; the default micro-batch token budgets are multiples of it."""
    precision: Precision = "bfloat16"
    """Dtype of the model's weights and compute."""
    offload_optimizer_for_logprob: bool = False
    """Move the optimizer state to CPU memory while logprobs are computed."""
    dtensor_cfg: DTensorConfig = field(default_factory=DTensorConfig)
    """The DTensor (FSDP2) backend, the one dask-lm runs."""
    megatron_cfg: MegatronConfig = field(default_factory=MegatronConfig)
    """NeMo RL's Megatron backend."""
    dynamic_batching: DynamicBatchingConfig = field(default_factory=DynamicBatchingConfig)
    """Micro-batches cut by a token budget."""
    sequence_packing: SequencePackingConfig = field(default_factory=SequencePackingConfig)
    """Micro-batches of rows packed end to end."""
    make_sequence_length_divisible_by: int = 1
    """A batch's padded width is rounded up to a multiple of this; under sequence packing, each row's."""
    max_grad_norm: float | None = 1.0
    """Clip the gradients' global norm to this before each optimizer step (null: no clipping)."""
    refit_buffer_size_gb: float | None = None
    """Size cap of a refit bucket in GiB (null: 0.3 x the smallest free device memory)."""
    optimizer: OptimizerConfig | None = field(default_factory=OptimizerConfig)
    """The optimizer's class and keyword arguments."""
    scheduler: dict[str, Any] | list[Any] | None = None
    """Learning-rate scheduler: ``{name, kwargs}``, or a list of them plus one ``{milestones: [...]}`` entry saying
    when each takes over."""
    generation: GenerationConfig | None = None
    """Generation settings (null: ``generate()`` is refused)."""
    reward_model_cfg: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Load the model as a reward model."""
    hf_config_overrides: dict[str, Any] | None = None
    """Entries that replace those of the model's ``config.json`` when it loads."""
    quant_cfg: dict[str, Any] | str | None = None
    """NeMo RL's quantised-training settings."""
    quant_calib_data: str | None = None
    """Calibration data of NeMo RL's quantised training."""
    quant_calib_size: int | None = None
    """Calibration rows of NeMo RL's quantised training."""
    quant_batch_size: int | None = None
    """Calibration batch size of NeMo RL's quantised training."""
    quant_sequence_length: int | None = None
    """Calibration sequence length of NeMo RL's quantised training."""
    disable_modelopt_layer_spec: bool | None = None
    """Use Megatron's standard layer specs with NeMo RL's quantised training."""
    draft: dict[str, Any] | None = None
    """NeMo RL's Eagle draft model, trained alongside the policy."""
    router_replay: dict[str, Any] | None = None
    """NeMo RL's replay of the generation's MoE routing in training."""
    pretrained_checkpoint: dict[str, Any] | str | None = None
    """NeMo RL's ``{path: ...}`` (Megatron backend only); accepted and, as under NeMo's DTensor backend, unused."""
    is_vlm: bool = False
    """The model is a vision-language model (NeMo RL)."""
    dequantize_base_checkpoint: bool | None = None
    """Dequantise a quantised base checkpoint as it loads (NeMo RL's DTensor v2 worker, through NeMo Automodel)."""
    learning_rate: float | None = None
    """A key of NeMo RL's unit-test config that NeMo RL does not read (the learning rate is
    ``optimizer.kwargs.lr``)."""
    activation_checkpointing_enabled: bool | None = None
    """A key two of NeMo RL's example configs carry and NeMo RL does not read (activation checkpointing is
    ``dtensor_cfg.activation_checkpointing``)."""
    # dask-lm keys
    model_revision: str | None = None
    """Branch, tag or commit of a Hub ``model_name`` (null: the repository's default branch)."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """Attention kernel of the Hugging Face model; packing builds a block-diagonal mask that both accept."""
    inference_packing: bool | None = None
    """How logprob / top-k / score calls cut micro-batches when neither ``dynamic_batching`` nor
    ``sequence_packing`` is enabled and the call passes no ``micro_batch_size``. null (auto): on GPU workers that
    run the varlen attention kernel (bf16 / fp16, sdpa, Ampere or newer), rows are packed into micro-batches of
    ``inference_mb_tokens`` tokens (no padding: the fastest mode measured, see the README's benchmarks);
    elsewhere ``logprob_batch_size`` rows per micro-batch. true: pack on every device; false: rows per micro-batch
    everywhere."""
    inference_mb_tokens: int | None = None
    """Token budget of those packed micro-batches; null: 32768 (``dask_lm.config.defaults.PACKED_BATCH_TOKENS``:
    on an H200, 16k / 32k / 64k / 128k tokens ran at 0.98 / 1 / 1.02 / 1.02x the speed for Qwen2.5-0.5B), and never
    less than ``max_total_sequence_length``."""
    inference_compile: bool | None = None
    """Compile the decoder layers and the output head's reductions (``torch.compile``, dynamic shapes) for the
    logprob / top-k / score forwards; training and generation stay eager. null (auto): on GPU ranks (FSDP-sharded
    ones included), off on the CPU. false: off; true: also on the CPU (Inductor's C++ backend, which takes tens of
    seconds to compile). A rank without peers compiles in the background from the moment its model is built, and
    runs calls eagerly until it is done (``DASK_LM_COMPILE_AHEAD=0``: the first call compiles instead)."""
    train_compile: bool | None = None
    """Compile the decoder layers for training forwards (``torch.compile``, dynamic shapes; AOTAutograd compiles
    their backward with them). null (auto): on GPU ranks (FSDP-sharded ones included: FSDP's hooks run eagerly
    around each compiled layer), off on the CPU and with ``dtensor_cfg.activation_checkpointing``. false: off;
    true: also on the CPU (Inductor's C++ backend)."""
    collective_timeout_s: float = 600.0
    """torch.distributed timeout: a lost rank becomes an error after this long, never a hang."""

    def __post_init__(self) -> None:
        p = "policy"
        for key in (
            "train_global_batch_size",
            "train_micro_batch_size",
            "max_total_sequence_length",
            "generation_batch_size",
            "make_sequence_length_divisible_by",
        ):
            if getattr(self, key) < 1:
                raise ValueError(f"`{p}.{key}` must be >= 1, got {getattr(self, key)}")
        if self.logprob_batch_size is None:
            self.logprob_batch_size = self.train_micro_batch_size
        elif self.logprob_batch_size < 1:
            raise ValueError(f"`{p}.logprob_batch_size` must be >= 1, got {self.logprob_batch_size}")
        if self.logprob_chunk_size is not None and self.logprob_chunk_size < 1:
            raise ValueError(f"`{p}.logprob_chunk_size` must be >= 1 or null, got {self.logprob_chunk_size}")
        if self.dynamic_batching.sequence_length_round < 1:
            raise ValueError(
                f"`{p}.dynamic_batching.sequence_length_round` must be >= 1, got "
                f"{self.dynamic_batching.sequence_length_round}"
            )
        if self.inference_mb_tokens is not None and self.inference_mb_tokens < 1:
            raise ValueError(f"`{p}.inference_mb_tokens` must be >= 1 or null, got {self.inference_mb_tokens}")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"`{p}.collective_timeout_s` must be > 0, got {self.collective_timeout_s}")
        if self.train_compile is True and self.dtensor_cfg.activation_checkpointing:
            raise ValueError(
                f"`{p}.train_compile` true and `{p}.dtensor_cfg.activation_checkpointing` true do not "
                "combine (the recomputation would run the layers eagerly): set train_compile to null or "
                "false to checkpoint activations"
            )
        if self.dynamic_batching.enabled and self.sequence_packing.enabled:
            raise ValueError(
                f"`{p}.dynamic_batching.enabled` and `{p}.sequence_packing.enabled` cannot both be "
                "true: pick one way to cut micro-batches"
            )
        for section in (self.dynamic_batching, self.sequence_packing):
            if section.train_mb_tokens is None:
                section.train_mb_tokens = self.max_total_sequence_length * self.train_micro_batch_size
            if section.logprob_mb_tokens is None:
                section.logprob_mb_tokens = self.max_total_sequence_length * self.logprob_batch_size
        name = "dynamic_batching" if self.dynamic_batching.enabled else "sequence_packing"
        active = self.dynamic_batching if self.dynamic_batching.enabled else self.sequence_packing
        if self.dynamic_batching.enabled or self.sequence_packing.enabled:
            for key in ("train_mb_tokens", "logprob_mb_tokens"):
                if getattr(active, key) < 1:
                    raise ValueError(f"`{p}.{name}.{key}` must be >= 1, got {getattr(active, key)}")
        check_unhonoured(self)
        if self.tokenizer.name is None:
            self.tokenizer.name = self.model_name

    @classmethod
    def from_dict(cls, data: dict[str, Any] | PolicyConfig) -> PolicyConfig:
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"policy config must be a dict or PolicyConfig, got {type(data).__name__}")
        return config_from_dict(cls, data, prefix="policy")

    @classmethod
    def from_yaml(cls, path: str) -> PolicyConfig:
        """Read a YAML file; a top-level ``policy:`` section is used when present."""
        import yaml

        with open(path) as f:
            data = yaml.safe_load(f) or {}
        if "policy" in data and isinstance(data["policy"], dict):
            data = data["policy"]
        return cls.from_dict(data)

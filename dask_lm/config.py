"""Typed configuration with NeMo RL's PolicyConfig key names.

A user passes a plain dict (as NeMo RL code does) or a :class:`PolicyConfig`. Every key has a default except
``model_name``; an unknown key, or a value of the wrong type, raises ``ValueError`` naming the dotted key
(``policy.dynamic_batching.logprob_mb_tokens``) and what was expected, before any worker is touched.

Example
-------
>>> cfg = PolicyConfig.from_dict({"model_name": "/models/qwen", "precision": "float32",
...                               "dynamic_batching": {"enabled": True, "logprob_mb_tokens": 4096}})
>>> cfg.dynamic_batching.logprob_mb_tokens
4096
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

from dask_lm.config_keys import _UNHONOURED as _UNHONOURED  # tests read config._UNHONOURED
from dask_lm.config_keys import _check_unhonoured

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["PolicyConfig", "TokenizerConfig", "DTensorConfig", "MegatronConfig", "DynamicBatchingConfig",
           "SequencePackingConfig", "GenerationConfig", "RewardModelConfig", "OptimizerConfig", "config_from_dict"]

Precision = Literal["float32", "bfloat16", "float16"]
_D = TypeVar("_D", bound="DataclassInstance")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (nested dicts become dataclasses)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = [o for o in typing.get_args(tp) if o is not type(None)]
        if value is None and len(options) < len(typing.get_args(tp)):
            return None
        if len(options) == 1:  # `X | None` with a value: X's own error names the inner key
            return _coerce(value, options[0], key)
        errors = []
        for option in typing.get_args(tp):
            try:
                return _coerce(value, option, key)
            except ValueError as e:
                errors.append(e)
        raise ValueError(f"`{key}` must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    if tp is type(None):
        if value is None:
            return None
        raise ValueError(f"`{key}` must be null, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, str) and value.lower() in [str(a).lower() for a in allowed]:
            return next(a for a in allowed if str(a).lower() == value.lower())
        raise ValueError(f"`{key}` must be one of {list(allowed)}, got {value!r}")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"`{key}` must be a mapping of {tp.__name__} keys, got {type(value).__name__}")
        return config_from_dict(tp, value, prefix=key)
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"`{key}` must be a list, got {value!r}")
        (item_tp,) = typing.get_args(tp)[:1] or (Any,)  # a bare `list` holds anything
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ValueError(f"`{key}` must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"`{key}` must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"`{key}` must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError(f"`{key}` must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"`{key}` must be a string, got {value!r}")
    raise AssertionError(f"unsupported annotation {tp!r} for {key}")


def config_from_dict(cls: type[_D], data: dict[str, Any], *, prefix: str = "policy") -> _D:
    """Build dataclass ``cls`` from ``data``; errors name the dotted key (``prefix.key``)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    # NeMo RL spells a few keys with a leading underscore (`_v2`, `_pad_token_id`); we keep the spelling.
    aliases = {f.metadata.get("key", f.name): f.name for f in fields.values()}
    kwargs: dict[str, Any] = {}
    # a section read only by a backend dask-lm refuses keeps whatever it holds (NeMo RL's example configs carry a
    # full megatron_cfg with enabled: false); only its `enabled` is checked
    open_into: str | None = getattr(cls, "_UNKNOWN_KEYS_INTO", None)
    for key, value in data.items():
        if key not in aliases and open_into is not None:
            kwargs.setdefault(open_into, {})[key] = value
            continue
        if key not in aliases:
            close = difflib.get_close_matches(key, list(aliases), n=1)
            hint = f"; did you mean `{prefix}.{close[0]}`?" if close else ""
            raise ValueError(f"unknown config key `{prefix}.{key}`{hint} (known keys: {sorted(aliases)})")
        name = aliases[key]
        kwargs[name] = _coerce(value, hints[name], f"{prefix}.{key}")
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"missing required config key `{prefix}.{missing[0]}`") from e
        raise


def _to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.metadata.get("key", f.name): _to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [_to_dict(v) for v in obj]
    return obj


class _Section:
    """Mixin: ``from_dict`` / ``to_dict`` and dict-style reads, so NeMo RL code doing ``cfg["key"]`` ports."""

    # every _Section is a @dataclass, which sets this (declared only: no class attribute is created here)
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def to_dict(self) -> dict[str, Any]:
        return {f.metadata.get("key", f.name): _to_dict(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def __getitem__(self, key: str) -> Any:
        for f in dataclasses.fields(self):
            if f.metadata.get("key", f.name) == key:
                return getattr(self, f.name)
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: str) -> bool:
        return self.get(key, None) is not None


@dataclass(kw_only=True)
class TokenizerConfig(_Section):
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
    audio: dict[str, Any] | None = None
    video: dict[str, Any] | None = None


@dataclass(kw_only=True)
class DTensorConfig(_Section):
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
    automodel_kwargs: dict[str, Any] | None = None
    """NeMo Automodel's model-building options."""
    moe_parallelizer: dict[str, Any] | None = None
    """NeMo RL's options for sharding MoE layers."""


@dataclass(kw_only=True)
class MegatronConfig(_Section):
    _UNKNOWN_KEYS_INTO: ClassVar[str] = "extra"  # Megatron's own keys, kept as they are (the backend is refused)
    enabled: bool = False
    """Run NeMo RL's Megatron backend instead of DTensor (FSDP2)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The section's other keys (Megatron's own), kept as they are."""


@dataclass(kw_only=True)
class DynamicBatchingConfig(_Section):
    enabled: bool = False
    """Cut micro-batches by a token budget (``train_mb_tokens``, ``logprob_mb_tokens``) instead of a row count; not
    together with ``sequence_packing``."""
    train_mb_tokens: int | None = None
    """Token budget of a training micro-batch (default: max_total_sequence_length x train_micro_batch_size)."""
    logprob_mb_tokens: int | None = None
    """Token budget of a logprob / top-k / score micro-batch (default: max_total_sequence_length x logprob_batch_size)."""
    sequence_length_round: int = 64
    """A micro-batch's padded width is rounded up to a multiple of this."""


@dataclass(kw_only=True)
class SequencePackingConfig(_Section):
    enabled: bool = False
    """Pack rows end to end into micro-batches of a token budget, without padding between them; not together with
    ``dynamic_batching``."""
    train_mb_tokens: int | None = None
    """Token budget of a packed training micro-batch (default: max_total_sequence_length x train_micro_batch_size)."""
    logprob_mb_tokens: int | None = None
    """Token budget of a packed logprob / top-k / score micro-batch (default: max_total_sequence_length x
    logprob_batch_size)."""
    algorithm: Literal["modified_first_fit_decreasing", "first_fit_decreasing", "first_fit_shuffle",
                       "concatenative"] = "modified_first_fit_decreasing"
    """The bin-packing algorithm that groups rows into micro-batches."""
    microbatch_order: Literal["packer", "largest_first"] = "packer"
    """The order of the packed micro-batches: as the packer made them, or the largest first."""
    sequence_length_round: int | None = None
    """Accepted for NeMo RL compatibility and, as there, unused: the pad multiple is
    ``make_sequence_length_divisible_by``."""


@dataclass(kw_only=True)
class GenerationConfig(_Section):
    backend: str = "hf"
    """Where ``generate()`` decodes: ``hf`` on the policy's own workers, ``sglang`` on the SGLang servers of
    ``sglang_cfg``."""
    max_new_tokens: int | None = None
    """Most tokens ``generate()`` adds to a row; ``generate()`` needs it."""
    temperature: float = 1.0
    """Sampling temperature; logprobs, top-k logits and training losses divide the logits by it too, as NeMo RL does."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0: off); below 1, logprobs and training use the filtered distribution too (a
    filtered-out token's logprob is 0)."""
    top_k: int | None = None
    """Sample among the k most likely tokens (null or -1: off); like ``top_p``, it filters logprobs and training too."""
    stop_token_ids: list[int] | None = None
    """Token ids that end a row's generation, besides the model's EOS."""
    stop_strings: list[str] | None = None
    """Strings that end a row's generation once its generated text ends with one."""
    model_name: str | None = None
    """The generation engine's model (NeMo RL)."""
    colocated: dict[str, Any] | None = None
    """NeMo RL's placement of generation: on the training GPUs or on GPUs of its own."""
    vllm_cfg: dict[str, Any] | None = None
    """Settings of NeMo RL's vLLM backend."""
    sglang_cfg: dict[str, Any] | None = None
    """The ``sglang`` backend's settings: ``server_urls`` lists the SGLang servers."""
    vllm_kwargs: dict[str, Any] | None = None
    """Extra keyword arguments of NeMo RL's vLLM engine."""
    pad_token_id: int | None = field(default=None, metadata={"key": "_pad_token_id"})
    """Filled in from the tokenizer by NeMo RL's setup; dask-lm pads with the tokenizer's pad (else EOS) id."""

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"`policy.generation.temperature` must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"`policy.generation.top_p` must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < -1:
            raise ValueError(f"`policy.generation.top_k` must be null, -1 or >= 1, got {self.top_k}")

    @property
    def filtering_active(self) -> bool:
        return (self.top_k is not None and self.top_k > 0) or self.top_p < 1.0


@dataclass(kw_only=True)
class RewardModelConfig(_Section):
    enabled: bool = False
    """Load the model as a reward model (a sequence-classification head): ``Policy.score`` returns its scores."""
    reward_model_type: Literal["bradley_terry"] = "bradley_terry"
    """The reward model's kind."""


@dataclass(kw_only=True)
class OptimizerConfig(_Section):
    name: str = "torch.optim.AdamW"
    """Import path of the optimizer class."""
    kwargs: dict[str, Any] = field(default_factory=lambda: {"lr": 5e-6, "weight_decay": 0.01,
                                                            "betas": [0.9, 0.999], "eps": 1e-8})
    """Keyword arguments of the optimizer class (learning rate, weight decay, ...)."""


@dataclass(kw_only=True)
class PolicyConfig(_Section):
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
    quant_cfg: dict[str, Any] | None = None
    """NeMo RL's quantised-training settings."""
    draft: dict[str, Any] | None = None
    """NeMo RL's Eagle draft model, trained alongside the policy."""
    router_replay: dict[str, Any] | None = None
    """NeMo RL's replay of the generation's MoE routing in training."""
    pretrained_checkpoint: dict[str, Any] | str | None = None
    """NeMo RL's ``{path: ...}`` (Megatron backend only); accepted and, as under NeMo's DTensor backend, unused."""
    is_vlm: bool = False
    """The model is a vision-language model (NeMo RL)."""
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
    """Token budget of those packed micro-batches; null: 32768 (on an H200, 16k / 32k / 64k / 128k tokens ran at
    0.98 / 1 / 1.02 / 1.02x the speed for Qwen2.5-0.5B), and never less than ``max_total_sequence_length``."""
    inference_compile: bool | None = None
    """Compile the decoder layers and the output head's reductions (``torch.compile``, dynamic shapes) for the
    logprob / top-k / score forwards; training and generation stay eager. null (auto): on GPU ranks (FSDP-sharded
    ones included), off on the CPU. false: off; true: also on the CPU (Inductor's C++ backend, which takes tens of
    seconds to compile)."""
    train_compile: bool | None = None
    """Compile the decoder layers for training forwards (``torch.compile``, dynamic shapes; AOTAutograd compiles
    their backward with them). null (auto): on GPU ranks (FSDP-sharded ones included: FSDP's hooks run eagerly
    around each compiled layer), off on the CPU and with ``dtensor_cfg.activation_checkpointing``. false: off;
    true: also on the CPU (Inductor's C++ backend)."""
    collective_timeout_s: float = 600.0
    """torch.distributed timeout: a lost rank becomes an error after this long, never a hang."""

    def __post_init__(self) -> None:
        p = "policy"
        for key in ("train_global_batch_size", "train_micro_batch_size", "max_total_sequence_length",
                    "generation_batch_size", "make_sequence_length_divisible_by"):
            if getattr(self, key) < 1:
                raise ValueError(f"`{p}.{key}` must be >= 1, got {getattr(self, key)}")
        if self.logprob_batch_size is None:
            self.logprob_batch_size = self.train_micro_batch_size
        elif self.logprob_batch_size < 1:
            raise ValueError(f"`{p}.logprob_batch_size` must be >= 1, got {self.logprob_batch_size}")
        if self.logprob_chunk_size is not None and self.logprob_chunk_size < 1:
            raise ValueError(f"`{p}.logprob_chunk_size` must be >= 1 or null, got {self.logprob_chunk_size}")
        if self.dynamic_batching.sequence_length_round < 1:
            raise ValueError(f"`{p}.dynamic_batching.sequence_length_round` must be >= 1, got "
                             f"{self.dynamic_batching.sequence_length_round}")
        if self.inference_mb_tokens is not None and self.inference_mb_tokens < 1:
            raise ValueError(f"`{p}.inference_mb_tokens` must be >= 1 or null, got {self.inference_mb_tokens}")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"`{p}.collective_timeout_s` must be > 0, got {self.collective_timeout_s}")
        if self.train_compile is True and self.dtensor_cfg.activation_checkpointing:
            raise ValueError(f"`{p}.train_compile` true and `{p}.dtensor_cfg.activation_checkpointing` true do not "
                             "combine (the recomputation would run the layers eagerly): set train_compile to null or "
                             "false to checkpoint activations")
        if self.dynamic_batching.enabled and self.sequence_packing.enabled:
            raise ValueError(f"`{p}.dynamic_batching.enabled` and `{p}.sequence_packing.enabled` cannot both be "
                             "true: pick one way to cut micro-batches")
        for section in (self.dynamic_batching, self.sequence_packing):
            if section.train_mb_tokens is None:
                section.train_mb_tokens = self.max_total_sequence_length * self.train_micro_batch_size
            if section.logprob_mb_tokens is None:
                section.logprob_mb_tokens = self.max_total_sequence_length * self.logprob_batch_size
        name = "dynamic_batching" if self.dynamic_batching.enabled else "sequence_packing"
        active = self.dynamic_batching if self.dynamic_batching.enabled else self.sequence_packing
        if (self.dynamic_batching.enabled or self.sequence_packing.enabled):
            for key in ("train_mb_tokens", "logprob_mb_tokens"):
                if getattr(active, key) < 1:
                    raise ValueError(f"`{p}.{name}.{key}` must be >= 1, got {getattr(active, key)}")
        _check_unhonoured(self)
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

"""The ``policy.generation`` section: how ``Policy.generate`` decodes, and the SGLang servers it may send to.

``backend`` is a checked choice (:data:`Backend`) and ``sglang_cfg`` a typed section (:class:`SGLangConfig`), so a
misspelt value fails when the config is read, naming the key, rather than on the first ``generate()``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from dask_lm.config.schema import Section

__all__ = ["GenerationConfig", "SGLangConfig", "Backend", "DECODING_BACKENDS"]

# NeMo RL's backend names load, so its example configs do; "hf", and NeMo's "dtensor" / "megatron", run on the
# policy's workers. "vllm", "trtllm" and "dynamo" are engines NeMo RL runs beside its Policy, as generation workers of
# their own (NeMo RL 7ea279a, nemo_rl/algorithms/grpo.py:1297 vllm, :1449 trtllm, :1477 dynamo), never through
# Policy.generate: they load (with a warning, keys.py), and generate() refuses them
Backend = Literal["hf", "dtensor", "megatron", "sglang", "vllm", "trtllm", "dynamo"]
DECODING_BACKENDS: tuple[str, ...] = ("hf", "dtensor", "megatron", "sglang")  # those generate() runs


@dataclass(kw_only=True)
class SGLangConfig(Section):
    """The SGLang servers ``generate()`` sends prompts to (``generation.backend: sglang``). dask-lm talks to servers
    that already run; NeMo RL's ``sglang_cfg`` also carries the options it launches its own servers with (SGLang's
    ``ServerArgs``: ``model_path``, ``mem_fraction_static``, ...). Those load, as in NeMo RL, and are kept unread."""

    # NeMo RL types this section as a TypedDict of dozens of optional SGLang server options and checks no key at
    # run time; keeping the ones dask-lm does not read (instead of refusing them) lets its configs load unchanged
    _UNKNOWN_KEYS_INTO: ClassVar[str] = "extra"
    server_urls: list[str] | None = None
    """The SGLang servers (``http://host:port``); prompts go to them round-robin, ``rows_per_request`` at a time.
    ``generate()`` needs at least one."""
    rows_per_request: int = 64
    """Prompts per ``/generate`` request to one server."""
    timeout_s: float = 600.0
    """Seconds a server may take to answer one request."""
    retries: int = 3
    """Retries of a request whose server cannot be reached, with a doubling back-off; then the call fails, naming
    the server."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The section's other keys (NeMo RL's options for the servers it launches), kept as they are."""

    def __post_init__(self) -> None:
        for key in ("rows_per_request", "timeout_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"`policy.generation.sglang_cfg.{key}` must be > 0, got {getattr(self, key)}")
        if self.retries < 0:
            raise ValueError(f"`policy.generation.sglang_cfg.retries` must be >= 0, got {self.retries}")


@dataclass(kw_only=True)
class GenerationConfig(Section):
    backend: Backend = "hf"
    """Where ``generate()`` decodes: ``hf`` on the policy's own workers (NeMo RL's ``dtensor`` and ``megatron``
    name the same), ``sglang`` on the SGLang servers of ``sglang_cfg``. ``vllm``, ``trtllm`` and ``dynamo`` load,
    so NeMo RL's GRPO configs do, and ``generate()`` refuses them."""
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
    sglang_cfg: SGLangConfig | None = None
    """The ``sglang`` backend's settings: the servers and how requests go to them."""
    vllm_kwargs: dict[str, Any] | None = None
    """Extra keyword arguments of NeMo RL's vLLM engine."""
    pad_token_id: int | None = field(default=None, metadata={"key": "_pad_token_id"})
    """Filled in from the tokenizer by NeMo RL's setup; dask-lm pads with the tokenizer's pad (else EOS) id."""
    val_temperature: float | None = None
    """NeMo RL's sampling temperature for validation rollouts (its example configs set it to ``temperature``)."""
    val_top_p: float | None = None
    """NeMo RL's ``top_p`` for validation rollouts."""
    val_top_k: int | None = None
    """NeMo RL's ``top_k`` for validation rollouts."""
    bad_words: list[str] | None = None
    """Words NeMo RL's vLLM backend bans from the output."""
    use_async_rollouts: bool | None = None
    """NeMo RL's asynchronous rollouts with its SGLang backend."""
    port_range_low: int | None = None
    """Lowest port of the inference servers NeMo RL launches."""
    port_range_high: int | None = None
    """Highest port of the inference servers NeMo RL launches."""
    mtp_weights_from_refit: bool | None = field(default=None, metadata={"key": "_mtp_weights_from_refit"})
    """Set by NeMo RL itself: its engines' multi-token-prediction weights come with the refit."""
    debug_payload_metrics: bool | None = field(default=None, metadata={"key": "_debug_payload_metrics"})
    """Set by NeMo RL itself: measure its Ray generation calls."""
    refit_transport: str | None = None
    """How NeMo RL moves the weights into its vLLM engines (null: its topology's default)."""
    refit_cfg: dict[str, Any] | None = None
    """Settings of NeMo RL's vLLM refit transports."""
    quant_cfg: str | None = None
    """NeMo RL's quantisation of vLLM rollouts."""
    real_quant: bool | None = None
    """Run NeMo RL's quantised vLLM rollouts with real quantised kernels."""
    real_quant_export_cpu_offload: bool | None = None
    """Stage the quantised weights NeMo RL exports to vLLM in CPU memory."""
    real_quant_ignore: list[str] | None = None
    """Modules NeMo RL's quantised vLLM rollouts leave unquantised."""
    mcore_generation_config: dict[str, Any] | None = None
    """Settings of NeMo RL's Megatron inference engine (``backend: megatron``)."""
    sglang_kwargs: dict[str, Any] | None = None
    """Extra options of the SGLang servers NeMo RL launches."""
    trtllm_cfg: dict[str, Any] | None = None
    """Settings of NeMo RL's TensorRT-LLM backend."""
    trtllm_kwargs: dict[str, Any] | None = None
    """Extra keyword arguments of NeMo RL's TensorRT-LLM engine."""
    dynamo_cfg: dict[str, Any] | None = None
    """Settings of NeMo RL's Dynamo backend."""

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"`policy.generation.temperature` must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"`policy.generation.top_p` must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < -1:
            raise ValueError(f"`policy.generation.top_k` must be null, -1 or >= 1, got {self.top_k}")

"""What travels between the driver and a rank: frozen, slotted dataclasses, one per request and per result.

The driver builds a request, :class:`dask_lm.engine.worker_group.WorkerGroup` submits it as the argument of
:func:`dask_lm.workers.tasks.serve` on each rank, and the rank's endpoint table
(:data:`dask_lm.workers.endpoints.ENDPOINTS`) maps the request's *type* to the handler that answers it. So a call
can be followed from ``Policy.get_logprobs`` to the rank's code by type, by an IDE or by mypy, with no method name
passed as a string. Rows travel inside a :class:`Shard` as the Arrow table of :mod:`dask_lm.data.arrow` (token ids
as ``list<int32>``, padding trimmed) beside its :class:`MicroBatchPlan`, and the columns that table cannot store as
data (a ``message_log`` of dicts holding tensors, tuples, custom objects) beside it as Python objects. Those go
through Dask's own serializers, which pickle them: a Dask worker already unpickles whatever its peers send (Dask's
protocol does), so this channel adds no trust. A table read from a file is never given that trust:
:func:`dask_lm.data.arrow.from_arrow` stores and reads only data.

Shapes in the field comments use ``B`` (rows of the shard), ``S`` (the padded width of the shard), ``k`` (top-k).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from dask_lm.config.defaults import PACKED_BATCH_TOKENS, PADDED_BATCH_TOKENS
from dask_lm.data.continuation import Convention

if TYPE_CHECKING:
    import pyarrow as pa
    import torch

    from dask_lm.data.batch import BatchedDataDict
    from dask_lm.data.tokens import TokenRows

__all__ = [
    "GENERATE_BATCH_FACTOR",
    "MicroBatchPlan",
    "Shard",
    "ForwardRequest",
    "FullLogitsRequest",
    "QKVCalibrationRequest",
    "GenerateRequest",
    "ForwardOutput",
    "TrainRequest",
    "TrainResult",
    "SaveRequest",
    "ActionRequest",
    "HttpRefitRequest",
    "ZmqRefitRequest",
    "BroadcastRefitRequest",
    "ReshardRefitRequest",
    "RefitRequest",
    "CollectiveInitRequest",
    "WeightSwapRequest",
    "ExtensionCall",
    "JoinRows",
    "JoinGenerated",
    "ReduceTrain",
    "Join",
    "ScoreOptions",
    "Request",
    "ACTIONS",
]


# ------------------------------------------------------------------------------------------- rows
@dataclass(frozen=True, slots=True)
class MicroBatchPlan:
    """How the driver cut one rank's shard (:mod:`dask_lm.data.sharding`); every field None means "cut it by
    ``micro_batch_size`` rows on the rank"."""

    packed: bool = False  # rows of a micro-batch are concatenated into one sequence (varlen / block mask)
    micro_batch_indices: list[list[list[int]]] | None = None  # per global batch: [start, end) rows per micro-batch
    micro_batch_lengths: list[list[int]] | None = None  # per global batch: padded length / packed tokens per mb
    elem_counts_per_gb: list[int] | None = None  # packing: rows of this shard in each global batch

    @classmethod
    def of(cls, batch: BatchedDataDict[Any], *, packed: bool) -> MicroBatchPlan:
        return cls(
            packed=packed,
            micro_batch_indices=batch.micro_batch_indices,
            micro_batch_lengths=batch.micro_batch_lengths,
            elem_counts_per_gb=batch.elem_counts_per_gb,
        )

    def global_batch(self, index: int, rows: int) -> tuple[int, int, list[list[list[int]]] | None]:
        """Global batch ``index`` of the shard: its rows ``[start, end)`` (``rows`` each without packing, else as
        the packer counted them) and its micro-batches (``[start, end)`` within it, as the one chunk
        :func:`dask_lm.model.forward.plan_micro_batches` takes), or None to cut it by rows."""
        if self.elem_counts_per_gb is not None:
            start = sum(self.elem_counts_per_gb[:index])
            end = start + self.elem_counts_per_gb[index]
        else:
            start, end = rows * index, rows * (index + 1)
        chunk = None if self.micro_batch_indices is None else [self.micro_batch_indices[index]]
        return start, end, chunk


@dataclass(frozen=True, slots=True)
class Shard:
    """One rank's rows as they cross the wire: an Arrow table, the plan that cuts it into micro-batches, and the
    columns Arrow cannot store as data, as Python objects.

    ``objects`` holds exactly the columns :func:`dask_lm.data.arrow.to_arrow` refuses (tuples, numpy arrays,
    tensors inside lists, custom objects), so NeMo RL code that keeps such columns in a batch still works. They
    travel pickled by Dask, inside its channel between trusted peers (see the module docstring); the table itself
    holds data only, which is what lets it be written to and read from files."""

    table: pa.Table
    plan: MicroBatchPlan
    objects: Mapping[str, list[Any]] = field(default_factory=dict)  # key -> one Python object per row
    keys: tuple[str, ...] = ()  # with objects: every key of the batch in its order (the table's and objects' keys)

    @classmethod
    def of(cls, batch: BatchedDataDict[Any], *, packed: bool = False) -> Shard:
        from dask_lm.data.arrow import encode_columns

        table, objects = encode_columns(batch)
        return cls(table, MicroBatchPlan.of(batch, packed=packed), objects, tuple(batch) if objects else ())

    def tokens(self) -> TokenRows:
        """The shard's ``input_ids`` as an inference pass reads them: the Arrow column's values and offsets, as they
        arrived (no padded tensor is made; see :mod:`dask_lm.data.tokens`)."""
        from dask_lm.data.tokens import TokenRows

        return TokenRows.from_table(self.table)

    def rows(self) -> BatchedDataDict[Any]:
        """The shard as the BatchedDataDict the driver cut (tensors right-padded again, object columns back in their
        place). The micro-batch layout stays in :attr:`plan`, where the rank reads it: it is not copied onto the
        rows."""
        from dask_lm.data.arrow import from_arrow
        from dask_lm.data.batch import BatchedDataDict

        columns = from_arrow(self.table)
        if self.objects:
            columns = {**columns, **self.objects}
            return BatchedDataDict({key: columns[key] for key in self.keys})
        return BatchedDataDict(columns)


# ------------------------------------------------------------------------------------------- forward passes
Head = Literal["logprobs", "reference_logprobs", "topk", "score"]


@dataclass(frozen=True, slots=True)
class ForwardRequest:
    """One inference pass over a shard, read out by ``head``: next-token logprobs (under the current weights, or
    the reference weights kept at load), the ``k`` largest logits, or a reward model's score of each row."""

    shard: Shard
    head: Head = "logprobs"
    k: int | None = None  # topk: how many logits per position
    micro_batch_size: int | None = None  # rows per micro-batch when the call names one (no packing then)


@dataclass(frozen=True, slots=True)
class FullLogitsRequest:
    """Every logit of every real token of a shard (a contiguous slice of the batch, in order), left in the rank's
    shareable buffer (:mod:`dask_lm.workers.full_logits`); the answer says where each row sits."""

    shard: Shard
    micro_batch_size: int | None = None  # rows per micro-batch (default: logprob_batch_size)


@dataclass(frozen=True, slots=True)
class QKVCalibrationRequest:
    """``calibrate_qkv_fp8_scales`` on a shard: each layer's percentile amax of Q / K / V over this rank's
    micro-batches (:mod:`dask_lm.workers.qkv_calibration`)."""

    shard: Shard
    micro_batch_size: int | None = None
    percentile: float = 99.9
    include_q: bool = False


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """Decode ``generation.max_new_tokens`` after each row (a contiguous slice of the batch per rank)."""

    shard: Shard
    greedy: bool = False
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class ForwardOutput:
    """A forward or generation's tensors, on the host, one row per shard row. Keys by head: ``logprobs`` /
    ``reference_logprobs`` float32 [B, S]; ``topk_logits`` float32 [B, S, k] and ``topk_indices`` int64 [B, S, k];
    ``scores`` float32 [B]; generation: ``output_ids`` [B, S'], ``logprobs`` [B, S'], ``generation_lengths`` [B],
    ``unpadded_sequence_lengths`` [B] and ``truncated`` [B]."""

    tensors: Mapping[str, torch.Tensor]


# ------------------------------------------------------------------------------------------- training
@dataclass(frozen=True, slots=True)
class TrainRequest:
    """``num_global_batches`` optimizer steps over the shard (``eval_mode``: forward only)."""

    shard: Shard
    loss_fn: Any  # a LossFunction: called on the rank with each micro-batch
    eval_mode: bool
    gbs: int
    mbs: int
    num_global_batches: int
    progress_id: str | None = None


@dataclass(frozen=True, slots=True)
class TrainResult:
    """One rank's answer to a :class:`TrainRequest`; the ranks agree on ``loss`` and ``grad_norm``."""

    loss: torch.Tensor  # float32 [num_global_batches], summed over the ranks' micro-batches
    grad_norm: torch.Tensor | None  # float32 [1]: the last step's norm before clipping (None in eval)
    grad_norms: list[float]  # every step's norm
    all_mb_metrics: dict[str, list[Any]]  # metric -> one value per micro-batch of this rank
    train_elapsed_seconds: float
    rank: int
    gpu_name: str | None
    model_dtype: str
    num_tokens: int  # real tokens of this rank's shard


# ------------------------------------------------------------------------------------------- joining the answers
# How a call's combine task (:func:`dask_lm.workers.combine.combine`, on rank 0's worker) joins its ranks' answers:
# one type per kind of answer, each looked up in :data:`dask_lm.workers.combine.JOINS`. Small: pickled with the task.
@dataclass(frozen=True, slots=True)
class JoinRows:
    """Per-row tensors cut by rows over the ranks (:class:`ForwardOutput`), joined and put back in input order."""

    keys: tuple[str, ...]  # the answers' tensors to join
    order: list[int] | None  # the permutation that restores the input's row order (None: already in order)
    cat: bool = False  # same-width tensors (top-k, scores): concatenated; else [B, S] right-padded to the widest


@dataclass(frozen=True, slots=True)
class JoinGenerated:
    """Generation's contiguous per-rank slices (:class:`ForwardOutput`), right-padded to the widest rank's output."""

    pad_token_id: int  # fills ``output_ids``


@dataclass(frozen=True, slots=True)
class ReduceTrain:
    """The ranks' :class:`TrainResult` reduced to NeMo RL's train() dict."""

    total_flops: float | None  # the call's FLOPs counted on the driver (None: no formula for the model)


Join = JoinRows | JoinGenerated | ReduceTrain


@dataclass(frozen=True, slots=True)
class SaveRequest:
    """Write a checkpoint: ``weights`` / ``optimizer`` are ``(staging path, final path)``, ``tokenizer`` adds the
    tokenizer object; ``weights_tokenizer`` is written into the weights directory too."""

    weights: tuple[str, str] | None
    optimizer: tuple[str, str] | None
    tokenizer: tuple[str, str, Any] | None
    async_save: bool
    max_shard_size: int
    weights_tokenizer: Any = None


# ------------------------------------------------------------------------------------------- argument-free calls
PlacementAction = Literal[
    "prepare_for_training",
    "finish_training",
    "prepare_for_lp_inference",
    "finish_inference",
    "prepare_for_generation",
    "finish_generation",
    "invalidate_kv_cache",
    "offload_before_refit",
    "offload_after_refit",
    "offload_to_cpu",
]
Action = (
    PlacementAction | Literal["prepare_refit_info", "report_device_id", "finalize_async_save", "release_ipc_buffer"]
)
ACTIONS: tuple[str, ...] = (
    *typing.get_args(PlacementAction),
    "prepare_refit_info",
    "report_device_id",
    "finalize_async_save",
    "release_ipc_buffer",
)


@dataclass(frozen=True, slots=True)
class ActionRequest:
    """A rank operation without arguments: move weights / optimizer state around the phases of an RL loop, report
    the refit info (``{name: (shape, dtype)}``) or the device id, finish a pending asynchronous save, or free the
    full-logits buffer."""

    action: Action


# ------------------------------------------------------------------------------------------- refit
# One request per route the weights take out of the ranks, each answered by its own handler on the rank
# (:data:`dask_lm.workers.endpoints.ENDPOINTS`); ``progress_id`` names the driver's bar over the bytes sent.
@dataclass(frozen=True, slots=True)
class HttpRefitRequest:
    """Into SGLang servers over HTTP (their weight-update session), in buckets of at most ``buffer_size_bytes``."""

    urls: tuple[str, ...]  # one server per engine
    layout: list[list[int]]  # layout[e][i]: the policy rank that feeds TP rank i of engine e
    weight_version: str  # names the update on the servers
    buffer_size_bytes: int
    timeout_s: float
    transport: str | None = None  # how buckets travel ("ipc", "shm", "value"; None: the device's default)
    progress_id: str | None = None

    def __post_init__(self) -> None:
        assert self.urls and len(self.layout) == len(self.urls), "an HTTP refit names its servers and their layout"


@dataclass(frozen=True, slots=True)
class ZmqRefitRequest:
    """To the inference worker on the same device, over this rank's ZMQ socket, in two ping-pong buffers of half
    ``buffer_size_bytes``."""

    buffer_size_bytes: int
    timeout_s: float
    progress_id: str | None = None


@dataclass(frozen=True, slots=True)
class BroadcastRefitRequest:
    """From rank 0 over the group of a :class:`CollectiveInitRequest` (NCCL on GPUs, gloo on CPU), in buckets of
    ``buffer_size_bytes``."""

    buffer_size_bytes: int
    progress_id: str | None = None


@dataclass(frozen=True, slots=True)
class ReshardRefitRequest:
    """Each rank's boxes of its shards to the inference ranks of the refit group that need them."""

    plan: dict[str, Any]  # plain data: the plan of :func:`dask_lm.refit.reshard.build_plan`
    progress_id: str | None = None


RefitRequest = HttpRefitRequest | ZmqRefitRequest | BroadcastRefitRequest | ReshardRefitRequest


@dataclass(frozen=True, slots=True)
class CollectiveInitRequest:
    """Join the refit process group at ``ip:port`` as members ``rank_offset + rank``: the training side
    (``rank_offset`` 0, whose rank 0 hosts the store) or a generation-side Policy's ranks
    (``init_collective_mcore_generation``). ``backend``: ``"gloo"`` or ``"nccl"``; None is NCCL on GPUs, gloo on
    CPU."""

    ip: str
    port: int
    world_size: int
    train_world_size: int
    timeout_s: float
    rank_offset: int = 0
    backend: str | None = None


@dataclass(frozen=True, slots=True)
class WeightSwapRequest:
    """``swap_weights_via_reshard``: send this rank's rows of every weight to the other Policy of the refit group
    (``is_source``), or receive this rank's own rows from it (:mod:`dask_lm.refit.swap`)."""

    is_source: bool


# ------------------------------------------------------------------------------------------- batch jobs
# generation's tasks and micro-batches hold this many times more (context + new) tokens than scoring's (lm-eval's
# driver, dask_lm.evaluation.engine, and its ranks, dask_lm.evaluation.requests, both read it here): a decode step costs
# about the same for 20 rows as for 200 (it is launch-bound), and the extra rows cost KV cache, not logits (prefill
# keeps the last position's only)
GENERATE_BATCH_FACTOR = 8


@dataclass(frozen=True, slots=True)
class ScoreOptions:
    """One ``score_parquet`` job's settings, sent with every partition task
    (:func:`dask_lm.scoring.tasks.score_partition`)."""

    model: str
    tokenizer: str
    precision: str
    output: str
    text_column: str | None = None
    ids_column: str | None = None
    prompt_length_column: str | None = None  # ids mode: how many leading ids are context (not scored)
    prompt_column: str | None = None
    response_column: str | None = None
    id_column: str | None = None
    topk: int = 0
    decode_topk: bool = False  # also write topk_tokens, decoded on the worker (dask_lm.io.results.token_strings)
    max_length: int | None = None
    truncate: bool = False
    batch_tokens: int | None = None  # None: PACKED_BATCH_TOKENS where rows are packed, else PADDED_BATCH_TOKENS
    skip_bad_rows: bool = False
    allow_nonfinite: bool = False
    chunk_size: int = 1024
    compile: bool = True
    # the head's fused reductions compiled (GPU workers; dask_lm.scoring.scorer.score_ids): a few seconds per
    # worker process, paid back from about 8M tokens per worker (dask_lm.scoring.compile_choice.worth_compiling_head)
    compile_head: bool = False
    convention: Convention = "lm-eval"  # prompt + response / text tokenization: dask_lm.data.continuation
    # the model and tokenizer files as the job pinned them (dask_lm.io.fingerprint.Pin): a replica is loaded only
    # from files that still hold that content, and is kept apart from one loaded from another version
    model_pins: tuple[Any, ...] = ()
    # who started the job ("python" or "cli"): a worker's messages name options as that caller spells them
    # (dask_lm.interface); not pinned by the manifest, as it changes no value
    interface: Literal["python", "cli"] = "python"
    # the job's identity (dask_lm.io.part_proof.job_identity), written into each part's footer with its span;
    # empty outside a scoring job (no part files)
    identity: str = ""

    def micro_batch_tokens(self, packed: bool) -> int:
        """Tokens per micro-batch: ``batch_tokens``, else the default for the worker's layout."""
        if self.batch_tokens is not None:
            return self.batch_tokens
        return PACKED_BATCH_TOKENS if packed else PADDED_BATCH_TOKENS


# ------------------------------------------------------------------------------------------- extensions
@dataclass(frozen=True, slots=True)
class ExtensionCall:
    """``run_all_workers_*``: a public method of the user's worker extension class (or of the allow-list of the
    base worker's methods, :data:`dask_lm.workers.endpoints.EXTENSION_BASE_METHODS`), called with these arguments."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


Request = (
    ForwardRequest
    | FullLogitsRequest
    | QKVCalibrationRequest
    | GenerateRequest
    | TrainRequest
    | SaveRequest
    | ActionRequest
    | RefitRequest
    | CollectiveInitRequest
    | WeightSwapRequest
    | ExtensionCall
)


# ------------------------------------------------------------------------------------------- on the wire
def _register_dask_serialization(cls: type) -> None:
    """Serialize a message field by field through Dask's own serializers, so its tensors and Arrow tables travel
    as zero-copy frames (Dask's torch / Arrow serializers). Left to pickle, a message would pickle its tensors
    through ``torch.save`` into bytes: measured on an H200, 0.3 s more per ``get_logprobs`` call of 2048 rows."""
    from distributed.protocol import dask_deserialize, dask_serialize, deserialize, serialize

    names = [f.name for f in dataclasses.fields(cls)]

    @dask_serialize.register(cls)
    def _serialize(message: Any) -> tuple[dict[str, Any], list[Any]]:
        header, frames = serialize(
            {n: getattr(message, n) for n in names}, serializers=("dask", "pickle"), on_error="raise"
        )
        return {"fields": header}, frames

    @dask_deserialize.register(cls)
    def _deserialize(header: dict[str, Any], frames: list[Any]) -> Any:
        return cls(**deserialize(header["fields"], frames))


for _cls in (
    Shard,
    MicroBatchPlan,
    ForwardRequest,
    GenerateRequest,
    ForwardOutput,
    TrainRequest,
    TrainResult,
    SaveRequest,
):
    _register_dask_serialization(_cls)

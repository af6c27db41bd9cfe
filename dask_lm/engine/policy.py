"""``Policy``: NeMo RL's Policy API on a Dask cluster. The driver half: it owns no model and never touches CUDA.

Example
-------
>>> client = dask_lm.connect()                      # one worker per GPU (2 CPU workers without GPUs)
>>> policy = dask_lm.Policy(client, {"model_name": "/models/qwen2.5-0.5b", "precision": "bfloat16"}, tokenizer)
>>> out = policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lengths))
>>> out["logprobs"].shape                           # float32 [B, S]; position 0 is 0
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from distributed import span

from dask_lm.config import PolicyConfig, SGLangConfig
from dask_lm.config.generation import DECODING_BACKENDS
from dask_lm.config.optim import check_optim_config
from dask_lm.data.batch import BatchedDataDict
from dask_lm.data.messages import (
    ActionRequest,
    ExtensionCall,
    ForwardRequest,
    FullLogitsRequest,
    GenerateRequest,
    Join,
    JoinGenerated,
    JoinRows,
    PlacementAction,
    QKVCalibrationRequest,
    ReduceTrain,
)
from dask_lm.data.named_sharding import NamedSharding
from dask_lm.data.validation import validate_input_batch
from dask_lm.engine import progress
from dask_lm.engine.cluster import as_client
from dask_lm.engine.futures import Pending
from dask_lm.engine.metrics import FLOPTracker
from dask_lm.engine.model_config import check_model_config, model_config, resolve_names
from dask_lm.engine.posting import PostingMixin
from dask_lm.engine.shutdown import shutdown_quietly
from dask_lm.engine.start_phases import PolicyStartClock
from dask_lm.engine.training import TrainingMixin, submit_train
from dask_lm.engine.worker_group import WorkerGroup
from dask_lm.io import checkpoint as ckpt
from dask_lm.io import modelcheck
from dask_lm.refit.driver import RefitMixin
from dask_lm.workers import tasks

__all__ = ["Policy", "SUBMIT", "SUBMITTABLE", "Submittable"]

FP8_E4M3_MAX = 448.0  # the largest finite float8 e4m3 value, NeMo RL's default range for Q / K / V scales


class Policy(TrainingMixin, RefitMixin, PostingMixin):
    """A language-model policy sharded over the workers of a Dask cluster (NeMo RL's ``Policy`` API).

    Parameters follow NeMo RL. ``cluster`` is a ``distributed.Client``, a Dask cluster object or a scheduler
    address; every worker of it becomes one rank (``workers_per_node`` caps the ranks taken per host; ``workers``,
    a dask-lm addition, names the workers to take, in rank order, e.g. to run a second Policy beside the first).
    ``config`` is a dict with NeMo RL's PolicyConfig keys or a :class:`~dask_lm.PolicyConfig`.
    """

    def __init__(
        self,
        cluster: Any,
        config: dict[str, Any] | PolicyConfig,
        tokenizer: Any,
        name_prefix: str = "lm_policy",
        workers_per_node: int | None = None,
        init_optimizer: bool = True,
        weights_path: str | os.PathLike[str] | None = None,
        optimizer_path: str | os.PathLike[str] | None = None,
        init_reference_model: bool = True,
        processor: Any = None,
        worker_extension_cls_fqn: str | None = None,
        skip_weight_load: bool = False,
        workers: Sequence[Any] | None = None,
    ) -> None:
        self._group: WorkerGroup | None = None
        clock = PolicyStartClock()
        self.cfg, self.model_source = resolve_names(PolicyConfig.from_dict(config))
        if processor is not None:
            raise ValueError("`processor` (multimodal inputs) is not supported yet; pass processor=None")
        if weights_path is not None:
            weights_path = os.path.abspath(weights_path)
            if not os.path.isdir(weights_path):
                raise ValueError(f"`weights_path` {weights_path!r} is not a directory")
            modelcheck.refuse_remote_code(weights_path, "`weights_path`")
        if optimizer_path is not None:
            optimizer_path = os.path.abspath(optimizer_path)
            if not init_optimizer:
                raise ValueError("`optimizer_path` restores optimizer state, which needs init_optimizer=True")
            if not any(os.path.isfile(os.path.join(optimizer_path, f)) for f in (".metadata", ckpt.FRESH_OPTIMIZER)):
                raise ValueError(
                    f"`optimizer_path` {optimizer_path!r} is not an optimizer checkpoint written by "
                    "save_checkpoint (no .metadata file in it)"
                )
        self.init_optimizer = bool(init_optimizer and self.cfg.optimizer is not None)
        if self.init_optimizer:
            check_optim_config(self.cfg)
        self.tokenizer = tokenizer
        self.pad_token_id = self._pad_id(tokenizer)
        # transformers' parse of the config (its import: 1-4 s) runs while the ranks load, where there is a
        # config.json to check first; without one, its error comes before any worker starts
        parse_later = check_model_config(self.cfg.model_name, self.cfg.hf_config_overrides)
        if not parse_later:
            self._read_model_config()
        clock.mark("config")
        self.client = as_client(cluster)
        if workers is not None:
            if workers_per_node is not None:
                raise ValueError("pass `workers` (which workers, by name) or `workers_per_node`, not both")
            if isinstance(workers, (str, bytes)) or len(set(workers)) != len(workers) or not workers:
                raise ValueError(f"`workers` must list distinct worker names, got {workers!r}")
            workers = list(workers)
        elif workers_per_node is not None:
            workers = WorkerGroup.per_node(self.client, workers_per_node)
        self._group = group = WorkerGroup(self.client, workers=workers, name_prefix=name_prefix)
        self.sharding_annotations = NamedSharding.data_parallel(group.world_size)
        clock.mark("workers")
        options = {
            "init_optimizer": init_optimizer,
            "init_reference_model": init_reference_model,
            "weights_path": weights_path,
            "optimizer_path": optimizer_path,
            "skip_weight_load": skip_weight_load,
        }
        members = tuple(str(n) for n in group.names)
        lock = group.group_lock() if group.world_size > 1 else contextlib.nullcontext()
        with span("dask-lm/load-model"), lock:
            master = group.rendezvous()
            futs = group.submit(
                tasks.init_policy,
                group.policy_id,
                self.cfg.to_dict(),
                key_name="load-model",
                per_rank_kwargs=[{"rank": r} for r in range(group.world_size)],
                members=members,
                member_ids=tuple(group.ids),
                master=master,
                pad_token_id=self.pad_token_id,
                extension_fqn=worker_extension_cls_fqn,
                options=options,
            )
            try:
                if parse_later:
                    self._read_model_config()
                with progress.bar(self.client, len(futs), "loading the model", "rank") as (_id, load_bar):
                    self.worker_info = group.gather(futs, what="loading the model", progress=load_bar)
            except BaseException:
                shutdown_quietly(group)  # ranks that did load free their model and process group
                raise
        clock.mark("load")
        #: where this Policy's start went, in seconds: the driver's steps and each rank's (engine/start_phases.py)
        self.start_phases: dict[str, Any] = clock.phases(self.worker_info)
        self._finalizer = weakref.finalize(self, shutdown_quietly, group)

    def _read_model_config(self) -> None:
        self.hf_config = model_config(self.cfg.model_name, self.cfg.hf_config_overrides)
        text = self.hf_config.get_text_config() if hasattr(self.hf_config, "get_text_config") else self.hf_config
        self.vocab_size = getattr(text, "vocab_size", None)
        self.flops_tracker = FLOPTracker.from_config(self.hf_config)

    # ----------------------------------------------------------------------------------------- futures
    def submit(self, method: str, /, *args: Any, collect: bool = True, **kwargs: Any) -> Any:
        """Start ``method`` (``"get_logprobs"``, ``"get_reference_policy_logprobs"``, ``"get_topk_logits"``,
        ``"score"``, ``"generate"`` or ``"train"``) with the blocking method's arguments and return its
        :class:`~dask_lm.PolicyFuture` at once; the blocking method is ``submit(...).result()``.

        Input checks run here, before any work. Calls on one Policy run on the ranks in the order they were
        submitted. ``data`` may also be a ``distributed.Future`` of a batch (e.g. another call's PolicyFuture) or a
        Dask DataFrame of token ids: the rows then go from the workers that hold them to the ranks, not through
        this process. ``collect=False`` (the four inference methods): the ranks' outputs stay on their workers, as
        a lazy Dask DataFrame with a partition per rank, a row per input row (``row``: its number in the input)
        (docs/guides/policy.md, "Futures")."""
        entry = SUBMIT.get(method)
        if entry is None:
            raise ValueError(f"Policy.submit: {method!r} cannot be submitted; use one of {list(SUBMITTABLE)}")
        if not collect and entry.join is not JoinRows:
            raise ValueError(
                f"Policy.submit({method!r}, collect=False): only the inference calls "
                "(get_logprobs, get_reference_policy_logprobs, get_topk_logits, score) give rows that "
                "can stay on the workers; leave collect=True"
            )
        pending = entry.post(self, *args, **kwargs)
        assert isinstance(pending.join, entry.join), f"{method} posts a {type(pending.join).__name__}"
        return pending.future(self.group) if collect else pending.frame(self.group)

    # ----------------------------------------------------------------------------------------- inference
    def get_logprobs(self, data: BatchedDataDict[Any], timer: Any = None) -> BatchedDataDict[Any]:
        """Per-token log-probabilities: ``{"logprobs": float32 [B, S]}``; position 0 and padding hold 0."""
        out: BatchedDataDict[Any] = self.submit("get_logprobs", data, timer=timer).result()
        return out

    def _submit_get_logprobs(self, data: Any, timer: Any = None) -> Pending:
        posted = self._post_sharded(ForwardRequest, data, what="get_logprobs", timer=timer)
        return self._rows_future(posted, "get_logprobs", ("logprobs",))

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict[Any], micro_batch_size: int | None = None, timer: Any = None
    ) -> BatchedDataDict[Any]:
        """Log-probabilities under the weights as first loaded (before training or a ``weights_path`` restore):
        ``{"reference_logprobs": float32 [B, S]}``; the generation temperature applies, top-k/top-p do not."""
        out: BatchedDataDict[Any] = self.submit(
            "get_reference_policy_logprobs", data, micro_batch_size=micro_batch_size, timer=timer
        ).result()
        return out

    def _submit_get_reference_policy_logprobs(
        self, data: Any, micro_batch_size: int | None = None, timer: Any = None
    ) -> Pending:
        what = "get_reference_policy_logprobs"
        posted = self._post_sharded(
            functools.partial(ForwardRequest, head="reference_logprobs", micro_batch_size=micro_batch_size),
            data,
            what=what,
            timer=timer,
            rows_per_mb=micro_batch_size is not None,
        )
        return self._rows_future(posted, what, ("reference_logprobs",))

    def get_topk_logits(
        self, data: BatchedDataDict[Any], k: int, micro_batch_size: int | None = None, timer: Any = None
    ) -> BatchedDataDict[Any]:
        """The k largest temperature-scaled logits at every position: ``topk_logits`` float32 [B, S, k] and
        ``topk_indices`` int64 [B, S, k] (padding positions hold 0)."""
        out: BatchedDataDict[Any] = self.submit(
            "get_topk_logits", data, k, micro_batch_size=micro_batch_size, timer=timer
        ).result()
        return out

    def _submit_get_topk_logits(
        self, data: Any, k: int, micro_batch_size: int | None = None, timer: Any = None
    ) -> Pending:
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"get_topk_logits: `k` must be a positive integer, got {k!r}")
        if self.vocab_size is not None and k > self.vocab_size:
            raise ValueError(f"get_topk_logits: `k`={k} exceeds the vocabulary size {self.vocab_size}")
        request = functools.partial(ForwardRequest, head="topk", k=k, micro_batch_size=micro_batch_size)
        posted = self._post_sharded(
            request, data, what="get_topk_logits", timer=timer, rows_per_mb=micro_batch_size is not None
        )
        return self._rows_future(posted, "get_topk_logits", ("topk_logits", "topk_indices"), cat=True)

    def get_full_logits_ipc(
        self, data: BatchedDataDict[Any], micro_batch_size: int | None = None, timer: Any = None
    ) -> list[dict[str, Any]]:
        """Every logit of every token, left on the ranks for a consumer process on the same machine (a
        cross-tokenizer distillation student): NeMo RL's shape, a list with one ``{"teacher_shards": [shard]}``
        per row in input order. ``shard`` names the rank's buffer (``payload_ipc``: plain data, CUDA IPC on GPUs,
        shared memory on CPU workers) and the row's place in it (``buf_idx``, ``sample_index_in_buf``,
        ``actual_shape`` = ``(S, V)``); :func:`dask_lm.teacher_logits.open_full_logits` maps it as a float32
        ``[S, V]`` tensor: the temperature-scaled logits at each position (predicting the next token), 0 at and
        past the row's length. Each rank keeps one buffer, reused by later calls (grown when one needs more) until
        :meth:`release_ipc_buffer`; the memory it needs is checked on every rank before any forward runs. See
        :mod:`dask_lm.workers.full_logits` for the layout and how it differs from NeMo RL's v0."""
        if micro_batch_size is not None and (
            not isinstance(micro_batch_size, int) or isinstance(micro_batch_size, bool) or micro_batch_size < 1
        ):
            raise ValueError(
                f"get_full_logits_ipc: `micro_batch_size` must be a positive integer or None, got {micro_batch_size!r}"
            )
        what = "get_full_logits_ipc"
        # rows stay in order, a contiguous slice per rank, so rank order is row order (as NeMo RL's dp ranks)
        posted = self._post_sharded(
            functools.partial(FullLogitsRequest, micro_batch_size=micro_batch_size),
            data,
            what=what,
            timer=timer,
            contiguous=True,
        )
        answers = self.group.gather(posted.futures, what=what)
        posted.done(answers, None)
        assert [a["dp_rank"] for a in answers] == list(range(len(answers))), "gather answers in rank order"
        return [{"teacher_shards": [entry]} for answer in answers for entry in answer["per_sample_handles"]]

    def calibrate_qkv_fp8_scales(
        self,
        data: BatchedDataDict[Any],
        micro_batch_size: int | None = None,
        percentile: float = 99.9,
        margin: float = 1.05,
        include_q: bool = False,
    ) -> dict[str, Any]:
        """FP8 KV-cache scales from a representative batch (NeMo RL's calibration, there Megatron's only).

        Each rank runs its rows in order, ``micro_batch_size`` rows per forward (default ``logprob_batch_size``),
        and records per layer and forward the largest ``|K|`` and ``|V|`` (and ``|Q|`` with ``include_q``) over
        the real tokens, as the attention function receives them (after Q/K norms and RoPE); the ``percentile`` of
        a rank's samples, the largest over the ranks, times ``margin``, over the FP8 e4m3 maximum 448, is the
        layer's scale. Returns NeMo RL's ``{"format": "fp8", "percentile", "margin", "layers": {name: scale}}``
        with vLLM's parameter names (``model.layers.{i}.self_attn.k_scale`` / ``v_scale``,
        ``model.layers.{i}.self_attn.attn.q_scale``)."""
        what = "calibrate_qkv_fp8_scales"
        if micro_batch_size is not None and (
            not isinstance(micro_batch_size, int) or isinstance(micro_batch_size, bool) or micro_batch_size < 1
        ):
            raise ValueError(f"{what}: `micro_batch_size` must be a positive integer or None, got {micro_batch_size!r}")
        if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 0 < percentile <= 100:
            raise ValueError(f"{what}: `percentile` must be in (0, 100], got {percentile!r}")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin > 0:
            raise ValueError(f"{what}: `margin` must be a positive number, got {margin!r}")
        if self.cfg.reward_model_cfg.enabled:
            raise ValueError(f"{what}: a reward model has no KV cache to calibrate for generation")
        posted = self._post_sharded(
            functools.partial(
                QKVCalibrationRequest,
                micro_batch_size=micro_batch_size,
                percentile=float(percentile),
                include_q=bool(include_q),
            ),
            data,
            what=what,
            contiguous=True,
        )
        answers = self.group.gather(posted.futures, what=what)
        posted.done(answers, None)
        amax: dict[int, dict[str, float]] = {}
        for answer in answers:  # the largest over the ranks (NeMo RL's conservative merge)
            for layer, values in answer.items():
                merged = amax.setdefault(int(layer), {})
                for name, v in values.items():
                    merged[name] = max(merged.get(name, 0.0), float(v))
        layers: dict[str, float] = {}
        for i, values in sorted(amax.items()):
            for name, v in values.items():
                # vLLM's names: the query scale sits one module deeper (NeMo RL's get_vllm_qkv_scale_names)
                key = f"model.layers.{i}.self_attn.{'attn.' if name == 'q' else ''}{name}_scale"
                layers[key] = v * float(margin) / FP8_E4M3_MAX
        return {"format": "fp8", "percentile": float(percentile), "margin": float(margin), "layers": layers}

    def release_ipc_buffer(self) -> None:
        """Free every rank's :meth:`get_full_logits_ipc` buffer (once, when the loop is done with it: a consumer
        still holding a CUDA mapping keeps that memory until it lets go)."""
        self.group.run(ActionRequest("release_ipc_buffer"), what="release_ipc_buffer", key_name="release-ipc-buffer")

    def score(self, data: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
        """Reward-model scores ``{"scores": float32 [B]}`` (needs ``reward_model_cfg.enabled``)."""
        out: BatchedDataDict[Any] = self.submit("score", data).result()
        return out

    def _submit_score(self, data: Any) -> Pending:
        if not self.cfg.reward_model_cfg.enabled:
            raise ValueError(
                "score() needs a reward model: set `policy.reward_model_cfg.enabled: true` and point "
                "`policy.model_name` at a sequence-classification checkpoint"
            )
        posted = self._post_sharded(functools.partial(ForwardRequest, head="score"), data, what="score")
        return self._rows_future(posted, "score", ("scores",), cat=True)

    def generate(
        self, data: BatchedDataDict[Any], greedy: bool = False, seed: int | None = None
    ) -> BatchedDataDict[Any]:
        """Continue right-padded prompts with the policy's own weights (KV-cached, batched; ``generation`` config).

        Returns ``output_ids`` [B, S_out] (prompt then generation, right-padded with the pad id), ``logprobs``
        [B, S_out] (the sampled tokens' logprobs under the generation temperature / top-k / top-p, 0 on prompt
        and padding), ``generation_lengths``, ``unpadded_sequence_lengths`` and ``truncated`` (hit
        ``max_new_tokens`` without a stop)."""
        gen = self._generation_config()
        if gen.backend == "sglang":  # the driver talks to the servers itself: there is no future of it
            return self._generate_sglang(data, greedy=greedy, seed=seed)
        out: BatchedDataDict[Any] = self.submit("generate", data, greedy=greedy, seed=seed).result()
        return out

    def _generation_config(self) -> Any:
        gen = self.cfg.generation
        if gen is None or not gen.max_new_tokens or gen.max_new_tokens < 1:
            raise ValueError("generate() needs `policy.generation.max_new_tokens` (>= 1)")
        if gen.backend not in DECODING_BACKENDS:
            raise ValueError(
                f"`policy.generation.backend` = {gen.backend!r}: use 'hf' (the policy's own workers) "
                "or 'sglang' (servers listed in `policy.generation.sglang_cfg.server_urls`)"
            )
        return gen

    def _submit_generate(self, data: Any, greedy: bool = False, seed: int | None = None) -> Pending:
        gen = self._generation_config()
        if gen.backend == "sglang":
            raise ValueError(
                "Policy.submit('generate') runs on the policy's own workers; with "
                "`policy.generation.backend: sglang` the driver sends the prompts to the SGLang servers "
                "itself: call policy.generate(data), which blocks"
            )
        posted = self._post_sharded(
            functools.partial(GenerateRequest, greedy=greedy, seed=seed), data, what="generate", contiguous=True
        )
        return Pending(posted.futures, JoinGenerated(self.pad_token_id), "generate", posted.done)

    def _generate_sglang(self, data: BatchedDataDict[Any], *, greedy: bool, seed: int | None) -> BatchedDataDict[Any]:
        from dask_lm.engine.sglang_generation import SGLangGenerator, sampling_params

        gen = self.cfg.generation
        assert gen is not None, "generate() checks policy.generation"
        sg = gen.sglang_cfg or SGLangConfig()
        urls = sg.server_urls
        if not urls:
            raise ValueError(
                "`policy.generation.backend: sglang` needs `policy.generation.sglang_cfg.server_urls`: "
                "a list of SGLang server URLs (http://host:port)"
            )
        data = validate_input_batch(
            data,
            what="generate",
            vocab_size=self.vocab_size,
            max_length=self.cfg.max_total_sequence_length,
            pad_token_id=self.pad_token_id,
        )
        client = SGLangGenerator(
            list(urls),
            pad_token_id=self.pad_token_id,
            timeout_s=sg.timeout_s,
            retries=sg.retries,
            chunk_rows=sg.rows_per_request,
        )
        with span("dask-lm/generate-sglang"):
            return client.generate(data, sampling_params(gen, greedy=greedy), seed=seed)

    # ----------------------------------------------------------------------------------------- generic hooks
    def run_all_workers_single_data(
        self, method_name: str, *args: Any, run_rank_0_only_axes: Any = None, **kwargs: Any
    ) -> list[Any]:
        """Call ``method_name`` of ``worker_extension_cls_fqn`` (or one of the base worker's methods that take no
        rows: :data:`dask_lm.workers.endpoints.EXTENSION_BASE_METHODS`) on every rank with the same arguments;
        one result per rank."""
        return self.group.run(
            ExtensionCall(method_name, args, kwargs), what=method_name, key_name=method_name.replace("_", "-")
        )

    def run_all_workers_multiple_data(
        self,
        method_name: str,
        *args: Any,
        run_rank_0_only_axes: Any = None,
        common_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Like ``run_all_workers_single_data``, but each positional / keyword argument is a list with one entry
        per rank; ``common_kwargs`` go to every rank."""
        n = self.data_parallel_size
        for i, a in enumerate(args):
            if not isinstance(a, (list, tuple)) or len(a) != n:
                raise ValueError(
                    f"run_all_workers_multiple_data: positional argument {i} must be a list of {n} "
                    "entries (one per worker)"
                )
        for key, v in kwargs.items():
            if not isinstance(v, (list, tuple)) or len(v) != n:
                raise ValueError(f"run_all_workers_multiple_data: `{key}` must be a list of {n} entries")
        calls = [
            ExtensionCall(
                method_name,
                tuple(a[r] for a in args),
                {**{k: v[r] for k, v in kwargs.items()}, **(common_kwargs or {})},
            )
            for r in range(n)
        ]
        return self.group.run(calls, what=method_name, key_name=method_name.replace("_", "-"))

    def _place(self, action: PlacementAction) -> None:
        self.group.run(ActionRequest(action), what=action, key_name=action.replace("_", "-"))

    # ----------------------------------------------------------------------------------------- placement
    def print_node_ip_and_gpu_id(self) -> list[tuple[str, Any]]:
        infos = self.group.call(tasks.rank_info, what="print_node_ip_and_gpu_id", key_name="node-ip")
        rows = [(str(name), i["node_ip"], i["gpu_id"], i["gpu_name"]) for name, i in zip(self.group.names, infos)]
        lines = [
            f"{'worker':>8}  {'node ip':>15}  {'gpu id':>6}  device",
            *(f"{w:>8}  {ip:>15}  {g!s:>6}  {n}" for w, ip, g, n in rows),
        ]
        print("\n".join(lines))
        return [(ip, g) for _, ip, g, _ in rows]

    def prepare_for_lp_inference(self, keep_train_buffers: bool = False) -> None:
        self._place("prepare_for_lp_inference")

    def finish_inference(self) -> None:
        self._place("finish_inference")

    def offload_to_cpu(self) -> None:
        """Weights and optimizer state to host memory, freeing the devices."""
        self._place("offload_to_cpu")

    def start_gpu_profiling(self) -> None:
        self.group.call(tasks.profiler, True, what="start_gpu_profiling", key_name="profiler")

    def stop_gpu_profiling(self) -> None:
        self.group.call(tasks.profiler, False, what="stop_gpu_profiling", key_name="profiler")

    # ----------------------------------------------------------------------------------------- lifecycle
    def shutdown(self) -> bool:
        """Free everything this Policy holds on the workers (model, optimizer, reference, process group)."""
        if self._group is None or not self._finalizer.alive:
            return True
        self._finalizer.detach()
        ok = shutdown_quietly(self._group, raise_errors=True)
        return ok

    def __del__(self) -> None:  # weakref.finalize does the work; this keeps NeMo RL's contract visible
        pass

    def __enter__(self) -> Policy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        if self._group is None:
            return "Policy(<not started>)"
        return (
            f"Policy(model={self.cfg.model_name!r}, ranks={self._group.world_size}, "
            f"workers={self._group.names}, precision={self.cfg.precision})"
        )

    def _repr_html_(self) -> str:
        """The notebook view: model, precision, and a row per rank with its worker, device and live gauges."""
        from dask_lm.engine.reprs import policy_html

        return policy_html(self)


@dataclasses.dataclass(frozen=True, slots=True)
class Submittable:
    """A method ``Policy.submit`` takes: what posts it to the ranks and what its answers are joined into."""

    post: Callable[..., Pending]  # (policy, the blocking method's arguments) -> the call posted
    join: type[Join]  # the kind of answer; only rows (JoinRows) can stay on the workers (collect=False)


# the methods Policy.submit takes, the calls whose work is rows on the ranks: `submit(method, ...)` is one lookup here
SUBMIT: Mapping[str, Submittable] = types.MappingProxyType(
    {
        "get_logprobs": Submittable(Policy._submit_get_logprobs, JoinRows),
        "get_reference_policy_logprobs": Submittable(Policy._submit_get_reference_policy_logprobs, JoinRows),
        "get_topk_logits": Submittable(Policy._submit_get_topk_logits, JoinRows),
        "score": Submittable(Policy._submit_score, JoinRows),
        "generate": Submittable(Policy._submit_generate, JoinGenerated),
        "train": Submittable(submit_train, ReduceTrain),
    }
)
SUBMITTABLE = tuple(SUBMIT)

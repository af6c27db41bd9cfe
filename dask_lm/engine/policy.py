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
import logging
import os
import time
import weakref
from typing import Any

import torch
from distributed import span, wait

from dask_lm.config import PolicyConfig
from dask_lm.data.arrow import shard_to_wire
from dask_lm.data.batch import BatchedDataDict
from dask_lm.engine import progress
from dask_lm.engine.cluster import as_client
from dask_lm.engine.events import log_call
from dask_lm.engine.metrics import timed
from dask_lm.engine.refit import RefitMixin
from dask_lm.engine.training import TrainingMixin
from dask_lm.engine.validation import validate_input_batch
from dask_lm.engine.worker_group import WorkerGroup
from dask_lm.io import hub
from dask_lm.io.hub import ModelSource
from dask_lm.workers import tasks
from dask_lm.workers.optim import check_optim_config

__all__ = ["Policy"]

logger = logging.getLogger("dask_lm")



def _resolve_names(cfg: PolicyConfig) -> tuple[PolicyConfig, ModelSource]:
    """``cfg`` with a Hub ``model_name`` (and a Hub tokenizer name) replaced by local snapshot directories, resolved
    here on the driver once, so every worker loads the same commit (:mod:`dask_lm.io.hub`). A copy: the caller's
    config object keeps the names it was given."""
    source = hub.resolve_model(cfg.model_name, revision=cfg.model_revision, what="`policy.model_name`")
    tok = cfg.tokenizer.name
    if tok == cfg.model_name:
        tok = source.path
    elif tok is not None and not os.path.exists(tok) and hub.looks_like_hub_id(tok):
        tok = hub.resolve_model(tok, what="`policy.tokenizer.name`").path
    if source.path == cfg.model_name and tok == cfg.tokenizer.name:
        return cfg, source
    return dataclasses.replace(cfg, model_name=source.path,
                               tokenizer=dataclasses.replace(cfg.tokenizer, name=tok)), source


def _model_config(model_name: str, overrides: dict | None) -> Any:
    """The model's Hugging Face config, read from its config.json on the driver (no weights, no CUDA)."""
    try:
        import transformers

        return transformers.AutoConfig.from_pretrained(model_name, **(overrides or {}))
    except (OSError, ValueError) as e:
        raise ValueError(f"`policy.model_name` = {model_name!r} is not a readable Hugging Face model directory: "
                         f"{e}") from e


class Policy(TrainingMixin, RefitMixin):
    """A language-model policy sharded over the workers of a Dask cluster (NeMo RL's ``Policy`` API).

    Parameters follow NeMo RL. ``cluster`` is a ``distributed.Client``, a Dask cluster object or a scheduler
    address; every worker of it becomes one rank (``workers_per_node`` caps the ranks taken per host).
    ``config`` is a dict with NeMo RL's PolicyConfig keys or a :class:`~dask_lm.PolicyConfig`.
    """

    def __init__(self, cluster: Any, config: dict[str, Any] | PolicyConfig, tokenizer: Any,
                 name_prefix: str = "lm_policy", workers_per_node: int | None = None, init_optimizer: bool = True,
                 weights_path: str | os.PathLike | None = None, optimizer_path: str | os.PathLike | None = None,
                 init_reference_model: bool = True, processor: Any = None,
                 worker_extension_cls_fqn: str | None = None, skip_weight_load: bool = False) -> None:
        self._group: WorkerGroup | None = None
        self.cfg, self.model_source = _resolve_names(PolicyConfig.from_dict(config))
        if processor is not None:
            raise ValueError("`processor` (multimodal inputs) is not supported yet; pass processor=None")
        if weights_path is not None:
            weights_path = os.path.abspath(weights_path)
            if not os.path.isdir(weights_path):
                raise ValueError(f"`weights_path` {weights_path!r} is not a directory")
        if optimizer_path is not None:
            optimizer_path = os.path.abspath(optimizer_path)
            if not init_optimizer:
                raise ValueError("`optimizer_path` restores optimizer state, which needs init_optimizer=True")
            from dask_lm.workers.checkpointing import FRESH_OPTIMIZER

            if not any(os.path.isfile(os.path.join(optimizer_path, f)) for f in (".metadata", FRESH_OPTIMIZER)):
                raise ValueError(f"`optimizer_path` {optimizer_path!r} is not an optimizer checkpoint written by "
                                 "save_checkpoint (no .metadata file in it)")
        self.init_optimizer = bool(init_optimizer and self.cfg.optimizer is not None)
        if self.init_optimizer:
            check_optim_config(self.cfg)
        self.tokenizer = tokenizer
        self.pad_token_id = self._pad_id(tokenizer)
        self.hf_config = _model_config(self.cfg.model_name, self.cfg.hf_config_overrides)
        text = self.hf_config.get_text_config() if hasattr(self.hf_config, "get_text_config") else self.hf_config
        self.vocab_size = getattr(text, "vocab_size", None)
        self.client = as_client(cluster)
        workers = self._pick_workers(workers_per_node)
        self._group = group = WorkerGroup(self.client, workers=workers, name_prefix=name_prefix)
        options = {"init_optimizer": init_optimizer, "init_reference_model": init_reference_model,
                   "weights_path": weights_path, "optimizer_path": optimizer_path, "skip_weight_load": skip_weight_load}
        members = tuple(str(n) for n in group.names)
        lock = group.group_lock() if group.world_size > 1 else contextlib.nullcontext()
        with span("dask-lm/load-model"), lock:
            master = group.rendezvous()
            with group._submit_lock:
                futs = [group.submit_rank(r, tasks.init_policy, group.policy_id, self.cfg.to_dict(),
                                          key_name="load-model", rank=r, members=members,
                                          member_ids=tuple(group.ids), master=master,
                                          pad_token_id=self.pad_token_id, extension_fqn=worker_extension_cls_fqn,
                                          options=options)
                        for r in range(group.world_size)]
            try:
                with progress.bar(self.client, len(futs), "loading the model", "rank") as (_id, load_bar):
                    self.worker_info = group.gather(futs, what="loading the model", progress=load_bar)
            except BaseException:
                _shutdown_quietly(group)  # ranks that did load free their model and process group
                raise
        self._finalizer = weakref.finalize(self, _shutdown_quietly, group)

    # ----------------------------------------------------------------------------------------- helpers
    @staticmethod
    def _pad_id(tokenizer: Any) -> int:
        for attr in ("pad_token_id", "eos_token_id"):
            value = getattr(tokenizer, attr, None)
            if isinstance(value, int):
                return value
        return 0

    def _pick_workers(self, workers_per_node: int | None) -> list[Any] | None:
        if workers_per_node is None:
            return None
        if workers_per_node < 1:
            raise ValueError(f"`workers_per_node` must be >= 1, got {workers_per_node}")
        from dask_lm.engine.worker_group import _live_workers, _name_key

        per_host: dict[str, list[Any]] = {}
        for w in _live_workers(self.client)["workers"].values():
            per_host.setdefault(w["host"], []).append(w["name"])
        return sorted((n for names in per_host.values() for n in sorted(names, key=_name_key)[:workers_per_node]),
                      key=_name_key)

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
            on = bool(self.worker_info) and all(i.get("device") == "cuda" and i.get("varlen")
                                                for i in self.worker_info)
        if not on:
            return None
        return max(cfg.inference_mb_tokens or 32768, cfg.max_total_sequence_length)

    def _shard(self, data: BatchedDataDict, gbs: int | None = None,
               auto_pack: bool = False) -> tuple[list[BatchedDataDict], Any, bool]:
        """DP shards (plain, dynamic or packed) and the permutation that restores input order (or None).

        Inference (``gbs`` None) takes any batch size (shards may differ by a row) and the logprob token budgets;
        training splits per global batch of ``gbs`` rows with the training budgets. ``auto_pack``: an inference
        call that may pack by itself when no batching mode is configured (:meth:`_auto_packing`)."""
        dp = self.data_parallel_size
        cfg = self.cfg
        split: dict[str, Any] = ({"allow_uneven_shards": True} if gbs is None else {"batch_size": gbs})
        budget = "logprob_mb_tokens" if gbs is None else "train_mb_tokens"
        if cfg.dynamic_batching.enabled:
            shards, order = data.shard_by_batch_size(dp, **split, dynamic_batching_args={
                "input_key": "input_ids", "input_lengths_key": "input_lengths",
                "sequence_length_round": cfg.dynamic_batching.sequence_length_round,
                "max_tokens_per_microbatch": int(getattr(cfg.dynamic_batching, budget))})
            return shards, order, False
        if cfg.sequence_packing.enabled:
            shards, order = data.shard_by_batch_size(dp, **split, sequence_packing_args={
                "input_key": "input_ids", "input_lengths_key": "input_lengths",
                "max_tokens_per_microbatch": int(getattr(cfg.sequence_packing, budget)),
                "algorithm": cfg.sequence_packing.algorithm,
                "sequence_length_pad_multiple": cfg.make_sequence_length_divisible_by,
                "microbatch_order": cfg.sequence_packing.microbatch_order})
            return shards, order, True
        budget = self._auto_packing() if auto_pack and gbs is None else None
        if budget is not None:
            shards, order = data.shard_by_batch_size(dp, **split, sequence_packing_args={
                "input_key": "input_ids", "input_lengths_key": "input_lengths", "max_tokens_per_microbatch": budget,
                "algorithm": cfg.sequence_packing.algorithm, "sequence_length_pad_multiple": 1,
                "microbatch_order": cfg.sequence_packing.microbatch_order})
            return shards, order, True
        return data.shard_by_batch_size(dp, **split), None, False

    def _run_sharded(self, method: str, data: Any, *, what: str, timer: Any = None, label: str | None = None,
                     contiguous: bool = False, **kwargs: Any) -> tuple[list[dict[str, Any]], Any]:
        """Validate, shard, scatter each shard to its rank, run ``method`` on every rank, return rank results."""
        label = label or method
        start = time.perf_counter()
        data = validate_input_batch(data, what=what, vocab_size=self.vocab_size,
                                    max_length=self.cfg.max_total_sequence_length, pad_token_id=self.pad_token_id)
        group = self.group
        # the forward needs only these two keys; other per-row data (masks, advantages) stays on the driver
        data = BatchedDataDict(input_ids=data["input_ids"], input_lengths=data["input_lengths"])
        with timed(timer, f"{label}/shard_data"):
            if contiguous:  # rows stay in order, a contiguous slice per rank (generation decodes whole rows)
                shards, order, packed = data.shard_by_batch_size(self.data_parallel_size, allow_uneven_shards=True), \
                    None, False
            else:
                # rows per micro-batch were asked for when the call names a micro_batch_size: no packing then
                shards, order, packed = self._shard(data, auto_pack=kwargs.get("micro_batch_size") is None)
        with timed(timer, f"{label}/submit_logprob_futures"), span(f"dask-lm/{label}"):
            payloads = group.scatter([shard_to_wire(s, packed=packed) for s in shards], what=what)
            futs = group.submit_all(tasks.call_policy, [(group.policy_id, method, p) for p in payloads],
                                    key_name=label.replace("_", "-"), **kwargs)
            results = group.gather(futs, what=what)
        log_call(self.client, group.policy_id, label, start=start, tokens=int(data["input_lengths"].sum()),
                 rows=int(data["input_lengths"].shape[0]), ranks=group.world_size)
        return results, order

    @staticmethod
    def _join(results: list[dict[str, Any]], order: Any, key: str, cat: bool = False) -> torch.Tensor:
        if cat:
            joined = BatchedDataDict({key: torch.cat([r[key] for r in results], dim=0)})
        else:
            joined = BatchedDataDict.from_batches([BatchedDataDict({key: r[key]}) for r in results])
        if order is not None:
            joined.reorder_data(order)
        return joined[key]

    # ----------------------------------------------------------------------------------------- inference
    def get_logprobs(self, data: BatchedDataDict, timer: Any = None) -> BatchedDataDict:
        """Per-token log-probabilities: ``{"logprobs": float32 [B, S]}``; position 0 and padding hold 0."""
        results, order = self._run_sharded("get_logprobs", data, what="get_logprobs", timer=timer)
        return BatchedDataDict(logprobs=self._join(results, order, "logprobs"))

    def get_reference_policy_logprobs(self, data: BatchedDataDict, micro_batch_size: int | None = None,
                                      timer: Any = None) -> BatchedDataDict:
        """Log-probabilities under the weights as first loaded (before training or a ``weights_path`` restore):
        ``{"reference_logprobs": float32 [B, S]}``; the generation temperature applies, top-k/top-p do not."""
        results, order = self._run_sharded("get_logprobs", data, what="get_reference_policy_logprobs", timer=timer,
                                           label="get_reference_policy_logprobs",
                                           micro_batch_size=micro_batch_size, reference=True)
        return BatchedDataDict(reference_logprobs=self._join(results, order, "reference_logprobs"))

    def get_topk_logits(self, data: BatchedDataDict, k: int, micro_batch_size: int | None = None,
                        timer: Any = None) -> BatchedDataDict:
        """The k largest temperature-scaled logits at every position: ``topk_logits`` float32 [B, S, k] and
        ``topk_indices`` int64 [B, S, k] (padding positions hold 0)."""
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"get_topk_logits: `k` must be a positive integer, got {k!r}")
        if self.vocab_size is not None and k > self.vocab_size:
            raise ValueError(f"get_topk_logits: `k`={k} exceeds the vocabulary size {self.vocab_size}")
        results, order = self._run_sharded("get_topk_logits", data, what="get_topk_logits", timer=timer, k=k,
                                           micro_batch_size=micro_batch_size)
        return BatchedDataDict(topk_logits=self._join(results, order, "topk_logits", cat=True),
                               topk_indices=self._join(results, order, "topk_indices", cat=True))

    def score(self, data: BatchedDataDict) -> BatchedDataDict:
        """Reward-model scores ``{"scores": float32 [B]}`` (needs ``reward_model_cfg.enabled``)."""
        if not self.cfg.reward_model_cfg.enabled:
            raise ValueError("score() needs a reward model: set `policy.reward_model_cfg.enabled: true` and point "
                             "`policy.model_name` at a sequence-classification checkpoint")
        results, order = self._run_sharded("score", data, what="score")
        return BatchedDataDict(scores=self._join(results, order, "scores", cat=True))

    def generate(self, data: BatchedDataDict, greedy: bool = False, seed: int | None = None) -> BatchedDataDict:
        """Continue right-padded prompts with the policy's own weights (KV-cached, batched; ``generation`` config).

        Returns ``output_ids`` [B, S_out] (prompt then generation, right-padded with the pad id), ``logprobs``
        [B, S_out] (the sampled tokens' logprobs under the generation temperature / top-k / top-p, 0 on prompt
        and padding), ``generation_lengths``, ``unpadded_sequence_lengths`` and ``truncated`` (hit
        ``max_new_tokens`` without a stop)."""
        gen = self.cfg.generation
        if gen is None or not gen.max_new_tokens or gen.max_new_tokens < 1:
            raise ValueError("generate() needs `policy.generation.max_new_tokens` (>= 1)")
        if gen.backend == "sglang":
            return self._generate_sglang(data, greedy=greedy, seed=seed)
        if gen.backend not in ("hf", "dtensor", "megatron"):
            raise ValueError(f"`policy.generation.backend` = {gen.backend!r}: use 'hf' (the policy's own workers) "
                             "or 'sglang' (servers listed in `policy.generation.sglang_cfg.server_urls`)")
        results, _order = self._run_sharded("generate", data, what="generate", contiguous=True, greedy=greedy,
                                            seed=seed)
        width = max((r["output_ids"].shape[1] for r in results), default=0)
        pad = self.pad_token_id

        def cat(key: str, fill: float) -> torch.Tensor:
            parts = [torch.nn.functional.pad(r[key], (0, width - r[key].shape[1]), value=fill) for r in results]
            return torch.cat(parts, dim=0)

        return BatchedDataDict(output_ids=cat("output_ids", pad), logprobs=cat("logprobs", 0.0),
                               generation_lengths=torch.cat([r["generation_lengths"] for r in results]),
                               unpadded_sequence_lengths=torch.cat([r["unpadded_sequence_lengths"] for r in results]),
                               truncated=torch.cat([r["truncated"] for r in results]))

    def _generate_sglang(self, data: BatchedDataDict, *, greedy: bool, seed: int | None) -> BatchedDataDict:
        from dask_lm.engine.sglang_generation import SGLangGenerator, sampling_params

        gen = self.cfg.generation
        sg = dict(gen.sglang_cfg or {})
        urls = sg.get("server_urls")
        if not urls or isinstance(urls, str):
            raise ValueError("`policy.generation.backend: sglang` needs `policy.generation.sglang_cfg.server_urls`: "
                             "a list of SGLang server URLs (http://host:port)")
        data = validate_input_batch(data, what="generate", vocab_size=self.vocab_size,
                                    max_length=self.cfg.max_total_sequence_length, pad_token_id=self.pad_token_id)
        client = SGLangGenerator(list(urls), pad_token_id=self.pad_token_id,
                                 timeout_s=float(sg.get("timeout_s", 600.0)), retries=int(sg.get("retries", 3)),
                                 chunk_rows=int(sg.get("rows_per_request", 64)))
        with span("dask-lm/generate-sglang"):
            return client.generate(data, sampling_params(gen, greedy=greedy), seed=seed)

    # ----------------------------------------------------------------------------------------- generic hooks
    def run_all_workers_single_data(self, method_name: str, *args: Any, run_rank_0_only_axes: Any = None,
                                    **kwargs: Any) -> list[Any]:
        """Call ``method_name`` (of the worker, or of ``worker_extension_cls_fqn``) on every rank with the same
        arguments; one result per rank."""
        return self.group.run_all(tasks.call_policy, self.group.policy_id, method_name, None, *args,
                                  what=method_name, key_name=method_name.replace("_", "-"), **kwargs)

    def run_all_workers_multiple_data(self, method_name: str, *args: Any, run_rank_0_only_axes: Any = None,
                                      common_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> list[Any]:
        """Like ``run_all_workers_single_data``, but each positional / keyword argument is a list with one entry
        per rank; ``common_kwargs`` go to every rank."""
        n = self.data_parallel_size
        for i, a in enumerate(args):
            if not isinstance(a, (list, tuple)) or len(a) != n:
                raise ValueError(f"run_all_workers_multiple_data: positional argument {i} must be a list of {n} "
                                 "entries (one per worker)")
        for key, v in kwargs.items():
            if not isinstance(v, (list, tuple)) or len(v) != n:
                raise ValueError(f"run_all_workers_multiple_data: `{key}` must be a list of {n} entries")
        group = self.group
        with group._submit_lock:
            futs = [group.submit_rank(r, tasks.call_policy, group.policy_id, method_name, None,
                                      *[a[r] for a in args], key_name=method_name.replace("_", "-"),
                                      **{k: v[r] for k, v in kwargs.items()}, **(common_kwargs or {}))
                    for r in range(n)]
        return group.gather(futs, what=method_name)

    def _call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self.run_all_workers_single_data(method, *args, **kwargs)

    # ----------------------------------------------------------------------------------------- placement
    def get_free_memory_bytes(self) -> int:
        """The smallest free device memory over the workers (host RAM on CPU workers)."""
        infos = self.group.run_all(tasks.rank_info, what="get_free_memory_bytes", key_name="free-memory")
        return int(min(i["free_memory_bytes"] for i in infos))

    def print_node_ip_and_gpu_id(self) -> list[tuple[str, Any]]:
        infos = self.group.run_all(tasks.rank_info, what="print_node_ip_and_gpu_id", key_name="node-ip")
        rows = [(str(name), i["node_ip"], i["gpu_id"], i["gpu_name"]) for name, i in zip(self.group.names, infos)]
        lines = [f"{'worker':>8}  {'node ip':>15}  {'gpu id':>6}  device", *(
            f"{w:>8}  {ip:>15}  {str(g):>6}  {n}" for w, ip, g, n in rows)]
        print("\n".join(lines))
        return [(ip, g) for _, ip, g, _ in rows]

    def prepare_for_lp_inference(self, keep_train_buffers: bool = False) -> None:
        self._call_all("prepare_for_lp_inference")

    def finish_inference(self) -> None:
        self._call_all("finish_inference")

    def offload_to_cpu(self) -> None:
        """Weights and optimizer state to host memory, freeing the devices."""
        self._call_all("offload_to_cpu")

    def start_gpu_profiling(self) -> None:
        self.group.run_all(_profiler, True, what="start_gpu_profiling", key_name="profiler")

    def stop_gpu_profiling(self) -> None:
        self.group.run_all(_profiler, False, what="stop_gpu_profiling", key_name="profiler")

    # ----------------------------------------------------------------------------------------- lifecycle
    def shutdown(self) -> bool:
        """Free everything this Policy holds on the workers (model, optimizer, reference, process group)."""
        if self._group is None or not self._finalizer.alive:
            return True
        self._finalizer.detach()
        ok = _shutdown_quietly(self._group, raise_errors=True)
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
        return (f"Policy(model={self.cfg.model_name!r}, ranks={self._group.world_size}, "
                f"workers={self._group.names}, precision={self.cfg.precision})")

    def _repr_html_(self) -> str:
        """The notebook view: model, precision, and a row per rank with its worker, device and live gauges."""
        from dask_lm.engine.reprs import policy_html

        return policy_html(self)


def _profiler(_prev: Any, start: bool) -> bool:
    from dask_lm.workers import device

    (device.start_profiler if start else device.stop_profiler)()
    return True


SHUTDOWN_TIMEOUT_S = 30.0


def _shutdown_quietly(group: WorkerGroup, raise_errors: bool = False) -> bool:
    """Free the Policy on every rank that still holds it. A rank whose worker is gone holds nothing (it is skipped
    with a warning); a rank stuck in a collective frees the Policy when that collective times out, or when the
    lease released here tells it the driver let go."""
    try:
        if group.client.status not in ("running", "connecting") or group.client.asynchronous:
            # a closed client, or a finalizer run by the garbage collector on the client's own event loop (which
            # must not block on it): the lease released below frees the ranks (see dask_lm.workers.lease)
            return False
        lost = set(group.lost_ranks())
        if lost:
            logger.warning("policy %s: workers %s are gone (their share of the Policy went with them); shutting down "
                           "the other ranks", group.policy_id, [group.names[r] for r in sorted(lost)])
        # not chained: a failed earlier call must not stop the clean-up (one task thread per worker keeps order)
        futs = [group.submit_rank(r, tasks.shutdown_policy, group.policy_id, key_name="shutdown", chain=False,
                                  orphaned=bool(lost)) for r in range(group.world_size) if r not in lost]
        try:
            wait(futs, timeout=SHUTDOWN_TIMEOUT_S)
        except TimeoutError:
            pass
        busy = [f for f in futs if f.status == "pending"]
        if busy:
            logger.warning("policy %s: %d rank(s) did not shut down within %.0f s (busy in a call, e.g. a collective "
                           "waiting for a lost peer); they free the Policy when that call ends", group.policy_id,
                           len(busy), SHUTDOWN_TIMEOUT_S)
        failed = [f for f in futs if f.status == "error"]
        if failed and raise_errors:
            group.gather(failed, what="shutdown")
        return not (lost or busy or failed)
    except Exception:
        if raise_errors:
            raise
        logger.warning("shutting down policy %s failed", group.policy_id, exc_info=True)
        return False
    finally:
        group.release_lease()

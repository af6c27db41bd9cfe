"""Scoring's model replicas: one per worker, cached in the worker's dask-lm plugin state.

Scoring needs no collectives, so unlike a Policy it does not shard the model: each worker loads a full replica
once (cached in the worker's dask-lm plugin state, ``DaskLMWorkerState.scorers``, keyed by model, precision,
compilation and the pinned files) and scores whichever partition the scheduler hands it, for ``score_parquet``'s
file job and ``dask_lm.score``'s collections alike (:mod:`dask_lm.scoring.scorer`). ``score_parquet`` preloads
one beside its driver's checks (:func:`preload_replica`); a replica no partition has used for a while is freed by
the worker's lease check (:func:`release_idle`), a finished job's by :func:`release_scorers`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Hashable
from typing import Any

import torch

from dask_lm.data.messages import ScoreOptions
from dask_lm.data.rows import RowModel
from dask_lm.data.tokens import TokenRows
from dask_lm.io.fingerprint import RACY_NS, Stamp, verify
from dask_lm.model import device, fused, liger_layers, varlen
from dask_lm.model.inference import forward_rows
from dask_lm.model.load import load_causal_lm
from dask_lm.model.logprobs import next_token_logprobs_greedy, output_head
from dask_lm.workers import warm

__all__ = ["preload_replica", "release_idle", "release_scorers", "auto_precision"]


def auto_precision(precision: str | None) -> str:
    """``precision`` as given, or where it is automatic (``None`` / ``"auto"``) this worker's: bfloat16 on a GPU,
    float32 elsewhere (the rule of :func:`dask_lm.jobs.start.worker_precision`, decided here by the worker
    itself)."""
    if precision not in (None, "auto"):
        return precision
    return "bfloat16" if device.is_cuda() else "float32"


class Replica:
    last_used: float  # time.monotonic() of the last partition that picked it (set by replica_for)
    stamps: dict[str, Stamp]  # a preloaded replica's files, settled and unchanged over its load (preload_replica)

    def __init__(
        self, model_dir: str, tokenizer_dir: str, precision: str, *, compile: bool = True, compile_head: bool = False
    ) -> None:
        t0 = time.perf_counter()
        warm.wait()  # the worker's warm-up imports transformers and makes the CUDA context: not twice at once
        import transformers

        transformers.utils.logging.disable_progress_bar()  # one bar per worker would garble the job's own bar
        self.device = device.local_device()
        device.synchronize()  # CUDA initialised here, so that the load's own timing is the weights'
        t_weights = time.perf_counter()
        dtype = device.torch_dtype(precision)
        self.model = load_causal_lm(model_dir, dtype, self.device)
        device.synchronize()
        self.load_phases = {"imports_and_device": t_weights - t0, "weights": time.perf_counter() - t_weights}
        # the fast path of a Policy's inference pass: packed rows through varlen attention, compiled layers
        self.varlen = varlen.available(dtype) and self.model.config._attn_implementation == "sdpa"
        self.packed = self.varlen  # packing pays only with the varlen kernel (a dense [T, T] mask costs more)
        self.compiled = False
        self.tokenizer: transformers.PreTrainedTokenizerBase | None
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)
            self.tokenizer_error: str | None = None
        except (OSError, ValueError, ImportError) as e:  # token-id input needs no tokenizer; text input says why
            self.tokenizer = None
            self.tokenizer_error = (
                f"the tokenizer in {tokenizer_dir} cannot be loaded on this worker: "
                f"{' '.join(str(e).split())}; install what it needs (e.g. sentencepiece) on the "
                "workers"
            )  # the way on, naming an option, is added when raised
        cfg = self.model.config
        candidates = (
            getattr(self.tokenizer, "pad_token_id", None),
            getattr(self.tokenizer, "eos_token_id", None),
            getattr(cfg, "pad_token_id", None),
            getattr(cfg, "eos_token_id", None),
        )
        pad = next((v for v in candidates if isinstance(v, int)), 0)
        self.pad_id = int(pad)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        positions = getattr(text_cfg, "max_position_embeddings", None) or getattr(text_cfg, "n_positions", None)
        self.max_positions = int(positions) if positions else None  # None: the model has no position limit
        self.lock = threading.Lock()  # a worker with several threads runs one forward at a time per replica
        # what a job's cold start is made of (ScoreResult reports the longest over the workers): imports, CUDA
        # initialisation and the weights' load; then the compilation, paid here on two short rows so that no
        # partition's timing carries it
        self.load_seconds = time.perf_counter() - t0
        self.compile_seconds = 0.0
        self.fresh = True  # the first partition of this replica reports the two timings
        self.compile_requested = False
        self.head_compiled = False  # the head's fused reductions run compiled (score_ids says why)
        # uncompiled layers' RMSNorms and SwiGLU products as liger's one-pass kernels (liger_layers.py says why);
        # compile() puts the class forwards back for Inductor to fuse
        t_liger = time.perf_counter()
        self.liger_layers = 0 if compile else liger_layers.patch(self.model)
        if self.liger_layers:
            self.load_phases["liger_layers"] = time.perf_counter() - t_liger
        if compile_head or compile:
            self.compile_head()
        if compile:
            self.compile()
        self.ready_at = time.time()  # wall clock: the driver compares it with its own (one host, or NTP-close)

    @property
    def row_model(self) -> RowModel:
        """What this replica asks of the rows it scores (:func:`dask_lm.data.rows.prepare_rows` checks them)."""
        return RowModel(self.tokenizer, self.vocab_size, self.max_positions)

    def compile_head(self) -> None:
        """Compile the head's fused reductions (on a GPU; a no-op elsewhere), paid here on two short rows."""
        if fused.enabled() and not self.head_compiled:
            t0 = time.perf_counter()
            self.head_compiled = True
            self._warm_up()
            self.compile_seconds += time.perf_counter() - t0
            self.ready_at = time.time()  # only when it compiled: an adopted replica's readiness is its load's

    def compile(self) -> None:
        """Compile the decoder layers, paid here on two short rows so that no partition's timing carries it."""
        self.compile_requested = True
        liger_layers.unpatch(self.model)
        if fused.compile_decoder_layers(self.model) > 0:
            t0 = time.perf_counter()
            _, self.compiled = fused.call(True, self._warm_up, "the scoring forward")
            self.compile_seconds += time.perf_counter() - t0
        # compiling is off here, or failed: the layers run eagerly, so with liger's kernels where they can
        self.liger_layers = 0 if self.compiled else liger_layers.patch(self.model)
        self.ready_at = time.time()

    @torch.no_grad()
    def _warm_up(self) -> None:
        """Two short rows through the forward and head (no longer than the model's positions allow)."""
        n1, n2 = (min(n, self.max_positions or n) for n in (61, 37))
        x = (torch.arange(2 * n1).reshape(2, n1) % max(self.vocab_size - 3, 1) + 3).clamp(max=self.vocab_size - 1)
        rows = TokenRows.from_padded(x, torch.tensor([n1, n2]))
        hidden, layout = forward_rows(self.model, rows, packed=self.packed, varlen_ok=self.varlen, where=self.device)
        with fused.use_compiled(self.head_compiled):
            next_token_logprobs_greedy(
                hidden, layout.ids, layout.targets_valid, output_head(self.model), index=layout.scored
            )[0].cpu()


# one lock for the replica caches of this process: a worker with several threads loads a model once, and the
# lease check never frees a replica while a partition picks it
_CACHE_LOCK = threading.Lock()


def replica_for(opts: ScoreOptions) -> Replica:
    """This worker's replica for ``opts``, loaded on first use into the worker's dask-lm plugin state (or the one
    :func:`preload_replica` loaded while the driver checked, where it was loaded from the pinned bytes)."""
    from dask_lm.workers.state import get_state

    cache = get_state().scorers
    # the pins in the key: a replica of the same path loaded from other bytes (an earlier job's) is another model
    key = (opts.model, opts.tokenizer, opts.precision, opts.compile, opts.model_pins)
    with _CACHE_LOCK:
        rep = cache.get(key)
        if rep is None:
            preloaded = cache.pop(_preload_key(opts.model, opts.tokenizer, opts.precision), None)
            rep = adopt(preloaded, opts)
            if preloaded is not None and rep is None:  # loaded from other bytes: its memory goes before the reload
                del preloaded
                _free()
        if rep is None:
            before = [verify(pin) for pin in opts.model_pins]
            rep = Replica(
                opts.model, opts.tokenizer, opts.precision, compile=opts.compile, compile_head=opts.compile_head
            )
            for pin, was in zip(opts.model_pins, before):  # written during the load: the weights may mix versions
                verify(pin, since=was)
        cache[key] = rep
        rep.last_used = time.monotonic()
        return rep


# ------------------------------------------------------------------------------------------- preloading
def _preload_key(model: str, tokenizer: str, precision: str) -> tuple[str, str, str, str]:
    return ("preloaded", model, tokenizer, precision)


def _settled_stamps(directories: set[str], now_ns: int) -> dict[str, Stamp]:
    """The stamp of every file directly in ``directories`` whose last change is at least ``RACY_NS`` old: a file
    changed within the filesystem clock's tick of ``now_ns`` could change again under the same stamp."""
    stamps: dict[str, Stamp] = {}
    for d in directories:
        with contextlib.suppress(OSError):
            for e in os.scandir(d):
                with contextlib.suppress(OSError):
                    if e.is_file():
                        st = e.stat()
                        s = Stamp(st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                        if now_ns - max(s.mtime_ns, s.ctime_ns) >= RACY_NS:
                            stamps[os.path.abspath(e.path)] = s
    return stamps


def preload_replica(
    model: str, tokenizer: str, precision: str | None, compile: bool, compile_head: bool = False
) -> dict[str, Any]:
    """Load this worker's replica before the job's pins exist: ``score_parquet`` submits this to every worker
    as soon as the cluster is up, so that imports, CUDA initialisation, the weights' load and the compilation
    happen while the driver checks the inputs and hashes the files.

    The replica is adopted by the job's first partition only if every pinned file kept one settled stamp from
    before this load began, through its end, to the driver's hash (:func:`adopt`): then the bytes loaded are the
    bytes pinned. Otherwise that partition loads the model again, as without a preload. ``precision`` ``None``
    is the worker's automatic one (as :func:`dask_lm.jobs.start.worker_precision` decides it)."""
    from dask_lm.workers.state import get_state

    began = time.time()
    precision = auto_precision(precision)
    dirs = {os.path.abspath(model), os.path.abspath(tokenizer)}
    # under the cache lock, as replica_for loads: a partition that starts meanwhile on another thread of this worker
    # waits for this replica instead of loading a second one beside it
    with _CACHE_LOCK:
        before = _settled_stamps(dirs, time.time_ns())
        try:
            rep = Replica(model, tokenizer, precision, compile=compile, compile_head=compile_head)
        except Exception as e:  # a model the driver's checks will refuse, or one the job's first partition loads
            return {"error": f"{type(e).__name__}: {e}"}  # again and reports: not a failed task in the logs
        after = _settled_stamps(dirs, time.time_ns())
        rep.stamps = {p: s for p, s in before.items() if after.get(p) == s}
        rep.last_used = time.monotonic()  # an unadopted preload is freed by the lease check like any idle replica
        get_state().scorers[_preload_key(model, tokenizer, precision)] = rep
    # when this worker's start went where (wall clock, for ScoreResult.start_phases): its process began, this task
    # began (the worker up and registered, this module and torch imported), the replica was ready
    return {
        "load_seconds": rep.load_seconds,
        "compile_seconds": rep.compile_seconds,
        "precision": precision,
        "process_started_at": _process_started_at(),
        "began_at": began,
        "ready_at": rep.ready_at,
        "load_phases": rep.load_phases,
    }


def _process_started_at() -> float | None:
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # no psutil (it comes with distributed), or a platform without process times
        return None


def adopt(rep: Replica | None, opts: ScoreOptions) -> Replica | None:
    """``rep`` (a preloaded replica) if it was loaded from the pinned bytes: each pinned file's settled stamp
    before and after its load is the stamp the driver hashed it under. ``None`` (load again) otherwise."""
    if rep is None or not opts.model_pins:
        return None
    for pin in opts.model_pins:
        if pin.racy or rep.stamps.get(pin.path) != pin.stamp:
            return None
    if opts.compile_head:  # before the layers: their warm-up then runs the compiled head too
        rep.compile_head()
    if opts.compile and not rep.compile_requested:  # the job chose to compile once it knew its size
        rep.compile()
    return rep


def _caches(dask_worker: Any = None) -> list[dict[tuple[Hashable, ...], Replica]]:
    """The replica caches to look at: ``dask_worker``'s (``client.run`` and the lease check pass it), else the
    current task's worker's, else none (no worker: no replica)."""
    from distributed import get_worker

    from dask_lm.workers.state import PLUGIN_NAME

    if dask_worker is None:
        try:
            dask_worker = get_worker()
        except ValueError:
            return []
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    return [plugin.scorers] if plugin is not None else []


def _free() -> None:
    """Give the freed replicas' memory back: their tensors go with the last reference, the allocator's cache with
    ``empty_cache``."""
    import gc

    gc.collect()
    device.empty_cache()


def release_idle(max_idle_s: float, dask_worker: Any = None) -> int:
    """Free replicas no partition has used for ``max_idle_s`` (the worker's lease check calls this). A job frees
    its replicas when it ends; a job whose driver died cannot, and its model must not hold the device for good."""
    now = time.monotonic()
    idle = 0
    with _CACHE_LOCK:
        for cache in _caches(dask_worker):
            keys = [
                k
                for k, rep in cache.items()
                if now - getattr(rep, "last_used", now) > max_idle_s and not rep.lock.locked()
            ]
            for k in keys:
                del cache[k]
            idle += len(keys)
    if idle:
        _free()
    return idle


def release_scorers(dask_worker: Any = None) -> int:
    """Free this worker's replicas (run with ``client.run`` when a job ends)."""
    with _CACHE_LOCK:
        caches = _caches(dask_worker)
        n = sum(len(c) for c in caches)
        for cache in caches:
            cache.clear()
    _free()
    return n
